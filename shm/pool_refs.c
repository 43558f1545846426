/* The tensor pool's references (pool_alloc, pool_ref, pool_unref) and
 * statistics (see pool_internal.h). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "shmrpc.h"
#include "common/error.h"
#include "shm/pool.h"
#include "shm/pool_internal.h"

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
				    pool_fmt_bytes(b[0], bytes), p->max_blocks, pool_fmt_bytes(b[1], st.size),
				    pool_fmt_bytes(b[2], st.used), pool_fmt_bytes(b[3], st.largest_free),
				    p->max_blocks >= (1u << 31) ? POOL_MAX_BLOCKS : p->max_blocks * 2);
	return shmrpc__fail(-ENOMEM,
			    "tensor pool exhausted: asked %s (a %s block), pool %s, %s in use, "
			    "largest free block %s; run the job with a larger pool: shmrun "
			    "--pool-size %s",
			    pool_fmt_bytes(b[0], bytes),
			    pool_fmt_bytes(b[4], k < POOL_NCLASS ? class_size(k) : bytes),
			    pool_fmt_bytes(b[1], st.size), pool_fmt_bytes(b[2], st.used),
			    pool_fmt_bytes(b[3], st.largest_free),
			    pool_fmt_size_flag(b[5], k < POOL_NCLASS && class_size(k) > st.size - st.used ?
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
		idx = k < LARGE_CLASS0 ? pool_small_alloc(p, k) : pool_large_alloc(p, k - LARGE_CLASS0);
		if ((idx != -NO_SPACE && idx != -NO_RECORDS) || !pool_slabs_reclaim(p))
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
	int err = pool_healthy(p) ?: pool_holder_tag(p, rank, &tag);

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
	if (pool_block_class(p, (uint32_t)idx) != k) {
		err = POOL_BAD(p, SHM_CORRUPT_POOL_RECORDS,
			       "the tensor pool's block record %" PRId64 " is corrupt: it was "
			       "handed out at offset %" PRIu64 ", where the chunk table has no "
			       "block of %s" POOL_RESTART,
			       idx, *off, pool_fmt_bytes((char[32]){ 0 }, class_size(k)));
		*off = 0;
		return err;
	}
	err = pool_record(p, rank, tag, (uint32_t)idx);
	if (err) {
		pool_block_drop(p, (uint32_t)idx, 1, true);
		return err;
	}
	/* A large block's memory is committed now, outside the lock and once
	 * recorded (a death in the system call leaks nothing): the chunks
	 * asked for, not the whole class, and none when they all still are (a
	 * slab was committed when carved). */
	if (k >= LARGE_CLASS0) {
		uint32_t c = (uint32_t)((*off - p->data_off) >> POOL_CHUNK_SHIFT);
		uint32_t n = (uint32_t)((bytes + POOL_CHUNK - 1) >> POOL_CHUNK_SHIFT);

		if (pool_committed_in(p, c, n) == n)
			return 0;
		if ((err = pool_commit(p, *off, (uint64_t)n << POOL_CHUNK_SHIFT, bytes))) {
			char msg[512];

			snprintf(msg, sizeof(msg), "%s", shmrpc_errmsg());
			if (pool_unrecord(p, rank, tag, (uint32_t)idx) == 0)
				pool_block_drop(p, (uint32_t)idx, 1, true);
			return shmrpc__fail(err, "%s", msg);
		}
		pool_set_committed(p, c, n, 1);
	}
	return 0;
}

int pool_ref(struct shm_pool *p, uint32_t rank, uint64_t off)
{
	uint32_t tag, idx, k, r;
	_Atomic uint32_t *refs;
	int err = pool_healthy(p) ?: pool_holder_tag(p, rank, &tag);

	if (err || (err = pool_block_at(p, off, &idx, &k)))
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
	 * pool_block_at and the CAS (records move: a slab's go back when it is
	 * empty): check that it is still the block at off. If not, the count
	 * we added is to that other block, which it keeps live for an instant:
	 * drop it again, and off was freed (the caller's stale offset). */
	if (atomic_load_explicit(&p->meta[idx].off, memory_order_acquire) != off ||
	    pool_block_class(p, idx) != k) {
		pool_block_drop(p, idx, 1, true);
		return shmrpc__fail(-EINVAL,
				    "the pool block at offset %" PRIu64 " is free: no "
				    "reference can be taken",
				    off);
	}
	err = pool_record(p, rank, tag, idx);
	if (err)
		pool_block_drop(p, idx, 1, true);
	return err;
}

int pool_unref(struct shm_pool *p, uint32_t rank, uint64_t off)
{
	uint32_t tag, idx, k;
	int err = pool_holder_tag(p, rank, &tag);

	if (err || (err = pool_block_at(p, off, &idx, &k)))
		return err;
	if (atomic_load_explicit(&p->meta[idx].refs, memory_order_acquire) == 0)
		return shmrpc__fail(-EINVAL, "the pool block at offset %" PRIu64 " is already free",
				    off);
	err = pool_unrecord(p, rank, tag, idx);
	return err ? err : pool_block_drop(p, idx, 1, true);
}

int64_t pool_block_size(struct shm_pool *p, uint64_t off)
{
	uint32_t idx, k;
	int err = pool_block_at(p, off, &idx, &k);

	if (err)
		return err;
	if (atomic_load_explicit(&p->meta[idx].refs, memory_order_acquire) == 0)
		return shmrpc__fail(-EINVAL, "the pool block at offset %" PRIu64 " is free", off);
	return (int64_t)class_size(k);
}

int64_t pool_block_refs(struct shm_pool *p, uint64_t off)
{
	uint32_t idx, k, r;
	int err = pool_block_at(p, off, &idx, &k);

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
	int err = pool_block_at(p, off, &idx, &k);

	if (err)
		return err;
	if (pool_holder_tag(p, rank, &tag))
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

		if (!r || (k = pool_block_class(p, i)) >= POOL_NCLASS)
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
