/* SPSC ring of records; the protocol is described in ring.h. */
#include <string.h>

#include "shmrpc.h"
#include "ipc/ring.h"

#define REC_DATA 0x52434544u /* "DECR" */
#define REC_WRAP 0x50415257u /* "WRAP" */

struct rec_prefix {
	uint32_t len;
	uint32_t kind;
};
_Static_assert(sizeof(struct rec_prefix) == IPC_REC_PREFIX, "record prefix");

static inline uint32_t rec_bytes(uint32_t len)
{
	return IPC_REC_PREFIX + ((len + 7u) & ~7u);
}

void ipc_ring_open(struct ipc_ring *r, const struct shm_seg *seg, uint32_t src, uint32_t dst,
		   bool producer)
{
	r->ctl = shm_ring(seg, src, dst);
	r->data = shm_ring_data(seg, src, dst);
	r->size = seg->ring_size;
	r->mask = seg->ring_size - 1;
	/* Acquire pairs with the other side's release: start from what it published. */
	if (producer) {
		r->pos = atomic_load_explicit(&r->ctl->tail, memory_order_acquire);
		r->cached = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
	} else {
		r->pos = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
		r->cached = r->pos;
	}
	r->pending = 0;
}

/* Bytes needed at the current tail for a record of len, WRAP filler included. */
static inline uint64_t reserve_need(const struct ipc_ring *r, uint32_t len)
{
	uint32_t contig = r->size - (uint32_t)(r->pos & r->mask);
	uint32_t need = rec_bytes(len);

	return need <= contig ? need : (uint64_t)contig + need;
}

/* A head that is ahead of our tail or more than a ring behind is garbage:
 * treated as no room, so a corrupt consumer stalls us instead of making us
 * overwrite unread bytes. */
static inline bool fits(const struct ipc_ring *r, uint64_t need)
{
	uint64_t used = r->pos - r->cached;

	return used <= r->size && r->size - used >= need;
}

static bool has_room(struct ipc_ring *r, uint64_t need)
{
	if (fits(r, need))
		return true;
	/* Acquire pairs with the consumer's release of head: its reads of the
	 * bytes we are about to overwrite are done. */
	r->cached = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
	return fits(r, need);
}

void *ipc_ring_reserve(struct ipc_ring *r, uint32_t len)
{
	uint64_t need;
	uint32_t off;
	struct rec_prefix *p;

	if (len > ipc_ring_max_record(r))
		return NULL;
	need = reserve_need(r, len);
	if (!has_room(r, need))
		return NULL;
	off = (uint32_t)(r->pos & r->mask);
	if (rec_bytes(len) > r->size - off) {
		p = (struct rec_prefix *)(r->data + off);
		p->len = r->size - off - IPC_REC_PREFIX;
		p->kind = REC_WRAP;
		off = 0;
	}
	p = (struct rec_prefix *)(r->data + off);
	p->len = len;
	p->kind = REC_DATA;
	r->pending = need;
	return p + 1;
}

void ipc_ring_commit(struct ipc_ring *r)
{
	r->pos += r->pending;
	r->pending = 0;
	/* Release pairs with the consumer's acquire load of tail: the record's
	 * bytes are visible before the tail that covers them. */
	atomic_store_explicit(&r->ctl->tail, r->pos, memory_order_release);
}

bool ipc_ring_wait_space_prepare(struct ipc_ring *r, uint32_t len)
{
	/* seq_cst store, then re-check head: pairs with the consumer's fence
	 * between its head store and its load of prod_waiting. Either we see
	 * the space, or the consumer sees the flag and rings our doorbell. */
	atomic_store_explicit(&r->ctl->prod_waiting, 1, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
	if (has_room(r, reserve_need(r, len))) {
		ipc_ring_wait_space_done(r);
		return true;
	}
	return false;
}

void ipc_ring_wait_space_done(struct ipc_ring *r)
{
	/* Relaxed: a stale 1 only costs the consumer one extra doorbell. */
	atomic_store_explicit(&r->ctl->prod_waiting, 0, memory_order_relaxed);
}

int ipc_ring_peek(struct ipc_ring *r, const uint8_t **rec, uint32_t *len)
{
	const struct rec_prefix *p;
	uint32_t off, contig;
	uint64_t avail;

	for (;;) {
		avail = r->cached - r->pos;
		if (avail == 0) {
			/* Acquire pairs with the producer's release of tail. */
			r->cached = atomic_load_explicit(&r->ctl->tail, memory_order_acquire);
			avail = r->cached - r->pos;
			if (avail == 0)
				return 0;
		}
		/* Nothing read from the segment is trusted: tail may be garbage. */
		if (avail > r->size || (avail & 7u))
			return -SHMRPC_ECORRUPT;
		off = (uint32_t)(r->pos & r->mask);
		contig = r->size - off;
		p = (const struct rec_prefix *)(r->data + off);
		if (p->kind == REC_WRAP) {
			if (p->len != contig - IPC_REC_PREFIX || avail < contig)
				return -SHMRPC_ECORRUPT;
			r->pos += contig;
			continue;
		}
		if (p->kind != REC_DATA || p->len > r->size / 2 - IPC_REC_PREFIX ||
		    rec_bytes(p->len) > avail || rec_bytes(p->len) > contig)
			return -SHMRPC_ECORRUPT;
		*rec = (const uint8_t *)(p + 1);
		*len = p->len;
		return 1;
	}
}

void ipc_ring_consume(struct ipc_ring *r, uint32_t len)
{
	r->pos += rec_bytes(len);
}

bool ipc_ring_unreleased(const struct ipc_ring *r)
{
	/* Acquire pairs with the producer's release of tail; relaxed for head,
	 * our own process's store: a stale one only says "yes" too soon. */
	return atomic_load_explicit(&r->ctl->tail, memory_order_acquire) !=
	       atomic_load_explicit(&r->ctl->head, memory_order_relaxed);
}

bool ipc_ring_release(struct ipc_ring *r)
{
	/* Release pairs with the producer's acquire of head: we are done
	 * reading the bytes it may now overwrite. */
	atomic_store_explicit(&r->ctl->head, r->pos, memory_order_release);
	/* Full fence between the head store and the flag load: pairs with the
	 * producer's seq_cst flag store + re-check (ipc_ring_wait_space_prepare). */
	atomic_thread_fence(memory_order_seq_cst);
	if (!atomic_load_explicit(&r->ctl->prod_waiting, memory_order_relaxed))
		return false;
	return atomic_exchange_explicit(&r->ctl->prod_waiting, 0, memory_order_relaxed) != 0;
}

uint64_t ipc_ring_fill(const struct shm_ring_ctl *ctl)
{
	/* Acquire loads pair with the producer's and consumer's releases. */
	uint64_t tail = atomic_load_explicit(&ctl->tail, memory_order_acquire);
	uint64_t head = atomic_load_explicit(&ctl->head, memory_order_acquire);

	return tail - head;
}
