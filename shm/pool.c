/*
 * The shared tensor pool (see pool.h for the layout and the allocator).
 *
 * Why a process may die at any instruction without a double free or the free
 * of a block in use. Three kinds of shared words change:
 *   meta[b].refs    the block's reference count (CAS; 0 means free)
 *   table[r][s]     rank r's records: (block, generation tag, count)
 *   free[k].head    the class free lists
 * and the rules are:
 *   1. Taking a reference raises refs first, then records it in the table
 *      (pool_alloc: pop, refs = 1, record; pool_ref: refs + 1, record).
 *   2. Dropping one lowers the table first, then refs (pool_unref), and a
 *      rank can only lower a record it has: it drops only what it holds.
 *   3. Only the CAS that takes refs to 0 pushes the block on its free list,
 *      and refs never goes up from 0 (pool_ref refuses a free block; only the
 *      allocator that popped the block stores 1).
 *   4. A sweeper takes a record with one CAS (record -> tombstone) and only
 *      then lowers refs by its count; a record carries the generation that
 *      wrote it and a sweeper of generation g takes only g's records.
 * Invariant: for every block, the references recorded in the tables are at
 * most refs, and each recorded reference is one that its rank really added.
 * Rule 1 and 2 keep it at every instruction of a live or dying process: a
 * death between the two steps of 1 leaves refs one above the records (a
 * leaked reference), between the two steps of 2 the same. Rule 4 makes each
 * record dropped once whoever sweeps and however many sweep (a sweeper that
 * dies after its CAS leaks that record's count, nothing more), and it never
 * touches the records of the rank's next incarnation. So sweeping lowers
 * refs by at most what the dead process held, refs reaches 0 only when no
 * live holder remains (rule 3: once, by one CAS), and a block is pushed on
 * a free list once per allocation. Free-list pushes and pops are single
 * CASes with an ABA tag, so a death there leaves the list whole; a death
 * between a pop and `refs = 1`, or between refs reaching 0 and the push,
 * loses that block (neither live nor free: pool_stats counts it as `lost`).
 * Carving is one CAS on the bump word, then the records and the chunk entry
 * are written and the new slab's blocks pushed as one chain in one CAS: a
 * death in between loses the carved space, nothing else. Those windows are
 * a few instructions wide; the leak they allow is the price of having no
 * lock a dead process could hold.
 *
 * Memory order: refs, records and list heads change by seq_cst or acq_rel
 * CAS, so that the user's writes to a block happen before the CAS that frees
 * it, which happens before the pop that hands it out again. Chunk entries
 * and block records are written before the release that publishes them (the
 * free-list push, or the offset returned to the caller, which reaches other
 * processes through their own release/acquire channels).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "shm/memfd.h"
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

/* Internal: no block record or chunk left (pool_alloc says which). */
#define CARVE_NO_SPACE 1
#define CARVE_NO_RECORDS 2

struct pool_shape {
	uint64_t holder_off, table_off, chunk_off, meta_off, data_off, total;
};

static uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) & ~(a - 1);
}

static bool is_pow2(uint64_t v)
{
	return v && !(v & (v - 1));
}

static uint64_t class_size(uint32_t k)
{
	return 1ull << (k + POOL_MIN_SHIFT);
}

/* The one place where the layout is computed, by creator and attacher alike. */
static bool pool_shape(uint32_t world, uint32_t cap, uint32_t max_blocks, uint32_t nchunks,
		       struct pool_shape *s)
{
	if (world < 1 || world > POOL_MAX_WORLD || !is_pow2(cap) || cap < 16 || cap > (1u << 24) ||
	    max_blocks < 1 || max_blocks > POOL_MAX_BLOCKS || nchunks < 1 || nchunks > POOL_MAX_CHUNKS)
		return false;
	s->holder_off = sizeof(struct pool_header);
	s->table_off = align_up(s->holder_off + world * (uint64_t)sizeof(struct pool_holder),
				SHMRPC_CACHELINE);
	s->chunk_off = align_up(s->table_off + (uint64_t)world * cap * sizeof(uint64_t),
				SHMRPC_CACHELINE);
	s->meta_off = align_up(s->chunk_off + nchunks * (uint64_t)sizeof(uint64_t), SHMRPC_CACHELINE);
	s->data_off = align_up(s->meta_off + max_blocks * (uint64_t)sizeof(struct pool_meta),
			       POOL_CHUNK);
	s->total = s->data_off + ((uint64_t)nchunks << POOL_CHUNK_SHIFT);
	return true;
}

/* Fills in the defaults; false if the parameters cannot make a pool. */
static bool pool_resolve(const struct pool_params *in, struct pool_params *out, uint32_t *nchunks,
			 struct pool_shape *s)
{
	uint64_t chunks = (in->bytes + POOL_CHUNK - 1) >> POOL_CHUNK_SHIFT;
	uint64_t blocks = in->max_blocks;

