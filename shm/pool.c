/*
 * The shared tensor pool (see pool.h for the layout and the allocator).
 *
 * Why a process may die at any instruction without a double free or the free
 * of a block in use. Three kinds of shared words change:
 *   meta[b].refs    the block's reference count (CAS; 0 means free)
 *   table[r][s]     rank r's records: (block, generation tag, count)
 *   the lists       free chunk blocks, free records, slabs' free blocks:
 *                   changed under the pool's robust lock only
 * and the rules are:
 *   1. Taking a reference raises refs first, then records it in the table
 *      (pool_alloc: refs = 1 under the lock, then record; pool_ref: refs + 1,
 *      then record).
 *   2. Dropping one lowers the table first, then refs (pool_unref), and a
 *      rank can only lower a record it has: it drops only what it holds.
 *   3. Only the CAS that takes refs to 0 frees the block (under the lock,
 *      idempotently: see "What a block's state is" below), and refs never
 *      goes up from 0 (pool_ref refuses a free block; only the allocator,
 *      under the lock, stores 1).
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
 * refs by at most what the dead process held, and refs reaches 0 only when
 * no live holder remains (rule 3: once, by one CAS).
 *
 * A death under the lock leaves the lists half changed: the next taker gets
 * EOWNERDEAD and rebuilds them from the blocks (rebuild()). A death after
 * refs reached 0 but before the free loses a large block of 2 MiB or more
 * (its pages are given back unlocked first; pool_stats counts it as lost);
 * smaller ones are found free by the next rebuild. The lock is held for a
 * few list operations: a process stopped while holding it (SIGSTOP, a
 * debugger) stops every allocation and free of the job until it goes on.
 *
 * Records move between blocks (an empty slab gives its records back), so
 * pool_ref checks after its CAS that the record is still the block at its
 * offset, and undoes the count if not.
 *
 * Memory order: refs and records change by acq_rel CAS, so that the user's
 * writes to a block happen before the CAS that frees it, which happens
 * before the lock that frees it and the lock that hands it out again.
 * A record's off is written before the release store of refs = 1 and of its
 * chunk entry; block_at and pool_ref read them with acquire.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdlib.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "shm/attach.h"
#include "shm/corrupt.h"
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

static uint32_t log2_floor(uint64_t v)
{
	return 63u - (uint32_t)__builtin_clzll(v);
}

static int pool_init_lists(struct shm_pool *p);

/* A structure of the pool found corrupt (bit: SHM_CORRUPT_POOL_*): noted
 * for this process's report and in the header; -SHMRPC_ECORRUPT. */
#define POOL_BAD(p, bit, ...) shm_corrupt((p)->corrupt_note, &(p)->hdr->corrupt, (bit), __VA_ARGS__)
#define POOL_RESTART "; the pool cannot be used (restart the job)"

/* 0, or the sentence of a pool some process found corrupt: no block is
 * handed out and no reference taken from then on. */
static int pool_healthy(struct shm_pool *p)
{
	/* Relaxed: see shm/corrupt.h. */
	uint64_t bad = atomic_load_explicit(&p->hdr->corrupt, memory_order_relaxed), first;

	if (!bad)
		return 0;
	first = bad & -bad; /* the sentence names one */
	return shmrpc__fail(-SHMRPC_ECORRUPT, "%s %s found corrupt earlier (the job's memory was "
			    "written outside shmrpc)" POOL_RESTART,
			    shm_corrupt_name(first),
			    first == SHM_CORRUPT_POOL_CHUNKS || !(first & SHM_CORRUPT_ALL) ? "was"
											    : "were");
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
	s->meta_off = align_up(s->chunk_off + nchunks * (uint64_t)sizeof(struct pool_chunk),
			       SHMRPC_CACHELINE);
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
		/* One per 16 KiB of data, in 256Ki..4Mi: 8..128 MiB of records,
		 * committed at creation; a slab of 64 B blocks takes 1024. */
		blocks = (chunks << POOL_CHUNK_SHIFT) >> 14;
		blocks = blocks < POOL_BLOCKS_DEFAULT_MIN ? POOL_BLOCKS_DEFAULT_MIN :
			 blocks > POOL_BLOCKS_DEFAULT_MAX ? POOL_BLOCKS_DEFAULT_MAX : blocks;
	}
	out->bytes = chunks << POOL_CHUNK_SHIFT;
	out->max_blocks = (uint32_t)blocks;
	out->holder_cap = in->holder_cap ? in->holder_cap : POOL_HOLDER_CAP_DEFAULT;
	/* The tables are committed at creation: beyond 512 workers the
	 * default halves, keeping them to 1 GiB (131072 per worker at 1024). */
	while (!in->holder_cap && out->holder_cap > (1u << 17) &&
	       (uint64_t)out->holder_cap * sizeof(uint64_t) * in->world > (1ull << 30))
		out->holder_cap >>= 1;
	*nchunks = (uint32_t)chunks;
	return pool_shape(out->world, out->holder_cap, out->max_blocks, *nchunks, s);
}

/* A memory limit from a cgroup file ("max" or a number); UINT64_MAX if none. */
static uint64_t cgroup_limit_file(const char *path)
{
	char buf[64];
	ssize_t n;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	unsigned long long v;
	char *end;

	if (fd < 0)
		return UINT64_MAX;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return UINT64_MAX;
	buf[n] = '\0';
	errno = 0;
	v = strtoull(buf, &end, 10);
	if (errno || end == buf || (*end && *end != '\n'))
		return UINT64_MAX; /* "max", or anything unreadable: no limit */
	return v;
}

/*
 * The memory limit of this process's cgroup (v2 memory.max, v1
 * memory.limit_in_bytes), the least of its own and its ancestors' as far as
 * they are visible; UINT64_MAX when there is none.
 */
static uint64_t cgroup_limit(void)
{
	char line[512], path[PATH_MAX];
	uint64_t lim = UINT64_MAX, v;
	FILE *f = fopen("/proc/self/cgroup", "re");

	while (f && fgets(line, sizeof(line), f)) {
		char *rel = strchr(line, ':'), *ctl, *end;
		bool v2;

		if (!rel)
			continue;
		ctl = rel + 1;
		rel = strchr(ctl, ':');
		if (!rel)
			continue;
		*rel++ = '\0';
		rel[strcspn(rel, "\n")] = '\0';
		v2 = !*ctl;
		if (!v2 && strcmp(ctl, "memory"))
			continue;
		/* The cgroup and each ancestor: the tightest limit counts. */
		for (;;) {
			snprintf(path, sizeof(path), "/sys/fs/cgroup%s%s/%s", v2 ? "" : "/memory", rel,
				 v2 ? "memory.max" : "memory.limit_in_bytes");
			v = cgroup_limit_file(path);
			lim = v < lim ? v : lim;
			end = strrchr(rel, '/');
			if (!end || end == rel)
				break;
			*end = '\0';
		}
	}
	if (f)
		fclose(f);
	/* The root of the namespace's view (a container sees its own there). */
	v = cgroup_limit_file("/sys/fs/cgroup/memory.max");
	lim = v < lim ? v : lim;
	v = cgroup_limit_file("/sys/fs/cgroup/memory/memory.limit_in_bytes");
	return v < lim ? v : lim;
}

