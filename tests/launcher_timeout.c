/*
 * --timeout: a job still running when it expires is stopped (SIGTERM, and
 * SIGKILL after --grace for workers that ignore it) and shmrun exits 124
 * saying so; a job that ends in time is not affected.
 */
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define SH "/bin/sh"
#define QUICK_S 15.0 /* "within a few seconds" of the timeout, the workers sleep 30 */

static char out[16384];

static double run_timed(const char *const *argv, int *rc)
{
	uint64_t t0 = shmrpc_now_ns();

	*rc = tl_run(out, sizeof(out), argv);
	return (double)(shmrpc_now_ns() - t0) / 1e9;
}

static void expires(const char *script, const char *grace)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "3", "--timeout", "1", "--grace", grace,
			       "--", SH, "-c", script, NULL };
	int rc;
	double s = run_timed(argv, &rc);

	CHECK(rc == 124, "exit code %d", rc);
	CHECK(strstr(out, "shmrun: job timed out after 1 s\n"), "no timeout text");
	CHECK(strstr(out, "shmrun: 3 workers, 3 stopped by the timeout ("), "no summary");
	CHECK(s >= 1.0, "%.2f s: stopped before its time", s);
	CHECK(s < QUICK_S, "%.2f s: the timeout did not stop the job", s);
	fprintf(stderr, "timeout 1 s, grace %s s: %.2f s\n", grace, s);
}

static void in_time(void)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--timeout", "30", "--", SH, "-c",
			       "exit 0", NULL };

	CHECK(tl_run(out, sizeof(out), argv) == 0, "a job that ended in time failed");
	CHECK(!strstr(out, "timed out"), "timed out in time");
	CHECK(strstr(out, "shmrun: 2 workers, all exited 0 ("), "no summary");
}

int main(void)
{
	CHECK(access(tl_shmrun_path(), X_OK) == 0, "%s is not built", tl_shmrun_path());
	expires("exec sleep 30", "3");
	/* Ignoring SIGTERM buys the grace, not 30 s. */
	expires("trap '' TERM; exec sleep 30", "0.5");
	in_time();
	CHECK(tl_wait_children(), "a child failed");
	CHECK(tl_shm_leftovers() == 0, "left in /dev/shm");
	return 0;
}
