/*
 * The guard: what a kill -9 of shmrun would leave running is stopped
 * anyway. shmrun forks the guard before the workers; the guard waits for
 * the end of a pipe whose write end only shmrun holds (close-on-exec, so
 * no worker holds it), and that end comes when shmrun closes it, or dies
 * in any way. The guard then stops every process that still carries the
 * job's mark in its environment (SHMRPC_JOB_INO, the job segment's inode,
 * which spawn.c gives the workers and their children inherit): SIGTERM,
 * the grace, SIGKILL. After a normal end shmrun has stopped them already
 * (orphans.c) and the guard finds none; after a kill -9 it finds what the
 * workers started: the parent-death signal reaches only the workers
 * (which the guard leaves to it: their SIGKILL says how they ended), and
 * no subreaper of the job is left. The job segment stays mapped in the
 * guard (the workers' pids); its fds are closed. What escapes it: a process that
 * cleared its environment, and a kill of the guard itself (a kill -9 of
 * shmrun's whole process group). docs/ARCHITECTURE.md says so.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "launcher/shmrun.h"

#define GUARD_ENV_MAX (256u << 10) /* environment bytes looked at per process */
#define GUARD_KILL_ROUNDS 50

/* "\0SHMRPC_JOB_INO=123\0": the mark, NUL on both sides (the first
 * variable matches from the environment's start, see marked()). */
static char mark[64];
static size_t mark_len;

/* Whether pid's environment carries the job's mark. */
static bool marked(pid_t pid)
{
	static char env[GUARD_ENV_MAX + 1];
	char path[64];
	size_t len = 1;
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/environ", (int)pid);
	if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
		return false;
	env[0] = '\0'; /* so that the first variable has a NUL before it */
	while (len < sizeof(env) && (n = read(fd, env + len, sizeof(env) - len)) > 0)
		len += (size_t)n;
	close(fd);
	return len > 1 && memmem(env, len, mark, mark_len) != NULL;
}

/* Whether pid is one of the job's workers, as their slots say: those
 * have their own end (the parent-death signal, SIGKILL). The slots are
 * shared memory, so at worst a wrong word spares a process or two. */
static bool a_worker(const struct job *j, pid_t pid)
{
	for (uint32_t r = 0; r < j->shm.seg.world; r++)
		/* Relaxed: the launcher's store at fork happened before its death. */
		if ((pid_t)atomic_load_explicit(&shm_worker(&j->shm.seg, r)->pid,
						memory_order_relaxed) == pid)
			return true;
	return false;
}

/* Sends sig (0: only counts) to every marked process but the workers; how
 * many, and the first as "pid 123 (sleep)". */
static int signal_marked(const struct job *j, int sig, char *first, size_t len)
{
	DIR *d = opendir("/proc");
	struct dirent *de;
	int n = 0;

	while (d && (de = readdir(d))) {
		char *end;
		long pid = strtol(de->d_name, &end, 10);

		if (*end || pid <= 0 || pid == getpid() || !marked((pid_t)pid) ||
		    a_worker(j, (pid_t)pid))
			continue;
		if (sig && kill((pid_t)pid, sig) < 0)
			continue;
		if (!n++ && first) {
			char path[64], comm[32] = "?";
			FILE *f;

			snprintf(path, sizeof(path), "/proc/%ld/comm", pid);
			if ((f = fopen(path, "r"))) {
				if (fgets(comm, sizeof(comm), f))
					comm[strcspn(comm, "\n")] = '\0';
				fclose(f);
			}
			snprintf(first, len, "pid %ld (%s)", pid, comm);
		}
	}
	if (d)
		closedir(d);
	return n;
}

static __attribute__((noreturn)) void guard_main(const struct job *j, int fd)
{
	char first[64] = "", c;
	uint64_t until;
	int n;

	/* It outlives shmrun on purpose: no parent-death signal, and the
	 * terminal's signals (shmrun forwards them) are not for it. */
	signal(SIGINT, SIG_IGN);
	signal(SIGTERM, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	signal(SIGQUIT, SIG_IGN);
	prctl(PR_SET_NAME, "shmrun-guard");
	while (read(fd, &c, 1) < 0 && errno == EINTR)
		;
	n = signal_marked(j, SIGTERM, first, sizeof(first));
	if (!n)
		_exit(0);
	until = shmrpc_now_ns() + j->o->grace_ns;
	while (shmrpc_now_ns() < until && signal_marked(j, 0, NULL, 0))
		usleep(10000);
	for (int round = 0; round < GUARD_KILL_ROUNDS && signal_marked(j, SIGKILL, NULL, 0);
	     round++)
		usleep(10000);
	fprintf(stderr, "shmrun: the launcher ended before its job: its guard stopped %d "
		"process%s of the job (%s%s)\n", n, n == 1 ? "" : "es", first,
		n > 1 ? ", ..." : "");
	_exit(0);
}

int guard_start(struct job *j)
{
	struct stat st;
	int p[2];
	pid_t pid;

	if (fstat(j->shm.seg.fd, &st) < 0 || pipe2(p, O_CLOEXEC) < 0) {
		fprintf(stderr, "shmrun: cannot start the guard of the job (what a killed shmrun "
			"leaves will not be stopped): %s\n", strerror(errno));
		return -1;
	}
	mark[0] = '\0';
	mark_len = 1 + (size_t)snprintf(mark + 1, sizeof(mark) - 2, "%s=%llu", SHMRPC_ENV_JOB_INO,
					(unsigned long long)st.st_ino) + 1;
	fflush(NULL);
	pid = fork();
	if (pid < 0) {
		fprintf(stderr, "shmrun: cannot start the guard of the job (what a killed shmrun "
			"leaves will not be stopped): %s\n", strerror(errno));
		close(p[0]);
		close(p[1]);
		return -1;
	}
	if (pid == 0) {
		int null = open("/dev/null", O_WRONLY | O_CLOEXEC);

		/* Only the pipe and stderr: no stdout that a $(shmrun ...)
		 * would wait on, none of the job's memfds. */
		if (null >= 0)
			dup2(null, 1);
		if (dup2(p[0], 3) < 0)
			_exit(1);
		close_range(4, ~0u, 0);
		sigprocmask(SIG_SETMASK, &j->worker_sigmask, NULL);
		guard_main(j, 3);
	}
	close(p[0]);
	j->guard_pid = pid;
	j->guard_fd = p[1];
	return 0;
}

void guard_stop(struct job *j)
{
	if (!j->guard_pid)
		return;
	/* The end of the pipe: the guard looks (and finds nothing when the
	 * workers' processes were stopped already), and ends. */
	close(j->guard_fd);
	while (waitpid(j->guard_pid, NULL, 0) < 0 && errno == EINTR)
		;
	j->guard_pid = 0;
}
