/*
 * Nested calls deeper than the executor pool: with one executor thread per
 * worker, chain(16) bounces A->B->A->B... sixteen times. Each waiting
 * executor thread serves the next hop itself, so the chain completes
 * (torch.distributed.rpc hangs here). Once in the default wait mode, once
 * in spin mode.
 */
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define DEPTH 16

static int fn_chain(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value next = shmrpc_int(a[0].u.i - 1);
	shmrpc_future *f;
	int rc;

	(void)n, (void)u;
	if (a[0].u.i == 0) {
		*r = shmrpc_int(shmrpc_rank());
		return 0;
	}
	rc = shmrpc_rpc_sync(1 - shmrpc_rank(), "chain", &next, 1, SHMRPC_TIMEOUT_DEFAULT, &f);
	if (rc)
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	/* The sum of ranks along the chain proves every hop ran where it should. */
	*r = shmrpc_int(shmrpc_future_value(f)->u.i + shmrpc_rank());
	shmrpc_future_free(f);
	return 0;
}

static int worker(void)
{
	struct shmrpc_options o = SHMRPC_OPTIONS(.num_threads = 1, .timeout_ms = 20000);
	shmrpc_value depth = shmrpc_int(DEPTH);
	shmrpc_future *f;

	CHECK_OK(shmrpc_register("chain", "i", fn_chain, NULL));
	CHECK_OK(shmrpc_init(&o));
	if (shmrpc_rank() == 0) {
		/* Hops alternate 1,0,1,0,...: DEPTH+1 calls, ranks summing to (DEPTH+2)/2. */
		CHECK_OK(shmrpc_rpc_sync(1, "chain", &depth, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == (DEPTH + 2) / 2, "chain returned %lld",
		      (long long)shmrpc_future_value(f)->u.i);
		shmrpc_future_free(f);
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	/* Spin mode too: there threads never sleep. */
	return tl_job_test(worker, "-n", "2", NULL) ?: tl_job_test(worker, "-n", "2", "--wait=spin", NULL);
}
