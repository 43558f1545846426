/*
 * Checking a worker slot as read from the job's memory. Any process of
 * the user can write any word of a slot; a reader that acts on a field
 * (a state it compares, a pid it watches or signals, a name it prints)
 * first checks that the slot holds together, and names "worker slot N"
 * when it does not. The checks here are what any reader can tell; the
 * launcher, which wrote the slot's lifecycle, also compares it with what
 * it knows (launcher/watch.c).
 */
#ifndef SHMRPC_SHM_SLOT_H
#define SHMRPC_SHM_SLOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/segment.h"

/* The largest pid Linux hands out (PID_MAX_LIMIT on 64-bit kernels). */
#define SHM_PID_MAX (4u * 1024u * 1024u)

/* What a reader took from one slot, each field loaded once. */
struct shm_slot_view {
	uint32_t state;       /* SHM_WORKER_* */
	uint32_t agent_state; /* SHM_AGENT_* */
	uint32_t pid;
	uint32_t generation;
	uint32_t exit_info;
	char name[SHM_NAME_MAX + 1]; /* NUL-terminated here whatever the slot holds */
	bool name_terminated;        /* the slot's own name had its NUL */
};

/* Loads rank's slot into v (acquire on state, so exit_info is the one
 * its DEAD published; the rest relaxed: each is checked on its own). */
SHMRPC_HIDDEN void shm_slot_read(const struct shm_seg *seg, uint32_t rank,
				 struct shm_slot_view *v);

/*
 * Whether v holds together: state and agent state in range, a pid Linux
 * could have given, the name NUL-terminated, a generation once started,
 * an exit_info that says something once ended. When it does not: false,
 * and why as "worker slot N is corrupt: its state is 77, not a worker
 * state" into why.
 */
SHMRPC_HIDDEN bool shm_slot_ok(uint32_t rank, const struct shm_slot_view *v, char *why,
			       size_t len);

#endif
