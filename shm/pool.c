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
 *      idempotently: see "What a block's state is" in pool_blocks.c), and refs
 *      never goes up from 0 (pool_ref refuses a free block; only the
 *      allocator, under the lock, stores 1).
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
 * EOWNERDEAD and rebuilds them from the blocks (rebuild(), pool_lock.c). A
 * death after refs reached 0 but before the free loses a large block of
 * 2 MiB or more (its pages are given back unlocked first; pool_stats counts
 * it as lost); smaller ones are found free by the next rebuild. The lock is
 * held for a few list operations: a process stopped while holding it
 * (SIGSTOP, a debugger) stops every allocation and free of the job until it
 * goes on.
 *
 * Records move between blocks (an empty slab gives its records back), so
 * pool_ref checks after its CAS that the record is still the block at its
 * offset, and undoes the count if not.
 *
 * Memory order: refs and records change by acq_rel CAS, so that the user's
 * writes to a block happen before the CAS that frees it, which happens
 * before the lock that frees it and the lock that hands it out again.
 * A record's off is written before the release store of refs = 1 and of its
 * chunk entry; pool_block_at and pool_ref read them with acquire.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "shm/attach.h"
#include "shm/memfd.h"
#include "shm/pool.h"
#include "shm/pool_internal.h"

struct pool_shape {
	uint64_t holder_off, table_off, chunk_off, meta_off, data_off, total;
};


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
	out->retain = !in->retain ? POOL_RETAIN_DEFAULT(out->bytes) :
		      in->retain < out->bytes ? in->retain : out->bytes;
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
const char *pool_fmt_bytes(char buf[32], uint64_t v)
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
const char *pool_fmt_size_flag(char buf[32], uint64_t v)
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
		      uint32_t max_blocks, uint32_t nchunks, uint64_t retain)
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
	p->retain = retain;
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
				    pool_fmt_bytes(b1, (uint64_t)POOL_MAX_CHUNKS << POOL_CHUNK_SHIFT),
				    POOL_MAX_WORLD);

	snprintf(what, sizeof(what), "the tensor pool (%s of tensor data asked)",
		 pool_fmt_bytes(b2, params->bytes));
	/* The data may never be more than the machine could commit (a cap
	 * above it would only promise what fails later). */
	if (params->bytes > shm_machine_bytes())
		return shmrpc__fail(-ENOMEM,
				    "cannot commit %s for %s: this machine has %s of memory and "
				    "swap; pass a smaller --pool-size",
				    pool_fmt_bytes(b1, params->bytes), what,
				    pool_fmt_bytes((char[32]){ 0 }, shm_machine_bytes()));
	/* Records and tables committed now; the data as blocks are handed out. */
	err = shm_memfd_create_sparse("shmrpc-pool", s.total, s.data_off, what, "--pool-size", &fd,
				      &mem);
	if (err)
		return err;
	p->base = mem;
	p->fd = fd;
	pool_fill(p, &s, r.world, r.holder_cap, r.max_blocks, nchunks, r.retain);

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
	h->retain = r.retain;
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
	    h.data_size != (uint64_t)h.nchunks << POOL_CHUNK_SHIFT || h.retain > h.data_size)
		return shm_attach_inconsistent(&pool_kind,
					       "world %u, %u chunks, total %" PRIu64 ", retain %" PRIu64,
					       h.world, h.nchunks, h.total_size, h.retain);
	if ((err = shm_attach_map(fd, &pool_kind, h.total_size, file_size, readonly, &p->base)))
		return err;
	p->fd = fd;
	pool_fill(p, &s, h.world, h.holder_cap, h.max_blocks, h.nchunks, h.retain);
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
