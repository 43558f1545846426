/*
 * The RRef table (rref_table.h): creation, attach, and the atomic steps.
 *
 * Why removal is safe without a lock: an entry is removed only once total
 * is 0, and total never rises from 0 (only a holder makes a reference), so
 * no one can be using it. The remover empties the state first and the key
 * last (release), and the key's CAS from id to TOMB succeeds once: two
 * processes that both see "unreferenced and owner dead" cannot both free
 * it. A creator that takes the slot again (CAS TOMB -> new id, acquire)
 * sees the zeroed fields.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older glibc headers lack it */
#endif

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "shm/attach.h"
#include "shm/corrupt.h"
#include "shm/memfd.h"
#include "shm/rref_table.h"

struct shape {
	uint32_t capacity, entry_size;
	uint64_t heads_off, slots_off, total;
};

static bool table_shape(uint32_t max_rrefs, uint32_t world, struct shape *s)
{
	uint32_t cap = 16;

	if (!max_rrefs || max_rrefs > RREF_MAX_RREFS || !world || world > RREF_MAX_WORLD)
		return false;
	while (cap < 2 * (uint64_t)max_rrefs)
		cap <<= 1;
	s->capacity = cap;
	s->entry_size = (uint32_t)((sizeof(struct rref_entry) + 4u * world + 63) & ~63u);
	s->heads_off = RREF_TABLE_PAGE;
	s->slots_off = s->heads_off + ((4u * world + RREF_TABLE_PAGE - 1) & ~(RREF_TABLE_PAGE - 1));
	s->total = s->slots_off + (uint64_t)cap * s->entry_size;
	return true;
}

uint64_t rref_table_bytes(const struct rref_table_params *params)
{
	struct shape s;

	return table_shape(params->max_rrefs ? params->max_rrefs : RREF_DEFAULT_MAX_RREFS,
			   params->world, &s) ? s.total : 0;
}

static void table_fill(struct rref_table *t, const struct shape *s, uint32_t max_rrefs,
		       uint32_t world)
{
	t->hdr = (struct rref_table_header *)t->base;
	t->size = s->total;
	t->capacity = s->capacity;
	t->max_rrefs = max_rrefs;
	t->world = world;
	t->entry_size = s->entry_size;
	t->heads = (_Atomic uint32_t *)(t->base + s->heads_off);
	t->slots = t->base + s->slots_off;
}

int rref_table_create(struct rref_table *t, const struct rref_table_params *params)
{
	uint32_t max = params->max_rrefs ? params->max_rrefs : RREF_DEFAULT_MAX_RREFS;
	struct rref_table_header *h;
	struct shape s;
	char what[96];
	void *mem;
	int fd, err;

	memset(t, 0, sizeof(*t));
	t->fd = -1;
	if (!table_shape(max, params->world, &s))
		return shmrpc__fail(-EINVAL, "cannot make an RRef table for %u RRefs and %u workers: "
				    "RRefs 1..%u, workers 1..%u", max, params->world,
				    RREF_MAX_RREFS, RREF_MAX_WORLD);
	snprintf(what, sizeof(what), "the RRef table (%u RRefs, %u workers)", max, params->world);
	err = shm_memfd_create("shmrpc-rrefs", s.total, what, "--max-rrefs", &fd, &mem);
	if (err)
		return err;
	t->base = mem;
	t->fd = fd;
	table_fill(t, &s, max, params->world);
	/* The creator (the launcher) walks the whole table when a worker
	 * ends, before it may say so: its page faults now, not then (about
	 * 50 ms for 16 MiB on a 2-core VM). Best effort: kernel >= 5.14. */
	madvise(mem, s.total, MADV_POPULATE_WRITE);
	/* The memfd reads as zeros: every slot starts unused. */
	h = t->hdr;
	h->magic = RREF_TABLE_MAGIC;
	h->format_version = RREF_TABLE_FORMAT_VERSION;
	h->header_size = sizeof(*h);
	h->total_size = s.total;
	h->heads_off = s.heads_off;
	h->slots_off = s.slots_off;
	h->capacity = s.capacity;
	h->max_rrefs = max;
	h->world = params->world;
	h->entry_size = s.entry_size;
	h->created_ns = shmrpc_realtime_ns();
	h->creator_pid = (uint32_t)getpid();
	return 0;
}

