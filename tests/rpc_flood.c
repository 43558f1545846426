/*
 * 100,000 rpc_async calls in flight from one worker to another before the
 * first is waited for: back-pressure on full rings, a pending table of
 * 100 k entries, every result right.
 */
#include <stdlib.h>
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static int fn_square(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i * a[0].u.i);
	return 0;
}

static int worker(void)
{
	int n = (int)(100000 * tl_scale());
	shmrpc_future **f;

	CHECK_OK(shmrpc_register("square", "i", fn_square, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		CHECK((f = calloc((size_t)n, sizeof(*f))) != NULL, "calloc");
		for (int i = 0; i < n; i++) {
			shmrpc_value v = shmrpc_int(i);

			CHECK_OK(shmrpc_rpc_async(1, "square", &v, 1, SHMRPC_TIMEOUT_NONE, &f[i]));
		}
		for (int i = 0; i < n; i++) {
			CHECK_OK(shmrpc_future_wait(f[i], -1));
			CHECK(shmrpc_future_value(f[i])->u.i == (int64_t)i * i, "call %d", i);
			shmrpc_future_free(f[i]);
		}
		free(f);
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	/* Spin mode: waiting callers and idle executors poll the rings without bound. */
	return tl_job_test(worker, "-n", "2", NULL) ?: tl_job_test(worker, "-n", "2", "--wait=spin", NULL);
}