	*out = *in;
	if (in->bytes == 0 || chunks > POOL_MAX_CHUNKS)
		return false;
	if (!blocks) {
		blocks = (chunks << POOL_CHUNK_SHIFT) >> 10;
		blocks = blocks < 16384 ? 16384 : blocks > POOL_MAX_BLOCKS ? POOL_MAX_BLOCKS : blocks;
	}
	out->bytes = chunks << POOL_CHUNK_SHIFT;
	out->max_blocks = (uint32_t)blocks;
	out->holder_cap = in->holder_cap ? in->holder_cap : POOL_HOLDER_CAP_DEFAULT;
	*nchunks = (uint32_t)chunks;
	return pool_shape(out->world, out->holder_cap, out->max_blocks, *nchunks, s);
}

uint64_t pool_total_bytes(const struct pool_params *params)
{
	struct pool_params r;
	struct pool_shape s;
	uint32_t nchunks;

	return pool_resolve(params, &r, &nchunks, &s) ? s.total : 0;
}

/* "3.0 GiB", "512 MiB", "64 B": sizes as a person reads them. */
static const char *fmt_bytes(char buf[32], uint64_t v)
{
	static const char *unit[] = { "KiB", "MiB", "GiB", "TiB" };
	double d = (double)v;
	int u = -1;

	while (d >= 1024 && u < 3) {
		d /= 1024;
		u++;
	}
	if (u < 0)
		snprintf(buf, 32, "%" PRIu64 " B", v);
	else if (d == (double)(uint64_t)d)
		snprintf(buf, 32, "%.0f %s", d, unit[u]);
	else
		snprintf(buf, 32, "%.1f %s", d, unit[u]);
	return buf;
}

static void pool_fill(struct shm_pool *p, const struct pool_shape *s, uint32_t world, uint32_t cap,
		      uint32_t max_blocks, uint32_t nchunks)
{
	p->hdr = (struct pool_header *)p->base;
	p->size = s->total;
	p->data_off = s->data_off;
	p->data_size = (uint64_t)nchunks << POOL_CHUNK_SHIFT;
	p->world = world;
	p->holder_cap = cap;
	p->max_blocks = max_blocks;
	p->nchunks = nchunks;
	p->holders = (struct pool_holder *)(p->base + s->holder_off);
	p->tables = (_Atomic uint64_t *)(p->base + s->table_off);
	p->chunks = (_Atomic uint64_t *)(p->base + s->chunk_off);
	p->meta = (struct pool_meta *)(p->base + s->meta_off);
}

int pool_create(struct shm_pool *p, const struct pool_params *params)
{
	struct pool_params r;
	struct pool_shape s;
	struct pool_header *h;
	uint32_t nchunks;
	char b1[32], b2[32], what[96];
	void *mem;
	int fd, err;

	memset(p, 0, sizeof(*p));
	p->fd = -1;
	if (!pool_resolve(params, &r, &nchunks, &s))
		return shmrpc__fail(-EINVAL,
				    "cannot create a tensor pool of %" PRIu64 " bytes for %u workers "
				    "(%u records per worker, %u block records): the size must be "
				    "1 B..%s, workers 1..%u, records per worker a power of two in "
				    "16..16777216",
				    params->bytes, params->world, params->holder_cap, params->max_blocks,
				    fmt_bytes(b1, (uint64_t)POOL_MAX_CHUNKS << POOL_CHUNK_SHIFT),
				    POOL_MAX_WORLD);

	snprintf(what, sizeof(what), "the tensor pool (%s of tensor data asked)",
		 fmt_bytes(b2, params->bytes));
	err = shm_memfd_create("shmrpc-pool", s.total, what, "--pool-size", &fd, &mem);
	if (err)
		return err;
	p->base = mem;
	p->fd = fd;
	pool_fill(p, &s, r.world, r.holder_cap, r.max_blocks, nchunks);

	/* The memfd reads as zeros: every list, record and table starts empty. */
	h = p->hdr;
	h->magic = POOL_MAGIC;
	h->format_version = POOL_FORMAT_VERSION;
	h->header_size = sizeof(*h);
	h->total_size = s.total;
	h->data_off = s.data_off;
	h->data_size = p->data_size;
	h->holder_off = s.holder_off;
	h->table_off = s.table_off;
	h->chunk_off = s.chunk_off;
	h->meta_off = s.meta_off;
	h->world = r.world;
	h->holder_cap = r.holder_cap;
	h->max_blocks = r.max_blocks;
	h->nchunks = nchunks;
	h->created_ns = shmrpc_realtime_ns();
	h->creator_pid = (uint32_t)getpid();
	h->holder_size = sizeof(struct pool_holder);
	h->meta_size = sizeof(struct pool_meta);
	return 0;
}