uint64_t pool_default_bytes(void)
{
	struct sysinfo si;
	uint64_t ram = sysinfo(&si) == 0 ? (uint64_t)si.totalram * si.mem_unit : 0;
	uint64_t lim = cgroup_limit(), v;

	if (!ram)
		return POOL_DEFAULT_FALLBACK;
	v = (lim < ram ? lim : ram) / 2;
	v &= ~(uint64_t)(POOL_CHUNK - 1);
	return v < POOL_CHUNK ? POOL_CHUNK : v;
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

/* A size for shmrun's --pool-size: "512M", "3G" (rounded up). */
static const char *fmt_size_flag(char buf[32], uint64_t v)
{
	static const char unit[] = "KMGT";
	int u = 0;

	v = (v + 1023) >> 10;
	while (v >= 1024 && u < 3 && !(v & 1023))
		v >>= 10, u++;
	while (v >= 10240 && u < 3)
		v = (v + 1023) >> 10, u++;
	snprintf(buf, 32, "%" PRIu64 "%c", v, unit[u]);
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
	p->max_order = log2_floor(nchunks);
	p->max_rec_order = log2_floor(max_blocks);
	p->holders = (struct pool_holder *)(p->base + s->holder_off);
	p->tables = (_Atomic uint64_t *)(p->base + s->table_off);
	p->chunks = (struct pool_chunk *)(p->base + s->chunk_off);
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
				    "(%u records per worker, %u block records): the size (shmrun "
				    "--pool-size) must be 1 B..%s, workers 1..%u, records per worker "
				    "(--holder-records) a power of two in 16..16777216",
				    params->bytes, params->world, params->holder_cap, params->max_blocks,
				    fmt_bytes(b1, (uint64_t)POOL_MAX_CHUNKS << POOL_CHUNK_SHIFT),
				    POOL_MAX_WORLD);

	snprintf(what, sizeof(what), "the tensor pool (%s of tensor data asked)",
		 fmt_bytes(b2, params->bytes));
	/* The data may never be more than the machine could commit (a cap
	 * above it would only promise what fails later). */
	if (params->bytes > shm_machine_bytes())
		return shmrpc__fail(-ENOMEM,
				    "cannot commit %s for %s: this machine has %s of memory and "
				    "swap; pass a smaller --pool-size",
				    fmt_bytes(b1, params->bytes), what,
				    fmt_bytes((char[32]){ 0 }, shm_machine_bytes()));
	/* Records and tables committed now; the data as blocks are handed out. */
	err = shm_memfd_create_sparse("shmrpc-pool", s.total, s.data_off, what, "--pool-size", &fd,
				      &mem);
	if (err)
		return err;
	p->base = mem;
	p->fd = fd;
	pool_fill(p, &s, r.world, r.holder_cap, r.max_blocks, nchunks);

	/* The memfd reads as zeros: every record and table starts empty. */
	h = p->hdr;
	if ((err = pool_init_lists(p))) {
		pool_detach(p);
		return err;
	}
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
	h->chunk_size = sizeof(struct pool_chunk);
	return 0;
}

static const struct shm_file_kind pool_kind = { "tensor pool", POOL_MAGIC, POOL_FORMAT_VERSION,
						 sizeof(struct pool_header) };

