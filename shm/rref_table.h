/*
 * The RRef table: one memfd, separate from the job segment and the tensor
 * pool, that every worker maps read-write. It says, for every live RRef of
 * the job, whether its value is there yet, where it lives, and who still
 * holds a reference to it. docs/RREF.md tells which steps of PyTorch's RRef
 * protocol this turns into atomic operations.
 *
 * Layout (format 2):
 *
 *   0          struct rref_table_header     one page
 *   heads_off  _Atomic uint32_t heads[world]: each owner's collect list,
 *              padded to a page
 *   slots_off  capacity entries of entry_size bytes: struct rref_entry,
 *              then _Atomic uint32_t counts[world], padded to 64 bytes
 *
 * Open addressing, keyed by the RRef id (nonzero; ids are never reused),
 * hashed with xxHash, linear probing. key 0 is a slot never used, RREF_TOMB
 * a slot freed (a lookup probes past it, an insert may take it),
 * RREF_REMOVING a slot being emptied (probed past, not taken). The
 * capacity is a power of two at least twice max_rrefs, so a probe is short.
 *
 * References. counts[r] is how many references rank r holds; total is
 * their sum. An RRef is created with one reference for its creator and one
 * for its owner's pending run (held until the value or error is stored), so
 * it cannot be deleted before it has a value. Only a holder makes another
 * reference (a fork is charged to its receiver by the sender, which still
 * holds its own), so once total is 0 it stays 0: the RRef is unreferenced
 * and its owner frees the value and removes the entry.
 *
 * Collect lists. Whoever makes an entry UNREFERENCED (a worker's last
 * drop, or a sweep's) pushes it on its owner's list: a lock-free stack
 * threaded through the entries (collect_next), its head per owner. The
 * owner takes its whole list at once (exchange with 0) and frees what is
 * on it; it removes entries only that way, so an entry on a list is never
 * removed under it and the walk reads each next before freeing the entry.
 * A pusher finding the list empty tells the owner (its doorbell);
 * the others know it has been told and has not taken the list yet. So no
 * message is needed for an RRef's last drop (RREF_USER_DELETE becomes a
 * push; docs/RREF.md), and no walk of the table after a death. A value
 * its owner keeps nothing of (RREF_VALUE_ALONE) is not pushed by a live
 * worker's last drop: that drop removes the entry itself.
 *
 * Crash safety, as in the tensor pool: a holder raises total before its
 * count and lowers its count before total, so sum(counts) <= total always;
 * a sweep of a dead rank exchanges its counts with 0 and lowers total by
 * what it took, once however many sweepers run. A death between two steps
 * never frees an entry in use; it can leak one (never freed until the job
 * ends, and shmrun reports it then):
 *  - between the two steps of a hold or a release: total above the counts;
 *  - between the drop to total 0 and the change to UNREFERENCED: a READY
 *    entry with total 0 that no one hands to its owner; between that
 *    change and the push: an UNREFERENCED entry on no list;
 *  - inside an insert or a removal: a key with state FREE (skipped by
 *    sweeps and inspectors), or `live` one above the entries there are;
 *  - a fork charged to its receiver and never sent (the protocol's).
 *
 * Waiting: state is a futex word. A waiter raises waiters, re-reads the
 * state and sleeps on it (FUTEX_WAIT, shared); whoever changes the state
 * does so with seq_cst and wakes all when waiters is nonzero. The fence
 * pairing is the doorbell's (ipc/doorbell.h): one of the two sees the other.
 *
 * Nothing read from the table is trusted: slots, keys, states, owners,
 * totals and collect links are checked before use. A check that fails
 * is -SHMRPC_ECORRUPT with a sentence naming the entry or the list, noted
 * for shmrun's report (shm/corrupt.h); the RRef it touched fails, the
 * rest of the table goes on (an entry is no other entry's business).
 */
#ifndef SHMRPC_SHM_RREF_TABLE_H
#define SHMRPC_SHM_RREF_TABLE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"

#define SHMRPC_ENV_RREF_FD "SHMRPC_RREF_FD"

