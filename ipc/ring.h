/*
 * A single-producer single-consumer ring of variable-size records in the
 * job segment. The ring knows nothing of frames: a record is a length and
 * bytes. Each record is preceded by an 8-byte prefix and padded to 8 bytes;
 * a record never wraps: when it does not fit before the end, a WRAP prefix
 * fills the rest and the record starts again at offset 0. Hence the largest
 * record is half the ring (ipc_ring_max_record), which always fits once the
 * ring has drained.
 *
 * Publication: the producer writes prefix and bytes, then stores `tail` with
 * release; the consumer loads `tail` with acquire and only then reads. A
 * producer killed mid-record never advanced `tail`, so no torn record is
 * ever visible. The consumer frees space by storing `head` with release
 * (pairs with the producer's acquire load of `head` before it overwrites).
 */
#ifndef SHMRPC_IPC_RING_H
#define SHMRPC_IPC_RING_H

#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/segment.h"

#define IPC_REC_PREFIX 8u

/* Process-local handle. One side only: a process is either the producer or
 * the consumer of a given ring. */
struct ipc_ring {
	struct shm_ring_ctl *ctl;
	uint8_t *data;
	uint32_t size;
	uint32_t mask;
	uint64_t pos;     /* producer: next tail; consumer: next head */
	uint64_t cached;  /* producer: last head seen; consumer: last tail seen */
	uint64_t pending; /* producer: bytes reserved but not committed */
};

SHMRPC_HIDDEN void ipc_ring_open(struct ipc_ring *r, const struct shm_seg *seg, uint32_t src,
				 uint32_t dst, bool producer);

static inline uint32_t ipc_ring_max_record(const struct ipc_ring *r)
{
	return r->size / 2 - IPC_REC_PREFIX;
}

/* Producer. reserve: a pointer to len contiguous bytes, or NULL when the ring
 * has no room now (or len exceeds ipc_ring_max_record). commit publishes. */
SHMRPC_HIDDEN void *ipc_ring_reserve(struct ipc_ring *r, uint32_t len);
SHMRPC_HIDDEN void ipc_ring_commit(struct ipc_ring *r);
/* Announce that the producer will sleep until the consumer frees space;
 * returns true if space for len appeared meanwhile (then no sleep). */
SHMRPC_HIDDEN bool ipc_ring_wait_space_prepare(struct ipc_ring *r, uint32_t len);
SHMRPC_HIDDEN void ipc_ring_wait_space_done(struct ipc_ring *r);

/* Consumer. peek: 1 and the next record, 0 when empty, -SHMRPC_ECORRUPT
 * when the ring's shared state is impossible (the ring cannot be trusted
 * any more). consume moves past the record; release publishes every
 * consumed record at once and returns true when the producer sleeps
 * waiting for space and must be woken. */
SHMRPC_HIDDEN int ipc_ring_peek(struct ipc_ring *r, const uint8_t **rec, uint32_t *len);
SHMRPC_HIDDEN void ipc_ring_consume(struct ipc_ring *r, uint32_t len);
SHMRPC_HIDDEN bool ipc_ring_release(struct ipc_ring *r);
/* Consumer side, from any thread of the consumer's process: whether the
 * ring holds records not yet released (consumed by a poll in progress, or
 * not at all). Reads only the shared words, never the consumer's cursor,
 * which the thread polling may be moving. */
SHMRPC_HIDDEN bool ipc_ring_unreleased(const struct ipc_ring *r);

/* Bytes published and not yet consumed, as seen now (for inspectors). */
SHMRPC_HIDDEN uint64_t ipc_ring_fill(const struct shm_ring_ctl *ctl);

#endif