static const struct shm_file_kind table_kind = { "RRef table", RREF_TABLE_MAGIC,
						  RREF_TABLE_FORMAT_VERSION,
						  sizeof(struct rref_table_header) };

int rref_table_attach_fd(struct rref_table *t, int fd, bool readonly)
{
	struct rref_table_header h;
	uint64_t file_size;
	struct shape s;
	int err;

	memset(t, 0, sizeof(*t));
	t->fd = -1;
	if ((err = shm_attach_header(fd, &table_kind, &h, &file_size)))
		return err;
	if (!table_shape(h.max_rrefs, h.world, &s) || s.capacity != h.capacity ||
	    s.entry_size != h.entry_size || s.heads_off != h.heads_off ||
	    s.slots_off != h.slots_off || s.total != h.total_size)
		return shm_attach_inconsistent(&table_kind, "%u RRefs, %u workers", h.max_rrefs,
					       h.world);
	if ((err = shm_attach_map(fd, &table_kind, h.total_size, file_size, readonly, &t->base)))
		return err;
	t->fd = fd;
	table_fill(t, &s, h.max_rrefs, h.world);
	return 0;
}

void rref_table_detach(struct rref_table *t)
{
	if (t->base)
		munmap(t->base, t->size);
	if (t->fd >= 0)
		close(t->fd);
	t->base = NULL;
	t->hdr = NULL;
	t->fd = -1;
}

static uint32_t home_of(const struct rref_table *t, uint64_t id)
{
	return (uint32_t)XXH3_64bits(&id, sizeof(id)) & (t->capacity - 1);
}

/* w with its state replaced: the incarnation stays. */
static uint32_t with_state(uint32_t w, uint32_t st)
{
	return (w & ~0xffu) | st;
}

