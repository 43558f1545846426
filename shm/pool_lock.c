/* The tensor pool's lock, its rebuild after a death under it, and blocks
 * handed out and put back under it (see pool_internal.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <inttypes.h>
#include <string.h>

#include "common/error.h"
#include "shm/pool.h"
#include "shm/pool_internal.h"

/* ---- The lock, and the rebuild after a death under it -------------------- */

static int rebuild(struct shm_pool *p);

int pool_lock(struct shm_pool *p)
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

void pool_unlock(struct shm_pool *p)
{
	pthread_mutex_unlock(&p->hdr->lock.m);
}

/* Gives the records of a block back (off cleared first: see pool_meta). */
static int recs_free(struct shm_pool *p, uint32_t r, uint32_t o)
{
	struct buddy rb = pool_rec_buddy(p);

	for (uint32_t i = 0; i < (1u << o); i++) {
		atomic_store_explicit(&p->meta[r + i].off, 0, memory_order_relaxed);
		p->meta[r + i].next = 0;
	}
	return pool_buddy_free(&rb, r, o);
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
				pool_fmt_bytes((char[32]){ 0 }, class_size(k)), c, pv, nx, p->nchunks);
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
uint32_t pool_committed_in(struct shm_pool *p, uint32_t c, uint32_t n)
{
	uint32_t k = 0;

	for (uint32_t i = c; i < c + n; i++)
		k += atomic_load_explicit(&p->chunks[i].committed, memory_order_relaxed) != 0;
	return k;
}

void pool_set_committed(struct shm_pool *p, uint32_t c, uint32_t n, uint32_t v)
{
	for (uint32_t i = c; i < c + n; i++)
		atomic_store_explicit(&p->chunks[i].committed, v, memory_order_relaxed);
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
				c, pool_fmt_bytes((char[32]){ 0 }, class_size(k)), e);
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
	struct buddy cb = pool_chunk_buddy(p);
	int64_t r = slab_check(p, c, k);
	int err;

	if (r < 0)
		return (int)r;
	if ((err = partial_remove(p, k, c)))
		return err;
	add_slab_free(p, -(int64_t)POOL_CHUNK);
	add_retained(p, pool_committed_in(p, c, 1));
	p->chunks[c].nfree = p->chunks[c].free_head = 0;
	set_entry(p, c, 0);
	if ((err = recs_free(p, (uint32_t)r, (uint32_t)slab_nb_order(k))))
		return err;
	return pool_buddy_free(&cb, c, 0);
}

/* Gives back every empty slab (a large block found no room). How many. */
int pool_slabs_reclaim(struct shm_pool *p)
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
int pool_commit(struct shm_pool *p, uint64_t off, uint64_t len, uint64_t asked)
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
			    pool_fmt_bytes(b1, len), pool_fmt_bytes(b2, asked), strerror(err));
}

/* A small block of class k (under the lock): its record, or -errno. */
int64_t pool_small_alloc(struct shm_pool *p, uint32_t k)
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
				pool_fmt_bytes((char[32]){ 0 }, size), h, p->nchunks);
	if (!h) {
		/* A fresh slab: its records, its chunk, its memory. */
		struct buddy cb = pool_chunk_buddy(p), rb = pool_rec_buddy(p);
		int64_t r = pool_buddy_alloc(&rb, nbo), cc;

		if (r < 0)
			return r == -NO_SPACE ? -NO_RECORDS : r;
		cc = pool_buddy_alloc(&cb, 0);
		if (cc < 0) {
			recs_free(p, (uint32_t)r, nbo);
			return cc;
		}
		c = (uint32_t)cc;
		if (pool_committed_in(p, c, 1)) {
			add_retained(p, -1);
		} else if ((err = pool_commit(p, chunk_off(p, c), POOL_CHUNK, size))) {
			recs_free(p, (uint32_t)r, nbo);
			pool_buddy_free(&cb, c, 0);
			return err;
		} else {
			pool_set_committed(p, c, 1, 1);
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
				pool_fmt_bytes((char[32]){ 0 }, size), c);
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

	/* Release, after the slab's offs: as in pool_large_alloc (pool_ref). */
	atomic_store_explicit(&p->meta[idx].refs, 1, memory_order_release);
	add_slab_free(p, -(int64_t)size);
	if (--p->chunks[c].nfree == 0 && (err = partial_remove(p, k, c)))
		return err;
	return idx;
}

