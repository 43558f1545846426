/*
 * shmrpc-inspect where things are wrong; each failure is one line on
 * stderr and exit 1, never a hang:
 * - a process holding a memfd named as a job's segment that holds garbage,
 *   then a segment of a newer format (this process holds them), in every
 *   mode; and the job list leaves it out;
 * - another user's job (when root: a child that drops to uid 65534; else
 *   that part is skipped, said on stderr);
 * - a worker killed while its launcher is stopped (so it cannot reap nor
 *   sweep it: the state an operator meets when a launcher is stuck):
 *   --check names it, still RUNNING with its process gone, and its pool
 *   references unswept; once the launcher runs again, DEAD and swept;
 * - a job that ends under --watch, a finished launcher not yet reaped, and
 *   one that is gone;
 * - a job whose tensor pool cannot be read (a child holding a copy of a
 *   live job's segment, as its "launcher", beside a pool memfd of
 *   garbage): the text and JSON say why where the pool would be, and
 *   --check calls it an anomaly.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "shm/pool.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define OUT_MAX 65536
#define WAIT_NS (10ull * 1000000000ull) /* only stops a hang */
#define NOBODY 65534
#define TENSOR_BYTES 4096

static char out[OUT_MAX];

static int inspect(const char *a1, const char *a2, const char *a3)
{
	const char *argv[5] = { tl_inspect_path(), a1, a2, a3, NULL };

	return tl_run(out, sizeof(out), argv);
}

/* The output is the one line "shmrpc-inspect: " text... */
static void one_line(const char *what, int rc, const char *text)
{
	char *nl = strchr(out, '\n');

	CHECK(rc == 1, "%s: exit %d, want 1: %s", what, rc, out);
	CHECK(!strncmp(out, "shmrpc-inspect: ", 16) && nl && nl[1] == '\0',
	      "%s: not one line of error: \"%s\"", what, out);
	CHECK(strstr(out, text), "%s: \"%s\" lacks \"%s\"", what, out, text);
}

static bool until(uint64_t deadline)
{
	if (shmrpc_now_ns() > deadline)
		return false;
	usleep(1000);
	return true;
}

/* ---- garbage ---- */

/* A memfd named as a job's segment, holding bytes then zeros up to size. */
static int fake_segment(const void *bytes, size_t len, size_t size)
{
	int fd = memfd_create("shmrpc-job", MFD_CLOEXEC);

	CHECK(fd >= 0, "memfd_create");
	CHECK(ftruncate(fd, (off_t)size) == 0, "ftruncate");
	CHECK(pwrite(fd, bytes, len, 0) == (ssize_t)len, "pwrite");
	return fd;
}

/* Each mode on this process, which holds fd as its job segment. */
static void refused_everywhere(const char *what, int fd, const char *text)
{
	char self[16], line[32];
	int rc;

	snprintf(self, sizeof(self), "%d", (int)getpid());
	one_line(what, inspect(self, NULL, NULL), text);
	one_line(what, inspect("--json", self, NULL), text);
	one_line(what, inspect("--check", self, NULL), text);
	one_line(what, inspect("--trace", "0", self), text);
	/* The first draw fails: no table, no cleared screen, no loop. */
	one_line(what, inspect("--watch=0.1", self, NULL), text);
	rc = inspect(NULL, NULL, NULL);
	snprintf(line, sizeof(line), "\n%7s ", self);
	CHECK(rc == 0 && !strstr(out, line), "%s: the job list exited %d, or lists it: %s", what,
	      rc, out);
	close(fd);
}

static void test_garbage(void)
{
	struct shm_seg_params sp = { .world_size = 2 };
	static uint8_t junk[8192];
	uint64_t x = 0x9e3779b97f4a7c15ull;
	struct shm_header h;
	struct shm_seg seg;
	uint64_t size;
	char text[96];

	for (size_t i = 0; i < sizeof(junk); i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		junk[i] = (uint8_t)x;
	}
	snprintf(text, sizeof(text), "process %d: not a shmrpc segment (bad magic)", (int)getpid());
	refused_everywhere("garbage", fake_segment(junk, sizeof(junk), sizeof(junk)), text);

	/* A real header, then made newer; the real segment goes first, so
	 * that this process holds one job segment at a time. */
	CHECK_OK(shm_seg_create(&seg, &sp));
	h = *seg.hdr;
	size = seg.size;
	shm_seg_detach(&seg);
	h.format_version = SHM_FORMAT_VERSION + 1;
	snprintf(text, sizeof(text), "process %d: segment format %u, this library reads format %u",
		 (int)getpid(), SHM_FORMAT_VERSION + 1, SHM_FORMAT_VERSION);
	refused_everywhere("newer format", fake_segment(&h, sizeof(h), size), text);

	h.format_version = SHM_FORMAT_VERSION;
	snprintf(text, sizeof(text), "process %d: segment truncated", (int)getpid());
	refused_everywhere("truncated", fake_segment(&h, sizeof(h), sizeof(h)), text);
}