static void wake_all(struct rref_entry *e)
{
	/* seq_cst RMW (not a fence: TSan has none): after our seq_cst change
	 * of the state; pairs with the waiter's seq_cst waiters++ before its
	 * seq_cst re-read of the state. One of the two sees the other. */
	if (atomic_fetch_add_explicit(&e->waiters, 0, memory_order_seq_cst))
		syscall(SYS_futex, &e->state, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Takes slot s for id if it is free (0 or TOMB), as rref_insert says. */
static bool claim(struct rref_table *t, uint32_t s, uint64_t id, uint32_t owner,
		  uint32_t creator, uint32_t flags)
{
	struct rref_entry *e = rref_entry_at(t, s);
	uint64_t k = atomic_load_explicit(&e->key, memory_order_relaxed);
	uint32_t w;

	/* Acquire: pairs with the remover's release of TOMB (its zeroed
	 * fields are visible before ours are written). */
	if ((k != 0 && k != RREF_TOMB) ||
	    !atomic_compare_exchange_strong_explicit(&e->key, &k, id, memory_order_acquire,
						     memory_order_relaxed))
		return false;
	/* Release fence: the key's change before any field below, for
	 * rref_info_at, whose acquire fence pairs with it: a reader that
	 * loads one of these stores then sees the key no longer its id. */
	atomic_thread_fence(memory_order_release);
	atomic_store_explicit(&e->owner, owner, memory_order_relaxed);
	atomic_store_explicit(&e->creator, creator, memory_order_relaxed);
	atomic_store_explicit(&e->flags, flags, memory_order_relaxed);
	atomic_store_explicit(&e->created_ns, shmrpc_now_ns(), memory_order_relaxed);
	atomic_store_explicit(&e->value_off, 0, memory_order_relaxed);
	atomic_store_explicit(&e->value_len, 0, memory_order_relaxed);
	/* Relaxed: published with the state store below. */
	atomic_store_explicit(&e->total, 2, memory_order_relaxed);
	atomic_fetch_add_explicit(&e->counts[creator], 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&e->counts[owner], 1, memory_order_relaxed);
	/* The next incarnation of the slot. Release: the fields above before
	 * the entry counts as live; pairs with the acquire loads of state by
	 * readers. */
	w = atomic_load_explicit(&e->state, memory_order_relaxed);
	atomic_store_explicit(&e->state, ((w >> 8) + 1) << 8 | RREF_PENDING, memory_order_release);
	return true;
}

int rref_insert(struct rref_table *t, uint64_t id, uint32_t owner, uint32_t creator,
		uint32_t flags, uint32_t *slot)
{
	uint32_t mask = t->capacity - 1, s, hint;

	if (!RREF_KEY_LIVE(id) || owner >= t->world || creator >= t->world)
		return shmrpc__fail(-EINVAL, "bad RRef id %#" PRIx64 " or rank (owner %u, creator "
				    "%u) for a table of %u workers", id, owner, creator, t->world);
	/* Relaxed: a bound on the count; the slot's CAS orders the entry. */
	if (atomic_fetch_add_explicit(&t->hdr->live, 1, memory_order_relaxed) >= t->max_rrefs) {
		atomic_fetch_sub_explicit(&t->hdr->live, 1, memory_order_relaxed);
		return shmrpc__fail(-ENOSPC, "the RRef table is full: %u RRefs are alive; delete "
				    "some, or run the job with more: shmrun --max-rrefs %u",
				    t->max_rrefs,
				    t->max_rrefs >= RREF_MAX_RREFS / 2 ? RREF_MAX_RREFS : 2 * t->max_rrefs);
	}
	/* Relaxed: a hint; the slot's CAS decides. Taken, so that two
	 * threads do not both start there. */
	hint = atomic_exchange_explicit(&t->freed_hint, 0, memory_order_relaxed);
	if (hint && hint <= t->capacity && claim(t, hint - 1, id, owner, creator, flags)) {
		*slot = hint - 1;
		return 0;
	}
	s = home_of(t, id);
	for (uint32_t probe = 0; probe < t->capacity; probe++, s = (s + 1) & mask) {
		if (claim(t, s, id, owner, creator, flags)) {
			*slot = s;
			return 0;
		}
	}
	/* Cannot happen while live <= max_rrefs <= capacity / 2. */
	atomic_fetch_sub_explicit(&t->hdr->live, 1, memory_order_relaxed);
	return shmrpc__fail(-ENOSPC, "the RRef table has no free slot (%u slots)", t->capacity);
}

int rref_find(const struct rref_table *t, uint64_t id, uint32_t *slot)
{
	uint32_t mask = t->capacity - 1, s = home_of(t, id);

	for (uint32_t probe = 0; probe < t->capacity; probe++, s = (s + 1) & mask) {
		/* Acquire: pairs with the creator's CAS; state is checked after. */
		uint64_t k = atomic_load_explicit(&rref_entry_at(t, s)->key, memory_order_acquire);

		if (k == id && id) {
			*slot = s;
			return 0;
		}
	}
	return -ENOENT;
}

/* An entry (or a collect list: bit) found corrupt: noted for this
 * process's report; -SHMRPC_ECORRUPT with the sentence. */
#define TABLE_BAD(t, bit, ...) shm_corrupt((t)->corrupt_note, NULL, (bit), __VA_ARGS__)

static int gone(uint32_t slot, uint64_t id)
{
	return shmrpc__fail(-ENOENT, "RRef %" PRIu64 ":%" PRIu64 " is not in the RRef table "
			    "(slot %u): it was deleted", (uint64_t)RREF_ID_RANK(id),
			    (uint64_t)RREF_ID_LOCAL(id), slot);
}

/*
 * The entry at slot if it holds id (and is not being filled or emptied):
 * 0 and *out, -ENOENT, or -SHMRPC_ECORRUPT when what a live entry must
 * be (a state the table knows, an owner of the job) does not hold.
 */
static int entry_of(const struct rref_table *t, uint32_t slot, uint64_t id,
		    struct rref_entry **out)
{
	struct rref_entry *e;
	uint32_t st, owner;

	if (slot >= t->capacity)
		return gone(slot, id);
	e = rref_entry_at(t, slot);
	/* Acquire on both: pairs with the creator's release of state. */
	if (atomic_load_explicit(&e->key, memory_order_acquire) != id)
		return gone(slot, id);
	st = RREF_STATE(atomic_load_explicit(&e->state, memory_order_acquire));
	if (st == RREF_FREE)
		return gone(slot, id);
	/* Relaxed: ordered by the acquire of state. */
	owner = atomic_load_explicit(&e->owner, memory_order_relaxed);
	if (st > RREF_OWNER_DEAD || owner >= t->world)
		return TABLE_BAD(t, SHM_CORRUPT_RREF_ENTRIES,
				 "the RRef table's entry of RRef %" PRIu64 ":%" PRIu64 " (slot %u) "
				 "is corrupt: state %u, owner %u of %u workers; the RRef cannot be "
				 "used (the job's memory was written outside shmrpc)",
				 (uint64_t)RREF_ID_RANK(id), (uint64_t)RREF_ID_LOCAL(id), slot, st,
				 owner, t->world);
	*out = e;
	return 0;
}

/* entry_of, for a count of rank's. */
static int entry_of_rank(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t rank,
			 struct rref_entry **out)
{
	int rc = entry_of(t, slot, id, out);

	if (rc == 0 && rank >= t->world)
		rc = shmrpc__fail(-EINVAL, "no rank %u in an RRef table of %u workers", rank,
				  t->world);
	return rc;
}

int rref_hold(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t rank, uint32_t n)
{
	struct rref_entry *e;
	int rc = entry_of_rank(t, slot, id, rank, &e);

	if (rc)
		return rc;
	/* total before the count: sum(counts) <= total whenever we stop.
	 * seq_cst: a sender charging a receiver then checks that the receiver
	 * lives; the launcher marks it dead then sweeps (rref_sweep_rank). */
	atomic_fetch_add_explicit(&e->total, n, memory_order_seq_cst);
	atomic_fetch_add_explicit(&e->counts[rank], n, memory_order_seq_cst);
	return 0;
}

/* Removes e (which held id) once: the key's CAS to REMOVING decides who;
 * only the winner empties the slot, then frees it. */
static bool remove_entry(struct rref_table *t, struct rref_entry *e, uint64_t id)
{
	uint64_t k = id;
	uint32_t w;

	/* acq_rel: after every use of the entry; before the emptying. */
	if (!atomic_compare_exchange_strong_explicit(&e->key, &k, RREF_REMOVING,
						     memory_order_acq_rel, memory_order_relaxed))
		return false;
	w = atomic_load_explicit(&e->state, memory_order_relaxed);
	/* Relaxed: published by the release of TOMB, which an insert acquires. */
	atomic_store_explicit(&e->state, with_state(w, RREF_FREE), memory_order_relaxed);
	atomic_store_explicit(&e->key, RREF_TOMB, memory_order_release);
	atomic_fetch_sub_explicit(&t->hdr->live, 1, memory_order_relaxed);
	/* Relaxed: a hint (rref_table.freed_hint). */
	atomic_store_explicit(&t->freed_hint,
			      (uint32_t)(((uint8_t *)e - t->slots) / t->entry_size) + 1,
			      memory_order_relaxed);
	return true;
}

/* total fell to 0 at e: hand it to its owner, or remove it if the owner is
 * dead, or if a live worker's drop (live) finds nothing of its value kept
 * by the owner (RREF_VALUE_ALONE). */
static int unreferenced(struct rref_table *t, struct rref_entry *e, uint64_t id, bool live)
{
	/* Acquire: the owner's value fields, for the owner that frees them. */
	uint32_t w = atomic_load_explicit(&e->state, memory_order_acquire);

	for (;;) {
		uint32_t st = RREF_STATE(w);

		if (st == RREF_OWNER_DEAD)
			return remove_entry(t, e, id) ? 2 : 0;
		if (st != RREF_READY && st != RREF_ERROR && st != RREF_PENDING)
			return 0; /* already handed over or removed */
		/* seq_cst: against the owner sweep's CAS to OWNER_DEAD. */
		if (atomic_compare_exchange_weak_explicit(&e->state, &w,
							  with_state(w, RREF_UNREFERENCED),
							  memory_order_seq_cst,
							  memory_order_acquire)) {
			wake_all(e);
			break;
		}
	}
	/* Relaxed: the owner's store wrote it before READY/ERROR (our
	 * acquire of the state), and nobody changes it after. Only the bit and the inline
	 * mark together: a block value is always the owner's to free. */
	if (live && (atomic_load_explicit(&e->value_len, memory_order_relaxed) &
		     (RREF_VALUE_ALONE | RREF_VALUE_INLINE)) ==
			    (RREF_VALUE_ALONE | RREF_VALUE_INLINE))
		return remove_entry(t, e, id) ? 2 : 0;
	return 1;
}

/* live: a live worker drops its own references (rref_release), not a
 * sweep those of a dead one. */
static int drop(struct rref_table *t, struct rref_entry *e, uint64_t id, uint32_t n, bool live)
{
	/* acq_rel: every holder's use of the value happens before the last
	 * drop, which the owner's free follows. A CAS, not a subtraction:
	 * a total below the counts (corrupt) is refused, never wrapped. */
	uint32_t before = atomic_load_explicit(&e->total, memory_order_relaxed);

	do {
		if (before < n)
			return TABLE_BAD(t, SHM_CORRUPT_RREF_ENTRIES,
					 "the RRef table's entry of RRef %" PRIu64 ":%" PRIu64
					 " is corrupt: %u references are dropped and its total "
					 "is %u; the RRef cannot be used (the job's memory was "
					 "written outside shmrpc)",
					 (uint64_t)RREF_ID_RANK(id), (uint64_t)RREF_ID_LOCAL(id), n,
					 before);
	} while (!atomic_compare_exchange_weak_explicit(&e->total, &before, before - n,
							memory_order_acq_rel, memory_order_relaxed));
	return before == n ? unreferenced(t, e, id, live) : 0;
}

int rref_release(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t rank, uint32_t n)
{
	struct rref_entry *e;
	uint32_t c;
	int rc = entry_of_rank(t, slot, id, rank, &e);

	if (rc)
		return rc;
	/* The count before total (see rref_hold); never below zero. */
	c = atomic_load_explicit(&e->counts[rank], memory_order_relaxed);
	do {
		if (c < n)
			return shmrpc__fail(-EINVAL, "rank %u drops %u references to RRef %"
					    PRIx64 " and holds %u", rank, n, id, c);
	} while (!atomic_compare_exchange_weak_explicit(&e->counts[rank], &c, c - n,
							memory_order_seq_cst, memory_order_relaxed));
	return drop(t, e, id, n, true);
}

int rref_store(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t state,
	       uint64_t value_off, uint64_t value_len)
{
	struct rref_entry *e;
	uint32_t w;
	int rc = entry_of(t, slot, id, &e);

	if (rc)
		return rc;
	if (state != RREF_READY && state != RREF_ERROR)
		return shmrpc__fail(-EINVAL, "an RRef stores a value or an error, not state %u",
				    state);
	/* Refused before the value is written: holders of a stored value read
	 * it. Only the owner leaves PENDING for READY/ERROR, so a pending entry
	 * stays so until the CAS, or becomes OWNER_DEAD (whose value no one reads). */
	w = atomic_load_explicit(&e->state, memory_order_relaxed);
	if (RREF_STATE(w) == RREF_PENDING) {
		atomic_store_explicit(&e->value_off, value_off, memory_order_relaxed);
		atomic_store_explicit(&e->value_len, value_len, memory_order_relaxed);
	}
	/* seq_cst (release at least): the value before the state that says it
	 * is there; pairs with readers' acquire. Fails if the owner was swept. */
	if (RREF_STATE(w) != RREF_PENDING ||
	    !atomic_compare_exchange_strong_explicit(&e->state, &w, with_state(w, state),
						     memory_order_seq_cst, memory_order_relaxed))
		return shmrpc__fail(-EINVAL, "RRef %" PRIx64 " is %s, not pending: it has a value "
				    "already", id, rref_state_name(RREF_STATE(w)));
	wake_all(e);
	/* Relaxed: ordered by entry_of's acquire of state. */
	return rref_release(t, slot, id, atomic_load_explicit(&e->owner, memory_order_relaxed), 1);
}

int rref_wait(struct rref_table *t, uint32_t slot, uint64_t id, uint64_t deadline_ns)
{
	struct rref_entry *e;
	int rc = entry_of(t, slot, id, &e);

	if (rc)
		return rc;
	for (;;) {
		/* Acquire: pairs with rref_store's release of the state. */
		uint32_t w = atomic_load_explicit(&e->state, memory_order_acquire);
		struct timespec ts;

		if (RREF_STATE(w) > RREF_OWNER_DEAD)
			return TABLE_BAD(t, SHM_CORRUPT_RREF_ENTRIES,
					 "the RRef table's entry of RRef %" PRIu64 ":%" PRIu64
					 " is corrupt: state %u; the RRef cannot be used (the "
					 "job's memory was written outside shmrpc)",
					 (uint64_t)RREF_ID_RANK(id), (uint64_t)RREF_ID_LOCAL(id),
					 RREF_STATE(w));
		if (RREF_STATE(w) != RREF_PENDING)
			return (int)RREF_STATE(w);
		if (deadline_ns && shmrpc_now_ns() >= deadline_ns)
			return -ETIMEDOUT;
		/* seq_cst both: pairs with wake_all. */
		atomic_fetch_add_explicit(&e->waiters, 1, memory_order_seq_cst);
		if (atomic_load_explicit(&e->state, memory_order_seq_cst) == w) {
			ts.tv_sec = (time_t)(deadline_ns / 1000000000u);
			ts.tv_nsec = (long)(deadline_ns % 1000000000u);
			/* BITSET: an absolute CLOCK_MONOTONIC deadline. */
			syscall(SYS_futex, &e->state, FUTEX_WAIT_BITSET, w, deadline_ns ? &ts : NULL,
				NULL, FUTEX_BITSET_MATCH_ANY);
		}
		atomic_fetch_sub_explicit(&e->waiters, 1, memory_order_relaxed);
	}
}

int rref_remove(struct rref_table *t, uint32_t slot, uint64_t id)
{
	struct rref_entry *e;
	int rc = entry_of(t, slot, id, &e);

	if (rc)
		return rc;
	/* Acquire: pairs with the last drop (unreferenced's CAS). */
	if (RREF_STATE(atomic_load_explicit(&e->state, memory_order_acquire)) != RREF_UNREFERENCED)
		return shmrpc__fail(-EBUSY, "RRef %" PRIx64 " still has references", id);
	return remove_entry(t, e, id) ? 0 : gone(slot, id);
}

bool rref_collect_push(struct rref_table *t, uint32_t slot)
{
	struct rref_entry *e = rref_entry_at(t, slot);
	_Atomic uint32_t *head;
	uint32_t first, owner;

	/* Its owner was checked when it was found, but it is shared memory:
	 * an owner beyond the job's would index past the heads. Not pushed,
	 * the entry is leaked (and the job marked unhealthy). Read once.
	 * Relaxed: an unreferenced entry's owner no longer changes. */
	owner = slot < t->capacity ? atomic_load_explicit(&e->owner, memory_order_relaxed) : 0;
	if (slot >= t->capacity || owner >= t->world) {
		TABLE_BAD(t, SHM_CORRUPT_RREF_ENTRIES,
			  "the RRef table's entry at slot %u is corrupt: owner %u of %u workers",
			  slot, owner, t->world);
		return false;
	}
	head = &t->heads[owner];
	/* Relaxed: the CAS below publishes the link. */
	first = atomic_load_explicit(head, memory_order_relaxed);

	do
		atomic_store_explicit(&e->collect_next, first, memory_order_relaxed);
	/* seq_cst (release at least): the link (and our drop before it)
	 * before the owner's exchange in rref_collect_take; seq_cst for the
	 * agent's job flag (worker/agent.c, run_collect). */
	while (!atomic_compare_exchange_weak_explicit(head, &first, slot + 1, memory_order_seq_cst,
						      memory_order_relaxed));
	return first == 0;
}

bool rref_collect_pending(const struct rref_table *t, uint32_t rank)
{
	/* seq_cst: a hint for what to take (the take orders the links), in
	 * one order with the agent's job flag (worker/agent.c, run_collect). */
	return rank < t->world && atomic_load_explicit(&t->heads[rank], memory_order_seq_cst);
}

uint32_t rref_collect_take(struct rref_table *t, uint32_t rank)
{
	/* seq_cst (acquire at least): pairs with the pushers' CAS: their
	 * links; see rref_collect_pending. */
	return rank < t->world ? atomic_exchange_explicit(&t->heads[rank], 0, memory_order_seq_cst)
			       : 0;
}

uint32_t rref_collect_next(const struct rref_table *t, uint32_t slot)
{
	uint32_t next, owner;
	struct rref_entry *n;

	if (slot >= t->capacity)
		return 0;
	/* Relaxed: ordered by the take's acquire (the pushers' release). */
	next = atomic_load_explicit(&rref_entry_at(t, slot)->collect_next, memory_order_relaxed);
	if (!next)
		return 0;
	/* Every entry of a taken list is UNREFERENCED, of the list's owner,
	 * until that owner removes it (after reading its link): a link to
	 * anything else is corrupt, or loops back to an entry already freed. */
	/* Relaxed: ordered by the take's acquire, and by n's state below. */
	owner = atomic_load_explicit(&rref_entry_at(t, slot)->owner, memory_order_relaxed);
	n = next <= t->capacity ? rref_entry_at(t, next - 1) : NULL;
	if (!n || !RREF_KEY_LIVE(atomic_load_explicit(&n->key, memory_order_acquire)) ||
	    RREF_STATE(atomic_load_explicit(&n->state, memory_order_acquire)) !=
		    RREF_UNREFERENCED ||
	    atomic_load_explicit(&n->owner, memory_order_relaxed) != owner) {
		TABLE_BAD(t, SHM_CORRUPT_RREF_COLLECT,
			  "the RRef table's collect list of worker %u is corrupt: slot %u links "
			  "to %u, not an unreferenced entry of it (the rest of the list is "
			  "leaked)", owner, slot, next);
		return 0;
	}
	return next;
}

int rref_sweep_entry(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t rank)
{
	struct rref_entry *e;
	uint32_t n;
	int rc = entry_of(t, slot, id, &e);

	if (rc || rank >= t->world)
		return rc == -ENOENT ? 0 : rc;
	/* seq_cst: see rref_hold. Exchange: each reference is taken once. */
	n = atomic_exchange_explicit(&e->counts[rank], 0, memory_order_seq_cst);
	return n ? drop(t, e, id, n, false) : 0;
}

/* e (which held id, owned by a dead rank, state word w read while its key
 * was id) becomes OWNER_DEAD, or goes if nothing references it. A CAS
 * that meets another incarnation of the slot stops: that RRef is not ours
 * to mark. */
static int owner_dead(struct rref_table *t, struct rref_entry *e, uint64_t id, uint32_t w)
{
	uint32_t born = w >> 8;
	int n = 0;

	while (RREF_STATE(w) == RREF_PENDING || RREF_STATE(w) == RREF_READY ||
	       RREF_STATE(w) == RREF_ERROR) {
		/* seq_cst: against unreferenced()'s CAS. */
		if (atomic_compare_exchange_weak_explicit(&e->state, &w,
							  with_state(w, RREF_OWNER_DEAD),
							  memory_order_seq_cst,
							  memory_order_acquire)) {
			wake_all(e);
			w = with_state(w, RREF_OWNER_DEAD);
			n = 1;
		} else if (w >> 8 != born) {
			return 0;
		}
	}
	/* Handed to the dead owner, or dead with nothing left: gone (the
	 * key's CAS in remove_entry checks it is still id). */
	if (RREF_STATE(w) == RREF_UNREFERENCED ||
	    (RREF_STATE(w) == RREF_OWNER_DEAD &&
	     !atomic_load_explicit(&e->total, memory_order_seq_cst)))
		remove_entry(t, e, id);
	return n;
}

int rref_mark_owner_dead(struct rref_table *t, uint32_t slot, uint64_t id)
{
	struct rref_entry *e;
	int rc = entry_of(t, slot, id, &e);

	if (rc)
		return rc == -ENOENT ? 0 : rc;
	/* Acquire: pairs with the state's release stores. */
	return owner_dead(t, e, id, atomic_load_explicit(&e->state, memory_order_acquire));
}

int rref_sweep_rank(struct rref_table *t, uint32_t rank)
{
	uint64_t n = 0; /* counts are 32-bit each: a sum of them overflows an int */
	int err = 0, rc;

	if (rank >= t->world)
		return shmrpc__fail(-EINVAL, "no rank %u in an RRef table of %u workers", rank,
				    t->world);
	/* Relaxed: a job without RRefs pays no walk; an entry made after
	 * this load is covered by the next sweep (see the header). */
	if (!atomic_load_explicit(&t->hdr->live, memory_order_relaxed))
		return 0;
	for (uint32_t s = 0; s < t->capacity; s++) {
		struct rref_entry *e = rref_entry_at(t, s);
		uint64_t id = atomic_load_explicit(&e->key, memory_order_acquire);
		uint32_t w, c, owner;

		if (!RREF_KEY_LIVE(id))
			continue;
		/* The state word of the incarnation that holds id: read, then
		 * the key again (ids are never reused). Acquire: a filled
		 * entry's fields, owner among them. */
		w = atomic_load_explicit(&e->state, memory_order_acquire);
		if (atomic_load_explicit(&e->key, memory_order_acquire) != id ||
		    RREF_STATE(w) == RREF_FREE)
			continue;
		/* Relaxed: ordered by the acquire of state. */
		owner = atomic_load_explicit(&e->owner, memory_order_relaxed);
		if (RREF_STATE(w) > RREF_OWNER_DEAD || owner >= t->world) {
			err = TABLE_BAD(t, SHM_CORRUPT_RREF_ENTRIES,
					"the RRef table's entry at slot %u is corrupt: state %u, "
					"owner %u of %u workers (the sweep of worker %u skipped it)",
					s, RREF_STATE(w), owner, t->world, rank);
			continue;
		}
		if (owner == rank)
			owner_dead(t, e, id, w);
		/* seq_cst: see rref_hold. Exchange: each reference is taken
		 * once. A count held keeps the entry from removal, so it is
		 * still id's. */
		c = atomic_exchange_explicit(&e->counts[rank], 0, memory_order_seq_cst);
		if (c) {
			/* Unreferenced now: its (live) owner frees it. */
			if ((rc = drop(t, e, id, c, false)) == 1)
				rref_collect_push(t, s);
			else if (rc < 0)
				err = rc;
			n += c;
		}
	}
	return err ? err : (int)(n > INT_MAX ? INT_MAX : n);
}

bool rref_info_at(const struct rref_table *t, uint32_t slot, struct rref_info *out)
{
	struct rref_entry *e;

	if (slot >= t->capacity)
		return false;
	e = rref_entry_at(t, slot);
	out->id = atomic_load_explicit(&e->key, memory_order_acquire);
	out->state = RREF_STATE(atomic_load_explicit(&e->state, memory_order_acquire));
	if (!RREF_KEY_LIVE(out->id) || out->state == RREF_FREE)
		return false;
	/* Relaxed, then the key again: an entry emptied and taken by the
	 * next insert meanwhile (at once where the inserter emptied it:
	 * freed_hint) would give its fields with our id. The acquire fence
	 * pairs with claim()'s release fence: a field of the next insert's
	 * read here means the key read after it is no longer out->id. */
	out->owner = atomic_load_explicit(&e->owner, memory_order_relaxed);
	out->creator = atomic_load_explicit(&e->creator, memory_order_relaxed);
	out->flags = atomic_load_explicit(&e->flags, memory_order_relaxed);
	out->created_ns = atomic_load_explicit(&e->created_ns, memory_order_relaxed);
	out->total = atomic_load_explicit(&e->total, memory_order_relaxed);
	out->value_off = atomic_load_explicit(&e->value_off, memory_order_relaxed);
	out->value_len = atomic_load_explicit(&e->value_len, memory_order_relaxed);
	atomic_thread_fence(memory_order_acquire);
	return atomic_load_explicit(&e->key, memory_order_relaxed) == out->id;
}

uint32_t rref_count_of(const struct rref_table *t, uint32_t slot, uint32_t rank)
{
	if (slot >= t->capacity || rank >= t->world)
		return 0;
	return atomic_load_explicit(&rref_entry_at(t, slot)->counts[rank], memory_order_relaxed);
}

const char *rref_state_name(uint32_t state)
{
	static const char *const names[] = { "free", "pending", "ready", "error",
					     "unreferenced", "owner-dead" };

	return state < sizeof(names) / sizeof(names[0]) ? names[state] : "invalid";
}
