/* The header and slot checks of a job's launcher; see seg_watch.h. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/proc_stat.h"
#include "launcher/seg_watch.h"
#include "shm/corrupt.h"
#include "shm/slot.h"

/* The header's fields, for the sentence that names the one changed. */
#define F(field) { #field, offsetof(struct shm_header, field), sizeof(((struct shm_header *)0)->field) }
static const struct {
	const char *name;
	size_t off, size;
} fields[] = {
	F(magic), F(format_version), F(header_size), F(total_size), F(world_size), F(flags),
	F(created_ns), F(launcher_pid), F(ring_size), F(worker_off), F(ring_ctl_off),
	F(ring_data_off), F(worker_size), F(ring_ctl_size), F(job_name), F(trace_off),
	F(trace_records), F(trace_rec_size), F(devmap_off), F(reserved),
};
#undef F

void seg_watch_init(struct seg_watch *w, const struct shm_seg *seg, const char *who)
{
	memset(w, 0, sizeof(*w));
	w->who = who;
	memcpy(&w->hdr, seg->hdr, sizeof(w->hdr));
}

/* The first field that differs from the launcher's copy, or NULL. */
static const char *header_changed(const struct seg_watch *w, const struct shm_seg *seg,
				  bool shutting_down)
{
	const struct shm_header *h = seg->hdr;
	const uint8_t *live = (const uint8_t *)h, *mine = (const uint8_t *)&w->hdr;

	for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
		if (memcmp(live + fields[i].off, mine + fields[i].off, fields[i].size))
			return fields[i].name;
	/* Relaxed: the launcher wrote both, in this thread. */
	if (atomic_load_explicit(&h->generation, memory_order_relaxed) != w->generation)
		return "generation";
	if (atomic_load_explicit(&h->shutting_down, memory_order_relaxed) != shutting_down)
		return "shutting_down";
	return NULL;
}

bool seg_watch_header(struct seg_watch *w, const struct shm_seg *seg, bool shutting_down,
		      _Atomic uint64_t *corrupt, const char *then)
{
	const char *field;

	if (w->header_bad || !(field = header_changed(w, seg, shutting_down)))
		return false;
	w->header_bad = true;
	/* Relaxed: the launcher's own word (shm/corrupt.h). */
	atomic_fetch_or_explicit(corrupt, SHM_CORRUPT_HEADER, memory_order_relaxed);
	fprintf(stderr, "%s: the segment header is corrupt: its %s is not what %s wrote (the "
		"job's memory was written outside shmrpc)%s\n", w->who, field, w->who, then);
	return true;
}

/* pid's parent; 0 when it is gone. */
static pid_t parent_of(pid_t pid)
{
	char buf[512];
	const char *f = proc_stat_fields(pid, buf, sizeof(buf), NULL);
	int ppid;

	return f && sscanf(f, "%*c %d", &ppid) == 1 ? (pid_t)ppid : 0;
}

/*
 * Whether a slot's pid can be its worker's: the process the launcher
 * started or let join, or one that started (a program run through a shell
 * that forks it), which shmrun, their subreaper, adopts if the one between
 * them ends; or a pid no process has now (a worker that ended before the
 * launcher looked). Not a process of another tree. r->pid_seen remembers
 * one found so.
 */
static bool pid_is_workers(struct seg_watch_rank *r, pid_t pid)
{
	pid_t at = pid;

	if (pid == r->pid || pid == r->pid_seen)
		return true;
	for (int depth = 0; depth < 64 && at > 1; depth++) {
		pid_t up = parent_of(at);

		if (!up)
			return at != pid || kill(pid, 0) < 0; /* gone: cannot tell */
		if (up == r->pid || up == getpid()) {
			r->pid_seen = pid;
			return true;
		}
		at = up;
	}
	return false;
}

/* What the launcher knows of rank that its slot must say; false and why if not. */
static bool slot_as_recorded(const char *who, uint32_t rank, struct seg_watch_rank *r,
			     const struct shm_slot_view *v, char *why, size_t len)
{
	uint32_t gen = r->generation + (r->ended && r->exit_info);

	if (r->pid ? !pid_is_workers(r, (pid_t)v->pid) : v->pid != 0)
		snprintf(why, len, "worker slot %u is corrupt: its pid is %u, a process that %s "
			 "did not start (its worker is pid %d)", rank, v->pid, who, (int)r->pid);
	else if (v->generation != gen)
		snprintf(why, len, "worker slot %u is corrupt: its generation is %u, %s recorded %u",
			 rank, v->generation, who, gen);
	else if (r->ended && v->state != (r->exit_info ? SHM_WORKER_DEAD : SHM_WORKER_EXITED))
		snprintf(why, len, "worker slot %u is corrupt: its state is %u, %s recorded its end",
			 rank, v->state, who);
	else if (!r->ended && (v->state >= SHM_WORKER_EXITED || v->exit_info))
		snprintf(why, len, "worker slot %u is corrupt: it says its worker ended, and its "
			 "process runs", rank);
	else if (r->ended && r->exit_info && v->exit_info != r->exit_info)
		snprintf(why, len, "worker slot %u is corrupt: its exit record 0x%08x is not the "
			 "end %s recorded", rank, v->exit_info, who);
	else
		return true;
	return false;
}

bool seg_watch_slot(const struct seg_watch *w, const struct shm_seg *seg, uint32_t rank,
		    struct seg_watch_rank *r, _Atomic uint64_t *corrupt, const char *then)
{
	struct shm_slot_view v;
	char why[192];

	if (r->bad)
		return false;
	shm_slot_read(seg, rank, &v);
	if (shm_slot_ok(rank, &v, why, sizeof(why)) &&
	    slot_as_recorded(w->who, rank, r, &v, why, sizeof(why)))
		return false;
	r->bad = true;
	/* Relaxed: the launcher's own word (shm/corrupt.h). */
	atomic_fetch_or_explicit(corrupt, SHM_CORRUPT_SLOTS, memory_order_relaxed);
	fprintf(stderr, "%s: %s%s\n", w->who, why, then);
	return true;
}