int pool_attach_fd(struct shm_pool *p, int fd, bool readonly)
{
	struct pool_header h;
	struct pool_shape s;
	uint64_t file_size;
	int err;

	memset(p, 0, sizeof(*p));
	p->fd = -1;
	if ((err = shm_attach_header(fd, &pool_kind, &h, &file_size)))
		return err;
	if (h.holder_size != sizeof(struct pool_holder) || h.meta_size != sizeof(struct pool_meta) ||
	    h.chunk_size != sizeof(struct pool_chunk) ||
	    !pool_shape(h.world, h.holder_cap, h.max_blocks, h.nchunks, &s) ||
	    s.total != h.total_size || s.holder_off != h.holder_off || s.table_off != h.table_off ||
	    s.chunk_off != h.chunk_off || s.meta_off != h.meta_off || s.data_off != h.data_off ||
	    h.data_size != (uint64_t)h.nchunks << POOL_CHUNK_SHIFT)
		return shm_attach_inconsistent(&pool_kind, "world %u, %u chunks, total %" PRIu64,
					       h.world, h.nchunks, h.total_size);
	if ((err = shm_attach_map(fd, &pool_kind, h.total_size, file_size, readonly, &p->base)))
		return err;
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

/*
 * What a block's state is, and why the lock's rebuild is exact.
 *
 * Under the lock, and only there, blocks are handed out and put back:
 * - a large block's first chunk entry is LARGE(order, record) from the
 *   moment it is handed out (its record's refs set to 1 and off written
 *   first) until the process that took its refs to 0 takes the lock and
 *   frees it (nobody else does: it first gives the pages back, unlocked,
 *   and must be the only one to touch them);
 * - a small block is free when its record's refs is 0 and it is on its
 *   slab's list (POOL_LISTED in next); handed out: refs set to 1 and taken
 *   off the list under the lock.
 * A free of a block whose refs reached 0 is idempotent: the freer checks,
 * under the lock, that the block is still what its record says (chunk
 * entry, record, offset, refs 0, not listed) and does nothing otherwise.
 *
 * The free lists are a cache of that state. A process that dies holding
 * the lock may leave them half changed; the next taker gets EOWNERDEAD and
 * rebuilds them (rebuild()): every LARGE entry whose record names it is
 * allocated (refs 0 included where its freer gives the pages back before it
 * takes the lock: it may be doing so, or dead: lost),
 * every SLAB entry whose records name it and which has a live block is a
 * slab whose free blocks are those with refs 0, and every other chunk and
 * record is free, regrouped into the largest aligned buddy blocks. A block
 * taken by the dead process but not yet committed (entry, refs) is free
 * again; one committed but not yet given to its caller stays allocated with
 * a reference no holder table records (refs_unrecorded: a leak, as a death
 * between the steps of pool_alloc always was).
 *
 * Chunk entries are stored with release and read with acquire by block_at,
 * without the lock: a reader that sees LARGE or SLAB sees the record's off
 * written before it. Every chunk that is not the first of a block has entry
 * 0 (splits write the heads of the halves, merges clear the absorbed one).
 */
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

static uint64_t ent_make(uint32_t kind, uint32_t ord, uint32_t rec)
{
	return (uint64_t)kind << ENT_KIND_SHIFT | (uint64_t)ord << ENT_ORD_SHIFT | rec;
}

static uint32_t ent_kind(uint64_t e)
{
	return (uint32_t)(e >> ENT_KIND_SHIFT);
}

static uint32_t ent_ord(uint64_t e)
{
	return (uint32_t)(e >> ENT_ORD_SHIFT) & 63u;
}

static uint32_t ent_rec(uint64_t e)
{
	return (uint32_t)e;
}

static uint64_t chunk_off(const struct shm_pool *p, uint32_t c)
{
	return p->data_off + ((uint64_t)c << POOL_CHUNK_SHIFT);
}

static void set_entry(struct shm_pool *p, uint32_t c, uint64_t e)
{
	/* Release: pairs with block_at's acquire (the record's off first). */
	atomic_store_explicit(&p->chunks[c].entry, e, memory_order_release);
}

static uint64_t get_entry(const struct shm_pool *p, uint32_t c)
{
	return atomic_load_explicit(&p->chunks[c].entry, memory_order_acquire);
}

static uint32_t class_of(uint64_t bytes)
{
	if (bytes <= (1u << POOL_MIN_SHIFT))
		return 0;
	return (uint32_t)(64 - __builtin_clzll(bytes - 1)) - POOL_MIN_SHIFT;
}

static int slab_nb_order(uint32_t k);

/*
 * What the chunk table says starts at off (inside the data area): the
 * block's record and class, or false when no block starts there. Read
 * from the pool, so checked: a LARGE entry must name an aligned run of
 * chunks inside the pool and a record, a SLAB entry a class and a run of
 * records that exist; else *bad (the chunk table is corrupt).
 */
static bool entry_block(const struct shm_pool *p, uint64_t off, uint32_t *idx, uint32_t *cls,
			bool *bad)
{
	uint64_t rel = off - p->data_off, in = rel & (POOL_CHUNK - 1);
	uint32_t c = (uint32_t)(rel >> POOL_CHUNK_SHIFT);
	uint64_t e = get_entry(p, c);
	uint32_t o = ent_ord(e);

	*bad = false;
	if (ent_kind(e) == ENT_LARGE && in == 0) {
		*bad = o > p->max_order || c & ((1u << o) - 1) ||
		       (uint64_t)c + (1ull << o) > p->nchunks || ent_rec(e) >= p->max_blocks;
		*idx = ent_rec(e);
		*cls = LARGE_CLASS0 + o;
		return !*bad;
	}
	if (ent_kind(e) != ENT_SLAB)
		return false;
	if (o >= POOL_SMALL_CLASSES ||
	    (uint64_t)ent_rec(e) + (1u << slab_nb_order(o)) > p->max_blocks) {
		*bad = true;
		return false;
	}
	if (in & (class_size(o) - 1))
		return false;
	*idx = ent_rec(e) + (uint32_t)(in >> (o + POOL_MIN_SHIFT));
	*cls = o;
	return true;
}

/* The block at off: its index and class, or -EINVAL (off is checked
 * against everything this process knows, not trusted), or
 * -SHMRPC_ECORRUPT when the chunk table's entry for it is impossible. */
static int block_at(struct shm_pool *p, uint64_t off, uint32_t *idx, uint32_t *cls)
{
	uint32_t i, k;
	bool bad;

	if (off < p->data_off || off >= p->size)
		return shmrpc__fail(-EINVAL,
				    "offset %" PRIu64 " is outside the tensor pool's data "
				    "(%" PRIu64 "..%" PRIu64 ")",
				    off, p->data_off, p->size);
	if (!entry_block(p, off, &i, &k, &bad))
		return bad ? POOL_BAD(p, SHM_CORRUPT_POOL_CHUNKS,
				      "the tensor pool's chunk table is corrupt: the entry of chunk "
				      "%" PRIu64 " (offset %" PRIu64 ") names no block the pool can "
				      "have" POOL_RESTART,
				      (off - p->data_off) >> POOL_CHUNK_SHIFT, off)
			   : shmrpc__fail(-EINVAL, "offset %" PRIu64 " is not the start of a pool "
					  "block", off);
	/* A stale offset (its block freed, the record given to another) reads
	 * so too: the caller's, not a corrupt pool. */
	if (atomic_load_explicit(&p->meta[i].off, memory_order_relaxed) != off)
		return shmrpc__fail(-EINVAL,
				    "offset %" PRIu64 ": the pool's records for it are inconsistent "
				    "(class %u, record %u)",
				    off, k, i);
	*idx = i;
	*cls = k;
	return 0;
}

/* The class of block record idx, or POOL_NCLASS when the record holds no
 * block (free, or its chunk's entry does not name it): read from the
 * pool, so checked like anything else read there. Silent: inspectors,
 * whose mapping is read-only, call it too. */
static uint32_t block_class(struct shm_pool *p, uint32_t idx)
{
	uint64_t off = atomic_load_explicit(&p->meta[idx].off, memory_order_relaxed);
	uint32_t idx2, k;
	bool bad;

	if (off < p->data_off || off >= p->size || !entry_block(p, off, &idx2, &k, &bad))
		return POOL_NCLASS;
	return idx2 == idx ? k : POOL_NCLASS;
}

/* ---- The two buddy systems (under the lock) ------------------------------ */

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

static struct buddy chunk_buddy(struct shm_pool *p)
{
	return (struct buddy){ p, false, p->nchunks, p->max_order, p->hdr->chunk_free, "chunk" };
}

static struct buddy rec_buddy(struct shm_pool *p)
{
	return (struct buddy){ p, true, p->max_blocks, p->max_rec_order, p->hdr->rec_free,
			       "block record" };
}

static uint32_t *b_next(const struct buddy *b, uint32_t u)
{
	return b->recs ? &b->p->meta[u].next : &b->p->chunks[u].next;
}

static uint32_t *b_prev(const struct buddy *b, uint32_t u)
{
	return b->recs ? &b->p->meta[u].prev : &b->p->chunks[u].prev;
}

/* The order of the free block that starts at u, or -1 when u starts none. */
static int b_free_order(const struct buddy *b, uint32_t u)
{
	if (b->recs) {
		uint32_t r = b->p->meta[u].run;

		return r & RUN_FREE ? (int)(r & 63u) : -1;
	}
	uint64_t e = get_entry(b->p, u);

	return ent_kind(e) == ENT_FREE ? (int)ent_ord(e) : -1;
}

static void b_mark(const struct buddy *b, uint32_t u, int order)
{
	if (b->recs)
		b->p->meta[u].run = order < 0 ? 0 : RUN_FREE | (uint32_t)order;
	else
		set_entry(b->p, u, order < 0 ? 0 : ent_make(ENT_FREE, (uint32_t)order, 0));
}

static int b_corrupt(const struct buddy *b, uint32_t o, uint64_t link)
{
	return POOL_BAD(b->p, SHM_CORRUPT_POOL_LISTS,
			"the tensor pool's free list of %s blocks of order %u is corrupt: it "
			"names %" PRIu64 " of %u" POOL_RESTART,
			b->what, o, link, b->n);
}

static void b_push(const struct buddy *b, uint32_t u, uint32_t o)
{
	uint32_t h = atomic_load_explicit(&b->heads[o], memory_order_relaxed);

	*b_next(b, u) = h;
	*b_prev(b, u) = 0;
	if (h && h <= b->n)
		*b_prev(b, h - 1) = u + 1;
	b_mark(b, u, (int)o);
	/* Relaxed: the lock orders it; pool_stats reads it as a snapshot. */
	atomic_store_explicit(&b->heads[o], u + 1, memory_order_relaxed);
	if (b->recs)
		atomic_store_explicit(&b->p->hdr->free_records,
				      atomic_load_explicit(&b->p->hdr->free_records,
							   memory_order_relaxed) + (1ull << o),
				      memory_order_relaxed);
	else
		atomic_store_explicit(&b->p->hdr->free_chunks,
				      atomic_load_explicit(&b->p->hdr->free_chunks,
							   memory_order_relaxed) + (1ull << o),
				      memory_order_relaxed);
}

static int b_unlink(const struct buddy *b, uint32_t u, uint32_t o)
{
	uint32_t nx = *b_next(b, u), pv = *b_prev(b, u);
	_Atomic uint64_t *count = b->recs ? &b->p->hdr->free_records : &b->p->hdr->free_chunks;

	if (nx > b->n || pv > b->n)
		return b_corrupt(b, o, nx > b->n ? nx : pv);
	/* Both neighbours must name u back: a link into another list (or to
	 * a unit in use) would otherwise be followed on the next pop. */
	if ((pv ? *b_next(b, pv - 1)
		: atomic_load_explicit(&b->heads[o], memory_order_relaxed)) != u + 1 ||
	    (nx && *b_prev(b, nx - 1) != u + 1))
		return POOL_BAD(b->p, SHM_CORRUPT_POOL_LISTS,
				"the tensor pool's free list of %s blocks of order %u is corrupt: "
				"the neighbours of %u (links %u, %u) do not name it back"
				POOL_RESTART,
				b->what, o, u, pv, nx);
	if (pv)
		*b_next(b, pv - 1) = nx;
	else
		atomic_store_explicit(&b->heads[o], nx, memory_order_relaxed);
	if (nx)
		*b_prev(b, nx - 1) = pv;
	b_mark(b, u, -1);
	atomic_store_explicit(count, atomic_load_explicit(count, memory_order_relaxed) - (1ull << o),
			      memory_order_relaxed);
	return 0;
}

/* A free block of 2^o units: its first unit, -NO_SPACE, or -errno. */
static int64_t b_alloc(const struct buddy *b, uint32_t o)
{
	for (uint32_t j = o; j <= b->max_order; j++) {
		uint32_t h = atomic_load_explicit(&b->heads[j], memory_order_relaxed), u;
		int err;

		if (!h)
			continue;
		if (h > b->n || (h - 1) & ((1u << j) - 1) || b_free_order(b, h - 1) != (int)j)
			return b_corrupt(b, j, h);
		u = h - 1;
		if ((err = b_unlink(b, u, j)))
			return err;
		/* Split: keep the lower half, free the upper one, down to o. */
		while (j > o) {
			j--;
			b_push(b, u + (1u << j), j);
		}
		return u;
	}
	return -NO_SPACE;
}

/* Frees the block of 2^o units at u, merging it with its free buddies. */
static int b_free(const struct buddy *b, uint32_t u, uint32_t o)
{
	while (o < b->max_order) {
		uint32_t buddy = u ^ (1u << o);
		int err;

		if ((uint64_t)buddy + (1u << o) > b->n || b_free_order(b, buddy) != (int)o)
			break;
		if ((err = b_unlink(b, buddy, o)))
			return err;
		b_mark(b, u > buddy ? u : buddy, -1);
		u = u < buddy ? u : buddy;
		o++;
	}
	b_push(b, u, o);
	return 0;
}

/* Frees everything in [from, to) as the largest aligned blocks (creation
 * and rebuild; the units must be free and unlisted). */
static void b_free_range(const struct buddy *b, uint32_t from, uint32_t to)
{
	while (from < to) {
		uint32_t o = from ? (uint32_t)__builtin_ctz(from) : b->max_order;

		if (o > b->max_order)
			o = b->max_order;
		while ((uint64_t)from + (1ull << o) > to)
			o--;
		b_push(b, from, o);
		from += 1u << o;
	}
}

/* A new pool's lock and lists: every chunk and record free. */
static int pool_init_lists(struct shm_pool *p)
{
	struct buddy cb = chunk_buddy(p), rb = rec_buddy(p);
	pthread_mutexattr_t a;
	int err;

	/* Robust: a holder's death hands it on with EOWNERDEAD. */
	if ((err = pthread_mutexattr_init(&a)))
		return shmrpc__fail(-err, "cannot make the tensor pool's lock: %s", strerror(err));
	if ((err = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED)) ||
	    (err = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST)) ||
	    (err = pthread_mutex_init(&p->hdr->lock.m, &a))) {
		pthread_mutexattr_destroy(&a);
		return shmrpc__fail(-err, "cannot make the tensor pool's lock: %s", strerror(err));
	}
	pthread_mutexattr_destroy(&a);
	b_free_range(&cb, 0, p->nchunks);
	b_free_range(&rb, 0, p->max_blocks);
	return 0;
}

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

