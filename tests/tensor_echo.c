/*
 * A tensor echoed back (issue 23): the reply hands back the request's own
 * pool block, which goes covered by the caller's request pin (no pin of
 * the callee's, no TENSOR_ACK), and every block is still freed exactly
 * once. Rank 0 calls rank 1 with a 4 KiB pool tensor it fills:
 * - "echo": the same bytes come back (the same block);
 * - the same with rank 0's handle freed as soon as the call is sent
 *   (rpc_async), so that only its request pin keeps the block while the
 *   reply is on its way: the bytes are still there when it arrives;
 * - "keep_echo": rank 1 keeps a handle of its own and returns the tensor;
 *   rank 0 lets go of everything, and rank 1 still reads the bytes
 *   ("kept_sum"), then lets go ("drop");
 * - "copy": another block comes back, the normal way (pinned and acked);
 * - 2000 echoes, 16 in flight, half of them with the handle freed at once.
 * After each, once rank 1 has let go, the pool is empty: no block leaked,
 * none freed twice (a second free is refused by the pool, on stderr, and
 * a block freed early shows as wrong bytes).
 */
#include <stdatomic.h>
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define BYTES 4096
#define ROUNDS 2000
#define IN_FLIGHT 16
#define SETTLE_NS 30000000000ull

static const DLDataType u8 = { kDLUInt, 8, 1 };

/* Set and taken on executor threads. */
static shmrpc_tensor *_Atomic kept;

static int fn_echo(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = a[0];
	return 0;
}