/* ---- a live job ---- */

static int worker(void)
{
	shmrpc_tensor *t[2];
	int64_t shape = TENSOR_BYTES;

	CHECK_OK(shmrpc_init(NULL));
	/* Rank 1 holds two blocks of the pool until it is killed. */
	for (int i = 0; i < 2 && shmrpc_rank() == 1; i++)
		CHECK_OK(shmrpc_tensor_alloc((DLDataType){ kDLUInt, 8, 1 }, 1, &shape, &t[i]));
	/* Both wait to be killed: rank 1 by the test, rank 0 by the launcher's
	 * SIGTERM, sent on to the workers. */
	for (;;)
		pause();
}

/* The memfd of pid linked as link, opened read-only; -1 while it has none. */
static int open_memfd(pid_t pid, const char *link)
{
	char dir[64], path[PATH_MAX], got[64];
	struct dirent *d;
	DIR *fds;
	int fd = -1;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
	if (!(fds = opendir(dir)))
		return -1;
	while (fd < 0 && (d = readdir(fds))) {
		ssize_t n;

		snprintf(path, sizeof(path), "%s/%s", dir, d->d_name);
		n = readlink(path, got, sizeof(got) - 1);
		if (n > 0 && (got[n] = '\0', !strcmp(got, link)))
			fd = open(path, O_RDONLY | O_CLOEXEC);
	}
	closedir(fds);
	return fd;
}

/* Whether pid has ended: gone, or a zombie not reaped. */
static bool gone(pid_t pid)
{
	char state = tl_proc_state(pid);

	return !state || state == 'Z' || state == 'X';
}

struct job {
	pid_t launcher, watcher;
	int out_fd, watch_fd;
	char pid[16];
	struct shm_seg seg;
	struct shm_pool pool;
};

/* Starts the job and waits until rank 1 holds its two blocks. */
static void start_job(struct job *j)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--on-failure=continue", "--",
			       "/proc/self/exe", NULL };
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;
	char self[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	struct pool_holder_stats hs = { 0 };
	int fd;

	CHECK(n > 0, "readlink /proc/self/exe");
	self[n] = '\0';
	argv[5] = self;
	j->launcher = tl_spawn(argv, &j->out_fd);
	CHECK(j->launcher > 0, "cannot run shmrun");
	snprintf(j->pid, sizeof(j->pid), "%d", (int)j->launcher);
	/* Each memfd is there before the launcher has written its header. */
	for (; (fd = open_memfd(j->launcher, "/memfd:shmrpc-job (deleted)")) < 0 ||
	       shm_seg_attach_fd(&j->seg, fd, true);
	     fd >= 0 ? close(fd) : 0)
		CHECK(until(deadline), "the launcher made no job segment: %s", shmrpc_errmsg());
	for (; (fd = open_memfd(j->launcher, "/memfd:shmrpc-pool (deleted)")) < 0 ||
	       pool_attach_fd(&j->pool, fd, true);
	     fd >= 0 ? close(fd) : 0)
		CHECK(until(deadline), "the launcher made no tensor pool: %s", shmrpc_errmsg());
	while (pool_holder_stats(&j->pool, 1, &hs) || hs.state != POOL_HOLDER_LIVE || hs.refs != 2)
		CHECK(until(deadline), "rank 1 never held its 2 blocks");
}

/* A child, the "launcher" of a copy of j's segment beside a pool of
 * garbage, and nothing else open: it says ready on ready_fd and waits. */
static void unreadable_launcher(struct job *j, int ready_fd)
{
	static const char garbage[] = "not a tensor pool";
	uint32_t me = (uint32_t)getpid();
	int seg_fd, copy, pool_fd;
	struct stat st;
	void *bytes;

	/* This process's own pool and segment fds would be found first. */
	close_range(3, (unsigned)ready_fd - 1, 0);
	close_range((unsigned)ready_fd + 1, ~0u, 0);
	seg_fd = open_memfd(j->launcher, "/memfd:shmrpc-job (deleted)");
	copy = memfd_create("shmrpc-job", 0);
	pool_fd = memfd_create("shmrpc-pool", 0);
	if (seg_fd < 0 || copy < 0 || pool_fd < 0 || fstat(seg_fd, &st) ||
	    (bytes = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, seg_fd, 0)) == MAP_FAILED ||
	    ftruncate(copy, st.st_size) || pwrite(copy, bytes, (size_t)st.st_size, 0) != st.st_size ||
	    pwrite(copy, &me, sizeof(me), offsetof(struct shm_header, launcher_pid)) != sizeof(me) ||
	    ftruncate(pool_fd, 1 << 16) || pwrite(pool_fd, garbage, sizeof(garbage), 0) != sizeof(garbage))
		_exit(1);
	if (write(ready_fd, "r", 1) != 1)
		_exit(1);
	for (;;)
		pause();
}

