/*
 * shmrun's watch over the segment's header and worker slots, a few times
 * a second from its watch loop, with the checks of seg_watch.h. A header
 * that no longer matches ends the job (a process that attaches now, an
 * inspector or a joiner, would read a wrong layout). A slot found corrupt
 * is said once and fails the job when it ends; the workers go on, as they
 * read a slot's fields only through checks (shm/slot.h). Reading is all
 * this costs: a page compared, and five words of each slot.
 */
#include <signal.h>

#include "launcher/shmrun.h"

void integrity_init(struct job *j)
{
	seg_watch_init(&j->watch, &j->shm.seg, "shmrun");
}

void integrity_check(struct job *j)
{
	/* Once the workers are gone there is nothing to stop: it is said,
	 * and fails the job at its end. */
	if (seg_watch_header(&j->watch, &j->shm.seg, j->stop != STOP_NONE, &j->shm.corrupt,
			     j->running ? ": the job is stopped" : "") && j->running)
		watch_stop(j, STOP_CORRUPT, SIGTERM);
	for (uint32_t r = 0; r < j->o->nproc; r++) {
		struct proc *p = &j->procs[r];

		p->watch.pid = p->pid;
		p->watch.generation = 1; /* spawn_workers wrote it in every slot */
		p->watch.ended = p->pid && p->pidfd < 0;
		p->watch.exit_info = p->exit_info;
		seg_watch_slot(&j->watch, &j->shm.seg, r, &p->watch, &j->shm.corrupt,
			       " (the job fails)");
	}
}