/* ---- The lock, and the rebuild after a death under it -------------------- */

static int rebuild(struct shm_pool *p);

static int pool_lock(struct shm_pool *p)
{
	int rc = pthread_mutex_lock(&p->hdr->lock.m);

	if (rc == EOWNERDEAD) {
		/* Its holder died: the lists may be half changed. */
		int err = rebuild(p);

		pthread_mutex_consistent(&p->hdr->lock.m);
		atomic_fetch_add_explicit(&p->hdr->rebuilds, 1, memory_order_relaxed);
		if (err) {
			pthread_mutex_unlock(&p->hdr->lock.m);
			return err;
		}
		return 0;
	}
	if (rc)
		return shmrpc__fail(-rc, "cannot take the tensor pool's lock: %s", strerror(rc));
	return 0;
}

static void pool_unlock(struct shm_pool *p)
{
	pthread_mutex_unlock(&p->hdr->lock.m);
}

/* Gives the records of a block back (off cleared first: see pool_meta). */
static int recs_free(struct shm_pool *p, uint32_t r, uint32_t o)
{
	struct buddy rb = rec_buddy(p);

	for (uint32_t i = 0; i < (1u << o); i++) {
		atomic_store_explicit(&p->meta[r + i].off, 0, memory_order_relaxed);
		p->meta[r + i].next = 0;
	}
	return b_free(&rb, r, o);
}

static int slab_nb_order(uint32_t k)
{
	return (int)(POOL_CHUNK_SHIFT - (k + POOL_MIN_SHIFT));
}

/* The partial-slab list of class k: links in the chunks' next/prev. */
static void partial_add(struct shm_pool *p, uint32_t k, uint32_t c)
{
	uint32_t h = atomic_load_explicit(&p->hdr->partial[k], memory_order_relaxed);

	p->chunks[c].next = h;
	p->chunks[c].prev = 0;
	if (h && h <= p->nchunks)
		p->chunks[h - 1].prev = c + 1;
	atomic_store_explicit(&p->hdr->partial[k], c + 1, memory_order_relaxed);
}

static int partial_remove(struct shm_pool *p, uint32_t k, uint32_t c)
{
	uint32_t nx = p->chunks[c].next, pv = p->chunks[c].prev;

	if (nx > p->nchunks || pv > p->nchunks ||
	    (pv ? p->chunks[pv - 1].next
		: atomic_load_explicit(&p->hdr->partial[k], memory_order_relaxed)) != c + 1 ||
	    (nx && p->chunks[nx - 1].prev != c + 1))
		return POOL_BAD(p, SHM_CORRUPT_POOL_LISTS,
				"the tensor pool's list of slabs of %s blocks is corrupt at chunk "
				"%u (links %u, %u of %u)" POOL_RESTART,
				fmt_bytes((char[32]){ 0 }, class_size(k)), c, pv, nx, p->nchunks);
	if (pv)
		p->chunks[pv - 1].next = nx;
	else
		atomic_store_explicit(&p->hdr->partial[k], nx, memory_order_relaxed);
	if (nx)
		p->chunks[nx - 1].prev = pv;
	p->chunks[c].next = p->chunks[c].prev = 0;
	return 0;
}

static void add_slab_free(struct shm_pool *p, int64_t bytes)
{
	_Atomic uint64_t *v = &p->hdr->slab_free_bytes;

	atomic_store_explicit(v, atomic_load_explicit(v, memory_order_relaxed) + (uint64_t)bytes,
			      memory_order_relaxed);
}

static void add_retained(struct shm_pool *p, int64_t chunks)
{
	_Atomic uint64_t *v = &p->hdr->retained_chunks;

	atomic_store_explicit(v, atomic_load_explicit(v, memory_order_relaxed) + (uint64_t)chunks,
			      memory_order_relaxed);
}

