/*
 * The shared tensor pool: one memfd, separate from the job segment, that
 * holds tensor data for every worker of the job. The launcher creates it
 * (pool_create), the workers inherit its fd and map it once (pool_attach_fd);
 * tensors travel between processes as byte offsets into it, never as fds or
 * pointers.
 *
 * Layout (format 2), every part found by offset, every offset checked:
 *
 *   0            struct pool_header                 one page: the lock, list heads
 *   holder_off   struct pool_holder[world]          64 B each: (pid, generation, state)
 *   table_off    uint64_t[world][holder_cap]        per rank: which blocks it holds
 *   chunk_off    struct pool_chunk[nchunks]         per 64 KiB chunk: what it is, links
 *   meta_off     struct pool_meta[max_blocks]       per block: offset, refcount, links
 *   data_off     tensor data, nchunks * 64 KiB      (64 KiB aligned)
 *
 * The allocator:
 * - Size classes are powers of two: 64 B .. 32 KiB ("small", carved from
 *   64 KiB slabs of one class) and 64 KiB, 128 KiB, ... up to the pool's
 *   size ("large": one buddy block of chunks). Every block is aligned to
 *   min(its size, 64 KiB): 64 B at least, a page from 4 KiB. A request is
 *   rounded up to its class (address space: memory is committed for the
 *   pages asked only, see below).
 * - Chunks form a binary buddy system: a free block of 2^o chunks is split
 *   to serve a smaller one, and a freed block merges with its free buddy,
 *   so that whatever the order of allocations and frees, a pool whose
 *   blocks are all free again is one free block (or the few aligned ones
 *   a size that is not a power of two makes): its whole size can be served
 *   again. A slab whose blocks are all free goes back to the chunks (one
 *   empty slab per class is kept for the next small block, and given back
 *   too when a large block finds no room). Block records come from a
 *   second buddy system (a slab of 64 B blocks takes 1024 in a row).
 * - The lists change under one lock in the header, a robust process-shared
 *   mutex: a process that dies holding it leaves it to the next taker with
 *   EOWNERDEAD, which rebuilds every free list from the blocks themselves
 *   (pool_blocks.c: what a block's state is, and why a rebuild is exact at any
 *   instruction of the dead process). References (counts, holder tables)
 *   take no lock. The lock is held for a few list operations, never across
 *   a system call other than a slab's 64 KiB commit.
 * - Memory: the memfd's size is the pool's address space; its records and
 *   tables are committed at creation, its data pages when a block is
 *   handed out (fallocate of the chunks asked: a full machine fails the
 *   allocation with -ENOMEM and a sentence, never SIGBUS later), and a
 *   freed block of 2 MiB or more gives its pages back (hole punching)
 *   unless the pool keeps less free committed memory than its retain
 *   budget (pool_params.retain; by default an eighth of its size, 256 MiB
 *   at most): those serve the next blocks without a commit nor page
 *   faults. Smaller blocks keep their pages.
 * - Running out of space or of block records is -ENOMEM with the sizes in
 *   words and the shmrun flag that raises the limit.
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
 * - Nothing read from the pool is trusted: every index, offset, count and
 *   link read there is checked before use. A check that fails is
 *   -SHMRPC_ECORRUPT with a sentence naming the structure (block records,
 *   chunk table, free lists, holder tables), noted for shmrun's report and
 *   in the header (shm/corrupt.h): from then on pool_alloc, pool_ref and
 *   pool_join of every process fail, so that a corrupt list never hands a
 *   block out twice; drops and sweeps go on, checked as ever.
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

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"

#define SHMRPC_ENV_POOL_FD "SHMRPC_POOL_FD"

#define POOL_MAGIC 0x314c4f4f504d4853ull /* "SHMPOOL1" read as little endian */
#define POOL_FORMAT_VERSION 2u
#define POOL_PAGE 4096u
#define POOL_CHUNK_SHIFT 16u /* 64 KiB: the buddy unit, a slab, the commit unit */
#define POOL_CHUNK (1u << POOL_CHUNK_SHIFT)
#define POOL_MIN_SHIFT 6u /* 64 B: the smallest class and the least alignment */
#define POOL_SMALL_CLASSES (POOL_CHUNK_SHIFT - POOL_MIN_SHIFT) /* 64 B .. 32 KiB: slabs */
#define POOL_NORDER 31u /* buddy orders: 2^0 .. 2^30 chunks, and 2^0 .. 2^30 records */
#define POOL_NCLASS 42u /* up to 64 B << 41 = 128 TiB */
#define POOL_MAX_WORLD 1024u
/* 100k+ references held per worker (received tensors) is ordinary: 2 MiB
 * of table per worker, committed at creation. shmrun --pool-holder-records. */