int pool_attach_fd(struct shm_pool *p, int fd, bool readonly)
{
	struct pool_header h;
	struct pool_shape s;
	struct stat st;
	ssize_t n;

	memset(p, 0, sizeof(*p));
	p->fd = -1;
	if (fstat(fd, &st) < 0)
		return shmrpc__fail(-errno, "cannot attach to the tensor pool on fd %d: %s", fd,
				    strerror(errno));
	/* Read the header with pread first: never map what we have not checked. */
	n = pread(fd, &h, sizeof(h), 0);
	if (n < 0)
		return shmrpc__fail(-errno, "cannot read the tensor pool header: %s", strerror(errno));
	if ((size_t)n < offsetof(struct pool_header, format_version) + 4 || h.magic != POOL_MAGIC)
		return shmrpc__fail(-SHMRPC_EBADSEG, "not a shmrpc tensor pool (bad magic)");
	if (h.format_version != POOL_FORMAT_VERSION)
		return shmrpc__fail(-SHMRPC_EVERSION,
				    "tensor pool format %u, this library reads format %u: run the job "
				    "and its tools from the same shmrpc build",
				    h.format_version, POOL_FORMAT_VERSION);
	if ((size_t)n < sizeof(h) || (uint64_t)st.st_size < sizeof(h))
		return shmrpc__fail(-SHMRPC_ETRUNC,
				    "tensor pool truncated: %lld bytes, header alone is %zu",
				    (long long)st.st_size, sizeof(h));
	if (h.header_size != sizeof(h) || h.holder_size != sizeof(struct pool_holder) ||
	    h.meta_size != sizeof(struct pool_meta) ||
	    !pool_shape(h.world, h.holder_cap, h.max_blocks, h.nchunks, &s) ||
	    s.total != h.total_size || s.holder_off != h.holder_off || s.table_off != h.table_off ||
	    s.chunk_off != h.chunk_off || s.meta_off != h.meta_off || s.data_off != h.data_off ||
	    h.data_size != (uint64_t)h.nchunks << POOL_CHUNK_SHIFT)
		return shmrpc__fail(-SHMRPC_EBADSEG,
				    "not a shmrpc tensor pool: header layout is inconsistent "
				    "(world %u, %u chunks, total %" PRIu64 ")",
				    h.world, h.nchunks, h.total_size);
	if ((uint64_t)st.st_size < h.total_size)
		return shmrpc__fail(-SHMRPC_ETRUNC,
				    "tensor pool truncated: %lld bytes, header says %" PRIu64,
				    (long long)st.st_size, h.total_size);

	p->base = mmap(NULL, h.total_size, readonly ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED,
		       fd, 0);
	if (p->base == MAP_FAILED) {
		p->base = NULL;
		return shmrpc__fail(-errno, "cannot map the tensor pool (%" PRIu64 " bytes): %s",
				    h.total_size, strerror(errno));
	}
	p->fd = fd;
	pool_fill(p, &s, h.world, h.holder_cap, h.max_blocks, h.nchunks);
	return 0;
}

void pool_detach(struct shm_pool *p)
{
	if (p->base)
		munmap(p->base, p->size);
	if (p->fd >= 0)
		close(p->fd);
	p->base = NULL;
	p->hdr = NULL;
	p->fd = -1;
}

/* ---- Blocks: classes, chunks, free lists --------------------------------- */

static uint32_t class_of(uint64_t bytes)
{
	if (bytes <= (1u << POOL_MIN_SHIFT))
		return 0;
	return (uint32_t)(64 - __builtin_clzll(bytes - 1)) - POOL_MIN_SHIFT;
}

/* The block at off: its index and class, or -EINVAL (off is checked
 * against everything this process knows, not trusted). */
static int block_at(struct shm_pool *p, uint64_t off, uint32_t *idx, uint32_t *cls)
{
	uint64_t rel, e, in, i;
	uint32_t k;

	if (off < p->data_off || off >= p->size)
		return shmrpc__fail(-EINVAL,
				    "offset %" PRIu64 " is outside the tensor pool's data "
				    "(%" PRIu64 "..%" PRIu64 ")",
				    off, p->data_off, p->size);
	rel = off - p->data_off;
	e = atomic_load_explicit(&p->chunks[rel >> POOL_CHUNK_SHIFT], memory_order_acquire);
	k = (uint32_t)(e >> 32) - 1;
	in = rel & (POOL_CHUNK - 1);
	if (!e || in & (class_size(k < POOL_SMALL_CLASSES ? k : POOL_SMALL_CLASSES - 1) - 1))
		return shmrpc__fail(-EINVAL, "offset %" PRIu64 " is not the start of a pool block",
				    off);
	i = (uint32_t)e + (k < POOL_SMALL_CLASSES ? in >> (k + POOL_MIN_SHIFT) : 0);
	if (k >= POOL_NCLASS || i >= p->max_blocks || p->meta[i].off != off)
		return shmrpc__fail(-EINVAL,
				    "offset %" PRIu64 ": the pool's records for it are inconsistent "
				    "(class %u, record %" PRIu64 ")",
				    off, k, i);
	*idx = (uint32_t)i;
	*cls = k;
	return 0;
}

