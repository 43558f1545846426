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

/* The bytes a chunk's header takes (arena_init's buffer holds it). */
#define ARENA_CHUNK_HEAD 32u
/* Room for one call's small values beside the header: an empty Python
 * message's decoded value, a reply's handful of items. */
#define ARENA_FIRST_BYTES (256u + ARENA_CHUNK_HEAD)

/* Memory for arena_init, 16-byte aligned as a chunk must be. */
struct arena_first {
	_Alignas(16) unsigned char bytes[ARENA_FIRST_BYTES];
};

/* a, empty, taking its first allocations from first (which must outlive
 * a, and which arena_free leaves alone) before it asks malloc: most
 * arenas hold one small value, and a malloc and free a call each arena's
 * first chunk cost more than the value (a chunk made on one thread and
 * freed on another misses malloc's per-thread cache). A zeroed struct
 * arena is empty too, and mallocs its first chunk. */
SHMRPC_HIDDEN void arena_init(struct arena *a, struct arena_first *first);

/* 16-byte aligned, zeroed; NULL when out of memory. */
SHMRPC_HIDDEN void *arena_alloc(struct arena *a, size_t n);
/* The same, not zeroed: for what the caller writes whole at once (a
 * decoded string's bytes, a megabyte's memset saved). */
SHMRPC_HIDDEN void *arena_alloc_raw(struct arena *a, size_t n);
SHMRPC_HIDDEN void arena_free(struct arena *a);

#endif
