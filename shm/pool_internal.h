/*
 * The tensor pool's insides, shared by its files (none of this is API):
 * the holder table's entry format, the chunk entries, the buddy systems'
 * handle, small helpers, and the functions one file of the pool gives the
 * ones above it. The files, bottom up (each calls only those below it):
 *
 *   pool_blocks.c   what a chunk entry says, the two buddy systems
 *   pool.c          create, attach, the layout, sizes in words
 *   pool_lock.c     the lock, its rebuild after a death, slabs, commits,
 *                   blocks handed out and put back (under the lock)
 *   pool_holders.c  per-rank records of references, sweeps, join, leave
 *   pool_refs.c     pool_alloc, pool_ref, pool_unref; statistics
 *
 * Why the pool survives a death at any instruction: pool.c's comment.
 */
#ifndef SHMRPC_SHM_POOL_INTERNAL_H
#define SHMRPC_SHM_POOL_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/corrupt.h"
#include "shm/pool.h"

/* A holder table entry: key = block index + 1 (0: never used, TOMB: freed),
 * the writer's generation tag, and how many references it stands for. */
#define ENTRY_TOMB 0xffffffffull
#define ENTRY_TAG_SHIFT 32
#define ENTRY_COUNT_SHIFT 48
#define ENTRY_COUNT_MAX 0xffffu
#define ENTRY_ONE (1ull << ENTRY_COUNT_SHIFT)

#define LIFE_STATE_SHIFT 30
#define LIFE_PID_MASK ((1u << LIFE_STATE_SHIFT) - 1)

static inline uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) & ~(a - 1);
}

static inline bool is_pow2(uint64_t v)
{
	return v && !(v & (v - 1));
}

static inline uint32_t log2_floor(uint64_t v)
{
	return 63u - (uint32_t)__builtin_clzll(v);
}

/* A structure of the pool found corrupt (bit: SHM_CORRUPT_POOL_*): noted
 * for this process's report and in the header; -SHMRPC_ECORRUPT. */
#define POOL_BAD(p, bit, ...) shm_corrupt((p)->corrupt_note, &(p)->hdr->corrupt, (bit), __VA_ARGS__)
#define POOL_RESTART "; the pool cannot be used (restart the job)"

static inline uint64_t class_size(uint32_t k)
{
	return 1ull << (k + POOL_MIN_SHIFT);
}

#define ENT_KIND_SHIFT 62
#define ENT_ORD_SHIFT 56
#define ENT_NONE 0u
#define ENT_FREE 1u
#define ENT_LARGE 2u
#define ENT_SLAB 3u
#define POOL_LISTED 0x80000000u
#define RUN_FREE 0x80000000u
/* The class of a 64 KiB block: from here on, blocks are buddy blocks. */
#define LARGE_CLASS0 (POOL_CHUNK_SHIFT - POOL_MIN_SHIFT)
/* Large blocks from this size give their pages back when freed; smaller
 * ones stay committed for the next (a punch and a fault per 64 KiB tensor
 * would cost more than the memory). */
#define POOL_PUNCH_MIN (2u << 20)

/* Internal: no chunk or no block record left (pool_alloc says which). */
#define NO_SPACE 1
#define NO_RECORDS 2

static inline uint64_t ent_make(uint32_t kind, uint32_t ord, uint32_t rec)
{
	return (uint64_t)kind << ENT_KIND_SHIFT | (uint64_t)ord << ENT_ORD_SHIFT | rec;
}

static inline uint32_t ent_kind(uint64_t e)
{
	return (uint32_t)(e >> ENT_KIND_SHIFT);
}

static inline uint32_t ent_ord(uint64_t e)
{
	return (uint32_t)(e >> ENT_ORD_SHIFT) & 63u;
}

static inline uint32_t ent_rec(uint64_t e)
{
	return (uint32_t)e;
}

static inline uint64_t chunk_off(const struct shm_pool *p, uint32_t c)
{
	return p->data_off + ((uint64_t)c << POOL_CHUNK_SHIFT);
}

static inline void set_entry(struct shm_pool *p, uint32_t c, uint64_t e)
{
	/* Release: pairs with pool_block_at's acquire (the record's off first). */
	atomic_store_explicit(&p->chunks[c].entry, e, memory_order_release);
}

static inline uint64_t get_entry(const struct shm_pool *p, uint32_t c)
{
	return atomic_load_explicit(&p->chunks[c].entry, memory_order_acquire);
}

static inline uint32_t class_of(uint64_t bytes)
{
	if (bytes <= (1u << POOL_MIN_SHIFT))
		return 0;
	return (uint32_t)(64 - __builtin_clzll(bytes - 1)) - POOL_MIN_SHIFT;
}

static inline int slab_nb_order(uint32_t k)
{
	return (int)(POOL_CHUNK_SHIFT - (k + POOL_MIN_SHIFT));
}

/*
 * One code for both: chunks (links in pool_chunk, the free head's order in
 * its entry) and block records (links and the order in pool_meta). Units
 * are indices; links are index + 1, 0 ends a list. Every link read is
 * checked against the count: a corrupt one fails with a sentence.
 */