/* The class of block record idx, or POOL_NCLASS when the record holds no
 * block: its carver may have died between reserving the record and writing
 * it, so its offset is checked like anything else read from the pool. */
static uint32_t block_class(struct shm_pool *p, uint32_t idx)
{
	uint64_t off = p->meta[idx].off, rel = off - p->data_off;

	if (off < p->data_off || (rel >> POOL_CHUNK_SHIFT) >= p->nchunks)
		return POOL_NCLASS;
	return (uint32_t)(atomic_load_explicit(&p->chunks[rel >> POOL_CHUNK_SHIFT],
					       memory_order_acquire) >> 32) - 1;
}

/* Pushes the chain first..last (already linked through next) on list k. */
static void list_push(struct shm_pool *p, uint32_t k, uint32_t first, uint32_t last)
{
	_Atomic uint64_t *head = &p->hdr->free[k].head;
	uint64_t h = atomic_load_explicit(head, memory_order_acquire);

	do {
		atomic_store_explicit(&p->meta[last].next, (uint32_t)h, memory_order_relaxed);
	} while (!atomic_compare_exchange_weak_explicit(
		head, &h, (((h >> 32) + 1) << 32) | (first + 1u), memory_order_acq_rel,
		memory_order_acquire));
}

/* A block of class k from its free list, or -1. */
static int64_t list_pop(struct shm_pool *p, uint32_t k)
{
	_Atomic uint64_t *head = &p->hdr->free[k].head;
	uint64_t h = atomic_load_explicit(head, memory_order_acquire);
	uint32_t idx, next;

	do {
		if ((uint32_t)h == 0 || (uint32_t)h > p->max_blocks)
			return -1;
		idx = (uint32_t)h - 1;
		/* May be stale if idx was popped meanwhile: the tag fails the CAS. */
		next = atomic_load_explicit(&p->meta[idx].next, memory_order_relaxed);
	} while (!atomic_compare_exchange_weak_explicit(head, &h, (((h >> 32) + 1) << 32) | next,
							memory_order_acq_rel, memory_order_acquire));
	return idx;
}

/* Carves fresh space for class k: a slab of 64 KiB for a small class (all
 * but the first block go on the free list), a run of chunks for a large
 * one. The first block's index, or -CARVE_NO_SPACE / -CARVE_NO_RECORDS. */
static int64_t carve(struct shm_pool *p, uint32_t k)
{
	uint64_t size = class_size(k);
	uint32_t nch = size > POOL_CHUNK ? (uint32_t)(size >> POOL_CHUNK_SHIFT) : 1;
	uint32_t nb = size < POOL_CHUNK ? (uint32_t)(POOL_CHUNK / size) : 1;
	uint64_t c = atomic_load_explicit(&p->hdr->carve, memory_order_acquire);
	uint32_t chunk, first;

	do {
		if ((c >> 32) + nch > p->nchunks)
			return -CARVE_NO_SPACE;
		if ((uint32_t)c + (uint64_t)nb > p->max_blocks)
			return -CARVE_NO_RECORDS;
	} while (!atomic_compare_exchange_weak_explicit(&p->hdr->carve, &c,
							c + ((uint64_t)nch << 32) + nb,
							memory_order_acq_rel, memory_order_acquire));
	chunk = (uint32_t)(c >> 32);
	first = (uint32_t)c;
	for (uint32_t i = 0; i < nb; i++) {
		p->meta[first + i].off = p->data_off + ((uint64_t)chunk << POOL_CHUNK_SHIFT) + i * size;
		atomic_store_explicit(&p->meta[first + i].next, first + i + 2, memory_order_relaxed);
	}
	atomic_store_explicit(&p->chunks[chunk], ((uint64_t)(k + 1) << 32) | first,
			      memory_order_release);
	if (nb > 1)
		list_push(p, k, first + 1, first + nb - 1);
	return first;
}

/* Drops n references of block idx; the last one frees it. */
static int block_drop(struct shm_pool *p, uint32_t idx, uint32_t n)
{
	_Atomic uint32_t *refs = &p->meta[idx].refs;
	uint32_t r = atomic_load_explicit(refs, memory_order_acquire);

	do {
		if (r < n)
			return shmrpc__fail(-SHMRPC_ECORRUPT,
					    "pool block at offset %" PRIu64 " has %u references, "
					    "%u to drop: the pool's records are inconsistent",
					    p->meta[idx].off, r, n);
	} while (!atomic_compare_exchange_weak_explicit(refs, &r, r - n, memory_order_acq_rel,
							memory_order_acquire));
	if (r == n)
		list_push(p, block_class(p, idx), idx, idx);
	return 0;
}

/* ---- Holders: per-rank records of references ------------------------------ */

static uint64_t life_make(uint32_t gen, uint32_t state, uint32_t pid)
{
	return (uint64_t)gen << 32 | (uint64_t)state << LIFE_STATE_SHIFT | (pid & LIFE_PID_MASK);
}

