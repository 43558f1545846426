/*
 * Signals to shmrun. SIGINT, SIGTERM and SIGHUP go to every worker, and
 * shmrun exits 128+N once all are gone. kill -9 of shmrun itself: every
 * worker is gone within 1 s (PR_SET_PDEATHSIG; the bound, the
 * time it took is printed). Workers write their pid into a directory
 * before they exec sleep, so that the test knows when they run and whom
 * to look for; the launcher's grace is 60 s, so only the forwarded signal
 * stops them in time. This test is a child subreaper, so the orphans of the
 * killed launcher come back to it and it can see how they ended.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define N 3
#define WAIT_NS 10000000000ull /* a bound for things that take milliseconds */
#define QUICK_S 15.0 /* well under the workers' 30 s and the 60 s grace */
#define ORPHAN_BOUND_NS 1000000000ull /* the issue: workers gone within 1 s */

static char out[16384];

/* Starts N workers that leave their pid in dir, then sleep 30 s. The
 * grace is longer than that: only the forwarded signal can stop them soon. */
static pid_t start_sleepers(const char *dir, int *fd)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "3", "--grace", "60", "--", "/bin/sh", "-c",
			       "echo $$ > \"$0/$SHMRPC_RANK.tmp\" && "
			       "mv \"$0/$SHMRPC_RANK.tmp\" \"$0/$SHMRPC_RANK\" && exec sleep 30",
			       dir, NULL };
	pid_t pid = tl_spawn(argv, fd);

	CHECK(pid > 0, "cannot start shmrun");
	return pid;
}

/* Waits until every worker has left its pid; removes the files. */
static void read_pids(const char *dir, pid_t *pids)
{
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;

	for (int r = 0; r < N; r++) {
		char path[128];
		FILE *f;
		int pid = 0;

		snprintf(path, sizeof(path), "%s/%d", dir, r);
		while (!(f = fopen(path, "r"))) {
			CHECK(shmrpc_now_ns() < deadline, "worker %d never started", r);
			usleep(2000);
		}
		CHECK(fscanf(f, "%d", &pid) == 1 && pid > 0, "worker %d: bad pid file", r);
		fclose(f);
		unlink(path);
		pids[r] = pid;
	}
}

static void forwarded(const char *dir, int sig, int code, const char *name)
{
	pid_t pids[N];
	int fd, rc;
	pid_t launcher = start_sleepers(dir, &fd);
	char want[64];

	uint64_t t0;
	double s;

	read_pids(dir, pids);
	t0 = shmrpc_now_ns();
	CHECK(kill(launcher, sig) == 0, "kill");
	rc = tl_collect(launcher, fd, out, sizeof(out));
	s = (double)(shmrpc_now_ns() - t0) / 1e9;
	CHECK(rc == code, "%s: exit code %d, not %d", name, rc, code);
	CHECK(s < QUICK_S, "%s: %.2f s: the workers did not get it", name, s);
	snprintf(want, sizeof(want), "shmrun: 3 workers, 3 stopped by %s (", name);
	CHECK(strstr(out, want), "%s: no summary", name);
	/* Reaped by the launcher: they are not there any more, not even as zombies. */
	for (int r = 0; r < N; r++)
		CHECK(kill(pids[r], 0) < 0 && errno == ESRCH, "%s: worker %d is still there", name, r);
}

static void launcher_killed(const char *dir)
{
	pid_t pids[N];
	int fd, rc, gone = 0;
	pid_t launcher = start_sleepers(dir, &fd);
	uint64_t t0, dt = 0;

	read_pids(dir, pids);
	t0 = shmrpc_now_ns();
	CHECK(kill(launcher, SIGKILL) == 0, "kill");
	/* The workers keep the output pipe open: reap the launcher first. */
	while (waitpid(launcher, &rc, 0) < 0)
		CHECK(errno == EINTR, "waitpid launcher");
	CHECK(WIFSIGNALED(rc) && WTERMSIG(rc) == SIGKILL, "the launcher was not killed");
	while (gone < N) {
		for (int r = 0; r < N; r++) {
			int st;

			/* ECHILD until the orphan has come to us. */
			if (pids[r] <= 0 || waitpid(pids[r], &st, WNOHANG) != pids[r])
				continue;
			CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "worker %d ended otherwise", r);
			pids[r] = 0;
			gone++;
		}
		dt = shmrpc_now_ns() - t0;
		CHECK(dt < ORPHAN_BOUND_NS, "%d of %d workers still there %.3f s after kill -9 of "
		      "shmrun", N - gone, N, (double)dt / 1e9);
		usleep(1000);
	}
	fprintf(stderr, "kill -9 shmrun: all workers gone in %.1f ms\n", (double)dt / 1e6);
	/* Every writer is gone: the pipe ends. */
	while (read(fd, out, sizeof(out)) > 0)
		;
	close(fd);
}

int main(void)
{
	char dir[] = "/tmp/shmrun-signals-XXXXXX";

	CHECK(access(tl_shmrun_path(), X_OK) == 0, "%s is not built", tl_shmrun_path());
	CHECK(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0, "PR_SET_CHILD_SUBREAPER");
	/* A shell starts background jobs with SIGINT ignored, and workers
	 * would inherit that: the test wants them to die of what it sends. */
	signal(SIGINT, SIG_DFL);
	signal(SIGHUP, SIG_DFL);
	signal(SIGTERM, SIG_DFL);
	CHECK(mkdtemp(dir), "mkdtemp");
	forwarded(dir, SIGINT, 130, "SIGINT");
	forwarded(dir, SIGTERM, 143, "SIGTERM");
	forwarded(dir, SIGHUP, 129, "SIGHUP");
	launcher_killed(dir);
	rmdir(dir);
	CHECK(tl_wait_children(), "a child failed");
	CHECK(tl_shm_leftovers() == 0, "left in /dev/shm");
	return 0;
}
