/* The tensor pool's holders: per-rank records of references, sweeps,
 * join and leave (see pool_internal.h). */
#include <errno.h>
#include <inttypes.h>
#include <unistd.h>

#include "common/error.h"
#include "shm/pool.h"
#include "shm/pool_internal.h"

/* ---- Holders: per-rank records of references ------------------------------ */


/* The generation tag of rank's live holder, or -EINVAL. */
int pool_holder_tag(struct shm_pool *p, uint32_t rank, uint32_t *tag)
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
int pool_record(struct shm_pool *p, uint32_t rank, uint32_t tag, uint32_t idx)
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

int pool_unrecord(struct shm_pool *p, uint32_t rank, uint32_t tag, uint32_t idx)
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
			if ((derr = pool_block_drop(p, idx, entry_count(w), punch)) < 0)
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
	int err = pool_holder_tag(p, rank, &tag);

	if (err)
		return err;
	return sweep(p, rank,
		     life_gen(atomic_load_explicit(&p->holders[rank].life, memory_order_acquire)),
		     false);
}