static uint32_t life_gen(uint64_t l)
{
	return (uint32_t)(l >> 32);
}

static uint32_t life_state(uint64_t l)
{
	return (uint32_t)l >> LIFE_STATE_SHIFT;
}

static uint32_t entry_key(uint64_t w)
{
	return (uint32_t)w;
}

static uint32_t entry_tag(uint64_t w)
{
	return (uint16_t)(w >> ENTRY_TAG_SHIFT);
}

static uint32_t entry_count(uint64_t w)
{
	return (uint32_t)(w >> ENTRY_COUNT_SHIFT);
}

static _Atomic uint64_t *table_of(struct shm_pool *p, uint32_t rank)
{
	return p->tables + (uint64_t)rank * p->holder_cap;
}

static uint32_t slot_of(struct shm_pool *p, uint32_t idx)
{
	return (idx * 2654435761u) & (p->holder_cap - 1);
}

/* The generation tag of rank's live holder, or -EINVAL. */
static int holder_tag(struct shm_pool *p, uint32_t rank, uint32_t *tag)
{
	uint64_t l;

	if (rank >= p->world)
		return shmrpc__fail(-EINVAL, "rank %u is outside the tensor pool's %u workers", rank,
				    p->world);
	l = atomic_load_explicit(&p->holders[rank].life, memory_order_acquire);
	if (life_state(l) != POOL_HOLDER_LIVE)
		return shmrpc__fail(-EINVAL, "rank %u has not joined the tensor pool", rank);
	*tag = (uint16_t)life_gen(l);
	return 0;
}

/*
 * Records one reference of block idx for rank (whose threads may record at
 * once). Entries form a multiset: the same block may have several entries,
 * and an entry is found by linear probing from the block's slot up to the
 * first never-used slot. Adds to an entry of the block if there is one,
 * else takes the first tombstone or the never-used slot that ends the run.
 */
static int record(struct shm_pool *p, uint32_t rank, uint32_t tag, uint32_t idx)
{
	_Atomic uint64_t *t = table_of(p, rank);
	uint32_t mask = p->holder_cap - 1, h = slot_of(p, idx);
	uint64_t mine = (uint64_t)(idx + 1u) | (uint64_t)tag << ENTRY_TAG_SHIFT;

	for (;;) {
		int64_t target = -1;
		uint64_t seen = 0;

		for (uint32_t i = 0; i <= mask; i++) {
			uint32_t s = (h + i) & mask;
			uint64_t w = atomic_load_explicit(&t[s], memory_order_acquire);

			if (w == 0) {
				if (target < 0)
					target = s, seen = 0;
				break;
			}
			if (w == ENTRY_TOMB) {
				if (target < 0)
					target = s, seen = w;
			} else if ((w & 0xffffffffffffull) == mine &&
				   entry_count(w) < ENTRY_COUNT_MAX) {
				target = s, seen = w;
				break;
			}
		}
		if (target < 0)
			return shmrpc__fail(-ENOSPC,
					    "rank %u's holder table is full (%u records): it holds "
					    "too many pool blocks; create the pool with more records "
					    "per worker",
					    rank, p->holder_cap);
		if (atomic_compare_exchange_strong_explicit(
			    &t[target], &seen, seen == 0 || seen == ENTRY_TOMB ? mine | ENTRY_ONE
									  : seen + ENTRY_ONE,
			    memory_order_acq_rel, memory_order_acquire))
			return 0;
	}
}

/* Takes one reference of block idx off rank's records: false if it has none. */
static bool unrecord_range(struct shm_pool *p, uint32_t rank, uint64_t mine, uint32_t from,
			   bool whole)
{
	_Atomic uint64_t *t = table_of(p, rank);
	uint32_t mask = p->holder_cap - 1;

	for (uint32_t i = 0; i <= mask; i++) {
		uint32_t s = (from + i) & mask;
		uint64_t w = atomic_load_explicit(&t[s], memory_order_acquire);

		if (w == 0 && !whole)
			return false;
		if ((w & 0xffffffffffffull) != mine || entry_count(w) == 0)
			continue;
		/* The last reference: a tombstone, or never-used if it ends the
		 * run (keeps runs short; an inserter racing with it only
		 * strands its entry, which the whole-table pass still finds). */
		if (entry_count(w) > 1 ? atomic_compare_exchange_strong_explicit(
						 &t[s], &w, w - ENTRY_ONE, memory_order_acq_rel,
						 memory_order_acquire)
				       : atomic_compare_exchange_strong_explicit(
						 &t[s], &w,
						 atomic_load(&t[(s + 1) & mask]) ? ENTRY_TOMB : 0,
						 memory_order_acq_rel, memory_order_acquire))
			return true;
		i--; /* changed under us: look at the same slot again */
	}
	return false;
}

