/*
 * Watching the job: one poll() over a signalfd (SIGINT, SIGTERM, SIGHUP;
 * SIGCHLD for the workers' orphans),
 * a pidfd per worker and the --tag-output pipes, with the job's timeout
 * and the SIGKILL that follows a stop as poll's timeout.
 *
 * When a worker ends, job_worker_ended (job_shm.c) records how and
 * releases what it held; the launcher then says so and, unless told to go
 * on, stops the job.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "launcher/shmrun.h"

/* What each pollfd stands for. */
struct watched {
	uint32_t rank;
	int what; /* -1: the pidfd; 0, 1: out[what] */
};

int watch_init(struct job *j)
{
	struct sigaction ign = { .sa_handler = SIG_IGN };
	size_t most = 1 + 3 * (size_t)j->o->nproc; /* the signalfd, then per worker 2 pipes and a pidfd */
	sigset_t set;

	j->pfd = malloc(most * sizeof(*j->pfd));
	j->watched = malloc(most * sizeof(*j->watched));
	if (!j->pfd || !j->watched) {
		fprintf(stderr, "shmrun: out of memory\n");
		return -1;
	}
	sigemptyset(&set);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGHUP);
	sigaddset(&set, SIGCHLD); /* the workers' orphans ended: orphans_reap */
	if (sigprocmask(SIG_BLOCK, &set, &j->worker_sigmask) < 0 ||
	    (j->sigfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK)) < 0) {
		fprintf(stderr, "shmrun: cannot set up signal handling: %s\n", strerror(errno));
		return -1;
	}
	/* A closed stdout must not kill the launcher while it has workers. */
	sigaction(SIGPIPE, &ign, &j->worker_sigpipe);
	/* Ignored SIGCHLD (inherited) would reap the workers before waitid. */
	signal(SIGCHLD, SIG_DFL);
	return 0;
}

void watch_free(struct job *j)
{
	free(j->pfd);
	free(j->watched);
	if (j->sigfd >= 0)
		close(j->sigfd);
}

/* The workers and every process they started, however deep (orphans.c):
 * a worker's children need not wait for its end to hear of the stop. */
static void signal_all(const struct job *j, int sig)
{
	/* Through the pidfd: a reaped pid that was reused is never hit. */
	for (uint32_t r = 0; r < j->o->nproc; r++)
		if (j->procs[r].pidfd >= 0)
			syscall(SYS_pidfd_send_signal, j->procs[r].pidfd, sig, NULL, 0);
	orphans_signal(j, sig);
}

void watch_stop(struct job *j, enum stop_reason why, int sig)
{
	if (j->stop != STOP_NONE) {
		/* Asked again (a second Ctrl-C): no more grace. */
		if (why == STOP_SIGNAL) {
			signal_all(j, SIGKILL);
			j->kill_at_ns = 0;
		}
		return;
	}
	j->stop = why;
	j->stop_signal = sig;
	/* Release: workers woken by the doorbells read it with acquire. */
	atomic_store_explicit(&j->shm.seg.hdr->shutting_down, 1, memory_order_release);
	job_ring_all(&j->shm);
	signal_all(j, sig);
	j->kill_at_ns = shmrpc_now_ns() + j->o->grace_ns;
}

static void on_worker_end(struct job *j, uint32_t rank)
{
	struct proc *p = &j->procs[rank];

	p->exit_info = job_reap(p->pidfd, (int)p->pid);
	close(p->pidfd);
	p->pidfd = -1;
	j->running--;
	/* Its last words before the launcher's word on it. */
	output_finish(&p->out[0]);
	output_finish(&p->out[1]);
	job_worker_ended(&j->shm, rank, p->exit_info);
	if (p->exit_info)
		j->watch.generation++; /* job_worker_ended bumped the header's */
	if (!p->exit_info)
		return;
	if (j->stop != STOP_NONE) {
		p->stopped = true;
		return;
	}
	p->failed = true;
	j->failed++;
	report_death(j, rank);
	if (j->o->dump_on_failure)
		report_trace(j, rank);
	if (!j->o->keep_going)
		watch_stop(j, STOP_FAILURE, SIGTERM);
}