struct buddy {
	struct shm_pool *p;
	bool recs;              /* records, else chunks */
	uint32_t n;             /* units */
	uint32_t max_order;
	_Atomic uint32_t *heads;
	const char *what;
};


/*
 * ThreadSanitizer sees the lock only as this process takes and releases
 * it: a block whose last reference a thread of this process dropped, and
 * which another process then freed under the lock, reaches a thread of
 * this process again with no order that TSan can see, though the lock
 * gives one. Under TSan, every drop releases and every allocation
 * acquires one address: the order the lock gives, made visible.
 */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define TSAN_DROP(p) __tsan_release((void *)(p)->hdr)
#define TSAN_TAKE(p) __tsan_acquire((void *)(p)->hdr)
#else
#define TSAN_DROP(p) ((void)0)
#define TSAN_TAKE(p) ((void)0)
#endif

static inline uint64_t life_make(uint32_t gen, uint32_t state, uint32_t pid)
{
	return (uint64_t)gen << 32 | (uint64_t)state << LIFE_STATE_SHIFT | (pid & LIFE_PID_MASK);
}

static inline uint32_t life_gen(uint64_t l)
{
	return (uint32_t)(l >> 32);
}

static inline uint32_t life_state(uint64_t l)
{
	return (uint32_t)l >> LIFE_STATE_SHIFT;
}

static inline uint32_t entry_key(uint64_t w)
{
	return (uint32_t)w;
}

static inline uint32_t entry_tag(uint64_t w)
{
	return (uint16_t)(w >> ENTRY_TAG_SHIFT);
}

static inline uint32_t entry_count(uint64_t w)
{
	return (uint32_t)(w >> ENTRY_COUNT_SHIFT);
}

static inline _Atomic uint64_t *table_of(struct shm_pool *p, uint32_t rank)
{
	return p->tables + (uint64_t)rank * p->holder_cap;
}

static inline uint32_t slot_of(struct shm_pool *p, uint32_t idx)
{
	return (idx * 2654435761u) & (p->holder_cap - 1);
}

/* pool_blocks.c */
SHMRPC_HIDDEN int pool_healthy(struct shm_pool *p);
SHMRPC_HIDDEN bool pool_entry_block(const struct shm_pool *p, uint64_t off, uint32_t *idx, uint32_t *cls, bool *bad);
SHMRPC_HIDDEN int pool_block_at(struct shm_pool *p, uint64_t off, uint32_t *idx, uint32_t *cls);
SHMRPC_HIDDEN uint32_t pool_block_class(struct shm_pool *p, uint32_t idx);
SHMRPC_HIDDEN struct buddy pool_chunk_buddy(struct shm_pool *p);
SHMRPC_HIDDEN struct buddy pool_rec_buddy(struct shm_pool *p);
SHMRPC_HIDDEN int64_t pool_buddy_alloc(const struct buddy *b, uint32_t o);
SHMRPC_HIDDEN int pool_buddy_free(const struct buddy *b, uint32_t u, uint32_t o);
SHMRPC_HIDDEN void pool_buddy_free_range(const struct buddy *b, uint32_t from, uint32_t to);
SHMRPC_HIDDEN int pool_init_lists(struct shm_pool *p);

/* pool.c */
SHMRPC_HIDDEN const char *pool_fmt_bytes(char buf[32], uint64_t v);
SHMRPC_HIDDEN const char *pool_fmt_size_flag(char buf[32], uint64_t v);

/* pool_lock.c */
SHMRPC_HIDDEN int pool_lock(struct shm_pool *p);
SHMRPC_HIDDEN void pool_unlock(struct shm_pool *p);
SHMRPC_HIDDEN uint32_t pool_committed_in(struct shm_pool *p, uint32_t c, uint32_t n);
SHMRPC_HIDDEN void pool_set_committed(struct shm_pool *p, uint32_t c, uint32_t n, uint32_t v);
SHMRPC_HIDDEN int pool_slabs_reclaim(struct shm_pool *p);
SHMRPC_HIDDEN int pool_commit(struct shm_pool *p, uint64_t off, uint64_t len, uint64_t asked);
SHMRPC_HIDDEN int64_t pool_small_alloc(struct shm_pool *p, uint32_t k);
SHMRPC_HIDDEN int64_t pool_large_alloc(struct shm_pool *p, uint32_t o);
SHMRPC_HIDDEN int pool_block_drop(struct shm_pool *p, uint32_t idx, uint32_t n, bool punch);

/* pool_holders.c */
SHMRPC_HIDDEN int pool_holder_tag(struct shm_pool *p, uint32_t rank, uint32_t *tag);
SHMRPC_HIDDEN int pool_record(struct shm_pool *p, uint32_t rank, uint32_t tag, uint32_t idx);
SHMRPC_HIDDEN int pool_unrecord(struct shm_pool *p, uint32_t rank, uint32_t tag, uint32_t idx);

#endif