static int unrecord(struct shm_pool *p, uint32_t rank, uint32_t tag, uint32_t idx)
{
	uint64_t mine = (uint64_t)(idx + 1u) | (uint64_t)tag << ENTRY_TAG_SHIFT;

	if (unrecord_range(p, rank, mine, slot_of(p, idx), false) ||
	    unrecord_range(p, rank, mine, 0, true))
		return 0;
	return shmrpc__fail(-EINVAL, "rank %u holds no reference to the pool block at offset %" PRIu64,
			    rank, p->meta[idx].off);
}

int pool_sweep(struct shm_pool *p, uint32_t rank, uint32_t generation)
{
	_Atomic uint64_t *life, *t;
	uint64_t l, n = 0;
	int err = 0;

	if (rank >= p->world)
		return shmrpc__fail(-EINVAL, "rank %u is outside the tensor pool's %u workers", rank,
				    p->world);
	life = &p->holders[rank].life;
	l = atomic_load_explicit(life, memory_order_acquire);
	do {
		if (life_gen(l) != generation || life_state(l) == POOL_HOLDER_IDLE ||
		    life_state(l) == POOL_HOLDER_SWEPT)
			return 0;
	} while (life_state(l) == POOL_HOLDER_LIVE &&
		 !atomic_compare_exchange_weak_explicit(
			 life, &l, (l & ~(3ull << LIFE_STATE_SHIFT)) |
					   (uint64_t)POOL_HOLDER_DEAD << LIFE_STATE_SHIFT,
			 memory_order_acq_rel, memory_order_acquire));
	l = (l & ~(3ull << LIFE_STATE_SHIFT)) | (uint64_t)POOL_HOLDER_DEAD << LIFE_STATE_SHIFT;

	t = table_of(p, rank);
	for (uint32_t s = 0; s < p->holder_cap; s++) {
		uint64_t w = atomic_load_explicit(&t[s], memory_order_acquire);

		while (w != 0 && w != ENTRY_TOMB && entry_tag(w) == (uint16_t)generation) {
			uint32_t idx = entry_key(w) - 1;

			if (!atomic_compare_exchange_strong_explicit(&t[s], &w, ENTRY_TOMB,
								     memory_order_acq_rel,
								     memory_order_acquire))
				continue;
			if (idx >= p->max_blocks) {
				err = shmrpc__fail(-SHMRPC_ECORRUPT,
						   "rank %u's holder table names block record %u "
						   "of %u",
						   rank, idx, p->max_blocks);
				break;
			}
			if (block_drop(p, idx, entry_count(w)) < 0)
				err = -SHMRPC_ECORRUPT;
			else
				n += entry_count(w);
			break;
		}
	}
	/* Fails harmlessly if another sweeper or a new incarnation was faster. */
	atomic_compare_exchange_strong_explicit(
		life, &l, (l & ~(3ull << LIFE_STATE_SHIFT)) |
				  (uint64_t)POOL_HOLDER_SWEPT << LIFE_STATE_SHIFT,
		memory_order_acq_rel, memory_order_acquire);
	return err ? err : (int)(n > INT32_MAX ? INT32_MAX : n);
}

int pool_join(struct shm_pool *p, uint32_t rank, uint32_t generation)
{
	_Atomic uint64_t *life, *t;
	uint64_t l;

	if (rank >= p->world)
		return shmrpc__fail(-EINVAL, "rank %u is outside the tensor pool's %u workers", rank,
				    p->world);
	life = &p->holders[rank].life;
	l = atomic_load_explicit(life, memory_order_acquire);
	for (;;) {
		uint32_t st = life_state(l);

		if (st == POOL_HOLDER_LIVE)
			return shmrpc__fail(-EBUSY,
					    "rank %u of the tensor pool is held by pid %u "
					    "(generation %u): sweep it before it joins again",
					    rank, (uint32_t)l & LIFE_PID_MASK, life_gen(l));
		if (st != POOL_HOLDER_IDLE && generation <= life_gen(l))
			return shmrpc__fail(-EINVAL,
					    "rank %u cannot join the tensor pool as generation %u: "
					    "generation %u was there before",
					    rank, generation, life_gen(l));
		if (st == POOL_HOLDER_DEAD) {
			int err = pool_sweep(p, rank, life_gen(l));

			if (err < 0)
				return err;
			l = atomic_load_explicit(life, memory_order_acquire);
			continue;
		}
		if (atomic_compare_exchange_weak_explicit(
			    life, &l, life_make(generation, POOL_HOLDER_LIVE, (uint32_t)getpid()),
			    memory_order_acq_rel, memory_order_acquire))
			break;
	}
	/* The rank is ours and the old incarnation's records are all swept:
	 * clear the tombstones it left. */
	t = table_of(p, rank);
	for (uint32_t s = 0; s < p->holder_cap; s++)
		atomic_store_explicit(&t[s], 0, memory_order_relaxed);
	atomic_thread_fence(memory_order_release);
	return 0;
}

int pool_leave(struct shm_pool *p, uint32_t rank)
{
	uint32_t tag;
	int err = holder_tag(p, rank, &tag);

	if (err)
		return err;
	return pool_sweep(p, rank,
			  life_gen(atomic_load_explicit(&p->holders[rank].life, memory_order_acquire)));
}