static void on_signal(struct job *j)
{
	struct signalfd_siginfo si;

	while (read(j->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
		if (si.ssi_signo == SIGCHLD)
			orphans_reap(j); /* a worker's end comes by its pidfd */
		else
			watch_stop(j, STOP_SIGNAL, (int)si.ssi_signo);
	}
}

static uint64_t earlier(uint64_t a, uint64_t b)
{
	return a && (!b || a < b) ? a : b;
}

/* poll's timeout: until the earliest of the three deadlines (0: none), rounded up. */
static int poll_ms(uint64_t now, uint64_t a, uint64_t b, uint64_t c)
{
	uint64_t next = earlier(earlier(a, b), c);

	if (!next)
		return -1;
	if (next <= now)
		return 0;
	if (next - now >= (uint64_t)INT_MAX * 1000000u)
		return INT_MAX;
	return (int)((next - now + 999999u) / 1000000u);
}

/* One round of poll; false if poll failed for good. */
static bool watch_round(struct job *j, uint64_t now, uint64_t deadline)
{
	struct pollfd *pfd = j->pfd;
	struct watched *wd = j->watched;
	nfds_t nfds = 0;

	pfd[nfds] = (struct pollfd){ .fd = j->sigfd, .events = POLLIN };
	wd[nfds++] = (struct watched){ 0, -1 };
	for (uint32_t r = 0; r < j->o->nproc; r++) {
		struct proc *p = &j->procs[r];

		for (int s = 0; s < 2; s++) {
			if (p->out[s].fd < 0)
				continue;
			pfd[nfds] = (struct pollfd){ .fd = p->out[s].fd, .events = POLLIN };
			wd[nfds++] = (struct watched){ r, s };
		}
		if (p->pidfd < 0)
			continue;
		pfd[nfds] = (struct pollfd){ .fd = p->pidfd, .events = POLLIN };
		wd[nfds++] = (struct watched){ r, -1 };
	}
	if (poll(pfd, nfds, poll_ms(now, deadline, j->kill_at_ns, j->check_at)) < 0) {
		if (errno == EINTR)
			return true;
		fprintf(stderr, "shmrun: poll: %s\n", strerror(errno));
		return false;
	}
	if (pfd[0].revents)
		on_signal(j);
	/* Output before deaths, so a worker's last lines come before its obituary. */
	for (nfds_t i = 1; i < nfds; i++) {
		struct out_stream *s = wd[i].what >= 0 ? &j->procs[wd[i].rank].out[wd[i].what] : NULL;

		if (pfd[i].revents && s && s->fd >= 0)
			output_pump(s);
	}
	for (nfds_t i = 1; i < nfds; i++)
		if (pfd[i].revents && wd[i].what < 0)
			on_worker_end(j, wd[i].rank);
	return true;
}

static int exit_code(const struct job *j)
{
	switch (j->stop) {
	case STOP_SIGNAL:
		return 128 + j->stop_signal;
	case STOP_TIMEOUT:
		return SHMRUN_EXIT_TIMEOUT;
	case STOP_ERROR:
	case STOP_CORRUPT:
		return SHMRUN_EXIT_FAILED;
	default:
		return j->failed ? SHMRUN_EXIT_FAILED : 0;
	}
}

int watch_job(struct job *j)
{
	uint64_t deadline = j->o->timeout_ns ? j->start_ns + j->o->timeout_ns : 0;

	while (j->running) {
		uint64_t now = shmrpc_now_ns();

		if (deadline && now >= deadline) {
			deadline = 0;
			if (j->stop == STOP_NONE) {
				fprintf(stderr, "shmrun: job timed out after %s s\n", j->o->timeout_text);
				watch_stop(j, STOP_TIMEOUT, SIGTERM);
			}
		}
		if (now >= j->check_at) {
			integrity_check(j);
			j->check_at = now + SHMRUN_CHECK_NS;
		}
		if (j->kill_at_ns && now >= j->kill_at_ns) {
			signal_all(j, SIGKILL);
			j->kill_at_ns = 0;
		}
		if (watch_round(j, now, deadline))
			continue;
		/* Cannot watch any more: end the job now and collect everyone. */
		watch_stop(j, STOP_ERROR, SIGKILL);
		for (uint32_t r = 0; r < j->o->nproc; r++)
			if (j->procs[r].pidfd >= 0)
				on_worker_end(j, r);
	}
	/* Pipes of workers that never started. */
	for (uint32_t r = 0; r < j->o->nproc; r++) {
		output_finish(&j->procs[r].out[0]);
		output_finish(&j->procs[r].out[1]);
	}
	return exit_code(j);
}