#define POOL_HOLDER_CAP_DEFAULT 262144u
#define POOL_MAX_CHUNKS (1u << 30) /* 64 TiB of data */
#define POOL_MAX_BLOCKS 0x80000000u /* 2^31: a record index with a flag bit free */
#define POOL_BLOCKS_DEFAULT_MIN (1u << 18)
#define POOL_BLOCKS_DEFAULT_MAX (1u << 22)

/* Holder states (the state field of pool_holder.life). */
enum pool_holder_state {
	POOL_HOLDER_IDLE = 0,  /* never joined */
	POOL_HOLDER_LIVE = 1,  /* a process holds the rank: only it changes the table */
	POOL_HOLDER_DEAD = 2,  /* its process is gone: the table is being swept */
	POOL_HOLDER_SWEPT = 3, /* swept: the rank may join again */
};

/* Written once by the creator; then the lock, and under it the list heads
 * and counters (read without it, relaxed, by pool_stats only). */
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
	uint32_t chunk_size;
	/* Free committed bytes the pool keeps for its next blocks (freed large
	 * blocks are punched beyond that): data_size at most. */
	uint64_t retain;
	uint8_t pad0[8];
	/* line 2: the lock (robust, process-shared), alone on its line. */
	union {
		pthread_mutex_t m;
		uint8_t bytes[64];
	} lock;
	/* Under the lock: free chunk blocks of 2^o chunks (chunk index + 1,
	 * 0: none), free record runs of 2^o records (index + 1), slabs of
	 * each small class with a free block (chunk index + 1). */
	_Atomic uint32_t chunk_free[32];
	_Atomic uint32_t rec_free[32];
	_Atomic uint32_t partial[16];
	/* Under the lock, read relaxed by pool_stats: chunks on the free lists,
	 * bytes of free blocks in slabs, records on the free lists. */
	_Atomic uint64_t free_chunks;
	_Atomic uint64_t slab_free_bytes;
	_Atomic uint64_t free_records;
	_Atomic uint64_t rebuilds; /* free-list rebuilds after a death under the lock */
	/* Under the lock: free chunks whose pages are still committed (kept
	 * for the next block, up to the pool's retain budget). */
	_Atomic uint64_t retained_chunks;
	/* SHM_CORRUPT_* bits of the pool's structures some process found
	 * corrupt (shm/corrupt.h; relaxed fetch_or, read relaxed): once set,
	 * the pool hands out no block and takes no reference. */
	_Atomic uint64_t corrupt;
	uint8_t reserved[POOL_PAGE - 512 - 48];
};
_Static_assert(sizeof(pthread_mutex_t) <= 64, "the pool's lock fits its line");
_Static_assert(offsetof(struct pool_header, retain) == 112, "pool header layout");
_Static_assert(offsetof(struct pool_header, lock) == 128, "pool header layout");
_Static_assert(offsetof(struct pool_header, chunk_free) == 192, "pool header layout");
_Static_assert(offsetof(struct pool_header, free_chunks) == 512, "pool header layout");
_Static_assert(sizeof(struct pool_header) == POOL_PAGE, "pool header is one page");

/* One per rank. life = generation << 32 | state << 30 | pid, changed by CAS
 * (acq_rel) so that pid, generation and state always agree. */
struct pool_holder {
	_Atomic uint64_t life;
	uint8_t pad[56];
};
_Static_assert(sizeof(struct pool_holder) == 64, "holder is one line");

/*
 * One per 64 KiB chunk. entry (written under the lock, release; read
 * without it, acquire, to check an offset) says what the chunk is:
 * kind << 62 | order or class << 56 | record. Kinds: 0 inside a block
 * (not its first chunk), FREE (the first chunk of a free block of 2^order
 * chunks), LARGE (the first chunk of a block of 2^order chunks, its record),
 * SLAB (a slab of small blocks of class, its first record). The rest is
 * under the lock: list links (chunk index + 1), and a slab's free blocks.
 */