/* ---- References ----------------------------------------------------------- */

static int exhausted(struct shm_pool *p, uint64_t bytes, uint32_t k, bool records)
{
	struct pool_stats st;
	char b[5][32];

	pool_stats(p, &st);
	if (records)
		return shmrpc__fail(-ENOMEM,
				    "tensor pool out of block records: asked %s, all %u records "
				    "used (pool %s, %s in use, largest free block %s); create the "
				    "pool with more block records",
				    fmt_bytes(b[0], bytes), p->max_blocks, fmt_bytes(b[1], st.size),
				    fmt_bytes(b[2], st.used), fmt_bytes(b[3], st.largest_free));
	return shmrpc__fail(-ENOMEM,
			    "tensor pool exhausted: asked %s (a %s block), pool %s, %s in use, "
			    "largest free block %s",
			    fmt_bytes(b[0], bytes),
			    fmt_bytes(b[4], k < POOL_NCLASS ? class_size(k) : bytes),
			    fmt_bytes(b[1], st.size), fmt_bytes(b[2], st.used),
			    fmt_bytes(b[3], st.largest_free));
}

int pool_alloc(struct shm_pool *p, uint32_t rank, uint64_t bytes, uint64_t *off)
{
	uint32_t tag, k;
	int64_t idx;
	int err = holder_tag(p, rank, &tag);

	if (err)
		return err;
	if (bytes == 0)
		return shmrpc__fail(-EINVAL, "a pool block of 0 bytes was asked for");
	k = class_of(bytes);
	if (bytes > p->data_size || k >= POOL_NCLASS || class_size(k) > p->data_size)
		return exhausted(p, bytes, k, false);
	idx = list_pop(p, k);
	if (idx < 0)
		idx = carve(p, k);
	/* No fresh space for k: a block of a larger class, whole, beats failing. */
	for (uint32_t j = k + 1; idx < 0 && j < POOL_NCLASS && class_size(j) <= p->data_size; j++) {
		int64_t got = list_pop(p, j);

		if (got >= 0)
			idx = got;
	}
	if (idx < 0)
		return exhausted(p, bytes, k, idx == -CARVE_NO_RECORDS);
	atomic_store_explicit(&p->meta[idx].refs, 1, memory_order_release);
	err = record(p, rank, tag, (uint32_t)idx);
	if (err) {
		block_drop(p, (uint32_t)idx, 1);
		return err;
	}
	*off = p->meta[idx].off;
	return 0;
}

int pool_ref(struct shm_pool *p, uint32_t rank, uint64_t off)
{
	uint32_t tag, idx, k, r;
	_Atomic uint32_t *refs;
	int err = holder_tag(p, rank, &tag);

	if (err || (err = block_at(p, off, &idx, &k)))
		return err;
	refs = &p->meta[idx].refs;
	r = atomic_load_explicit(refs, memory_order_acquire);
	do {
		if (r == 0)
			return shmrpc__fail(-EINVAL,
					    "the pool block at offset %" PRIu64 " is free: no "
					    "reference can be taken",
					    off);
		if (r == UINT32_MAX)
			return shmrpc__fail(-EOVERFLOW, "the pool block at offset %" PRIu64
					    " has 2^32-1 references", off);
	} while (!atomic_compare_exchange_weak_explicit(refs, &r, r + 1, memory_order_acq_rel,
							memory_order_acquire));
	err = record(p, rank, tag, idx);
	if (err)
		block_drop(p, idx, 1);
	return err;
}

int pool_unref(struct shm_pool *p, uint32_t rank, uint64_t off)
{
	uint32_t tag, idx, k;
	int err = holder_tag(p, rank, &tag);

	if (err || (err = block_at(p, off, &idx, &k)))
		return err;
	if (atomic_load_explicit(&p->meta[idx].refs, memory_order_acquire) == 0)
		return shmrpc__fail(-EINVAL, "the pool block at offset %" PRIu64 " is already free",
				    off);
	err = unrecord(p, rank, tag, idx);
	return err ? err : block_drop(p, idx, 1);
}

int64_t pool_block_size(struct shm_pool *p, uint64_t off)
{
	uint32_t idx, k;
	int err = block_at(p, off, &idx, &k);

	if (err)
		return err;
	if (atomic_load_explicit(&p->meta[idx].refs, memory_order_acquire) == 0)
		return shmrpc__fail(-EINVAL, "the pool block at offset %" PRIu64 " is free", off);
	return (int64_t)class_size(k);
}

int64_t pool_block_refs(struct shm_pool *p, uint64_t off)
{
	uint32_t idx, k, r;
	int err = block_at(p, off, &idx, &k);

	if (err)
		return err;
	/* Acquire pairs with the CAS (acq_rel) of whoever changed it last. */
	r = atomic_load_explicit(&p->meta[idx].refs, memory_order_acquire);
	if (r == 0)
		return shmrpc__fail(-EINVAL, "the pool block at offset %" PRIu64 " is free", off);
	return r;
}