/* Committed chunks among [c, c + n). */
static uint32_t committed_in(struct shm_pool *p, uint32_t c, uint32_t n)
{
	uint32_t k = 0;

	for (uint32_t i = c; i < c + n; i++)
		k += atomic_load_explicit(&p->chunks[i].committed, memory_order_relaxed) != 0;
	return k;
}

static void set_committed(struct shm_pool *p, uint32_t c, uint32_t n, uint32_t v)
{
	for (uint32_t i = c; i < c + n; i++)
		atomic_store_explicit(&p->chunks[i].committed, v, memory_order_relaxed);
}

/* The free committed memory the pool keeps for its next blocks: an eighth
 * of its size, POOL_RETAIN_MAX at most. */
static uint64_t retain_budget(const struct shm_pool *p)
{
	uint64_t b = p->data_size / 8;

	return b < POOL_RETAIN_MAX ? b : POOL_RETAIN_MAX;
}

/*
 * Chunk c is a slab of class k: its entry says so and names records that
 * exist, its free count and first free block are possible (none free
 * exactly when there is no first). Its first record, or -SHMRPC_ECORRUPT.
 */
static int64_t slab_check(struct shm_pool *p, uint32_t c, uint32_t k)
{
	uint64_t e = get_entry(p, c);
	uint32_t nb = 1u << slab_nb_order(k), j = p->chunks[c].free_head, nf = p->chunks[c].nfree;

	if (ent_kind(e) != ENT_SLAB || ent_ord(e) != k || (uint64_t)ent_rec(e) + nb > p->max_blocks)
		return POOL_BAD(p, SHM_CORRUPT_POOL_CHUNKS,
				"the tensor pool's chunk table is corrupt: chunk %u, a slab of %s "
				"blocks, has the entry %#" PRIx64 POOL_RESTART,
				c, fmt_bytes((char[32]){ 0 }, class_size(k)), e);
	if (nf > nb || j > nb || !j != !nf)
		return POOL_BAD(p, SHM_CORRUPT_POOL_LISTS,
				"the tensor pool's free list of the slab at chunk %u is corrupt: %u "
				"of its %u blocks free, the first %u" POOL_RESTART,
				c, nf, nb, j);
	return ent_rec(e);
}

/* An empty slab goes back to the chunks and its records to theirs. */
static int slab_release(struct shm_pool *p, uint32_t k, uint32_t c)
{
	struct buddy cb = chunk_buddy(p);
	int64_t r = slab_check(p, c, k);
	int err;

	if (r < 0)
		return (int)r;
	if ((err = partial_remove(p, k, c)))
		return err;
	add_slab_free(p, -(int64_t)POOL_CHUNK);
	add_retained(p, committed_in(p, c, 1));
	p->chunks[c].nfree = p->chunks[c].free_head = 0;
	set_entry(p, c, 0);
	if ((err = recs_free(p, (uint32_t)r, (uint32_t)slab_nb_order(k))))
		return err;
	return b_free(&cb, c, 0);
}

/* Gives back every empty slab (a large block found no room). How many. */
static int slabs_reclaim(struct shm_pool *p)
{
	int n = 0;

	for (uint32_t k = 0; k < POOL_SMALL_CLASSES; k++) {
		uint32_t h = atomic_load_explicit(&p->hdr->partial[k], memory_order_relaxed);
		uint32_t nb = 1u << slab_nb_order(k);

		for (uint32_t steps = 0; h && h <= p->nchunks && steps < p->nchunks; steps++) {
			uint32_t c = h - 1;

			h = p->chunks[c].next;
			if (p->chunks[c].nfree == nb && slab_release(p, k, c) == 0)
				n++;
		}
	}
	return n;
}

/* Commits [off, off + len) of the data: -ENOMEM with a sentence when the
 * machine (or the cgroup) has no room, instead of a SIGBUS at first touch. */
static int commit(struct shm_pool *p, uint64_t off, uint64_t len, uint64_t asked)
{
	char b1[32], b2[32];
	int err;

	len = align_up(len, POOL_PAGE);
	err = fallocate(p->fd, 0, (off_t)off, (off_t)len) ? errno : 0;
	if (!err)
		return 0;
	if (err == ENOSPC)
		err = ENOMEM;
	return shmrpc__fail(-err,
			    "tensor pool: cannot commit %s of memory for a %s tensor: %s; the "
			    "machine (or this job's cgroup) has no more memory for the pool: "
			    "free some, or send fewer or smaller tensors at once",
			    fmt_bytes(b1, len), fmt_bytes(b2, asked), strerror(err));
}

/* A small block of class k (under the lock): its record, or -errno. */
static int64_t small_alloc(struct shm_pool *p, uint32_t k)
{
	uint32_t h = atomic_load_explicit(&p->hdr->partial[k], memory_order_relaxed), c, j, idx, next;
	uint32_t nbo = (uint32_t)slab_nb_order(k), nb = 1u << nbo;
	uint64_t size = class_size(k);
	int64_t first;
	int err;

	if (h > p->nchunks)
		return POOL_BAD(p, SHM_CORRUPT_POOL_LISTS,
				"the tensor pool's list of slabs of %s blocks names chunk %u of %u"
				POOL_RESTART,
				fmt_bytes((char[32]){ 0 }, size), h, p->nchunks);
	if (!h) {
		/* A fresh slab: its records, its chunk, its memory. */
		struct buddy cb = chunk_buddy(p), rb = rec_buddy(p);
		int64_t r = b_alloc(&rb, nbo), cc;

		if (r < 0)
			return r == -NO_SPACE ? -NO_RECORDS : r;
		cc = b_alloc(&cb, 0);
		if (cc < 0) {
			recs_free(p, (uint32_t)r, nbo);
			return cc;
		}
		c = (uint32_t)cc;
		if (committed_in(p, c, 1)) {
			add_retained(p, -1);
		} else if ((err = commit(p, chunk_off(p, c), POOL_CHUNK, size))) {
			recs_free(p, (uint32_t)r, nbo);
			b_free(&cb, c, 0);
			return err;
		} else {
			set_committed(p, c, 1, 1);
		}
		for (uint32_t i = 0; i < nb; i++) {
			struct pool_meta *m = &p->meta[r + i];

			atomic_store_explicit(&m->refs, 0, memory_order_relaxed);
			atomic_store_explicit(&m->off, chunk_off(p, c) + i * size, memory_order_relaxed);
			m->next = (i + 1 < nb ? i + 2 : 0) | POOL_LISTED;
		}
		p->chunks[c].nfree = nb;
		p->chunks[c].free_head = 1;
		set_entry(p, c, ent_make(ENT_SLAB, k, (uint32_t)r));
		partial_add(p, k, c);
		add_slab_free(p, POOL_CHUNK);
		h = c + 1;
	}
	c = h - 1;
	if ((first = slab_check(p, c, k)) < 0)
		return first;
	j = p->chunks[c].free_head;
	if (!j)
		return POOL_BAD(p, SHM_CORRUPT_POOL_LISTS,
				"the tensor pool's list of slabs of %s blocks names the full slab "
				"at chunk %u" POOL_RESTART,
				fmt_bytes((char[32]){ 0 }, size), c);
	/* The block it names must be free and listed, and name a possible
	 * next: a link to a block in use would hand that block out twice. */
	idx = (uint32_t)first + j - 1;
	next = p->meta[idx].next;
	if (!(next & POOL_LISTED) || (next & ~POOL_LISTED) > nb ||
	    atomic_load_explicit(&p->meta[idx].refs, memory_order_relaxed) ||
	    atomic_load_explicit(&p->meta[idx].off, memory_order_relaxed) !=
		    chunk_off(p, c) + (uint64_t)(j - 1) * size)
		return POOL_BAD(p, SHM_CORRUPT_POOL_RECORDS,
				"the tensor pool's block record %u, block %u of the slab at chunk "
				"%u, is not a free block of it (link %#x, %u references)"
				POOL_RESTART,
				idx, j - 1, c, next,
				atomic_load_explicit(&p->meta[idx].refs, memory_order_relaxed));
	p->chunks[c].free_head = next & ~POOL_LISTED;
	p->meta[idx].next = 0;

	/* Release, after the slab's offs: as in large_alloc (pool_ref). */
	atomic_store_explicit(&p->meta[idx].refs, 1, memory_order_release);
	add_slab_free(p, -(int64_t)size);
	if (--p->chunks[c].nfree == 0 && (err = partial_remove(p, k, c)))
		return err;
	return idx;
}

