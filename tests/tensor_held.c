/*
 * A worker holds 120,000 received tensors at once on a default job (issue
 * 20: the tables' defaults are above what real programs meet): rank 0
 * sends them 250 per call, rank 1 keeps each (shmrpc_tensor_retain), then
 * counts them and checks their bytes, then lets them all go; the pool
 * empties. Scaled down under the sanitizers.
 */
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define PER_CALL 250
#define TOTAL 120000
#define SETTLE_NS 60000000000ull

static const DLDataType i64 = { kDLInt, 64, 1 };
/* Every kept tensor holds its index, each a 64-byte block of its own,
 * held by this worker alone. */
static int check_kept(shmrpc_call *c, shmrpc_tensor *const *kept, int n)
{
	if (tl_pool_used() < (uint64_t)n * 64)
		return shmrpc_call_error(c, "ValueError", "%llu bytes used for %d tensors",
					 (unsigned long long)tl_pool_used(), n);
	for (int i = 0; i < n; i++)
		if (*(int64_t *)shmrpc_tensor_data(kept[i]) != i)
			return shmrpc_call_error(c, "ValueError", "tensor %d holds %lld", i,
						 (long long)*(int64_t *)shmrpc_tensor_data(kept[i]));
	return 0;
}

static int worker(void)
{
	int total = (int)(TOTAL * tl_scale()) / PER_CALL * PER_CALL;
	static shmrpc_value items[PER_CALL];
	static shmrpc_tensor *t[PER_CALL];
	int64_t shape[1] = { 1 };
	shmrpc_future *f;
	shmrpc_value v;

	tl_keep_all_register(TOTAL, check_kept);
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		for (int sent = 0; sent < total; sent += PER_CALL) {
			for (int i = 0; i < PER_CALL; i++) {
				CHECK_OK(shmrpc_tensor_alloc(i64, 1, shape, &t[i]));
				*(int64_t *)shmrpc_tensor_data(t[i]) = sent + i;
				items[i] = shmrpc_tensor_value(t[i]);
			}
			v = shmrpc_list(items, PER_CALL);
			CHECK(shmrpc_rpc_sync(1, "keep_all", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
			      "after %d tensors kept: %s", sent, shmrpc_errmsg());
			CHECK(shmrpc_future_value(f)->u.i == sent + PER_CALL, "rank 1 keeps %lld",
			      (long long)shmrpc_future_value(f)->u.i);
			shmrpc_future_free(f);
			for (int i = 0; i < PER_CALL; i++)
				shmrpc_tensor_free(t[i]);
		}
		CHECK_OK(shmrpc_rpc_sync(1, "release", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == total, "rank 1 held %lld of %d",
		      (long long)shmrpc_future_value(f)->u.i, total);
		shmrpc_future_free(f);
		printf("rank 1 held %d received tensors at once\n", total);
		CHECK(tl_wait_empty(SETTLE_NS), "the pool did not empty: %llu bytes used",
		      (unsigned long long)tl_pool_used());
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	tl_keep_all_free();
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "2", NULL);
}
