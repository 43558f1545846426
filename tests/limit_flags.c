/*
 * Every fixed-size table of a job has a shmrun flag, and the error of a
 * full one names that flag with the value to try (issue 20). Each limit is
 * set small by its flag and met:
 *   --holder-records 16   the pool references one worker holds: tensors
 *                         kept until one fails, "shmrun --holder-records 32"
 *   --pool-records 1024   the pool's block records: 64-byte tensors fill one
 *                         slab (1024 records), the next fails, "shmrun
 *                         --pool-records 2048"
 *   --max-rrefs 4         RRefs alive in the job: remote() until one fails,
 *                         "shmrun --max-rrefs 8"
 *   --pool-size 1M        the pool's size: a 2 MiB tensor fails, "shmrun
 *                         --pool-size 2M", a size that would hold it
 * Each limit's failure is an error the program sees, and everything made
 * before it is released. The defaults are far above these (shmrun --help).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define MAX_HELD 5000
#define SETTLE_NS 10000000000ull

static const DLDataType u8 = { kDLUInt, 8, 1 };

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

/* Tensors of `bytes` kept until one fails; the error must name want. */
static void tensors_until(uint64_t bytes, const char *want)
{
	static shmrpc_tensor *held[MAX_HELD];
	int64_t shape[1] = { (int64_t)bytes };
	int n = 0, rc = 0;

	while (n < MAX_HELD && (rc = shmrpc_tensor_alloc(u8, 1, shape, &held[n])) == 0)
		n++;
	CHECK(rc != 0, "%d tensors of %llu bytes and no limit met", n, (unsigned long long)bytes);
	printf("after %d tensors of %llu bytes: %s\n", n, (unsigned long long)bytes,
	       shmrpc_errmsg());
	CHECK(strstr(shmrpc_errmsg(), want), "the error does not say \"%s\": %s", want,
	      shmrpc_errmsg());
	while (n > 0)
		shmrpc_tensor_free(held[--n]);
}

static void rrefs_until(const char *want)
{
	shmrpc_value two[2] = { shmrpc_int(2), shmrpc_int(3) };
	shmrpc_rref *rr[64];
	shmrpc_future *f;
	int n = 0, rc = 0;

	while (n < 64 && (rc = shmrpc_remote(1, "add", two, 2, SHMRPC_TIMEOUT_DEFAULT, &rr[n])) == 0) {
		CHECK_OK(shmrpc_rref_to_here(rr[n], SHMRPC_TIMEOUT_DEFAULT, &f));
		shmrpc_future_free(f);
		n++;
	}
	CHECK(rc != 0, "%d RRefs and no limit met", n);
	printf("after %d RRefs: %s\n", n, shmrpc_errmsg());
	CHECK(strstr(shmrpc_errmsg(), want), "the error does not say \"%s\": %s", want,
	      shmrpc_errmsg());
	while (n > 0)
		shmrpc_rref_free(rr[--n]);
}

static int worker(void)
{
	const char *part = getenv("LIMIT_PART");

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		if (!strcmp(part, "holders"))
			tensors_until(4096, "shmrun --holder-records 32");
		else if (!strcmp(part, "records"))
			tensors_until(64, "shmrun --pool-records 2048");
		else if (!strcmp(part, "rrefs"))
			rrefs_until("shmrun --max-rrefs 8");
		else if (!strcmp(part, "size"))
			tensors_until(2u << 20, "shmrun --pool-size 2M");
		CHECK(tl_wait_empty(SETTLE_NS), "not released: %u RRefs, %llu pool bytes",
		      tl_rrefs_live(), (unsigned long long)tl_pool_used());
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	setenv("LIMIT_PART", "holders", 1);
	CHECK(tl_job_test(worker, "-n", "2", "--holder-records", "16", NULL) == 0, "holders");
	setenv("LIMIT_PART", "records", 1);
	CHECK(tl_job_test(worker, "-n", "2", "--pool-records", "1024", NULL) == 0, "records");
	setenv("LIMIT_PART", "rrefs", 1);
	CHECK(tl_job_test(worker, "-n", "2", "--max-rrefs", "4", NULL) == 0, "rrefs");
	setenv("LIMIT_PART", "size", 1);
	CHECK(tl_job_test(worker, "-n", "2", "--pool-size", "1M", NULL) == 0, "size");
	return 0;
}
