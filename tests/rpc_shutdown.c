/*
 * Graceful shutdown. A straggler: rank 1 calls rank 0 *after* rank 0 has
 * entered shutdown, and still gets its answer (workers keep serving until
 * all have arrived). A timeout: rank 0 gives up waiting for a rank that
 * does not come, with an error naming it; the late one then leaves too.
 */
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static int fn_one(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(1);
	return 0;
}

static int worker(void)
{
	const char *scenario = getenv("TL_SCENARIO");
	shmrpc_future *f;
	int rc;

	CHECK_OK(shmrpc_register("one", "", fn_one, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (strcmp(scenario, "straggler") == 0) {
		if (shmrpc_rank() == 1) {
			usleep(300000); /* rank 0 is inside shmrpc_shutdown by now */
			CHECK_OK(shmrpc_rpc_sync(0, "one", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
			CHECK(shmrpc_future_value(f)->u.i == 1, "straggler's call");
			shmrpc_future_free(f);
		}
		CHECK_OK(shmrpc_shutdown(1, 30000));
		return 0;
	}
	/* timeout */
	if (shmrpc_rank() == 0) {
		rc = shmrpc_shutdown(1, 200);
		CHECK(rc == -ETIMEDOUT, "shutdown returned %d", rc);
		CHECK(strstr(shmrpc_errmsg(), "timed out: still busy: worker 1 (worker1)"), "%s",
		      shmrpc_errmsg());
		fprintf(stderr, "rank 0: %s\n", shmrpc_errmsg());
		return 0;
	}
	usleep(1000000);
	CHECK_OK(shmrpc_shutdown(1, 30000)); /* rank 0 has left: nobody to wait for */
	return 0;
}

int main(void)
{
	char out[1 << 14];

	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	setenv("TL_SCENARIO", "straggler", 1);
	CHECK(tl_shmrun(out, sizeof(out), "-n", "2", NULL) == 0, "straggler scenario failed");
	setenv("TL_SCENARIO", "timeout", 1);
	CHECK(tl_shmrun(out, sizeof(out), "-n", "2", NULL) == 0, "timeout scenario failed");
	CHECK(strstr(out, "rank 0: shmrpc_shutdown on worker 0 timed out"), "no timeout text");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
