/*
 * A worker holds 120,000 received tensors at once on a default job (issue
 * 20: the tables' defaults are above what real programs meet): rank 0
 * sends them 250 per call, rank 1 keeps each (shmrpc_tensor_retain), then
 * counts them and checks their bytes, then lets them all go; the pool
 * empties. Scaled down under the sanitizers.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define PER_CALL 250
#define TOTAL 120000
#define SETTLE_NS 60000000000ull

static const DLDataType i64 = { kDLInt, 64, 1 };
/* Written by whichever executor threads run the calls, which other
 * processes order: under a lock that ThreadSanitizer can see. */
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static shmrpc_tensor **kept;
static int nkept;

static int fn_keep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const shmrpc_value *items = a[0].u.items;

	int rc = 0;

	(void)n, (void)u;
	pthread_mutex_lock(&kept_lock);
	for (uint32_t i = 0; i < a[0].len && rc == 0; i++)
		if (shmrpc_tensor_retain(items[i].u.t, &kept[nkept++]))
			rc = shmrpc_call_error(c, "RuntimeError", "keeping tensor %d: %s", nkept,
					       shmrpc_errmsg());
	*r = shmrpc_int(nkept);
	pthread_mutex_unlock(&kept_lock);
	return rc;
}

/* Checks every kept tensor's value, then drops them all. */
static int fn_release(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	int held, rc = 0;

	(void)a, (void)n, (void)u;
	pthread_mutex_lock(&kept_lock);
	held = nkept;
	/* Each a 64-byte block of its own, held by this worker alone. */
	if (tl_pool_used() < (uint64_t)nkept * 64)
		rc = shmrpc_call_error(c, "ValueError", "%llu bytes used for %d tensors",
				       (unsigned long long)tl_pool_used(), nkept);
	for (int i = 0; i < nkept && rc == 0; i++)
		if (*(int64_t *)shmrpc_tensor_data(kept[i]) != i)
			rc = shmrpc_call_error(c, "ValueError", "tensor %d holds %lld", i,
					       (long long)*(int64_t *)shmrpc_tensor_data(kept[i]));
	while (rc == 0 && nkept > 0)
		shmrpc_tensor_free(kept[--nkept]);
	pthread_mutex_unlock(&kept_lock);
	*r = shmrpc_int(held);
	return rc;
}

static int worker(void)
{
	int total = (int)(TOTAL * tl_scale()) / PER_CALL * PER_CALL;
	static shmrpc_value items[PER_CALL];
	static shmrpc_tensor *t[PER_CALL];
	int64_t shape[1] = { 1 };
	shmrpc_future *f;
	shmrpc_value v;

	kept = calloc(TOTAL, sizeof(*kept));
	CHECK(kept, "calloc");
	CHECK_OK(shmrpc_register("keep", "l", fn_keep, NULL));
	CHECK_OK(shmrpc_register("release", "", fn_release, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		for (int sent = 0; sent < total; sent += PER_CALL) {
			for (int i = 0; i < PER_CALL; i++) {
				CHECK_OK(shmrpc_tensor_alloc(i64, 1, shape, &t[i]));
				*(int64_t *)shmrpc_tensor_data(t[i]) = sent + i;
				items[i] = shmrpc_tensor_value(t[i]);
			}
			v = shmrpc_list(items, PER_CALL);
			CHECK(shmrpc_rpc_sync(1, "keep", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
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
	free(kept);
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "2", NULL);
}
