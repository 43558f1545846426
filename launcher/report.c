/* What the launcher tells the user: deaths as they happen, a summary at the end. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/clock.h"
#include "launcher/shmrun.h"
#include "shm/corrupt.h"
#include "shm/exit_info.h"
#include "worker/trace.h"

#define SUMMARY_LISTED 3 /* failed workers named in the summary; the rest are counted */

void report_worker(const struct job *j, uint32_t rank, char *buf, size_t len)
{
	const char *name = shm_worker(&j->shm.seg, rank)->name;

	/* A worker may rename itself in its slot: read it bounded. */
	snprintf(buf, len, "worker %u (%.*s)", rank, (int)strnlen(name, SHM_NAME_MAX), name);
}

void report_death(const struct job *j, uint32_t rank)
{
	char who[SHM_NAME_MAX + 32], cause[64];

	report_worker(j, rank, who, sizeof(who));
	shm_exit_info_format(j->procs[rank].exit_info, cause, sizeof(cause));
	fprintf(stderr, "shmrun: %s died: %s\n", who, cause);
}

void report_trace(const struct job *j, uint32_t rank)
{
	struct trace_entry e[SHMRUN_DUMP_RECORDS];
	char who[SHM_NAME_MAX + 32], line[192];
	uint64_t head, dropped, newest;
	/* The segment is still mapped: the dead worker's ring is as it left it. */
	size_t n = trace_read(&j->shm.seg, rank, SHMRUN_DUMP_RECORDS, e, &head, &dropped);

	report_worker(j, rank, who, sizeof(who));
	if (!n) {
		fprintf(stderr, "shmrun: %s recorded no messages%s\n", who,
			head ? "" : " (it made and served no call, or ran with SHMRPC_TRACE=0)");
		return;
	}
	fprintf(stderr, "shmrun: the last %zu of the %llu records of %s (oldest first; time in "
		"seconds before its last):\n", n, (unsigned long long)head, who);
	fprintf(stderr, "shmrun:   %s\n", trace_header());
	newest = trace_newest_ns(e, n);
	for (size_t i = 0; i < n; i++) {
		trace_format(e, i, newest, line, sizeof(line));
		fprintf(stderr, "shmrun:   %s\n", line);
	}
}

static void append(char *buf, size_t len, size_t *at, const char *fmt, ...) SHMRPC_PRINTF(4, 5);
static void append(char *buf, size_t len, size_t *at, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (*at >= len)
		return;
	va_start(ap, fmt);
	n = vsnprintf(buf + *at, len - *at, fmt, ap);
	va_end(ap);
	if (n > 0)
		*at += (size_t)n;
}

static const char *stopped_why(const struct job *j, char *buf, size_t len)
{
	if (j->stop == STOP_SIGNAL)
		snprintf(buf, len, " by SIG%s", sigabbrev_np(j->stop_signal));
	else if (j->stop == STOP_TIMEOUT)
		snprintf(buf, len, " by the timeout");
	else if (j->stop == STOP_CORRUPT)
		snprintf(buf, len, " for its corrupt segment header");
	else
		buf[0] = '\0';
	return buf;
}

void report_summary(const struct job *j)
{
	uint32_t n = j->o->nproc, ok = 0, stopped = 0, unstarted = 0, listed = 0;
	char line[1024], who[SHM_NAME_MAX + 32], cause[64], why[32];
	size_t at = 0;

	for (uint32_t r = 0; r < n; r++) {
		const struct proc *p = &j->procs[r];

		if (!p->pid)
			unstarted++;
		else if (p->stopped)
			stopped++;
		else if (!p->failed)
			ok++;
	}
	append(line, sizeof(line), &at, "shmrun: %u worker%s", n, n == 1 ? "" : "s");
	if (ok == n)
		append(line, sizeof(line), &at, ", all exited 0");
	if (j->failed)
		append(line, sizeof(line), &at, ", %u failed: ", j->failed);
	for (uint32_t r = 0; r < n && listed < SUMMARY_LISTED; r++) {
		if (!j->procs[r].failed)
			continue;
		report_worker(j, r, who, sizeof(who));
		shm_exit_info_format(j->procs[r].exit_info, cause, sizeof(cause));
		append(line, sizeof(line), &at, "%s%s %s", listed++ ? ", " : "", who, cause);
	}
	if (j->failed > listed)
		append(line, sizeof(line), &at, ", ...");
	if (stopped)
		append(line, sizeof(line), &at, "%s%u stopped%s", j->failed ? "; " : ", ", stopped,
		       stopped_why(j, why, sizeof(why)));
	else if (j->stop == STOP_SIGNAL || j->stop == STOP_TIMEOUT || j->stop == STOP_CORRUPT)
		append(line, sizeof(line), &at, ", job stopped%s", stopped_why(j, why, sizeof(why)));
	if (ok && ok < n)
		append(line, sizeof(line), &at, ", %u exited 0", ok);
	if (unstarted)
		append(line, sizeof(line), &at, ", %u not started", unstarted);
	fprintf(stderr, "%s (%.2f s)\n", line, (double)(shmrpc_now_ns() - j->start_ns) / 1e9);
}