/* A large block of 2^o chunks (under the lock): its record, or -errno. */
static int64_t large_alloc(struct shm_pool *p, uint32_t o)
{
	struct buddy cb = chunk_buddy(p), rb = rec_buddy(p);
	int64_t c = b_alloc(&cb, o), r;

	if (c < 0)
		return c;
	r = b_alloc(&rb, 0);
	if (r < 0) {
		b_free(&cb, (uint32_t)c, o);
		return r == -NO_SPACE ? -NO_RECORDS : r;
	}
	/* Its committed chunks are no longer free ones kept. */
	add_retained(p, -(int64_t)committed_in(p, (uint32_t)c, 1u << o));
	atomic_store_explicit(&p->meta[r].off, chunk_off(p, (uint32_t)c), memory_order_relaxed);
	p->meta[r].next = 0;
	/* Release, after off: pool_ref's CAS (acquire) that finds refs 1 here
	 * sees this off in its check that the record is still its block's. */
	atomic_store_explicit(&p->meta[r].refs, 1, memory_order_release);
	set_entry(p, (uint32_t)c, ent_make(ENT_LARGE, o, (uint32_t)r));
	return r;
}

/*
 * Block idx's refs reached 0 (under the lock): puts it back, if it still is
 * what its record says and nobody (a rebuild) did so already.
 */
static int block_free_locked(struct shm_pool *p, uint32_t idx, bool punched)
{
	struct pool_meta *m = &p->meta[idx];
	uint64_t off = atomic_load_explicit(&m->off, memory_order_relaxed);
	uint32_t c, k, at, nb, j;
	struct pool_chunk *ch;
	int64_t first;
	bool bad;

	if (off < p->data_off || off >= p->size ||
	    atomic_load_explicit(&m->refs, memory_order_acquire) != 0)
		return 0;
	c = (uint32_t)((off - p->data_off) >> POOL_CHUNK_SHIFT);
	if (!entry_block(p, off, &at, &k, &bad) || at != idx)
		return bad ? POOL_BAD(p, SHM_CORRUPT_POOL_CHUNKS,
				      "the tensor pool's chunk table is corrupt: the entry of chunk "
				      "%u, where block record %u's block is, names no block the pool "
				      "can have" POOL_RESTART,
				      c, idx)
			   : 0;
	if (k >= LARGE_CLASS0) {
		struct buddy cb = chunk_buddy(p);
		uint32_t o = k - LARGE_CLASS0;
		int err;

		set_entry(p, c, 0);
		/* Punched: nothing of it is committed; else its committed
		 * chunks are kept for the next blocks. */
		if (punched)
			set_committed(p, c, 1u << o, 0);
		else
			add_retained(p, committed_in(p, c, 1u << o));
		if ((err = recs_free(p, idx, 0)))
			return err;
		return b_free(&cb, c, o);
	}
	if (m->next & POOL_LISTED)
		return 0;
	if ((first = slab_check(p, c, k)) < 0)
		return (int)first;
	nb = 1u << slab_nb_order(k);
	j = idx - (uint32_t)first;
	ch = &p->chunks[c];
	if (ch->nfree >= nb)
		return POOL_BAD(p, SHM_CORRUPT_POOL_LISTS,
				"the tensor pool's free list of the slab at chunk %u is corrupt: "
				"it counts all %u blocks free while block %u is in use" POOL_RESTART,
				c, nb, j);
	m->next = ch->free_head | POOL_LISTED;
	ch->free_head = j + 1;
	add_slab_free(p, (int64_t)class_size(k));
	if (++ch->nfree == 1)
		partial_add(p, k, c);
	/* Empty: back to the chunks, unless it is its class's only slab
	 * with room (kept warm for the next small block). */
	if (ch->nfree == nb &&
	    (atomic_load_explicit(&p->hdr->partial[k], memory_order_relaxed) != c + 1 ||
	     ch->next))
		return slab_release(p, k, c);
	return 0;
}

/*
 * Drops n references of block idx; the last one frees it, and gives a large
 * block's pages back if punch: not when a live process lets go of all it
 * holds at once (pool_leave), whose views of its blocks stay readable after
 * it has left (a data loader's batches after its job ended).
 */
static int block_drop(struct shm_pool *p, uint32_t idx, uint32_t n, bool punch)
{
	_Atomic uint32_t *refs = &p->meta[idx].refs;
	uint32_t r = atomic_load_explicit(refs, memory_order_acquire), k;
	bool punched;
	int err;

	/* Its class while our references keep the record this block's. */
	k = block_class(p, idx);
	TSAN_DROP(p);
	do {
		if (r < n)
			return POOL_BAD(p, SHM_CORRUPT_POOL_RECORDS,
					"the tensor pool's block record %u is corrupt: its block "
					"(offset %" PRIu64 ") has %u references and %u are dropped"
					POOL_RESTART,
					idx,
					atomic_load_explicit(&p->meta[idx].off, memory_order_relaxed),
					r, n);
	} while (!atomic_compare_exchange_weak_explicit(refs, &r, r - n, memory_order_acq_rel,
							memory_order_acquire));
	if (r != n)
		return 0;
	/* The last reference: a large block is this process's alone until it
	 * is listed (a rebuild keeps it), so its pages go back unlocked. */
	/* Kept committed while the pool keeps less than its budget of free
	 * committed memory (a racy read: a bound, not an account). */
	punched = punch && k < POOL_NCLASS && class_size(k) >= POOL_PUNCH_MIN &&
		  (atomic_load_explicit(&p->hdr->retained_chunks, memory_order_relaxed)
		   << POOL_CHUNK_SHIFT) + class_size(k) > retain_budget(p) &&
		  fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
			    (off_t)atomic_load_explicit(&p->meta[idx].off, memory_order_relaxed),
			    (off_t)class_size(k)) == 0;
	if ((err = pool_lock(p)))
		return err;
	err = block_free_locked(p, idx, punched);
	pool_unlock(p);
	return err;
}

/*
 * After a death under the lock: every list rebuilt from the blocks (see the
 * comment at the top of this section). Records first: a chunk entry counts
 * only if the records it names name it back.
 */
