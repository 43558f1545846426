/*
 * A one-block cache for objects of one size that one thread mallocs and
 * another frees, once per call (a request copied off the ring and freed by
 * the executor that ran it; a reply's pin made by an executor and dropped
 * by whoever takes the ack). Such pairs miss malloc's per-thread caches
 * both ways: the freeing thread's cache fills, the allocating one's stays
 * empty, and each malloc and free goes the long way (about 450
 * instructions a pair, callgrind). The slot hands the last freed block to
 * the next taker instead; a second block freed while the slot is full goes
 * to free(). The block is the caller's to initialise.
 */
#ifndef SHMRPC_COMMON_SPARE_H
#define SHMRPC_COMMON_SPARE_H

#include <stdatomic.h>
#include <stdlib.h>

struct spare {
	_Atomic(void *) block;
};

/* The slot's block, or a new one of size bytes (NULL: out of memory). */
static inline void *spare_take(struct spare *s, size_t size)
{
	/* Acquire pairs with spare_put's release: the putter's writes to
	 * the block (and malloc's to its header) come before ours. */
	void *p = atomic_exchange_explicit(&s->block, NULL, memory_order_acquire);

	return p ? p : malloc(size);
}

/* p (from spare_take on s, or malloc of s's size) given back. */
static inline void spare_put(struct spare *s, void *p)
{
	/* Release: our use of p before the next taker's. Acquire: a block
	 * displaced from the slot was whole when it was put; we free it. */
	free(atomic_exchange_explicit(&s->block, p, memory_order_acq_rel));
}

#endif
