/*
 * The shared tensor pool: one memfd, separate from the job segment, that
 * holds tensor data for every worker of the job. The launcher creates it
 * (pool_create), the workers inherit its fd and map it once (pool_attach_fd);
 * tensors travel between processes as byte offsets into it, never as fds or
 * pointers.
 *
 * Layout (format 1), every part found by offset, every offset checked:
 *
 *   0            struct pool_header                 one page
 *   holder_off   struct pool_holder[world]          64 B each: (pid, generation, state)
 *   table_off    uint64_t[world][holder_cap]        per rank: which blocks it holds
 *   chunk_off    uint64_t[nchunks]                  per 64 KiB chunk: class and first block
 *   meta_off     struct pool_meta[max_blocks]       per block: offset, refcount, free link
 *   data_off     tensor data, nchunks * 64 KiB      (64 KiB aligned)
 *
 * The allocator:
 * - Size classes are powers of two: 64 B .. 64 KiB ("small", carved 64 KiB
 *   chunks at a time into slabs of one class) and 128 KiB, 256 KiB, ... up
 *   to the pool's size ("large", one block per run of chunks). Every block
 *   is aligned to min(its size, 64 KiB): 64 B at least, a page from 4 KiB.
 *   A request is rounded up to its class: up to 2x internal waste.
 * - Fresh space comes from one bump word (chunks carved and block records
 *   used, one CAS for both); freed blocks go on their class's lock-free free
 *   list (a Treiber stack: 32-bit block index + 32-bit ABA tag in one word).
 *   Nothing in the pool is ever locked, so no dying process can leave it
 *   locked. When a class is empty and the bump space is spent, a block of a
 *   larger class is handed out whole (never split).
 * - Fragmentation limit, honestly: space carved for a class stays in that
 *   class for the pool's life; blocks are never split nor coalesced. A job
 *   that frees 1 GiB of 64 KiB blocks cannot use that space for a 1 GiB
 *   tensor. Size the pool for the peak of each size the job uses.
 * - Block records (max_blocks) are a second limit: a slab of 64 B blocks uses
 *   1024 of them. Running out of either is -ENOMEM with the sizes in words.
 *
 * References and crash reclamation:
 * - Each block has a reference count (in its record, never in the user's
 *   bytes). pool_alloc gives 1; pool_ref adds one, pool_unref drops one and
 *   the last one puts the block back on its free list.
 * - Every reference is held by a rank and recorded in that rank's holder
 *   table, tagged with the rank's generation. A rank may only drop what it
 *   holds. When a process dies, pool_sweep(rank, generation) drops every
 *   reference its table records; any number of sweepers may run at once
 *   (launcher, survivors, the restarted rank), each reference is dropped
 *   once. The death of a process at any instruction leaves at worst a
 *   reference that no table records (the block is never freed: a leak,
 *   counted as refs_unrecorded / lost_bytes in pool_stats), never a double
 *   free nor the free of a block still in use: pool.c argues it.
 * - Offsets come from other processes: every call validates them (inside
 *   the data area, the start of a carved block, not free) and refuses bad
 *   ones with -EINVAL and a sentence, without touching the pool. A stale
 *   offset of a block that was freed and allocated again cannot be told
 *   from a good one: that is the caller's use-after-free.
 *
 * All functions return 0 (or a count) or a negative errno, with the
 * sentence in shmrpc_errmsg(). All are safe from any thread of any process
 * attached to the pool.
 */
#ifndef SHMRPC_SHM_POOL_H
#define SHMRPC_SHM_POOL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"

#define SHMRPC_ENV_POOL_FD "SHMRPC_POOL_FD"

#define POOL_MAGIC 0x314c4f4f504d4853ull /* "SHMPOOL1" read as little endian */
#define POOL_FORMAT_VERSION 1u
#define POOL_PAGE 4096u
#define POOL_CHUNK_SHIFT 16u /* 64 KiB: the unit of the bump pointer and of slabs */
#define POOL_CHUNK (1u << POOL_CHUNK_SHIFT)
#define POOL_MIN_SHIFT 6u /* 64 B: the smallest class and the least alignment */
#define POOL_SMALL_CLASSES (POOL_CHUNK_SHIFT - POOL_MIN_SHIFT + 1) /* 64 B .. 64 KiB */
#define POOL_NCLASS 42u /* up to 64 B << 41 = 128 TiB */
#define POOL_MAX_WORLD 1024u
#define POOL_HOLDER_CAP_DEFAULT 65536u
#define POOL_MAX_CHUNKS (1u << 30) /* 64 TiB of data */
#define POOL_MAX_BLOCKS 0xfffffff0u

