/*
 * shmrun's watch over the segment's header and worker slots, a few times
 * a second from its watch loop. The header is shmrun's: written once at
 * creation but for two words only shmrun writes (generation,
 * shutting_down), so it keeps a private copy and compares; a header that
 * no longer matches ends the job (a process that attaches now, an
 * inspector or a joiner, would read a wrong layout). A slot's lifecycle
 * is shmrun's word too (the pid it forked, the generation and end it
 * recorded); a slot that holds together no more, or says otherwise, is
 * said once and fails the job when it ends; the workers go on, as they
 * read a slot's fields only through checks (shm/slot.h). Reading is all
 * this costs: a page compared, and five words of each slot.
 */
#include <stddef.h>
#include <stdio.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "common/proc_stat.h"
#include "launcher/shmrun.h"
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

void integrity_init(struct job *j)
{
	memcpy(&j->hdr_copy, j->shm.seg.hdr, sizeof(j->hdr_copy));
}

/* The first field that differs from shmrun's copy, or NULL. */
static const char *header_changed(const struct job *j)
{
	const struct shm_header *h = j->shm.seg.hdr;
	const uint8_t *live = (const uint8_t *)h, *mine = (const uint8_t *)&j->hdr_copy;

	for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
		if (memcmp(live + fields[i].off, mine + fields[i].off, fields[i].size))
			return fields[i].name;
	/* Relaxed: shmrun wrote both, in this thread. */
	if (atomic_load_explicit(&h->generation, memory_order_relaxed) != j->hdr_generation)
		return "generation";
	if (atomic_load_explicit(&h->shutting_down, memory_order_relaxed) != (j->stop != STOP_NONE))
		return "shutting_down";
	return NULL;
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
 * Whether a slot's pid can be its worker's: the process shmrun forked, or
 * one it started (a program run through a shell that forks it), which
 * shmrun, their subreaper, adopts if the one between them ends; or a pid
 * no process has now (a worker that ended before shmrun looked). Not a
 * process of another tree. p->pid_seen remembers one found so.
 */
static bool pid_is_workers(struct proc *p, pid_t pid)
{
	pid_t at = pid;

	if (pid == p->pid || pid == p->pid_seen)
		return true;
	for (int depth = 0; depth < 64 && at > 1; depth++) {
		pid_t up = parent_of(at);

		if (!up)
			return at != pid || kill(pid, 0) < 0; /* gone: cannot tell */
		if (up == p->pid || up == getpid()) {
			p->pid_seen = pid;
			return true;
		}
		at = up;
	}
	return false;
}

/* What shmrun knows of rank that its slot must say; false and why if not. */
static bool slot_as_recorded(struct job *j, uint32_t rank, const struct shm_slot_view *v,
			     char *why, size_t len)
{
	struct proc *p = &j->procs[rank];
	bool reaped = p->pid && p->pidfd < 0;
	uint32_t gen = 1 + (reaped && p->exit_info);

	if (p->pid ? !pid_is_workers(p, (pid_t)v->pid) : v->pid != 0)
		snprintf(why, len, "worker slot %u is corrupt: its pid is %u, a process that "
			 "shmrun did not start (it started pid %d)", rank, v->pid, (int)p->pid);
	else if (v->generation != gen)
		snprintf(why, len, "worker slot %u is corrupt: its generation is %u, shmrun "
			 "recorded %u", rank, v->generation, gen);
	else if (reaped && v->state != (p->exit_info ? SHM_WORKER_DEAD : SHM_WORKER_EXITED))
		snprintf(why, len, "worker slot %u is corrupt: its state is %u, shmrun recorded "
			 "its end", rank, v->state);
	else if (!reaped && (v->state >= SHM_WORKER_EXITED || v->exit_info))
		snprintf(why, len, "worker slot %u is corrupt: it says its worker ended, and its "
			 "process runs", rank);
	else if (reaped && p->exit_info && v->exit_info != p->exit_info)
		snprintf(why, len, "worker slot %u is corrupt: its exit record 0x%08x is not the "
			 "end shmrun recorded", rank, v->exit_info);
	else
		return true;
	return false;
}

void integrity_check(struct job *j)
{
	const char *field;

	/* Once the workers are gone there is nothing to stop: it is said,
	 * and fails the job at its end. */
	if (!j->header_bad && (field = header_changed(j))) {
		j->header_bad = true;
		atomic_fetch_or_explicit(&j->shm.corrupt, SHM_CORRUPT_HEADER, memory_order_relaxed);
		fprintf(stderr, "shmrun: the segment header is corrupt: its %s is not what shmrun "
			"wrote (the job's memory was written outside shmrpc)%s\n", field,
			j->running ? ": the job is stopped" : "");
		if (j->running)
			watch_stop(j, STOP_CORRUPT, SIGTERM);
	}
	for (uint32_t r = 0; r < j->o->nproc; r++) {
		struct shm_slot_view v;
		char why[192];

		if (j->procs[r].slot_bad)
			continue;
		shm_slot_read(&j->shm.seg, r, &v);
		if (shm_slot_ok(r, &v, why, sizeof(why)) && slot_as_recorded(j, r, &v, why, sizeof(why)))
			continue;
		j->procs[r].slot_bad = true;
		/* Relaxed: shmrun's own word (shm/corrupt.h). */
		atomic_fetch_or_explicit(&j->shm.corrupt, SHM_CORRUPT_SLOTS, memory_order_relaxed);
		fprintf(stderr, "shmrun: %s (the job fails)\n", why);
	}
}
