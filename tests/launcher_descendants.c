/*
 * Everything the workers start ends with the job, however it ends and
 * however deep it is (launcher/orphans.c, launcher/tree.c): each worker
 * leaves a child (`sleep &`), a grandchild (a sleep under a shell that
 * waits for it) and a daemon (a sleep under `setsid`, whose parent has
 * ended: a session and process group of its own, shmrun's child by
 * then). The job ends by exit 0, by a failure (abort), by SIGTERM or
 * SIGINT to shmrun (a background sleep of sh ignores SIGINT: the grace's
 * SIGKILL ends those) or by kill -9 of shmrun (its guard, launcher/guard.c,
 * stops them; this test is a subreaper to reap them then). Each time every
 * one of those processes is gone. And at a stop, the workers' children
 * hear it with their workers, not after them: a worker deaf to SIGTERM
 * that ends once its child got SIGTERM ends by itself, exit 0, long before
 * the grace.
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

#define WAIT_NS 30000000000ull /* a bound for what takes milliseconds */

static char out[16384];
static const char *const kinds[] = { "child", "grand", "daemon" };

/* $0: the directory, $1: how the job ends. Each process's pid is put in
 * DIR/RANK.KIND (through a rename, so that a reader sees it whole). */
static const char script[] =
	"d=$0; r=$SHMRPC_RANK; "
	"put() { echo $2 > \"$d/$r.$1.tmp\"; mv \"$d/$r.$1.tmp\" \"$d/$r.$1\"; }; "
	"sleep 300 & put child $!; "
	"sh -c 'sleep 300 & echo $! > \"$0.tmp\"; mv \"$0.tmp\" \"$0\"; wait' \"$d/$r.grand\" & "
	"setsid sh -c 'sleep 300 </dev/null >/dev/null 2>&1 & echo $! > \"$0.tmp\"; "
	"mv \"$0.tmp\" \"$0\"' \"$d/$r.daemon\" & "
	"while [ ! -e \"$d/$r.grand\" ] || [ ! -e \"$d/$r.daemon\" ]; do sleep 0.01; done; "
	/* Rank 1 fails once rank 0's processes are all there. */
	"case $1 in exit0) exit 0;; abort) [ $r = 1 ] && { "
	"while [ ! -e \"$d/0.grand\" ] || [ ! -e \"$d/0.daemon\" ]; do sleep 0.01; done; "
	"exit 3; };; esac; "
	"exec sleep 300";

/* The pid in dir/RANK.KIND, once it is there (the file stays: the
 * worker waits for it too). */
static pid_t left_pid(const char *dir, int rank, const char *kind)
{
	uint64_t until = shmrpc_now_ns() + WAIT_NS;
	char path[160];
	int pid = 0;

	snprintf(path, sizeof(path), "%s/%d.%s", dir, rank, kind);
	for (;;) {
		FILE *f = fopen(path, "r");

		if (f) {
			bool got = fscanf(f, "%d", &pid) == 1 && pid > 0;

			fclose(f);
			if (got)
				break;
		}
		CHECK(shmrpc_now_ns() < until, "rank %d left no %s pid", rank, kind);
		usleep(10000);
	}
	return (pid_t)pid;
}

static void read_all(const char *dir, pid_t pids[2][3])
{
	for (int r = 0; r < 2; r++)
		for (int k = 0; k < 3; k++)
			pids[r][k] = left_pid(dir, r, kinds[k]);
}

/* Each is gone; their files removed. */
static void all_gone(const char *dir, const char *how, pid_t pids[2][3])
{
	char path[160];

	for (int r = 0; r < 2; r++) {
		for (int k = 0; k < 3; k++) {
			CHECK(kill(pids[r][k], 0) < 0 && errno == ESRCH, "%s: rank %d's %s (pid %d) "
			      "outlived the job", how, r, kinds[k], (int)pids[r][k]);
			snprintf(path, sizeof(path), "%s/%d.%s", dir, r, kinds[k]);
			unlink(path);
		}
	}
}

