/*
 * The documented nesting limit, at its boundary: a chain of
 * SHMRPC_MAX_NESTING (100,000) nested rpc_syncs going round the workers of
 * a job (rank r calls r + 1, the last calls 0), in jobs of 2, 3 and 5
 * workers whose pools start with one thread, completes, with the sum of
 * the ranks that served it right; one call more fails at once with
 * -SHMRPC_ENESTING and a sentence naming the limit, which travels back up
 * the chain as a value. Each thread runs 64 hops of the chain it waits for
 * (worker/executor.h: a request carries the waits upstream of it, so a
 * worker finds the thread that waits for it however many workers the
 * chain went through), and the pools grow for the rest: no stack holds
 * the whole chain, and no pool needs a thread per hop. Under sanitizers (SHMRPC_TEST_SCALE) the chain is shorter
 * and the boundary is not reached: it is a skip then, with that reason.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

/* What the innermost handler returns when its call was refused as it must be. */
#define REFUSED (-1)
/* ... and when it failed otherwise (the test then fails). */
#define FAILED (-2)

/* chain(k): k > 0 calls chain(k - 1) on the other worker; adds its rank. */
static int fn_chain(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value next = shmrpc_int(a[0].u.i - 1);
	shmrpc_future *f;
	int64_t got;
	int rc;

	(void)n, (void)u;
	if (a[0].u.i == 0) {
		*r = shmrpc_int(shmrpc_rank());
		return 0;
	}
	rc = shmrpc_rpc_sync((shmrpc_rank() + 1) % shmrpc_world_size(), "chain", &next, 1,
			     SHMRPC_TIMEOUT_DEFAULT, &f);
	if (rc == -SHMRPC_ENESTING) {
		char want[64];

		snprintf(want, sizeof(want), "limit of %d", SHMRPC_MAX_NESTING);
		*r = shmrpc_int(strstr(shmrpc_errmsg(), want) ? REFUSED : FAILED);
		if (!strstr(shmrpc_errmsg(), want))
			fprintf(stderr, "chain: the refusal does not say \"%s\": %s\n", want,
				shmrpc_errmsg());
		return 0;
	}
	if (rc)
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	got = shmrpc_future_value(f)->u.i;
	*r = shmrpc_int(got < 0 ? got : got + shmrpc_rank());
	shmrpc_future_free(f);
	return 0;
}

/* chain(k) from rank 0: k + 1 calls, the last at depth k + 1. */
static int64_t chain(int64_t k)
{
	shmrpc_value v = shmrpc_int(k);
	shmrpc_future *f;
	int64_t got;
	int rc = shmrpc_rpc_sync(1, "chain", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f);

	CHECK(rc == 0, "chain(%lld): %s", (long long)k, shmrpc_errmsg());
	got = shmrpc_future_value(f)->u.i;
	shmrpc_future_free(f);
	return got;
}

static int worker(void)
{
	struct shmrpc_options o = SHMRPC_OPTIONS(.num_threads = 1, .timeout_ms = 600000);
	int64_t depth = (int64_t)(SHMRPC_MAX_NESTING * tl_scale()), got;

	CHECK_OK(shmrpc_register("chain", "i", fn_chain, NULL));
	CHECK_OK(shmrpc_init(&o));
	if (shmrpc_rank() == 0) {
		/* Handlers go round ranks 1, 2, ..., 0, 1, ...: hop i runs on (i + 1) % world. */
		int64_t world = shmrpc_world_size(), want = 0;

		for (int64_t i = 0; i < depth; i++)
			want += (i + 1) % world;
		got = chain(depth - 1);
		CHECK(got == want, "a chain of %lld calls round %lld workers returned %lld, not %lld",
		      (long long)depth, (long long)world, (long long)got, (long long)want);
		if (depth == SHMRPC_MAX_NESTING) {
			got = chain(depth);
			CHECK(got == REFUSED, "a chain of %lld calls returned %lld, not the refusal",
			      (long long)depth + 1, (long long)got);
		}
	}
	CHECK_OK(shmrpc_shutdown(1, 600000));
	return 0;
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	if (tl_job_test(worker, "-n", "2", NULL) || tl_job_test(worker, "-n", "3", NULL) ||
	    tl_job_test(worker, "-n", "5", NULL))
		return 1;
	if (tl_scale() < 1)
		return tl_skip("scaled down under sanitizers, the chain does not reach the limit");
	return 0;
}