#define RREF_TABLE_MAGIC 0x31464552524d4853ull /* "SHMRREF1" read as little endian */
#define RREF_TABLE_FORMAT_VERSION 2u
#define RREF_TABLE_PAGE 4096u
#define RREF_MAX_WORLD 1024u
#define RREF_MAX_RREFS (1u << 24)
/* 64Ki live RRefs: 16 MiB of table for up to 16 workers, committed when
 * the job starts (shmrun --max-rrefs). */
#define RREF_DEFAULT_MAX_RREFS 65536u
#define RREF_TOMB UINT64_MAX         /* a freed slot */
#define RREF_REMOVING (UINT64_MAX - 1) /* a slot its remover is emptying */
#define RREF_KEY_LIVE(k) ((k) != 0 && (k) < RREF_REMOVING)

/* The state word: the state in the low byte, above it the slot's
 * incarnation (raised by each insert), so that a CAS made for one RRef
 * can never land on the next one to use the slot. */
#define RREF_STATE(w) ((w) & 0xffu)

/* An RRef id or a fork id: the rank that made it + 1, then a counter. */
#define RREF_ID(rank, local) (((uint64_t)(rank) + 1) << 40 | ((local) & ((1ull << 40) - 1)))
#define RREF_ID_RANK(id) ((uint32_t)((id) >> 40) - 1)
#define RREF_ID_LOCAL(id) ((id) & ((1ull << 40) - 1))

enum rref_state {
	RREF_FREE = 0,         /* slot being filled or emptied */
	RREF_PENDING = 1,      /* the owner has not stored a value yet */
	RREF_READY = 2,        /* value_off/value_len: the encoded value */
	RREF_ERROR = 3,        /* value_off/value_len: the encoded error */
	RREF_UNREFERENCED = 4, /* total reached 0: the owner frees it */
	RREF_OWNER_DEAD = 5,   /* the owner died; removed when total reaches 0 */
};

/* In value_len: the encoded value (at most 8 bytes: nil, a small number)
 * is value_off's own bytes, in memory order, rather than in a pool block;
 * a small value's store and collection then touch no pool (issue 23). */
#define RREF_VALUE_INLINE (1ull << 63)
#define RREF_VALUE_INLINE_MAX sizeof(uint64_t)
/* In value_len, beside RREF_VALUE_INLINE: the entry is all there is of the
 * value, its owner keeps nothing for it (no block, no references, no live
 * object, no fork ids). A live worker's drop that leaves such an entry
 * unreferenced removes it itself (rref_release returns 2), and its owner
 * hears nothing: no push, no wake-up (issue 23: that notice woke the owner
 * once per remote()+to_here() of nil). A sweep's drop hands it to its owner
 * as any other, so that the owner alone removes what a dead worker leaves.
 * Set by the owner's store where forks go through the table (the default),
 * never where they go by message (worker/rref_owner.c says why); nothing
 * changes it after. */
#define RREF_VALUE_ALONE (1ull << 62)

struct rref_table_header {
	uint64_t magic;
	uint32_t format_version;
	uint32_t header_size;
	uint64_t total_size;
	uint64_t slots_off;
	uint32_t capacity;   /* slots, a power of two */
	uint32_t max_rrefs;  /* live entries allowed */
	uint32_t world;
	uint32_t entry_size; /* sizeof(struct rref_entry) + counts, 64-byte multiple */
	uint64_t created_ns; /* CLOCK_REALTIME */
	uint32_t creator_pid;
	uint8_t pad0[4];
	/* line 2: live entries; fetch_add (relaxed: a bound, orders nothing). */
	_Atomic uint32_t live;
	uint8_t pad1[60];
	uint64_t heads_off;
	uint8_t reserved[RREF_TABLE_PAGE - 136];
};
_Static_assert(offsetof(struct rref_table_header, live) == 64, "rref header layout");
_Static_assert(offsetof(struct rref_table_header, heads_off) == 128, "rref header layout");
_Static_assert(sizeof(struct rref_table_header) == RREF_TABLE_PAGE, "rref header is one page");

