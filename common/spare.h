/*
 * A small cache for objects of one size that one thread mallocs and
 * another frees, several times per call (a request copied off the ring and
 * freed by the executor that ran it; a reply's pin made by an executor and
 * dropped by whoever takes the ack; the tensor handles a tensor echo makes
 * and drops on three threads, seven a call). Such pairs miss malloc's
 * per-thread caches both ways: the freeing thread's cache fills, the
 * allocating one's stays empty, and each malloc and free goes the long way
 * (about 450 instructions a pair, callgrind, with the arena's lock). The
 * slots hand freed blocks to the next takers instead; a block freed while
 * every slot is full goes to free(). A block is the caller's to
 * initialise.
 *
 * Under AddressSanitizer the slots are not used, so that a handle used
 * after its free is still reported.
 */
#ifndef SHMRPC_COMMON_SPARE_H
#define SHMRPC_COMMON_SPARE_H

#include <stdatomic.h>
#include <stdlib.h>

#if defined(__SANITIZE_ADDRESS__)
#define SPARE_SLOTS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SPARE_SLOTS 0
#endif
#endif
#ifndef SPARE_SLOTS
/* As many blocks as a tensor echo has in flight at once (one line). */
#define SPARE_SLOTS 8
#endif

/* A line of its own: its slots change on every take and put, and would
 * make a neighbour's line bounce between the threads too. */
struct spare {
	_Alignas(64) _Atomic(void *) slot[SPARE_SLOTS ? SPARE_SLOTS : 1];
};

/* A spare block of s, or a new one of size bytes (NULL: out of memory). */
static inline void *spare_take(struct spare *s, size_t size)
{
	for (int i = 0; i < SPARE_SLOTS; i++) {
		void *p;

		/* Relaxed peek: an empty slot is passed without writing its line. */
		if (!atomic_load_explicit(&s->slot[i], memory_order_relaxed))
			continue;
		/* Acquire pairs with spare_put's release: the putter's writes to
		 * the block (and malloc's to its header) come before ours. */
		if ((p = atomic_exchange_explicit(&s->slot[i], NULL, memory_order_acquire)))
			return p;
	}
	return malloc(size);
}

/* p (from spare_take on s, or malloc of s's size) given back. */
static inline void spare_put(struct spare *s, void *p)
{
	for (int i = 0; i < SPARE_SLOTS; i++) {
		void *empty = NULL;

		/* Release: our use of p before the next taker's (spare_take). */
		if (!atomic_load_explicit(&s->slot[i], memory_order_relaxed) &&
		    atomic_compare_exchange_strong_explicit(&s->slot[i], &empty, p,
							    memory_order_release,
							    memory_order_relaxed))
			return;
	}
	free(p);
}

#endif