static int fn_keep_echo(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			void *u)
{
	shmrpc_tensor *t;

	(void)n, (void)u;
	if (shmrpc_tensor_retain(a[0].u.t, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	shmrpc_tensor_free(atomic_exchange(&kept, t));
	*r = a[0];
	return 0;
}

static int fn_kept_sum(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
		       void *u)
{
	shmrpc_tensor *t = atomic_load(&kept);
	const uint8_t *p = t ? shmrpc_tensor_data(t) : NULL;
	int64_t sum = 0;

	(void)a, (void)n, (void)u;
	if (!p)
		return shmrpc_call_error(c, "RuntimeError", "nothing kept");
	for (uint64_t i = 0; i < shmrpc_tensor_nbytes(t); i++)
		sum += p[i];
	*r = shmrpc_int(sum);
	return 0;
}

static int fn_drop(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	shmrpc_tensor_free(atomic_exchange(&kept, NULL));
	*r = shmrpc_nil();
	return 0;
}

static int fn_copy(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	int64_t bytes = (int64_t)shmrpc_tensor_nbytes(a[0].u.t);
	shmrpc_tensor *t;

	(void)n, (void)u;
	if (shmrpc_tensor_alloc(u8, 1, &bytes, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	memcpy(shmrpc_tensor_data(t), shmrpc_tensor_data(a[0].u.t), (size_t)bytes);
	*r = shmrpc_tensor_value(t);
	return 0;
}

/* A pool tensor of BYTES holding seed, seed + 1, ... */
static shmrpc_tensor *filled(uint8_t seed)
{
	int64_t bytes = BYTES;
	shmrpc_tensor *t;

	CHECK_OK(shmrpc_tensor_alloc(u8, 1, &bytes, &t));
	for (int i = 0; i < BYTES; i++)
		((uint8_t *)shmrpc_tensor_data(t))[i] = (uint8_t)(seed + i);
	return t;
}

/* f's value is a tensor of BYTES holding seed, seed + 1, ... */
static void check_back(shmrpc_future *f, uint8_t seed, const char *what)
{
	const shmrpc_value *v = shmrpc_future_value(f);
	const uint8_t *p;

	CHECK(v && v->type == SHMRPC_TENSOR && shmrpc_tensor_nbytes(v->u.t) == BYTES,
	      "%s: no tensor of %d bytes came back", what, BYTES);
	p = shmrpc_tensor_data(v->u.t);
	for (int i = 0; i < BYTES; i++)
		CHECK(p[i] == (uint8_t)(seed + i), "%s: byte %d is %u, want %u", what, i, p[i],
		      (uint8_t)(seed + i));
}

static void expect_empty(const char *after)
{
	CHECK(tl_wait_empty(SETTLE_NS), "after %s the pool did not empty: %llu bytes used", after,
	      (unsigned long long)tl_pool_used());
}

/* One call of fn with a filled tensor; with early, its handle goes as
 * soon as the call is sent. */
static shmrpc_future *call(const char *fn, uint8_t seed, bool early, shmrpc_tensor **sent)
{
	shmrpc_tensor *t = filled(seed);
	shmrpc_value arg = shmrpc_tensor_value(t);
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_async(1, fn, &arg, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	if (early) {
		shmrpc_tensor_free(t);
		t = NULL;
	}
	*sent = t;
	return f;
}

static void caller(void)
{
	shmrpc_future *f, *fl[IN_FLIGHT] = { 0 };
	shmrpc_tensor *t, *tl[IN_FLIGHT] = { 0 };
	int rounds = (int)(ROUNDS * tl_scale());

	f = call("echo", 1, false, &t);
	CHECK_OK(shmrpc_future_wait(f, -1));
	check_back(f, 1, "echo");
	CHECK(shmrpc_tensor_data(shmrpc_future_value(f)->u.t) == shmrpc_tensor_data(t),
	      "the echo brought back another block");
	shmrpc_future_free(f);
	shmrpc_tensor_free(t);
	expect_empty("an echo");

	f = call("echo", 2, true, &t);
	CHECK_OK(shmrpc_future_wait(f, -1));
	check_back(f, 2, "an echo of a tensor let go once sent");
	shmrpc_future_free(f);
	expect_empty("an echo of a tensor let go once sent");

	f = call("keep_echo", 3, true, &t);
	CHECK_OK(shmrpc_future_wait(f, -1));
	check_back(f, 3, "keep_echo");
	shmrpc_future_free(f);
	CHECK_OK(shmrpc_rpc_sync(1, "kept_sum", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	/* 16 times 0..255, shifted by 3: the sum of every byte value, 16 times. */
	CHECK(shmrpc_future_value(f)->u.i == 16 * 255 * 256 / 2, "rank 1 kept %lld, want %d",
	      (long long)shmrpc_future_value(f)->u.i, 16 * 255 * 256 / 2);
	shmrpc_future_free(f);
	CHECK(tl_pool_used() > 0, "rank 1 keeps a tensor, and the pool is empty");
	CHECK_OK(shmrpc_rpc_sync(1, "drop", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
	expect_empty("a tensor kept by the callee was let go");

	f = call("copy", 4, false, &t);
	CHECK_OK(shmrpc_future_wait(f, -1));
	check_back(f, 4, "copy");
	CHECK(shmrpc_tensor_data(shmrpc_future_value(f)->u.t) != shmrpc_tensor_data(t),
	      "the copy is the block sent");
	shmrpc_future_free(f);
	shmrpc_tensor_free(t);
	expect_empty("a copy");

	for (int i = 0; i < rounds + IN_FLIGHT; i++) {
		int k = i % IN_FLIGHT;

		if (fl[k]) {
			CHECK_OK(shmrpc_future_wait(fl[k], -1));
			check_back(fl[k], (uint8_t)(i - IN_FLIGHT), "one of many echoes");
			shmrpc_future_free(fl[k]);
			shmrpc_tensor_free(tl[k]);
			fl[k] = NULL;
			tl[k] = NULL;
		}
		if (i < rounds)
			fl[k] = call((i / IN_FLIGHT) % 3 ? "echo" : "copy", (uint8_t)i, i % 2, &tl[k]);
	}
	expect_empty("many echoes");
	printf("%d echoes, every block freed once\n", rounds);
}

static int worker(void)
{
	CHECK_OK(shmrpc_register("echo", "t", fn_echo, NULL));
	CHECK_OK(shmrpc_register("keep_echo", "t", fn_keep_echo, NULL));
	CHECK_OK(shmrpc_register("kept_sum", "", fn_kept_sum, NULL));
	CHECK_OK(shmrpc_register("drop", "", fn_drop, NULL));
	CHECK_OK(shmrpc_register("copy", "t", fn_copy, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0)
		caller();
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "2", NULL);
}