/* Holder states (the state field of pool_holder.life). */
enum pool_holder_state {
	POOL_HOLDER_IDLE = 0,  /* never joined */
	POOL_HOLDER_LIVE = 1,  /* a process holds the rank: only it changes the table */
	POOL_HOLDER_DEAD = 2,  /* its process is gone: the table is being swept */
	POOL_HOLDER_SWEPT = 3, /* swept: the rank may join again */
};

/* Written once by the creator, then only the atomics change. */
struct pool_header {
	uint64_t magic;
	uint32_t format_version;
	uint32_t header_size;
	uint64_t total_size;
	uint64_t data_off;
	uint64_t data_size;
	uint64_t holder_off;
	uint64_t table_off;
	uint64_t chunk_off;
	uint64_t meta_off;
	uint32_t world;
	uint32_t holder_cap;  /* entries per rank, a power of two */
	uint32_t max_blocks;
	uint32_t nchunks;
	uint64_t created_ns;  /* CLOCK_REALTIME */
	uint32_t creator_pid;
	uint32_t holder_size;
	uint32_t meta_size;
	uint8_t pad0[20];
	/* line 2: chunks carved << 32 | block records used; CAS (acq_rel). */
	_Atomic uint64_t carve;
	uint8_t pad1[56];
	/* one line per class: the free list head, (tag << 32) | (index + 1),
	 * 0 when empty; CAS (acq_rel). */
	struct {
		_Atomic uint64_t head;
		uint8_t pad[56];
	} free[POOL_NCLASS];
	uint8_t reserved[POOL_PAGE - 192 - 64 * POOL_NCLASS];
};
_Static_assert(offsetof(struct pool_header, carve) == 128, "pool header layout");
_Static_assert(offsetof(struct pool_header, free) == 192, "pool header layout");
_Static_assert(sizeof(struct pool_header) == POOL_PAGE, "pool header is one page");

/* One per rank. life = generation << 32 | state << 30 | pid, changed by CAS
 * (acq_rel) so that pid, generation and state always agree. */
struct pool_holder {
	_Atomic uint64_t life;
	uint8_t pad[56];
};
_Static_assert(sizeof(struct pool_holder) == 64, "holder is one line");

/* One per block, written when its chunk is carved; off is then constant. */
struct pool_meta {
	uint64_t off;          /* from the start of the pool */
	_Atomic uint32_t refs; /* 0: free (or lost); CAS (acq_rel) */
	_Atomic uint32_t next; /* free-list link: index + 1, 0 ends the list */
};
_Static_assert(sizeof(struct pool_meta) == 16, "block record is 16 bytes");

struct pool_params {
	uint64_t bytes;      /* data bytes, rounded up to 64 KiB */
	uint32_t world;      /* ranks that may hold blocks, 1..POOL_MAX_WORLD */
	uint32_t holder_cap; /* references records per rank (power of two); 0: 65536 */
	uint32_t max_blocks; /* block records; 0: one per KiB of data, at least 16384 */
};

/* What one process knows of the pool: checked once at attach; the
 * functions use these copies, never the header's fields. */
struct shm_pool {
	int fd;
	uint8_t *base;
	struct pool_header *hdr;
	uint64_t size;
	uint64_t data_off;
	uint64_t data_size;
	uint32_t world;
	uint32_t holder_cap;
	uint32_t max_blocks;
	uint32_t nchunks;
	struct pool_holder *holders;
	_Atomic uint64_t *tables;
	_Atomic uint64_t *chunks;
	struct pool_meta *meta;
};

struct pool_stats {
	uint64_t size;             /* data bytes */
	uint64_t used;             /* bytes of blocks with a reference */
	uint64_t free;             /* size - used */
	uint64_t largest_free;     /* the largest block an allocation could get now */
	uint64_t carved;           /* bytes handed to classes so far */
	uint64_t free_listed;      /* bytes on the free lists */
	uint64_t lost;             /* carved - used - free_listed: blocks a death left
				    * neither live nor free (exact only when quiescent) */
	uint64_t blocks_live;
	uint64_t refs_live;        /* sum of the live blocks' reference counts */
	uint64_t refs_held;        /* sum of the references the holder tables record */
	uint64_t refs_unrecorded;  /* refs_live - refs_held: in flight, or leaked by a
				    * death (exact only when quiescent) */
	uint32_t block_records_used;
	uint32_t block_records_max;
};