/* A job whose pool cannot be read: said where the pool would be; an
 * anomaly for --check. */
static void test_unreadable_pool(struct job *j)
{
	int p[2], status, rc;
	char self[16], c;
	pid_t child;

	CHECK(pipe(p) == 0, "pipe: %m");
	child = fork();
	CHECK(child >= 0, "fork: %m");
	if (child == 0)
		unreadable_launcher(j, p[1]);
	close(p[1]);
	CHECK(read(p[0], &c, 1) == 1, "the child could not copy the job");
	close(p[0]);

	snprintf(self, sizeof(self), "%d", (int)child);
	rc = inspect(self, NULL, NULL);
	CHECK(rc == 0 && strstr(out, "\ntensor pool    cannot be read: "), "the text exited %d: %s",
	      rc, out);
	rc = inspect("--json", self, NULL);
	CHECK(rc == 0 && strstr(out, ",\"pool\":{\"error\":\"") && strstr(out, ",\"rrefs\":null"),
	      "the JSON exited %d: %s", rc, out);
	rc = inspect("--check", self, NULL);
	CHECK(rc == 1 && !strncmp(out, "the tensor pool cannot be read: ", 32) &&
		      strchr(out, '\n')[1] == '\0',
	      "--check exited %d: %s", rc, out);
	kill(child, SIGKILL);
	CHECK(waitpid(child, &status, 0) == child, "waitpid: %m");
}

/* As uid and gid 65534, the inspector on the job, and the job list. */
static void test_other_user(struct job *j)
{
	const char *argv[3][4] = { { tl_inspect_path(), j->pid, NULL },
				   { tl_inspect_path(), "--check", j->pid, NULL },
				   { tl_inspect_path(), NULL } };
	char line[32], text[96];

	if (geteuid() != 0) {
		fprintf(stderr, "inspect_bad: not root: another user's job is not tested\n");
		return;
	}
	snprintf(text, sizeof(text), "process %s belongs to another user", j->pid);
	for (int i = 0; i < 3; i++) {
		int fds[2], rc;
		pid_t pid;

		CHECK(pipe(fds) == 0, "pipe");
		fflush(NULL);
		pid = fork();
		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			dup2(fds[1], 1);
			dup2(fds[1], 2);
			close(fds[0]);
			close(fds[1]);
			if (setgroups(0, NULL) || setresgid(NOBODY, NOBODY, NOBODY) ||
			    setresuid(NOBODY, NOBODY, NOBODY)) {
				fprintf(stderr, "cannot drop to uid %d: %s\n", NOBODY, strerror(errno));
				_exit(127);
			}
			execv(argv[i][0], (char *const *)argv[i]);
			fprintf(stderr, "cannot run %s as uid %d: %s\n", argv[i][0], NOBODY, strerror(errno));
			_exit(127);
		}
		close(fds[1]);
		rc = tl_collect(pid, fds[0], out, sizeof(out));
		if (i < 2) {
			one_line("another user's job", rc, text);
		} else {
			snprintf(line, sizeof(line), "\n%7s ", j->pid);
			CHECK(rc == 0 && !strstr(out, line), "uid %d's job list exited %d, or lists "
			      "root's job: %s", NOBODY, rc, out);
		}
	}
}

/* --watch on the job, until it has drawn one table. */
static void start_watch(struct job *j)
{
	const char *argv[] = { tl_inspect_path(), "--watch=0.1", j->pid, NULL };
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;
	size_t len = 0;

	j->watcher = tl_spawn(argv, &j->watch_fd);
	CHECK(j->watcher > 0, "cannot run shmrpc-inspect --watch");
	while (!strstr(out, "launcher pid")) {
		struct pollfd p = { j->watch_fd, POLLIN, 0 };
		ssize_t n;

		CHECK(shmrpc_now_ns() < deadline && len < sizeof(out) - 1, "--watch drew no table");
		if (poll(&p, 1, 10) <= 0)
			continue;
		n = read(j->watch_fd, out + len, sizeof(out) - 1 - len);
		CHECK(n > 0, "--watch ended: %s", out);
		len += (size_t)n;
		out[len] = '\0';
	}
}

