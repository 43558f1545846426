/*
 * Tensors are handed over, not copied. Rank 0 sends tensors of 1 KiB to
 * 1 GiB to rank 1, which writes into them and returns them: rank 0 sees
 * the writes in its own tensor, at the same pool offset (nothing was
 * copied either way). Then one tensor goes to every other worker, which
 * keep a reference each and drop them later in their own order: the block
 * is freed once, and the pool is empty at the end.
 */
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "worker/link.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

static const DLDataType u8 = { kDLUInt, 8, 1 };
/* Writes a mark at both ends of the tensor and sends it back. */
static int fn_touch(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uint8_t *d = shmrpc_tensor_data(a[0].u.t);
	uint64_t len = shmrpc_tensor_nbytes(a[0].u.t);

	(void)c, (void)n, (void)u;
	d[0] = 0xa5;
	d[len - 1] = 0x5a;
	*r = a[0];
	return 0;
}

/* Makes a new tensor holding the argument's first byte, plus one. */
static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	int64_t shape[1] = { 4096 };
	shmrpc_tensor *t;

	(void)n, (void)u;
	if (shmrpc_tensor_alloc(u8, 1, shape, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	memset(shmrpc_tensor_data(t), (int)(a[0].u.i + 1), 4096);
	*r = shmrpc_tensor_value(t);
	return 0;
}

static void round_trip(uint64_t bytes)
{
	int64_t shape[1] = { (int64_t)bytes };
	shmrpc_tensor *t, *back;
	shmrpc_future *f;
	shmrpc_value v;
	uint8_t *d;

	CHECK_OK(shmrpc_tensor_alloc(u8, 1, shape, &t));
	d = shmrpc_tensor_data(t);
	d[0] = d[bytes - 1] = 0;
	v = shmrpc_tensor_value(t);
	CHECK_OK(shmrpc_rpc_sync(1, "touch", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(d[0] == 0xa5 && d[bytes - 1] == 0x5a, "%llu bytes: rank 1's writes are not in our tensor",
	      (unsigned long long)bytes);
	CHECK(shmrpc_future_value(f)->type == SHMRPC_TENSOR, "result is not a tensor");
	back = shmrpc_future_value(f)->u.t;
	CHECK(shmrpc_tensor_pool_offset(back) == shmrpc_tensor_pool_offset(t) &&
	      shmrpc_tensor_data(back) == shmrpc_tensor_data(t) && shmrpc_tensor_nbytes(back) == bytes,
	      "%llu bytes: the result is not the same block", (unsigned long long)bytes);
	shmrpc_future_free(f);
	shmrpc_tensor_free(t);
}

static int worker(void)
{
	int me, world;

	CHECK_OK(shmrpc_register("touch", "t", fn_touch, NULL));
	CHECK_OK(shmrpc_register("make", "i", fn_make, NULL));
	tl_keep_register();
	CHECK_OK(shmrpc_init(NULL));
	me = shmrpc_rank();
	world = shmrpc_world_size();
	if (me == 0) {
		int64_t shape[1] = { 1 << 20 };
		shmrpc_tensor *t;
		shmrpc_future *f;
		shmrpc_value v = shmrpc_int(6);
		uint64_t off;

		for (uint64_t bytes = 1024; bytes <= (1ull << 30); bytes <<= 10)
			round_trip(bytes);

		/* A tensor made by the callee comes back to us. */
		CHECK_OK(shmrpc_rpc_sync(1, "make", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(((uint8_t *)shmrpc_tensor_data(shmrpc_future_value(f)->u.t))[4095] == 7,
		      "made tensor's bytes");
		shmrpc_future_free(f);

		/* One tensor to every worker; each keeps it, then drops it. */
		CHECK_OK(shmrpc_tensor_alloc(u8, 1, shape, &t));
		off = shmrpc_tensor_pool_offset(t);
		v = shmrpc_tensor_value(t);
		for (int r = 1; r < world; r++) {
			CHECK_OK(shmrpc_rpc_sync(r, "keep", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
			CHECK((uint64_t)shmrpc_future_value(f)->u.i == off, "rank %d kept another block", r);
			shmrpc_future_free(f);
		}
		shmrpc_tensor_free(t); /* the others still hold it */
		CHECK(pool_block_size(&worker_agent->pool, off) > 0, "freed while others hold it");
		for (int r = world - 1; r >= 1; r--) {
			CHECK_OK(shmrpc_rpc_sync(r, "drop", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
			shmrpc_future_free(f);
		}
		/* Pins go with the acknowledgements, which follow the replies. */
		for (int i = 0; i < 2000 && tl_pool_used(); i++)
			usleep(1000);
		CHECK(tl_pool_used() == 0, "the pool still holds %llu bytes", (unsigned long long)tl_pool_used());
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "4", "--pool-size", "1100M", NULL);
}
