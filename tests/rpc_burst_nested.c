/*
 * A burst of 100,000 requests that each make one nested rpc_sync, on a pool
 * of 1 and of 4 threads: half of the nested calls go back to the caller,
 * half to the callee itself. A waiting executor thread runs only what its
 * own call needs (worker/executor.h), so the burst never piles up on one
 * stack (before: SIGSEGV at ~30,000 frames); the pool starts threads for
 * the requests behind the waiting ones instead. Every result is checked.
 */
#include <stdlib.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static int fn_inner(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + 1);
	return 0;
}

/* outer(i): inner(i) on rank 0 for even i, on itself for odd i; times 2. */
static int fn_outer(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_future *f;

	(void)n, (void)u;
	if (shmrpc_rpc_sync(a[0].u.i % 2 ? shmrpc_rank() : 0, "inner", a, 1,
			    SHMRPC_TIMEOUT_DEFAULT, &f))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	*r = shmrpc_int(2 * shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	return 0;
}

static int worker(void)
{
	struct shmrpc_options o = SHMRPC_OPTIONS(.num_threads = atoi(getenv("BURST_THREADS")),
						 .timeout_ms = 120000);
	int n = (int)(100000 * tl_scale());
	shmrpc_future **f;

	CHECK_OK(shmrpc_register("inner", "i", fn_inner, NULL));
	CHECK_OK(shmrpc_register("outer", "i", fn_outer, NULL));
	CHECK_OK(shmrpc_init(&o));
	if (shmrpc_rank() == 0) {
		CHECK((f = calloc((size_t)n, sizeof(*f))) != NULL, "calloc");
		for (int i = 0; i < n; i++) {
			shmrpc_value v = shmrpc_int(i);

			CHECK_OK(shmrpc_rpc_async(1, "outer", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f[i]));
		}
		for (int i = 0; i < n; i++) {
			CHECK_OK(shmrpc_future_wait(f[i], -1));
			CHECK(shmrpc_future_value(f[i])->u.i == 2 * ((int64_t)i + 1), "call %d: %lld",
			      i, (long long)shmrpc_future_value(f[i])->u.i);
			shmrpc_future_free(f[i]);
		}
		free(f);
	}
	/* Rank 1 waits in the graceful shutdown for rank 0's burst to end:
	 * as long as the runner lets the test run (a loaded 2-core VM has
	 * taken 60 s for one burst, and a shorter wait failed the calls). */
	CHECK_OK(shmrpc_shutdown(1, 120000));
	return 0;
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	setenv("BURST_THREADS", "1", 1);
	if (tl_job_test(worker, "-n", "2", NULL))
		return 1;
	setenv("BURST_THREADS", "4", 1);
	return tl_job_test(worker, "-n", "2", NULL);
}