int64_t pool_holder_refs(struct shm_pool *p, uint32_t rank, uint64_t off)
{
	uint32_t tag, idx, k;
	uint64_t mine, n = 0;
	_Atomic uint64_t *t;
	int err = block_at(p, off, &idx, &k);

	if (err)
		return err;
	if (holder_tag(p, rank, &tag))
		return 0;
	mine = (uint64_t)(idx + 1u) | (uint64_t)tag << ENTRY_TAG_SHIFT;
	t = table_of(p, rank);
	for (uint32_t s = 0; s < p->holder_cap; s++) {
		/* Relaxed: a snapshot for a report, as pool_holder_stats. */
		uint64_t w = atomic_load_explicit(&t[s], memory_order_relaxed);

		if (w != ENTRY_TOMB && (w & 0xffffffffffffull) == mine)
			n += entry_count(w);
	}
	return (int64_t)n;
}

/* ---- Statistics ----------------------------------------------------------- */

int pool_holder_stats(struct shm_pool *p, uint32_t rank, struct pool_holder_stats *hs)
{
	_Atomic uint64_t *t;
	uint64_t l;

	if (rank >= p->world)
		return shmrpc__fail(-EINVAL, "rank %u is outside the tensor pool's %u workers", rank,
				    p->world);
	memset(hs, 0, sizeof(*hs));
	l = atomic_load_explicit(&p->holders[rank].life, memory_order_acquire);
	hs->pid = (uint32_t)l & LIFE_PID_MASK;
	hs->generation = life_gen(l);
	hs->state = life_state(l);
	if (hs->state == POOL_HOLDER_IDLE || hs->state == POOL_HOLDER_SWEPT)
		return 0;
	t = table_of(p, rank);
	for (uint32_t s = 0; s < p->holder_cap; s++) {
		uint64_t w = atomic_load_explicit(&t[s], memory_order_relaxed);

		if (w == 0 || w == ENTRY_TOMB || entry_tag(w) != (uint16_t)hs->generation)
			continue;
		hs->entries++;
		hs->refs += entry_count(w);
	}
	return 0;
}

void pool_stats(struct shm_pool *p, struct pool_stats *st)
{
	uint64_t c = atomic_load_explicit(&p->hdr->carve, memory_order_acquire);
	uint32_t nrec = (uint32_t)c < p->max_blocks ? (uint32_t)c : p->max_blocks;
	uint64_t rest = (uint64_t)(p->nchunks - (uint32_t)(c >> 32)) << POOL_CHUNK_SHIFT;

	memset(st, 0, sizeof(*st));
	st->size = p->data_size;
	st->carved = (c >> 32) << POOL_CHUNK_SHIFT;
	st->block_records_used = nrec;
	st->block_records_max = p->max_blocks;
	for (uint32_t i = 0; i < nrec; i++) {
		uint32_t r = atomic_load_explicit(&p->meta[i].refs, memory_order_relaxed);
		uint32_t k = block_class(p, i);

		if (!r || k >= POOL_NCLASS)
			continue;
		st->used += class_size(k);
		st->blocks_live++;
		st->refs_live += r;
	}
	st->free = st->size - st->used;
	/* The fresh space is one run: its largest block is its largest power of two. */
	st->largest_free = rest ? 1ull << (63 - __builtin_clzll(rest)) : 0;
	for (uint32_t k = 0; k < POOL_NCLASS; k++) {
		uint64_t h = atomic_load_explicit(&p->hdr->free[k].head, memory_order_acquire);

		/* Bounded walk: the list may change under us. */
		for (uint32_t n = 0; (uint32_t)h && (uint32_t)h <= nrec && n < nrec; n++) {
			st->free_listed += class_size(k);
			if (class_size(k) > st->largest_free)
				st->largest_free = class_size(k);
			h = atomic_load_explicit(&p->meta[(uint32_t)h - 1].next, memory_order_relaxed);
		}
	}
	st->lost = st->carved > st->used + st->free_listed ? st->carved - st->used - st->free_listed
							   : 0;
	for (uint32_t r = 0; r < p->world; r++) {
		struct pool_holder_stats hs;

		pool_holder_stats(p, r, &hs);
		st->refs_held += hs.refs;
	}
	st->refs_unrecorded = st->refs_live > st->refs_held ? st->refs_live - st->refs_held : 0;
}

#if defined(__SANITIZE_THREAD__)
__attribute__((no_sanitize("thread"))) void pool_read(void *dst, const void *src, size_t n)
{
	volatile const unsigned char *s = src; /* volatile: not turned into memcpy */
	unsigned char *d = dst;

	for (size_t i = 0; i < n; i++)
		d[i] = s[i];
}
#else
void pool_read(void *dst, const void *src, size_t n)
{
	memcpy(dst, src, n);
}
#endif
