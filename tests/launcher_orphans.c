/*
 * The processes the workers start end with the job (launcher/orphans.c):
 * a `sleep &` left by each worker is stopped when the workers are done,
 * shmrun says so, and a `$(shmrun ...)`-style read of its output ends at
 * once; one that ignores SIGTERM gets SIGKILL after the grace; processes
 * orphaned while the job runs are reaped then, not left as zombies.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

static char out[16384];

/* The pids each rank left in dir/RANK (two ranks). */
static void read_pids(const char *dir, pid_t *pids)
{
	for (int r = 0; r < 2; r++) {
		char path[128];
		FILE *f;
		int pid = 0;

		snprintf(path, sizeof(path), "%s/%d", dir, r);
		f = fopen(path, "r");
		CHECK(f && fscanf(f, "%d", &pid) == 1 && pid > 0, "rank %d left no pid", r);
		fclose(f);
		unlink(path);
		pids[r] = pid;
	}
}

static double run(const char *grace, const char *script, const char *dir)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--grace", grace, "--", "/bin/sh", "-c",
			       script, dir, NULL };
	uint64_t t0 = shmrpc_now_ns();
	int rc = tl_run(out, sizeof(out), argv); /* reads until every writer is gone */

	CHECK(rc == 0, "shmrun exited %d", rc);
	return (double)(shmrpc_now_ns() - t0) / 1e9;
}

static void left_running(const char *dir)
{
	pid_t pids[2];
	/* The worker ends once its child runs sleep: until its exec the
	 * child is a copy of sh, and shmrun would name it so (the flake of
	 * "(sh), ...": under load the worker ended first). */
	double s = run("3", "sleep 300 & echo $! > \"$0/$SHMRPC_RANK\"; "
			    "until [ \"$(cat /proc/$!/comm)\" = sleep ]; do sleep 0.01; done", dir);

	CHECK(s < 2.5, "%.2f s: the job waited for its orphans", s);
	CHECK(strstr(out, "shmrun: the workers left 2 processes running (pid ") &&
	      strstr(out, "(sleep), ...): stopped"), "no word on them");
	read_pids(dir, pids);
	for (int r = 0; r < 2; r++)
		CHECK(kill(pids[r], 0) < 0 && errno == ESRCH, "rank %d's sleep is still there", r);
}

static void deaf_to_sigterm(const char *dir)
{
	pid_t pids[2];
	/* The worker ends once its child ignores SIGTERM (the .ready file). */
	double s = run("1", "sh -c 'trap \"\" TERM; : > \"$0.ready\"; sleep 300; :' \"$0/$SHMRPC_RANK\" "
			    "& echo $! > \"$0/$SHMRPC_RANK\"; "
			    "while [ ! -e \"$0/$SHMRPC_RANK.ready\" ]; do sleep 0.01; done; "
			    "rm \"$0/$SHMRPC_RANK.ready\"", dir);

	CHECK(s >= 0.9 && s < 5, "%.2f s: not stopped by SIGKILL after the 1 s grace", s);
	read_pids(dir, pids);
	for (int r = 0; r < 2; r++)
		CHECK(kill(pids[r], 0) < 0 && errno == ESRCH, "rank %d's shell is still there", r);
}

static void reaped_meanwhile(const char *dir)
{
	/* Each `(true &)` orphans a true that ends at once: shmrun's child
	 * then, a zombie until reaped. The worker counts shmrun's zombie
	 * trues (a worker that has just ended is one too, for a moment). */
	run("3", "for i in 1 2 3 4 5 6 7 8 9 10; do (true &); done; sleep 0.5; z=0; "
		 "for p in $(cat /proc/$PPID/task/$PPID/children); do "
		 "grep -q '^State:.*Z' /proc/$p/status 2>/dev/null && "
		 "grep -q '^Name:.true$' /proc/$p/status 2>/dev/null && z=$((z+1)); done; "
		 "echo \"rank $SHMRPC_RANK zombies $z\"; : \"$0\"", dir);
	CHECK(strstr(out, "rank 0 zombies 0") && strstr(out, "rank 1 zombies 0"),
	      "orphans left as zombies while the job ran");
	CHECK(!strstr(out, "left"), "nothing was left running");
}

int main(void)
{
	char dir[] = "/tmp/shmrun-orphans-XXXXXX";

	CHECK(access(tl_shmrun_path(), X_OK) == 0, "%s is not built", tl_shmrun_path());
	CHECK(mkdtemp(dir), "mkdtemp");
	left_running(dir);
	deaf_to_sigterm(dir);
	reaped_meanwhile(dir);
	CHECK(rmdir(dir) == 0, "rmdir %s: %s", dir, strerror(errno));
	return 0;
}