static int rebuild(struct shm_pool *p)
{
	struct buddy cb = chunk_buddy(p), rb = rec_buddy(p);
	uint8_t *cused = calloc(p->nchunks, 1), *rused = calloc(p->max_blocks, 1);

	if (!cused || !rused) {
		free(cused);
		free(rused);
		return shmrpc__fail(-ENOMEM, "cannot rebuild the tensor pool's free lists: out of "
				    "memory");
	}
	for (uint32_t o = 0; o < 32; o++) {
		atomic_store_explicit(&p->hdr->chunk_free[o], 0, memory_order_relaxed);
		atomic_store_explicit(&p->hdr->rec_free[o], 0, memory_order_relaxed);
	}
	for (uint32_t k = 0; k < 16; k++)
		atomic_store_explicit(&p->hdr->partial[k], 0, memory_order_relaxed);
	atomic_store_explicit(&p->hdr->free_chunks, 0, memory_order_relaxed);
	atomic_store_explicit(&p->hdr->free_records, 0, memory_order_relaxed);
	atomic_store_explicit(&p->hdr->slab_free_bytes, 0, memory_order_relaxed);

	for (uint32_t c = 0; c < p->nchunks; c++) {
		uint64_t e = get_entry(p, c), base = chunk_off(p, c);
		uint32_t r = ent_rec(e), o = ent_ord(e);

		if (ent_kind(e) == ENT_LARGE && o <= p->max_order && !(c & ((1u << o) - 1)) &&
		    (uint64_t)c + (1ull << o) <= p->nchunks && r < p->max_blocks && !rused[r] &&
		    atomic_load_explicit(&p->meta[r].off, memory_order_relaxed) == base &&
		    (atomic_load_explicit(&p->meta[r].refs, memory_order_relaxed) ||
		     (uint64_t)POOL_CHUNK << o >= POOL_PUNCH_MIN)) {
			/* Allocated; with refs 0 too if its freer may be giving its
			 * pages back unlocked (or died doing so: lost). Smaller ones
			 * with refs 0 are free: their freer only takes the lock,
			 * then finds them so and does nothing. */
			memset(cused + c, 1, 1u << o);
			rused[r] = 1;
			for (uint32_t i = c + 1; i < c + (1u << o); i++)
				set_entry(p, i, 0);
			c += (1u << o) - 1;
			continue;
		}
		if (ent_kind(e) == ENT_SLAB && o < POOL_SMALL_CLASSES) {
			uint32_t nbo = (uint32_t)slab_nb_order(o), nb = 1u << nbo, live = 0;
			uint64_t size = class_size(o);
			bool ok = !(r & (nb - 1)) && (uint64_t)r + nb <= p->max_blocks;

			for (uint32_t i = 0; ok && i < nb; i++)
				ok = !rused[r + i] && atomic_load_explicit(&p->meta[r + i].off,
									   memory_order_relaxed) ==
							      base + i * size;
			for (uint32_t i = 0; ok && i < nb; i++)
				live += atomic_load_explicit(&p->meta[r + i].refs,
							     memory_order_relaxed) != 0;
			if (ok && live) {
				struct pool_chunk *ch = &p->chunks[c];

				ch->free_head = 0;
				ch->nfree = 0;
				for (uint32_t i = nb; i-- > 0;) {
					struct pool_meta *m = &p->meta[r + i];

					rused[r + i] = 1;
					if (atomic_load_explicit(&m->refs, memory_order_relaxed))
						continue;
					m->next = ch->free_head | POOL_LISTED;
					ch->free_head = i + 1;
					ch->nfree++;
				}
				cused[c] = 1;
				add_slab_free(p, (int64_t)(ch->nfree * size));
				if (ch->nfree)
					partial_add(p, o, c);
				continue;
			}
		}
		set_entry(p, c, 0);
	}
	/* Everything else is free: records (off cleared) and chunks. */
	for (uint32_t r = 0; r < p->max_blocks; r++) {
		p->meta[r].run = 0;
		if (!rused[r]) {
			atomic_store_explicit(&p->meta[r].off, 0, memory_order_relaxed);
			atomic_store_explicit(&p->meta[r].refs, 0, memory_order_relaxed);
			p->meta[r].next = 0;
		}
	}
	atomic_store_explicit(&p->hdr->retained_chunks, 0, memory_order_relaxed);
	for (uint32_t c = 0; c < p->nchunks; c++)
		if (!cused[c] && atomic_load_explicit(&p->chunks[c].committed, memory_order_relaxed))
			add_retained(p, 1);
	for (uint32_t c = 0; c < p->nchunks;) {
		uint32_t end = c;

		while (end < p->nchunks && !cused[end])
			end++;
		b_free_range(&cb, c, end);
		while (end < p->nchunks && cused[end])
			end++;
		c = end;
	}
	for (uint32_t r = 0; r < p->max_blocks;) {
		uint32_t end = r;

		while (end < p->max_blocks && !rused[end])
			end++;
		b_free_range(&rb, r, end);
		while (end < p->max_blocks && rused[end])
			end++;
		r = end;
	}
	free(cused);
	free(rused);
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
					    "references to too many pool blocks at once (tensors it "
					    "made or received and still holds); run the job with "
					    "more: shmrun --holder-records %u",
					    rank, p->holder_cap,
					    p->holder_cap >= (1u << 24) ? 1u << 24 : p->holder_cap * 2);
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

static int sweep(struct shm_pool *p, uint32_t rank, uint32_t generation, bool punch);

int pool_sweep(struct shm_pool *p, uint32_t rank, uint32_t generation)
{
	return sweep(p, rank, generation, true);
}

/* pool_sweep, and pool_leave's sweep of a live rank (punch false). */
static int sweep(struct shm_pool *p, uint32_t rank, uint32_t generation, bool punch)
{
	_Atomic uint64_t *life, *t;
	uint64_t l, n = 0;
	int err = 0, derr;

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
			if (idx >= p->max_blocks || !entry_count(w)) {
				err = POOL_BAD(p, SHM_CORRUPT_POOL_HOLDERS,
					       "the tensor pool's holder table of rank %u is "
					       "corrupt: an entry names %u references to block "
					       "record %u of %u" POOL_RESTART,
					       rank, entry_count(w), idx, p->max_blocks);
				break;
			}
			if ((derr = block_drop(p, idx, entry_count(w), punch)) < 0)
				err = derr;
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
	int err = pool_healthy(p);

	if (err)
		return err;
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
			if ((err = pool_sweep(p, rank, life_gen(l))) < 0)
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
	 * clear the tombstones it left (a first join finds the table zero). */
	if (life_state(l) != POOL_HOLDER_IDLE) {
		t = table_of(p, rank);
		for (uint32_t s = 0; s < p->holder_cap; s++)
			atomic_store_explicit(&t[s], 0, memory_order_relaxed);
		atomic_thread_fence(memory_order_release);
	}
	return 0;
}

int pool_leave(struct shm_pool *p, uint32_t rank)
{
	uint32_t tag;
	int err = holder_tag(p, rank, &tag);

	if (err)
		return err;
	return sweep(p, rank,
		     life_gen(atomic_load_explicit(&p->holders[rank].life, memory_order_acquire)),
		     false);
}

/* ---- References ----------------------------------------------------------- */