struct pool_holder_stats {
	uint32_t pid;
	uint32_t generation;
	uint32_t state;   /* enum pool_holder_state */
	uint32_t entries; /* table entries in use: about one per block held */
	uint64_t refs;    /* references recorded */
};

/* Creates, commits (fallocate) and seals a new pool; the fd is close-on-exec. */
SHMRPC_HIDDEN int pool_create(struct shm_pool *p, const struct pool_params *params);
/* Maps an existing pool and checks magic, version, size and layout. On
 * success the pool owns fd (pool_detach closes it). readonly: mapped
 * PROT_READ, for inspectors: only pool_stats and pool_holder_stats may be
 * called then. */
SHMRPC_HIDDEN int pool_attach_fd(struct shm_pool *p, int fd, bool readonly);
SHMRPC_HIDDEN void pool_detach(struct shm_pool *p);
/* Bytes a pool of this shape occupies (data and records); 0 if invalid. */
SHMRPC_HIDDEN uint64_t pool_total_bytes(const struct pool_params *params);

/*
 * Makes the calling process the holder of rank, as incarnation generation
 * (the job's worker generation: it must exceed the rank's previous one).
 * A previous incarnation that died and was not fully swept is swept first.
 * -EBUSY while another process holds the rank (LIVE).
 */
SHMRPC_HIDDEN int pool_join(struct shm_pool *p, uint32_t rank, uint32_t generation);
/* Clean exit of rank's holder: drops every reference it still holds.
 * Returns the number of references dropped. */
SHMRPC_HIDDEN int pool_leave(struct shm_pool *p, uint32_t rank);
/*
 * The process that held rank as incarnation generation is dead (the caller
 * knows it: pidfd, waitpid, the job's worker state): drops every reference
 * it held. Idempotent and safe to run from several processes at once;
 * returns the number of references this call dropped (0 when already swept
 * or when the rank has moved on to a newer generation).
 */
SHMRPC_HIDDEN int pool_sweep(struct shm_pool *p, uint32_t rank, uint32_t generation);

/* A block of at least bytes (1..), one reference held by rank (which must
 * have joined). *off: from the start of the pool. */
SHMRPC_HIDDEN int pool_alloc(struct shm_pool *p, uint32_t rank, uint64_t bytes, uint64_t *off);
/* One more reference to the block at off, held by rank. */
SHMRPC_HIDDEN int pool_ref(struct shm_pool *p, uint32_t rank, uint64_t off);
/* Drops one of rank's references; the last reference frees the block. */
SHMRPC_HIDDEN int pool_unref(struct shm_pool *p, uint32_t rank, uint64_t off);
/* The usable size of the live block at off (its class size), or -errno. */
SHMRPC_HIDDEN int64_t pool_block_size(struct shm_pool *p, uint64_t off);
/* The reference count of the live block at off, or -errno: a snapshot
 * (other processes change it), for owners that watch who still holds a
 * block they made. */
SHMRPC_HIDDEN int64_t pool_block_refs(struct shm_pool *p, uint64_t off);
/* How many references to the block at off rank's live holder records
 * (0 when the rank is not live), or -errno; a snapshot for diagnostics. */
SHMRPC_HIDDEN int64_t pool_holder_refs(struct shm_pool *p, uint32_t rank, uint64_t off);

/* A pointer to [off, off+len) if inside the data area, else NULL. It does
 * not check that off is a live block (pool_block_size does). */
static inline void *pool_at(const struct shm_pool *p, uint64_t off, uint64_t len)
{
	if (off < p->data_off || off > p->size || len > p->size - off)
		return NULL;
	return p->base + off;
}

/*
 * Copies n bytes out of the pool (or any memory other processes write).
 * The ordering that makes the read safe runs through atomics in other
 * processes, which ThreadSanitizer cannot see; under TSan the copy is an
 * uninstrumented loop so that a block reused across processes is not
 * reported as a race. Elsewhere it is memcpy.
 */
SHMRPC_HIDDEN void pool_read(void *dst, const void *src, size_t n);

/* A snapshot, exact when no call is in flight. Walks the records: a
 * diagnostic, not for a hot path. */
SHMRPC_HIDDEN void pool_stats(struct shm_pool *p, struct pool_stats *st);
SHMRPC_HIDDEN int pool_holder_stats(struct shm_pool *p, uint32_t rank, struct pool_holder_stats *hs);

#endif
