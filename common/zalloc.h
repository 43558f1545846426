/*
 * Zeroed memory for objects made and freed on every call (a tensor handle,
 * a future, an RRef record; a pin, once: common/spare.h now): malloc and
 * memset rather than calloc, because glibc's calloc (2.36) never takes
 * from malloc's per-thread cache. Its chunks still go back into that
 * cache when freed, so the cache fills, and from then on every free goes
 * the long way too (_int_free): about 400 instructions an object against
 * 60 (callgrind, a Python tensor echo).
 * GCC turns a malloc and a memset of its bytes back into calloc; the
 * empty asm hides where p came from.
 */
#ifndef SHMRPC_COMMON_ZALLOC_H
#define SHMRPC_COMMON_ZALLOC_H

#include <stdlib.h>
#include <string.h>

static inline void *zalloc(size_t size)
{
	void *p = malloc(size);

	__asm__("" : "+r"(p));
	return p ? memset(p, 0, size) : NULL;
}

#endif
