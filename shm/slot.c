/* Checking a worker slot (slot.h). */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "shm/slot.h"

void shm_slot_read(const struct shm_seg *seg, uint32_t rank, struct shm_slot_view *v)
{
	const struct shm_worker *w = shm_worker(seg, rank);

	/* Acquire pairs with the release (seq_cst) store of DEAD or EXITED
	 * that published exit_info; the other fields are checked as they are. */
	v->state = atomic_load_explicit(&w->state, memory_order_acquire);
	v->agent_state = atomic_load_explicit(&w->agent_state, memory_order_relaxed);
	v->pid = atomic_load_explicit(&w->pid, memory_order_relaxed);
	v->generation = atomic_load_explicit(&w->generation, memory_order_relaxed);
	v->exit_info = atomic_load_explicit(&w->exit_info, memory_order_relaxed);
	memcpy(v->name, w->name, SHM_NAME_MAX);
	v->name[SHM_NAME_MAX] = '\0';
	v->name_terminated = strnlen(v->name, SHM_NAME_MAX) < SHM_NAME_MAX;
}

/* An exit_info that a launcher writes: an exit code or a signal (below
 * 256), a refusal naming a rank, or the word for a cause unknown. */
static bool exit_info_ok(uint32_t info)
{
	switch (SHM_EXIT_KIND(info)) {
	case 1:
	case 2:
		return SHM_EXIT_VALUE(info) < 256;
	case 3:
		return SHM_EXIT_VALUE(info) < SHM_MAX_WORLD;
	default:
		return info == 0 || info == 0xffffffffu;
	}
}

bool shm_slot_ok(uint32_t rank, const struct shm_slot_view *v, char *why, size_t len)
{
	const char *tail = "; the job's memory was written outside shmrpc";

	if (v->state > SHM_WORKER_DEAD)
		snprintf(why, len, "worker slot %u is corrupt: its state is %u, not a worker "
			 "state%s", rank, v->state, tail);
	else if (v->agent_state > SHM_AGENT_GONE)
		snprintf(why, len, "worker slot %u is corrupt: its agent state is %u, not an "
			 "agent state%s", rank, v->agent_state, tail);
	else if (v->pid > SHM_PID_MAX)
		snprintf(why, len, "worker slot %u is corrupt: its pid is %u, above any pid "
			 "Linux gives%s", rank, v->pid, tail);
	else if (!v->name_terminated)
		snprintf(why, len, "worker slot %u is corrupt: its name has no end within %u "
			 "bytes%s", rank, SHM_NAME_MAX, tail);
	else if (v->state != SHM_WORKER_EMPTY && !v->generation)
		snprintf(why, len, "worker slot %u is corrupt: state %u with generation 0%s",
			 rank, v->state, tail);
	else if (v->state >= SHM_WORKER_EXITED && !exit_info_ok(v->exit_info))
		snprintf(why, len, "worker slot %u is corrupt: its exit record 0x%08x says no "
			 "way of ending%s", rank, v->exit_info, tail);
	else
		return true;
	return false;
}
