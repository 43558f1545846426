/*
 * Starting the workers. Each slot gets its name and generation before any
 * worker exists, so a worker sees its peers' names from the start. A child
 * asks to be killed when the launcher dies (PR_SET_PDEATHSIG), then checks
 * that the launcher did not die before that request took effect.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "launcher/shmrun.h"

void spawn_format_name(const char *fmt, uint32_t rank, uint32_t local_rank, char *buf, size_t len)
{
	static const struct {
		const char *field;
		size_t field_len;
		bool local;
	} fields[] = { { "{rank}", 6, false }, { "{local_rank}", 12, true } };
	size_t at = 0;

	while (*fmt && at + 1 < len) {
		size_t i;

		for (i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
			if (!strncmp(fmt, fields[i].field, fields[i].field_len))
				break;
		if (i == sizeof(fields) / sizeof(fields[0])) {
			buf[at++] = *fmt++;
			continue;
		}
		at += (size_t)snprintf(buf + at, len - at, "%u", fields[i].local ? local_rank : rank);
		at = at < len ? at : len - 1;
		fmt += fields[i].field_len;
	}
	buf[at] = '\0';
}

static void set_env_u32(const char *name, uint32_t v)
{
	char s[16];

	snprintf(s, sizeof(s), "%u", v);
	setenv(name, s, 1);
}

/* Runs in the child; never returns. */
static void exec_worker(const struct job *j, uint32_t rank, const int *out_ends)
{
	const struct shmrun_opts *o = j->o;
	char ino[24], name[SHM_NAME_MAX];
	struct stat st;

	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != j->launcher_pid)
		_exit(SHMRUN_EXIT_FAILED);
	/* Its name as written in its slot, from the format again: the slot
	 * is shared memory, which a worker started earlier may have changed. */
	spawn_format_name(o->name_format, rank, rank, name, sizeof(name));
	sigprocmask(SIG_SETMASK, &j->worker_sigmask, NULL);
	sigaction(SIGPIPE, &j->worker_sigpipe, NULL);
	if (o->tag_output && (dup2(out_ends[0], 1) < 0 || dup2(out_ends[1], 2) < 0))
		_exit(SHMRUN_EXIT_FAILED);
	if (o->cpu_bind) {
		cpu_set_t set;
		int cpu = j->cpus[rank % j->ncpus];

		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		if (sched_setaffinity(0, sizeof(set), &set) < 0)
			fprintf(stderr, "shmrun: worker %u: cannot bind to core %d: %s\n", rank, cpu,
				strerror(errno));
	}
	/* Segment and pool are close-on-exec in the launcher; the worker inherits them. */
	if (fcntl(j->shm.seg.fd, F_SETFD, 0) < 0 || fcntl(j->shm.pool.fd, F_SETFD, 0) < 0 ||
	    fcntl(j->shm.rrefs.fd, F_SETFD, 0) < 0)
		_exit(SHMRUN_EXIT_FAILED);
	set_env_u32(SHMRPC_ENV_JOB_FD, (uint32_t)j->shm.seg.fd);
	if (fstat(j->shm.seg.fd, &st) < 0)
		_exit(SHMRUN_EXIT_FAILED);
	snprintf(ino, sizeof(ino), "%llu", (unsigned long long)st.st_ino);
	setenv(SHMRPC_ENV_JOB_INO, ino, 1);
	set_env_u32(SHMRPC_ENV_POOL_FD, (uint32_t)j->shm.pool.fd);
	set_env_u32(SHMRPC_ENV_RREF_FD, (uint32_t)j->shm.rrefs.fd);
	set_env_u32("SHMRPC_RANK", rank);
	set_env_u32("SHMRPC_WORLD_SIZE", o->nproc);
	set_env_u32("SHMRPC_LOCAL_RANK", rank);
	setenv("SHMRPC_NAME", name, 1);
	set_env_u32("RANK", rank);
	set_env_u32("WORLD_SIZE", o->nproc);
	set_env_u32("LOCAL_RANK", rank);
	if (o->wait_mode)
		setenv("SHMRPC_WAIT", o->wait_mode, 1);
	execvp(o->argv[0], o->argv);
	fprintf(stderr, "shmrun: cannot run %s: %s\n", o->argv[0], strerror(errno));
	_exit(SHMRUN_EXIT_NOEXEC);
}

/* The cores this process may run on, in order, for --cpu-bind. */
static int list_cpus(struct job *j)
{
	cpu_set_t set;

	if (sched_getaffinity(0, sizeof(set), &set) < 0) {
		fprintf(stderr, "shmrun: --cpu-bind: cannot read this process's cores: %s\n",
			strerror(errno));
		return -1;
	}
	j->ncpus = 0;
	for (int c = 0; c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &set))
			j->cpus[j->ncpus++] = c;
	return j->ncpus ? 0 : -1;
}

static int start_one(struct job *j, uint32_t rank)
{
	struct proc *p = &j->procs[rank];
	int ends[2] = { -1, -1 }, err;
	pid_t pid;

	if (j->o->tag_output && (output_open(&p->out[0], 1, rank, &ends[0]) ||
				 output_open(&p->out[1], 2, rank, &ends[1]))) {
		pid = -1;
	} else {
		pid = fork();
		if (pid == 0)
			exec_worker(j, rank, ends);
	}
	err = errno;
	/* The worker has its own copies; ours would keep its pipes from ending. */
	for (int i = 0; i < 2; i++)
		if (ends[i] >= 0)
			close(ends[i]);
	if (pid < 0)
		goto fail;
	p->pid = pid;
	/* Release: the slot's name and generation are visible with the pid. */
	atomic_store_explicit(&shm_worker(&j->shm.seg, rank)->pid, (uint32_t)pid, memory_order_release);
	p->pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (p->pidfd < 0) {
		err = errno;
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		p->pid = 0;
		goto fail;
	}
	j->running++;
	return 0;
fail:
	fprintf(stderr, "shmrun: cannot start worker %u: %s\n", rank, strerror(err));
	return -1;
}

int spawn_workers(struct job *j)
{
	const struct shmrun_opts *o = j->o;

	if (o->cpu_bind && list_cpus(j))
		return -1;
	for (uint32_t r = 0; r < o->nproc; r++) {
		struct shm_worker *w = shm_worker(&j->shm.seg, r);

		spawn_format_name(o->name_format, r, r, w->name, sizeof(w->name));
		atomic_store_explicit(&w->generation, 1, memory_order_release);
	}
	for (uint32_t r = 0; r < o->nproc; r++)
		if (start_one(j, r))
			return -1;
	return 0;
}