struct rref_entry {
	_Atomic uint64_t key;       /* CAS: 0/TOMB -> id by the creator, id -> REMOVING by the
				     * remover, which stores TOMB once it has emptied the slot */
	_Atomic uint32_t state;     /* incarnation << 8 | enum rref_state; the futex word */
	_Atomic uint32_t waiters;   /* threads asleep on state */
	_Atomic uint32_t total;     /* sum of counts (see above) */
	/* owner, creator, flags, created_ns: stored (relaxed) by the creator
	 * after its key CAS and a release fence, before state leaves FREE;
	 * loaded relaxed. Atomic: a reader of a stale slot (rref_info_at: an
	 * inspector, the debug counts) may meet the next insert's stores. */
	_Atomic uint32_t owner;
	_Atomic uint64_t value_off; /* pool offset, or the bytes themselves (RREF_VALUE_INLINE);
				     * written before state READY/ERROR (release) */
	_Atomic uint64_t value_len; /* bytes, | RREF_VALUE_INLINE when in value_off */
	_Atomic uint64_t created_ns; /* CLOCK_MONOTONIC, for inspectors */
	_Atomic uint32_t creator;
	_Atomic uint32_t flags;      /* RREF_F_* */
	/* On the owner's collect list: the next entry's slot + 1 (0: none).
	 * Written by the pusher before its release CAS of the head; read by
	 * the owner after its acquire exchange. */
	_Atomic uint32_t collect_next;
	uint8_t pad[4];
	_Atomic uint32_t counts[];  /* per rank */
};
_Static_assert(sizeof(struct rref_entry) == 64, "rref entry head is one line");
_Static_assert(offsetof(struct rref_entry, value_off) == 24, "rref entry layout");

/* The value is fetched from the owner by message (it lives in its process). */
#define RREF_F_FETCH_BY_MESSAGE 1u

struct rref_table_params {
	uint32_t max_rrefs; /* 0: RREF_DEFAULT_MAX_RREFS */
	uint32_t world;
};

/* What one process knows of the table, checked at attach. */
struct rref_table {
	int fd;
	uint8_t *base;
	struct rref_table_header *hdr;
	uint64_t size;
	uint32_t capacity;
	uint32_t max_rrefs;
	uint32_t world;
	uint32_t entry_size;
	_Atomic uint32_t *heads; /* [world] */
	uint8_t *slots;
	/* Where this process notes a structure it found corrupt (a worker's
	 * slot, the launcher's own word; NULL: nowhere). Set after attach. */
	_Atomic uint64_t *corrupt_note;
	/* The slot this process emptied last, + 1 (0: none), which its next
	 * insert tries before the id's home: its lines are still in this
	 * core's cache and TLB, where a home is a random line of a table of
	 * megabytes (a remote() whose RRef is dropped at once reuses one
	 * slot instead of missing twice on a new one in each process). */
	_Atomic uint32_t freed_hint;
};

/* A copy of one entry, for inspectors and tests. */
struct rref_info {
	uint64_t id;
	uint32_t state;
	uint32_t owner;
	uint32_t creator;
	uint32_t total;
	uint32_t flags;
	uint64_t value_off;
	uint64_t value_len;
	uint64_t created_ns;
};

SHMRPC_HIDDEN int rref_table_create(struct rref_table *t, const struct rref_table_params *params);
/* Maps an existing table (checks magic, version, layout); owns fd on success. */
SHMRPC_HIDDEN int rref_table_attach_fd(struct rref_table *t, int fd, bool readonly);
SHMRPC_HIDDEN void rref_table_detach(struct rref_table *t);
/* Bytes a table of this shape occupies; 0 if the shape is invalid. */
SHMRPC_HIDDEN uint64_t rref_table_bytes(const struct rref_table_params *params);

static inline struct rref_entry *rref_entry_at(const struct rref_table *t, uint32_t slot)
{
	return (struct rref_entry *)(t->slots + (uint64_t)slot * t->entry_size);
}

/*
 * Inserts id, owned by owner, in state PENDING with one reference for
 * creator and one for owner (its pending run; rref_store drops it). *slot
 * names the entry from now on. -ENOSPC when max_rrefs are live.
 */
SHMRPC_HIDDEN int rref_insert(struct rref_table *t, uint64_t id, uint32_t owner, uint32_t creator,
			      uint32_t flags, uint32_t *slot);
/* The slot of id, or -ENOENT: a scan from the id's home (an insert may
 * place it anywhere), for tests and tools; calls name their entries by
 * slot. */