/* Rank 1 killed while the launcher is stopped, then the launcher let go. */
static void test_killed_worker(struct job *j)
{
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;
	struct shm_worker *w1 = shm_worker(&j->seg, 1);
	pid_t victim = (pid_t)atomic_load(&w1->pid);
	struct pool_holder_stats hs;
	char line[160];
	int status, rc;

	CHECK(inspect("--check", j->pid, NULL) == 0 && !strcmp(out, "ok\n"), "--check: %s", out);
	CHECK(kill(j->launcher, SIGSTOP) == 0, "SIGSTOP the launcher");
	CHECK(waitpid(j->launcher, &status, WUNTRACED) == j->launcher && WIFSTOPPED(status),
	      "the launcher did not stop");
	CHECK(kill(victim, SIGKILL) == 0, "SIGKILL rank 1 (%d)", (int)victim);
	while (!gone(victim))
		CHECK(until(deadline), "rank 1 (%d) does not die", (int)victim);

	rc = inspect("--check", j->pid, NULL);
	snprintf(line, sizeof(line), "rank 1 (worker1) is RUNNING, but its process %d is gone: the "
		 "launcher has not seen it end\n", (int)victim);
	CHECK(rc == 1 && strstr(out, line), "--check with rank 1 killed exited %d: %s", rc, out);
	snprintf(line, sizeof(line), "rank 1 (pid %d) is gone holding 2 references in the tensor "
		 "pool, not swept", (int)victim);
	CHECK(strstr(out, line) && !strstr(out, "rank 0"), "--check: %s", out);

	/* Let go, the launcher reaps it: DEAD, and its blocks swept. */
	CHECK(kill(j->launcher, SIGCONT) == 0, "SIGCONT the launcher");
	while (atomic_load(&w1->state) != SHM_WORKER_DEAD ||
	       pool_holder_stats(&j->pool, 1, &hs) || hs.refs)
		CHECK(until(deadline), "the launcher did not sweep rank 1");
	rc = inspect("--check", j->pid, NULL);
	CHECK(rc == 1 && !strcmp(out, "rank 1 (worker1) is DEAD: killed by signal 9 (SIGKILL)\n"),
	      "--check with rank 1 swept exited %d: %s", rc, out);
}

/* The launcher stopped by SIGTERM: --watch says the job ended; the launcher
 * not yet reaped, then reaped, is no job. */
static void test_job_ends(struct job *j)
{
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;
	char text[64], tail[OUT_MAX], *last;
	siginfo_t si;
	int rc;

	shm_seg_detach(&j->seg);
	pool_detach(&j->pool);
	CHECK(kill(j->launcher, SIGTERM) == 0, "SIGTERM the launcher");
	memset(&si, 0, sizeof(si));
	CHECK(waitid(P_PID, (id_t)j->launcher, &si, WEXITED | WNOWAIT) == 0 && si.si_pid == j->launcher,
	      "waitid: %s", strerror(errno));
	snprintf(text, sizeof(text), "no such job: process %s has ended", j->pid);
	one_line("a launcher not reaped", inspect(j->pid, NULL, NULL), text);
	one_line("a launcher not reaped", inspect("--check", j->pid, NULL), text);

	rc = tl_collect(j->launcher, j->out_fd, tail, sizeof(tail));
	CHECK(rc == 128 + SIGTERM, "shmrun exited %d: %s", rc, tail);
	snprintf(text, sizeof(text), "no such job: no process %s", j->pid);
	one_line("a finished job", inspect(j->pid, NULL, NULL), text);

	/* The watcher ends by itself: read to its end, bounded, so that a
	 * hang fails instead (killed, it exits 128 + 9). Its last tables are
	 * dropped as they come: only what follows the last one matters. */
	out[0] = '\0';
	for (;;) {
		struct pollfd p = { j->watch_fd, POLLIN, 0 };
		ssize_t n;

		if (shmrpc_now_ns() > deadline) {
			kill(j->watcher, SIGKILL);
			break;
		}
		if (poll(&p, 1, 100) <= 0)
			continue;
		n = read(j->watch_fd, tail, sizeof(tail) - 1);
		if (n <= 0)
			break;
		tail[n] = '\0';
		if ((last = strrchr(tail, '\033')))
			memmove(out, last, strlen(last) + 1);
		else if (strlen(out) + (size_t)n < sizeof(out))
			strcat(out, tail);
	}
	rc = tl_collect(j->watcher, j->watch_fd, tail, sizeof(tail));
	memcpy(tail, out, strlen(out) + 1);
	CHECK(rc == 1, "--watch exited %d when the job ended (hung?)", rc);
	snprintf(text, sizeof(text), "shmrpc-inspect: job %s has ended\n", j->pid);
	last = strstr(tail, "shmrpc-inspect: ");
	CHECK(last && !strcmp(last, text), "--watch did not end with \"%s\": %s", text, tail);
}

int main(void)
{
	struct job j;

	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK) || access(tl_inspect_path(), X_OK))
		return tl_skip("shmrun or shmrpc-inspect is not built");
	test_garbage();
	start_job(&j);
	test_unreadable_pool(&j);
	test_other_user(&j);
	start_watch(&j);
	test_killed_worker(&j);
	test_job_ends(&j);
	CHECK(tl_wait_children(), "a child failed");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