void report_leaks(const struct job *j)
{
	uint32_t left = 0;
	char first[160] = "";

	/* Every worker has ended and been swept: nothing may remain but what
	 * a death between two steps of the protocol strands (rref_table.h). */
	for (uint32_t s = 0; s < j->shm.rrefs.capacity; s++) {
		struct rref_info info;

		if (!rref_info_at(&j->shm.rrefs, s, &info))
			continue;
		if (!left++)
			snprintf(first, sizeof(first), "the first: id %u:%llu, owner %u, %s, %u "
				 "reference(s)", RREF_ID_RANK(info.id),
				 (unsigned long long)RREF_ID_LOCAL(info.id), info.owner,
				 rref_state_name(info.state), info.total);
	}
	if (left)
		fprintf(stderr, "shmrun: %u RRef(s) were left in the RRef table when the job ended, "
			"%s\n", left, first);
}

/* One line per structure found corrupt, naming who found it: the
 * workers (their slots), shmrun's own sweeps, or only the pool's header
 * (a process that was not told where to note it, or one killed first). */
static int report_structures(const struct job *j)
{
	/* Relaxed: flags (shm/corrupt.h), read once every worker has ended. */
	uint64_t own = atomic_load_explicit(&j->shm.corrupt, memory_order_relaxed);
	uint64_t pool = atomic_load_explicit(&j->shm.pool.hdr->corrupt, memory_order_relaxed);
	int bad = 0;

	for (uint64_t bit = 1; bit & SHM_CORRUPT_ALL; bit <<= 1) {
		char line[1024], who[SHM_NAME_MAX + 32];
		size_t len = 0;

		for (uint32_t r = 0; r < j->o->nproc; r++) {
			if (!(atomic_load_explicit(&shm_worker(&j->shm.seg, r)->corrupt_found,
						   memory_order_relaxed) & bit))
				continue;
			report_worker(j, r, who, sizeof(who));
			if (len < sizeof(line))
				len += (size_t)snprintf(line + len, sizeof(line) - len, "%s%s",
							len ? ", " : "", who);
		}
		if ((own & bit) && len < sizeof(line))
			len += (size_t)snprintf(line + len, sizeof(line) - len, "%sshmrun",
						len ? ", " : "");
		if (!len && !(pool & bit))
			continue;
		fprintf(stderr, "shmrun: %s: found corrupt by %s; the job's memory was "
			"written outside shmrpc (the job fails)\n", shm_corrupt_name(bit),
			len ? line : "a process of the job");
		bad++;
	}
	return bad;
}

int report_corrupt(const struct job *j)
{
	int bad = report_structures(j);

	for (uint32_t r = 0; r < j->o->nproc; r++) {
		/* Relaxed: a statistic, and every worker has ended. */
		uint64_t n = atomic_load_explicit(&shm_worker(&j->shm.seg, r)->corrupt_frames,
						  memory_order_relaxed);
		char who[SHM_NAME_MAX + 32];

		if (!n)
			continue;
		report_worker(j, r, who, sizeof(who));
		fprintf(stderr, "shmrun: %s received %llu corrupt frame%s: the job's memory was "
			"written outside shmrpc (the job fails)\n", who, (unsigned long long)n,
			n == 1 ? "" : "s");
		bad++;
	}
	return bad;
}