/* How = exit0, abort, TERM, INT or KILL (the last three: sent to shmrun). */
static void ended(const char *dir, const char *how, int sig, int code)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--grace", "1", "--", "/bin/sh", "-c",
			       script, dir, how, NULL };
	pid_t shmrun, pids[2][3];
	int fd, rc;

	shmrun = tl_spawn(argv, &fd);
	CHECK(shmrun > 0, "cannot start shmrun");
	read_all(dir, pids);
	if (sig)
		CHECK(kill(shmrun, sig) == 0, "kill");
	/* Reads until every writer of the output is gone: the children too. */
	rc = tl_collect(shmrun, fd, out, sizeof(out));
	CHECK(rc == code, "%s: shmrun exited %d, not %d", how, rc, code);
	if (sig == SIGKILL) {
		/* The guard stops them; they came to us (a subreaper): reap
		 * them all, the guard and the workers too. */
		for (uint64_t until = shmrpc_now_ns() + WAIT_NS; waitpid(-1, NULL, WNOHANG) >= 0;) {
			CHECK(shmrpc_now_ns() < until, "KILL: a process of the job is still running");
			usleep(10000);
		}
		CHECK(errno == ECHILD, "waitpid: %s", strerror(errno));
	}
	all_gone(dir, how, pids);
	CHECK(tl_shm_leftovers() == 0, "%s: files left in /dev/shm", how);
}

static void heard_at_stop(const char *dir)
{
	/* Rank 1 fails once rank 0 is ready: its child has its trap set,
	 * and it ignores SIGTERM itself; it ends (0) once its child got the
	 * SIGTERM of the abort. With a grace of 60 s, only that ends it soon. */
	const char *deaf = "d=$0; "
			   "if [ $SHMRPC_RANK = 1 ]; then "
			   "while [ ! -e \"$d/0.ready\" ]; do sleep 0.01; done; exit 3; fi; "
			   "( trap ': > \"$d/0.got\"; exit 0' TERM; : > \"$d/0.sub\"; "
			   "while :; do sleep 0.05; done ) & "
			   "while [ ! -e \"$d/0.sub\" ]; do sleep 0.01; done; "
			   "trap '' TERM; : > \"$d/0.ready\"; "
			   "while [ ! -e \"$d/0.got\" ]; do sleep 0.05; done; exit 0";
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--grace", "60", "--", "/bin/sh", "-c",
			       deaf, dir, NULL };
	char path[160];
	int rc = tl_run(out, sizeof(out), argv);

	CHECK(rc == 1, "shmrun exited %d, not 1", rc);
	CHECK(strstr(out, "worker 1 (worker1) exited with code 3, 1 exited 0 ("),
	      "rank 0 did not end by itself: its child did not hear the stop");
	snprintf(path, sizeof(path), "%s/0.got", dir);
	CHECK(unlink(path) == 0, "no %s", path);
	snprintf(path, sizeof(path), "%s/0.ready", dir);
	CHECK(unlink(path) == 0, "no %s", path);
	snprintf(path, sizeof(path), "%s/0.sub", dir);
	CHECK(unlink(path) == 0, "no %s", path);
}

int main(void)
{
	char dir[] = "/tmp/shmrun-descendants-XXXXXX";

	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	if (access("/usr/bin/setsid", X_OK) && access("/bin/setsid", X_OK))
		return tl_skip("no setsid(1) to daemonise with");
	CHECK(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "PR_SET_CHILD_SUBREAPER");
	CHECK(mkdtemp(dir), "mkdtemp");
	ended(dir, "exit0", 0, 0);
	ended(dir, "abort", 0, 1);
	ended(dir, "TERM", SIGTERM, 128 + SIGTERM);
	ended(dir, "INT", SIGINT, 128 + SIGINT);
	ended(dir, "KILL", SIGKILL, 128 + SIGKILL);
	heard_at_stop(dir);
	CHECK(rmdir(dir) == 0, "rmdir %s: %s", dir, strerror(errno));
	return 0;
}