/* A large block of 2^o chunks (under the lock): its record, or -errno. */
int64_t pool_large_alloc(struct shm_pool *p, uint32_t o)
{
	struct buddy cb = pool_chunk_buddy(p), rb = pool_rec_buddy(p);
	int64_t c = pool_buddy_alloc(&cb, o), r;

	if (c < 0)
		return c;
	r = pool_buddy_alloc(&rb, 0);
	if (r < 0) {
		pool_buddy_free(&cb, (uint32_t)c, o);
		return r == -NO_SPACE ? -NO_RECORDS : r;
	}
	/* Its committed chunks are no longer free ones kept. */
	add_retained(p, -(int64_t)pool_committed_in(p, (uint32_t)c, 1u << o));
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
	if (!pool_entry_block(p, off, &at, &k, &bad) || at != idx)
		return bad ? POOL_BAD(p, SHM_CORRUPT_POOL_CHUNKS,
				      "the tensor pool's chunk table is corrupt: the entry of chunk "
				      "%u, where block record %u's block is, names no block the pool "
				      "can have" POOL_RESTART,
				      c, idx)
			   : 0;
	if (k >= LARGE_CLASS0) {
		struct buddy cb = pool_chunk_buddy(p);
		uint32_t o = k - LARGE_CLASS0;
		int err;

		set_entry(p, c, 0);
		/* Punched: nothing of it is committed; else its committed
		 * chunks are kept for the next blocks. */
		if (punched)
			pool_set_committed(p, c, 1u << o, 0);
		else
			add_retained(p, pool_committed_in(p, c, 1u << o));
		if ((err = recs_free(p, idx, 0)))
			return err;
		return pool_buddy_free(&cb, c, o);
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
int pool_block_drop(struct shm_pool *p, uint32_t idx, uint32_t n, bool punch)
{
	_Atomic uint32_t *refs = &p->meta[idx].refs;
	uint32_t r = atomic_load_explicit(refs, memory_order_acquire), k;
	bool punched;
	int err;

	/* Its class while our references keep the record this block's. */
	k = pool_block_class(p, idx);
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
		   << POOL_CHUNK_SHIFT) + class_size(k) > p->retain &&
		  fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
			    (off_t)atomic_load_explicit(&p->meta[idx].off, memory_order_relaxed),
			    (off_t)class_size(k)) == 0;
	if ((err = pool_lock(p)))
		return err;
	err = block_free_locked(p, idx, punched);
	pool_unlock(p);
	return err;
}

/* Hands b every run of entries that used[0..n) marks unused. */
static void free_unused(const struct buddy *b, const uint8_t *used, uint32_t n)
{
	for (uint32_t at = 0; at < n;) {
		uint32_t end = at;

		while (end < n && !used[end])
			end++;
		pool_buddy_free_range(b, at, end);
		while (end < n && used[end])
			end++;
		at = end;
	}
}

/*
 * After a death under the lock: every list rebuilt from the blocks (see the
 * comment at the top of this section). Records first: a chunk entry counts
 * only if the records it names name it back.
 */
static int rebuild(struct shm_pool *p)
{
	struct buddy cb = pool_chunk_buddy(p), rb = pool_rec_buddy(p);
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
	free_unused(&cb, cused, p->nchunks);
	free_unused(&rb, rused, p->max_blocks);
	free(cused);
	free(rused);
	return 0;
}