static int exhausted(struct shm_pool *p, uint64_t bytes, uint32_t k, bool records)
{
	struct pool_stats st;
	char b[6][32];

	pool_stats(p, &st);
	if (records)
		return shmrpc__fail(-ENOMEM,
				    "tensor pool out of block records: asked %s, all %u records "
				    "used (pool %s, %s in use, largest free block %s); run the job "
				    "with more: shmrun --pool-records %u",
				    fmt_bytes(b[0], bytes), p->max_blocks, fmt_bytes(b[1], st.size),
				    fmt_bytes(b[2], st.used), fmt_bytes(b[3], st.largest_free),
				    p->max_blocks >= (1u << 31) ? POOL_MAX_BLOCKS : p->max_blocks * 2);
	return shmrpc__fail(-ENOMEM,
			    "tensor pool exhausted: asked %s (a %s block), pool %s, %s in use, "
			    "largest free block %s; run the job with a larger pool: shmrun "
			    "--pool-size %s",
			    fmt_bytes(b[0], bytes),
			    fmt_bytes(b[4], k < POOL_NCLASS ? class_size(k) : bytes),
			    fmt_bytes(b[1], st.size), fmt_bytes(b[2], st.used),
			    fmt_bytes(b[3], st.largest_free),
			    fmt_size_flag(b[5], k < POOL_NCLASS && class_size(k) > st.size - st.used ?
							class_size(k) + st.used :
							2 * st.size));
}

/* A block of class k under the lock: its record, or -errno / -NO_SPACE /
 * -NO_RECORDS. A large block that finds no room has the empty slabs kept
 * warm given back first. */
static int64_t take_block(struct shm_pool *p, uint32_t k)
{
	int64_t idx;
	int err = pool_lock(p);

	if (err)
		return err;
	for (int tries = 0; tries < 2; tries++) {
		idx = k < LARGE_CLASS0 ? small_alloc(p, k) : large_alloc(p, k - LARGE_CLASS0);
		if ((idx != -NO_SPACE && idx != -NO_RECORDS) || !slabs_reclaim(p))
			break;
	}
	pool_unlock(p);
	if (idx >= 0)
		TSAN_TAKE(p);
	return idx;
}

int pool_alloc(struct shm_pool *p, uint32_t rank, uint64_t bytes, uint64_t *off)
{
	uint32_t tag, k;
	int64_t idx;
	int err = pool_healthy(p) ?: holder_tag(p, rank, &tag);

	if (err)
		return err;
	if (bytes == 0)
		return shmrpc__fail(-EINVAL, "a pool block of 0 bytes was asked for");
	k = class_of(bytes);
	if (bytes > p->data_size || k >= POOL_NCLASS || class_size(k) > p->data_size)
		return exhausted(p, bytes, k, false);
	idx = take_block(p, k);
	if (idx == -NO_SPACE || idx == -NO_RECORDS)
		return exhausted(p, bytes, k, idx == -NO_RECORDS);
	if (idx < 0)
		return (int)idx;
	*off = atomic_load_explicit(&p->meta[idx].off, memory_order_relaxed);
	/* Written under the lock a moment ago, but in shared memory: the
	 * block must still be where the chunk table says (this checks the
	 * range that the commit below and the caller will touch). */
	if (block_class(p, (uint32_t)idx) != k) {
		err = POOL_BAD(p, SHM_CORRUPT_POOL_RECORDS,
			       "the tensor pool's block record %" PRId64 " is corrupt: it was "
			       "handed out at offset %" PRIu64 ", where the chunk table has no "
			       "block of %s" POOL_RESTART,
			       idx, *off, fmt_bytes((char[32]){ 0 }, class_size(k)));
		*off = 0;
		return err;
	}
	err = record(p, rank, tag, (uint32_t)idx);
	if (err) {
		block_drop(p, (uint32_t)idx, 1, true);
		return err;
	}
	/* A large block's memory is committed now, outside the lock and once
	 * recorded (a death in the system call leaks nothing): the chunks
	 * asked for, not the whole class, and none when they all still are (a
	 * slab was committed when carved). */
	if (k >= LARGE_CLASS0) {
		uint32_t c = (uint32_t)((*off - p->data_off) >> POOL_CHUNK_SHIFT);
		uint32_t n = (uint32_t)((bytes + POOL_CHUNK - 1) >> POOL_CHUNK_SHIFT);

		if (committed_in(p, c, n) == n)
			return 0;
		if ((err = commit(p, *off, (uint64_t)n << POOL_CHUNK_SHIFT, bytes))) {
			char msg[512];

			snprintf(msg, sizeof(msg), "%s", shmrpc_errmsg());
			if (unrecord(p, rank, tag, (uint32_t)idx) == 0)
				block_drop(p, (uint32_t)idx, 1, true);
			return shmrpc__fail(err, "%s", msg);
		}
		set_committed(p, c, n, 1);
	}
	return 0;
}

int pool_ref(struct shm_pool *p, uint32_t rank, uint64_t off)
{
	uint32_t tag, idx, k, r;
	_Atomic uint32_t *refs;
	int err = pool_healthy(p) ?: holder_tag(p, rank, &tag);

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
	/* The record may have been freed and given to another block between
	 * block_at and the CAS (records move: a slab's go back when it is
	 * empty): check that it is still the block at off. If not, the count
	 * we added is to that other block, which it keeps live for an instant:
	 * drop it again, and off was freed (the caller's stale offset). */
	if (atomic_load_explicit(&p->meta[idx].off, memory_order_acquire) != off ||
	    block_class(p, idx) != k) {
		block_drop(p, idx, 1, true);
		return shmrpc__fail(-EINVAL,
				    "the pool block at offset %" PRIu64 " is free: no "
				    "reference can be taken",
				    off);
	}
	err = record(p, rank, tag, idx);
	if (err)
		block_drop(p, idx, 1, true);
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
	return err ? err : block_drop(p, idx, 1, true);
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
	/* Relaxed: a snapshot; the counters change under the lock. */
	uint64_t free_chunks = atomic_load_explicit(&p->hdr->free_chunks, memory_order_relaxed);
	uint64_t free_recs = atomic_load_explicit(&p->hdr->free_records, memory_order_relaxed);

	memset(st, 0, sizeof(*st));
	st->size = p->data_size;
	if (free_chunks > p->nchunks)
		free_chunks = p->nchunks;
	st->carved = st->size - (free_chunks << POOL_CHUNK_SHIFT);
	st->free_listed = atomic_load_explicit(&p->hdr->slab_free_bytes, memory_order_relaxed);
	st->block_records_max = p->max_blocks;
	st->block_records_used = free_recs > p->max_blocks ? 0 : p->max_blocks - (uint32_t)free_recs;
	for (uint32_t i = 0; i < p->max_blocks; i++) {
		uint32_t r = atomic_load_explicit(&p->meta[i].refs, memory_order_relaxed), k;

		if (!r || (k = block_class(p, i)) >= POOL_NCLASS)
			continue;
		st->used += class_size(k);
		st->blocks_live++;
		st->refs_live += r;
	}
	st->free = st->size > st->used ? st->size - st->used : 0;
	/* The largest free buddy block (a slab's free blocks are smaller). */
	for (uint32_t o = p->max_order + 1; o-- > 0;)
		if (atomic_load_explicit(&p->hdr->chunk_free[o], memory_order_relaxed)) {
			st->largest_free = (uint64_t)POOL_CHUNK << o;
			break;
		}
	if (!st->largest_free && st->free_listed) {
		for (uint32_t k = POOL_SMALL_CLASSES; k-- > 0;)
			if (atomic_load_explicit(&p->hdr->partial[k], memory_order_relaxed)) {
				st->largest_free = class_size(k);
				break;
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
