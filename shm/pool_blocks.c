/* The tensor pool's blocks: what a chunk entry says, the two buddy systems
 * (see pool_internal.h for where this file stands). */
#include <inttypes.h>
#include <string.h>

#include "shmrpc.h"
#include "common/error.h"
#include "shm/pool.h"
#include "shm/pool_internal.h"

/* 0, or the sentence of a pool some process found corrupt: no block is
 * handed out and no reference taken from then on. */
int pool_healthy(struct shm_pool *p)
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
 * Chunk entries are stored with release and read with acquire by pool_block_at,
 * without the lock: a reader that sees LARGE or SLAB sees the record's off
 * written before it. Every chunk that is not the first of a block has entry
 * 0 (splits write the heads of the halves, merges clear the absorbed one).
 */

/*
 * What the chunk table says starts at off (inside the data area): the
 * block's record and class, or false when no block starts there. Read
 * from the pool, so checked: a LARGE entry must name an aligned run of
 * chunks inside the pool and a record, a SLAB entry a class and a run of
 * records that exist; else *bad (the chunk table is corrupt).
 */
bool pool_entry_block(const struct shm_pool *p, uint64_t off, uint32_t *idx, uint32_t *cls,
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
int pool_block_at(struct shm_pool *p, uint64_t off, uint32_t *idx, uint32_t *cls)
{
	uint32_t i, k;
	bool bad;

	if (off < p->data_off || off >= p->size)
		return shmrpc__fail(-EINVAL,
				    "offset %" PRIu64 " is outside the tensor pool's data "
				    "(%" PRIu64 "..%" PRIu64 ")",
				    off, p->data_off, p->size);
	if (!pool_entry_block(p, off, &i, &k, &bad))
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
uint32_t pool_block_class(struct shm_pool *p, uint32_t idx)
{
	uint64_t off = atomic_load_explicit(&p->meta[idx].off, memory_order_relaxed);
	uint32_t idx2, k;
	bool bad;

	if (off < p->data_off || off >= p->size || !pool_entry_block(p, off, &idx2, &k, &bad))
		return POOL_NCLASS;
	return idx2 == idx ? k : POOL_NCLASS;
}


/* ---- The two buddy systems (under the lock) ------------------------------ */


struct buddy pool_chunk_buddy(struct shm_pool *p)
{
	return (struct buddy){ p, false, p->nchunks, p->max_order, p->hdr->chunk_free, "chunk" };
}

struct buddy pool_rec_buddy(struct shm_pool *p)
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
int64_t pool_buddy_alloc(const struct buddy *b, uint32_t o)
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
int pool_buddy_free(const struct buddy *b, uint32_t u, uint32_t o)
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
void pool_buddy_free_range(const struct buddy *b, uint32_t from, uint32_t to)
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
int pool_init_lists(struct shm_pool *p)
{
	struct buddy cb = pool_chunk_buddy(p), rb = pool_rec_buddy(p);
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
	pool_buddy_free_range(&cb, 0, p->nchunks);
	pool_buddy_free_range(&rb, 0, p->max_blocks);
	return 0;
}
