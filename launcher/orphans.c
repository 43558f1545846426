/*
 * The processes the workers start (a `sleep &`, a helper, a forked
 * grandchild, a `setsid` daemon) belong to the job too. shmrun is their
 * child subreaper: when the process that started one ends, it becomes
 * shmrun's child instead of init's. Those that end while the job runs are
 * reaped on SIGCHLD. When shmrun stops the job, they get the workers'
 * signal with them, and SIGKILL with them after the grace (orphans_signal,
 * from watch.c); when the last worker has ended, whatever is left is
 * stopped (SIGTERM, the grace, SIGKILL) and reaped. They are found as
 * shmrun's descendants (tree.c says why not by process group), so that
 * nothing of the job outlives shmrun: not a process, not the job's
 * memfds it inherited, not the pipe that a `$(shmrun ...)` waits on. (A
 * kill -9 of shmrun itself leaves them to init, as PR_SET_PDEATHSIG
 * reaches only the workers: guard.c stops them then.)
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/cuda_leftovers.h"
#include "common/proc_stat.h"
#include "launcher/shmrun.h"

#define MAX_LISTED 4096 /* children looked at per round; more wait for the next */

int orphans_adopt(void)
{
	if (prctl(PR_SET_CHILD_SUBREAPER, 1) == 0)
		return 0;
	fprintf(stderr, "shmrun: cannot become the subreaper of the workers' processes: %s\n",
		strerror(errno));
	return -1;
}

/* shmrun's children now (its only thread's list), the live workers left
 * out; their number. */
static int children(const struct job *j, pid_t *out, int most)
{
	char path[64];
	FILE *f;
	int n = 0, pid;

	snprintf(path, sizeof(path), "/proc/self/task/%d/children", (int)getpid());
	if (!(f = fopen(path, "r")))
		return 0;
	while (n < most && fscanf(f, "%d", &pid) == 1) {
		bool worker = false;

		for (uint32_t r = 0; r < j->o->nproc && !worker; r++)
			worker = j->procs[r].pidfd >= 0 && j->procs[r].pid == pid;
		if (!worker && pid != j->guard_pid) /* the guard ends after them */
			out[n++] = pid;
	}
	fclose(f);
	return n;
}

static bool live_worker(const struct job *j, pid_t pid)
{
	for (uint32_t r = 0; r < j->o->nproc; r++)
		if (j->procs[r].pidfd >= 0 && j->procs[r].pid == pid)
			return true;
	return false;
}

/* Every descendant of shmrun but the live workers and the guard (which
 * has none); how many. */
static int descendants(const struct job *j, pid_t *out, int most)
{
	int n = tree_list(getpid(), out, most), kept = 0;

	for (int i = 0; i < n; i++)
		if (out[i] != j->guard_pid && !live_worker(j, out[i]))
			out[kept++] = out[i];
	return kept;
}

void orphans_signal(const struct job *j, int sig)
{
	static pid_t pids[MAX_LISTED];
	int n = descendants(j, pids, MAX_LISTED);

	for (int i = 0; i < n; i++)
		kill(pids[i], sig);
}

/* Reaps pid if it is shmrun's child and has ended; whether it did. The
 * CUDA driver's files of it go first, while its pid is still its own. */
static bool reap(pid_t pid)
{
	siginfo_t si = { 0 };

	if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) || si.si_pid != pid)
		return false;
	cuda_leftovers_remove(pid);
	return waitpid(pid, NULL, WNOHANG) == pid;
}

void orphans_reap(const struct job *j)
{
	static pid_t pids[MAX_LISTED];
	int n = children(j, pids, MAX_LISTED);

	for (int i = 0; i < n; i++)
		reap(pids[i]);
}

/* "pid 123 (sleep)" for the message. */
static void describe(pid_t pid, char *buf, size_t len)
{
	char path[64], comm[32] = "?";
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
	if ((f = fopen(path, "r"))) {
		if (fgets(comm, sizeof(comm), f))
			comm[strcspn(comm, "\n")] = '\0';
		fclose(f);
	}
	snprintf(buf, len, "pid %d (%s)", (int)pid, comm);
}

/* A zombie, or gone. */
static bool ended(pid_t pid)
{
	char buf[512];
	const char *f = proc_stat_fields(pid, buf, sizeof(buf), NULL);

	return !f || f[0] == 'Z' || f[0] == 'X';
}

static bool among(const pid_t *pids, int n, pid_t pid)
{
	for (int i = 0; i < n; i++)
		if (pids[i] == pid)
			return true;
	return false;
}

void orphans_end(const struct job *j)
{
	static pid_t now[MAX_LISTED], termed[MAX_LISTED];
	uint64_t kill_at = shmrpc_now_ns() + j->o->grace_ns;
	char first[64] = "";
	int n, nterm = 0;

	orphans_reap(j); /* those that ended already are no news */
	/* Until shmrun has no child left but the guard: a descendant whose
	 * parent ends comes to it, and is reaped here. */
	while (children(j, now, MAX_LISTED) > 0) {
		bool late = shmrpc_now_ns() >= kill_at;

		n = descendants(j, now, MAX_LISTED);
		for (int i = 0; i < n; i++) {
			/* One that has ended is not left running: ours is
			 * reaped now, a deeper one waits for its parent. */
			if (reap(now[i]) || ended(now[i]))
				continue;
			if (late) {
				kill(now[i], SIGKILL);
			} else if (!among(termed, nterm, now[i]) && nterm < MAX_LISTED) {
				/* Each gets SIGTERM once, and SIGKILL after the grace. */
				if (!nterm)
					describe(now[i], first, sizeof(first));
				termed[nterm++] = now[i];
				kill(now[i], SIGTERM);
			}
		}
		usleep(5000);
		orphans_reap(j);
	}
	if (nterm)
		fprintf(stderr, "shmrun: the workers left %d process%s running (%s%s): stopped\n",
			nterm, nterm == 1 ? "" : "es", first, nterm > 1 ? ", ..." : "");
}
