/*
 * A received message's tensor handle made the binding's own without a
 * second reference (tensor_take_over, what python_tensor_take gives the
 * Python extension): rank 1's function takes each tensor of its request,
 * and the handles it took outlive the request; the request's handle, spent,
 * refuses a retain and its free drops nothing (the pool counts one
 * reference for the two); a small tensor sent inline, whose bytes are
 * rank 1's own, is retained instead. Once rank 0 and then rank 1 let go,
 * the pool empties: nothing was dropped twice or kept.
 */
#include <errno.h>
#include <pthread.h>
#include <string.h>

#include "shmrpc.h"
#include "worker/tensor.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define ROUNDS 40
#define LARGE 4096 /* int64 elements: 32 KiB, by the pool */
#define SETTLE_NS 30000000000ull

static const DLDataType i64 = { kDLInt, 64, 1 };
/* Rank 1's executor threads take turns at them, one call after another:
 * ordered through rank 0's process, which TSan does not see. */
static pthread_mutex_t taken_lock = PTHREAD_MUTEX_INITIALIZER;
static shmrpc_tensor *taken[ROUNDS];
static int ntaken;

static int64_t sum_of(const shmrpc_tensor *t)
{
	const int64_t *d = shmrpc_tensor_data(t);
	int64_t s = 0;

	for (uint64_t i = 0; i < shmrpc_tensor_nbytes(t) / sizeof(*d); i++)
		s += d[i];
	return s;
}

/* take(t), under taken_lock: t taken over and kept; returns its sum. */
static int take(shmrpc_call *c, const shmrpc_value *a, shmrpc_value *r)
{
	shmrpc_tensor *t = a[0].u.t, *again;
	bool pooled = !t->heap;
	int rc;

	if (ntaken == ROUNDS)
		return shmrpc_call_error(c, "ValueError", "too many tensors taken");
	if ((rc = tensor_take_over(t, &taken[ntaken])))
		return rc;
	if (pooled != t->spent)
		return shmrpc_call_error(c, "ValueError", "a %s tensor's handle is%s spent",
					 pooled ? "pool" : "heap", t->spent ? "" : " not");
	if (pooled && (shmrpc_tensor_retain(t, &again) != -EINVAL || !strstr(shmrpc_errmsg(),
									  "gave its reference")))
		return shmrpc_call_error(c, "ValueError", "a spent handle was retained");
	if (taken[ntaken]->dl.data != t->dl.data || taken[ntaken]->nbytes != t->nbytes)
		return shmrpc_call_error(c, "ValueError", "the handle taken names other bytes");
	*r = shmrpc_int(sum_of(taken[ntaken++]));
	return 0;
}

static int fn_take(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	int rc;

	(void)n, (void)u;
	pthread_mutex_lock(&taken_lock);
	rc = take(c, a, r);
	pthread_mutex_unlock(&taken_lock);
	return rc;
}

/* check(): the sums of what was taken (rank 0's tensors freed since), then
 * every one let go. */
static int fn_check(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	int64_t s = 0;

	(void)c, (void)a, (void)n, (void)u;
	pthread_mutex_lock(&taken_lock);
	for (int i = 0; i < ntaken; i++) {
		s += sum_of(taken[i]);
		shmrpc_tensor_free(taken[i]);
	}
	ntaken = 0;
	pthread_mutex_unlock(&taken_lock);
	*r = shmrpc_int(s);
	return 0;
}

static int worker(void)
{
	int64_t want = 0;
	shmrpc_future *f;

	CHECK_OK(shmrpc_register("take", "t", fn_take, NULL));
	CHECK_OK(shmrpc_register("check", "", fn_check, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		for (int i = 0; i < ROUNDS; i++) {
			int64_t len = i % 2 ? LARGE : 2; /* 16 B: inline */
			shmrpc_tensor *t;
			shmrpc_value v;
			int64_t *d;

			CHECK_OK(shmrpc_tensor_alloc(i64, 1, &len, &t));
			d = shmrpc_tensor_data(t);
			for (int64_t k = 0; k < len; k++)
				want += d[k] = i * 1000 + k;
			v = shmrpc_tensor_value(t);
			CHECK(shmrpc_rpc_sync(1, "take", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
			      "take %d: %s", i, shmrpc_errmsg());
			shmrpc_future_free(f);
			shmrpc_tensor_free(t);
		}
		/* Blocks that were rank 0's alone are free now: new ones could
		 * take their bytes, and must not. */
		for (int i = 0; i < ROUNDS; i++) {
			int64_t len = LARGE;
			shmrpc_tensor *t;

			CHECK_OK(shmrpc_tensor_alloc(i64, 1, &len, &t));
			memset(shmrpc_tensor_data(t), 0xff, shmrpc_tensor_nbytes(t));
			shmrpc_tensor_free(t);
		}
		CHECK_OK(shmrpc_rpc_sync(1, "check", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == want, "rank 1's taken tensors sum to %lld, "
		      "want %lld", (long long)shmrpc_future_value(f)->u.i, (long long)want);
		shmrpc_future_free(f);
		CHECK(tl_wait_empty(SETTLE_NS), "the pool did not empty: %llu bytes used",
		      (unsigned long long)tl_pool_used());
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "2", NULL);
}