struct pool_chunk {
	_Atomic uint64_t entry;
	uint32_t next, prev;
	uint32_t nfree;     /* SLAB: its free blocks */
	uint32_t free_head; /* SLAB: the first, local index + 1 (0: none) */
	/* 1: its pages are committed. Changed under the lock, or by the holder
	 * of the block it is part of (relaxed: the lock orders the rest). */
	_Atomic uint32_t committed;
	uint32_t pad;
};
_Static_assert(sizeof(struct pool_chunk) == 32, "chunk record is 32 bytes");

/* One per block. off is written under the lock when the record is given to
 * a block and cleared (0) when the record is freed, so that a stale chunk
 * entry never names a block; refs changes by CAS (acq_rel) outside the
 * lock too; the rest is under the lock. */
struct pool_meta {
	_Atomic uint64_t off;  /* from the start of the pool; 0: no block */
	_Atomic uint32_t refs; /* 0: free (or being freed, or lost) */
	uint32_t next;         /* slab free list: local index + 1 | POOL_LISTED; or
				* a free record run's next (index + 1) */
	uint32_t prev;         /* a free record run's previous (index + 1) */
	uint32_t run;          /* a free record run's first record: FREE | order */
	uint64_t pad;
};
_Static_assert(sizeof(struct pool_meta) == 32, "block record is 32 bytes");

struct pool_params {
	uint64_t bytes;      /* data bytes, rounded up to 64 KiB */
	uint32_t world;      /* ranks that may hold blocks, 1..POOL_MAX_WORLD */
	uint32_t holder_cap; /* references records per rank (power of two); 0: 262144 */
	uint32_t max_blocks; /* block records; 0: one per 8 KiB of data, at least 65536 */
	/* Bytes of freed large blocks kept committed for the next ones (the
	 * data bytes at most); 0: POOL_RETAIN_DEFAULT. */
	uint64_t retain;
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
	uint32_t max_order;     /* the largest buddy order of chunks */
	uint32_t max_rec_order; /* and of records */
	uint64_t retain;        /* the header's, checked */
	struct pool_holder *holders;
	_Atomic uint64_t *tables;
	struct pool_chunk *chunks;
	struct pool_meta *meta;
	/* Where this process notes a structure it found corrupt (a worker's
	 * slot, the launcher's own word; NULL: nowhere). Set after attach. */
	_Atomic uint64_t *corrupt_note;
};

struct pool_stats {
	uint64_t size;             /* data bytes */
	uint64_t used;             /* bytes of blocks with a reference */
	uint64_t free;             /* size - used */
	uint64_t largest_free;     /* the largest block an allocation could get now */
	uint64_t carved;           /* bytes of chunks not free: large blocks and slabs */
	uint64_t free_listed;      /* bytes of the free blocks in slabs */
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

/* Creates and seals a new pool, its records and tables committed (fallocate),
 * its data committed block by block; the fd is close-on-exec. */
SHMRPC_HIDDEN int pool_create(struct shm_pool *p, const struct pool_params *params);
/* Maps an existing pool and checks magic, version, size and layout. On
 * success the pool owns fd (pool_detach closes it). readonly: mapped
 * PROT_READ, for inspectors: only pool_stats and pool_holder_stats may be
 * called then. */
SHMRPC_HIDDEN int pool_attach_fd(struct shm_pool *p, int fd, bool readonly);
SHMRPC_HIDDEN void pool_detach(struct shm_pool *p);
/*
 * The pool's default size: half of the machine's memory, or of its cgroup's
 * limit where that is less (memory.max, memory.limit_in_bytes). Address
 * space, not memory: a block's pages are committed when it is handed out
 * and given back when a large one is freed, so the pool costs what the job
 * holds in it. shmrun --pool-size caps it.
 */
SHMRPC_HIDDEN uint64_t pool_default_bytes(void);
#define POOL_DEFAULT_FALLBACK (1ull << 30) /* when the memory cannot be read */
/* The default retain budget: an eighth of the data, 256 MiB at most. A job
 * whose pool holds only what it has in flight (a data loader's batches)
 * keeps more: its blocks then cycle without commits and hole punches. */
#define POOL_RETAIN_DEFAULT(data_bytes) \
	((data_bytes) / 8 < (256ull << 20) ? (data_bytes) / 8 : (256ull << 20))
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
 * Returns the number of references dropped. Unlike the other drops, it
 * gives no pages back: the process's views of those blocks stay readable
 * until someone allocates them again. */
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