SHMRPC_HIDDEN int rref_find(const struct rref_table *t, uint64_t id, uint32_t *slot);
/*
 * n more references for rank; the caller holds one (or the pending run),
 * so the entry cannot go away meanwhile. -ENOENT if slot does not hold id.
 */
SHMRPC_HIDDEN int rref_hold(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t rank,
			    uint32_t n);
/*
 * Drops n of rank's references. 1 when this made the RRef unreferenced
 * (state UNREFERENCED: the caller tells the owner, unless it is the owner),
 * 2 when this removed it (its owner is dead, or its value is
 * RREF_VALUE_ALONE), 0 otherwise, or -errno.
 */
SHMRPC_HIDDEN int rref_release(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t rank,
			       uint32_t n);
/*
 * The owner stores the value (state READY) or the error (state ERROR) of
 * id, wakes the waiters and drops its pending run's reference; the return
 * is rref_release's.
 */
SHMRPC_HIDDEN int rref_store(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t state,
			     uint64_t value_off, uint64_t value_len);
/*
 * Waits until id's state is no longer PENDING or deadline_ns
 * (CLOCK_MONOTONIC, 0: none) passes; returns the state seen, or -ETIMEDOUT,
 * or -ENOENT.
 */
SHMRPC_HIDDEN int rref_wait(struct rref_table *t, uint32_t slot, uint64_t id, uint64_t deadline_ns);
/* The owner, done with an UNREFERENCED entry's value: the slot is freed. */
SHMRPC_HIDDEN int rref_remove(struct rref_table *t, uint32_t slot, uint64_t id);

/*
 * Pushes the UNREFERENCED entry at slot (made so by the caller's drop:
 * rref_release returned 1) on its owner's collect list; true when the
 * list was empty, and the pusher must then tell the owner.
 */
SHMRPC_HIDDEN bool rref_collect_push(struct rref_table *t, uint32_t slot);
/* Whether rank's collect list holds anything. */
SHMRPC_HIDDEN bool rref_collect_pending(const struct rref_table *t, uint32_t rank);
/* Takes rank's whole list: its first slot + 1, 0 if empty. */
SHMRPC_HIDDEN uint32_t rref_collect_take(struct rref_table *t, uint32_t rank);
/* The slot + 1 after slot on a taken list (0: the end, or a bad link:
 * one to an entry that is not an UNREFERENCED one of the same owner, noted
 * as a corrupt collect list). */
SHMRPC_HIDDEN uint32_t rref_collect_next(const struct rref_table *t, uint32_t slot);

/*
 * rank's process is dead (or gone after a clean exit): every entry it owns
 * becomes OWNER_DEAD (waiters woken; removed if nothing references it),
 * and every reference it held is dropped (an entry of a live owner that
 * this leaves unreferenced goes on its collect list: the owner takes it
 * once it sees the death). Idempotent; returns the
 * references dropped. The launcher runs it twice: before the pool frees
 * the dead rank's blocks (a reader that copied a value re-checks the state
 * and sees the death), and again after marking the worker dead (for a
 * reference charged to it, or an entry made for it, meanwhile: see
 * rref_hold). One process sweeps at a time: the walk reads an entry's
 * owner before its CAS. A table with no live entry is not walked.
 */
SHMRPC_HIDDEN int rref_sweep_rank(struct rref_table *t, uint32_t rank);
/* One entry of a dead owner, for a creator that inserted it after the
 * owner's sweep (it holds a reference, so the entry is its). */
SHMRPC_HIDDEN int rref_mark_owner_dead(struct rref_table *t, uint32_t slot, uint64_t id);

/* Drops every reference rank holds on the entry at slot (exchange with 0);
 * the return is rref_release's for what it dropped. */
SHMRPC_HIDDEN int rref_sweep_entry(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t rank);

/* Copies the entry at slot; false when it is unused, or was emptied while
 * it was copied (the copy would mix two RRefs). */
SHMRPC_HIDDEN bool rref_info_at(const struct rref_table *t, uint32_t slot, struct rref_info *out);
/* rank's count on the entry at slot (for tests and inspectors). */
SHMRPC_HIDDEN uint32_t rref_count_of(const struct rref_table *t, uint32_t slot, uint32_t rank);
SHMRPC_HIDDEN const char *rref_state_name(uint32_t state);

#endif
