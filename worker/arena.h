/*
 * A bump allocator for one call's values: everything a decoded request or
 * a result points to is freed at once when the call is done.
 */
#ifndef SHMRPC_WORKER_ARENA_H
#define SHMRPC_WORKER_ARENA_H

#include <stddef.h>

#include "common/compiler.h"

struct arena_chunk;

struct arena {
	struct arena_chunk *head;
};

/* 16-byte aligned, zeroed; NULL when out of memory. */
SHMRPC_HIDDEN void *arena_alloc(struct arena *a, size_t n);
/* The same, not zeroed: for what the caller writes whole at once (a
 * decoded string's bytes, a megabyte's memset saved). */
SHMRPC_HIDDEN void *arena_alloc_raw(struct arena *a, size_t n);
SHMRPC_HIDDEN void arena_free(struct arena *a);

#endif
