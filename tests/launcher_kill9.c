/*
 * A kill -9 of shmrun: the workers die with it (parent-death signal), and
 * what they started is stopped by its guard (launcher/guard.c), which
 * outlives it: each worker's `sleep &` (and one that ignores SIGTERM gets
 * SIGKILL after the grace), reparented to this test (a subreaper here, as
 * init or a service manager would be), ends; the guard says so on stderr
 * and ends too. A normal end leaves the guard nothing to do and no word.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

static char out[16384];

/* The pid rank left in dir/RANK, once it is there (10 s at most). */
static pid_t left_pid(const char *dir, int rank)
{
	uint64_t until = shmrpc_now_ns() + 10000000000ull;
	char path[128];
	int pid = 0;

	snprintf(path, sizeof(path), "%s/%d", dir, rank);
	while (shmrpc_now_ns() < until) {
		FILE *f = fopen(path, "r");

		if (f) {
			bool got = fscanf(f, "%d", &pid) == 1 && pid > 0;

			fclose(f);
			if (got) {
				unlink(path);
				return pid;
			}
		}
		usleep(10000);
	}
	CHECK(0, "rank %d left no pid", rank);
	return 0;
}

/* Waits for pid, which becomes our child when its parent (a worker) has
 * died (we are a subreaper); how it ended. */
static int reaped(pid_t pid)
{
	uint64_t until = shmrpc_now_ns() + 20000000000ull;
	int status;
	pid_t got;

	while ((got = waitpid(pid, &status, WNOHANG)) != pid) {
		CHECK(got == 0 || errno == ECHILD, "pid %d: %s", (int)pid, strerror(errno));
		CHECK(shmrpc_now_ns() < until, "pid %d is still running (or not ours)", (int)pid);
		usleep(10000);
	}
	return status;
}

static void killed_launcher(const char *dir)
{
	/* Rank 0's child ignores SIGTERM: the guard's SIGKILL ends it. */
	const char *script = "exec >/dev/null 2>&1; "
			     "if [ $SHMRPC_RANK = 0 ]; then (trap '' TERM; exec sleep 300) & "
			     "else sleep 300 & fi; echo $! > \"$0/$SHMRPC_RANK.tmp\"; "
			     "mv \"$0/$SHMRPC_RANK.tmp\" \"$0/$SHMRPC_RANK\"; exec sleep 300";
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--grace", "1", "--", "/bin/sh", "-c",
			       script, dir, NULL };
	pid_t shmrun, left[2];
	int fd, rc, status;

	shmrun = tl_spawn(argv, &fd);
	CHECK(shmrun > 0, "cannot start shmrun");
	for (int r = 0; r < 2; r++)
		left[r] = left_pid(dir, r);
	CHECK(kill(shmrun, SIGKILL) == 0, "kill -9 shmrun");
	rc = tl_collect(shmrun, fd, out, sizeof(out)); /* ends once the guard let go of stderr */
	CHECK(rc == 128 + SIGKILL, "shmrun exited %d", rc);
	CHECK(strstr(out, "shmrun: the launcher ended before its job: its guard stopped "),
	      "the guard said nothing");
	status = reaped(left[0]);
	CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
	      "rank 0's child (it ignores SIGTERM) ended with status %#x", status);
	status = reaped(left[1]);
	CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM,
	      "rank 1's child ended with status %#x", status);
	/* The workers and the guard came to us too: none is left running. */
	for (uint64_t until = shmrpc_now_ns() + 20000000000ull; waitpid(-1, NULL, WNOHANG) >= 0;) {
		CHECK(shmrpc_now_ns() < until, "a process of the job is still running");
		usleep(10000);
	}
	CHECK(errno == ECHILD, "waitpid: %s", strerror(errno));
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
}

static void normal_end(void)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--", "/bin/true", NULL };

	CHECK(tl_run(out, sizeof(out), argv) == 0, "shmrun failed");
	CHECK(!strstr(out, "guard"), "the guard spoke after a normal end");
	CHECK(waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD, "something was left to reap");
}

int main(void)
{
	char dir[] = "/tmp/shmrpc-kill9-XXXXXX";

	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	CHECK(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "cannot be a subreaper");
	CHECK(mkdtemp(dir), "mkdtemp");
	normal_end();
	killed_launcher(dir);
	rmdir(dir);
	return 0;
}
