/* The owner's records of its RRefs' values: stored, fetched, collected; see rref.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/spin.h"
#include "common/zalloc.h"
#include "worker/executor.h"
#include "worker/future.h"
#include "worker/link.h"
#include "worker/rref.h"
#include "worker/rref_impl.h"
#include "worker/sbuf.h"
#include "worker/value.h"

#define RECORD_BUCKETS 1024u

struct record {
	struct record *next;
	uint64_t id;
	uint32_t slot;
	uint64_t value_off;     /* our pool block with the encoded value or error */
	bool block;             /* value_off is one (not an inline value) */
	struct tensor_list held; /* our references to what the value holds */
	bool live;              /* the value is an object the binding keeps (python.h) */
};

/* Set once at init by the binding that keeps live values, before any
 * request runs; read by whoever frees a record. Release/acquire: the
 * binding's state that the hook reads is set before it. */
static _Atomic(rref_live_release_fn) live_release;

void rref_set_live_release(rref_live_release_fn fn)
{
	atomic_store_explicit(&live_release, fn, memory_order_release);
}

/* The binding lets go of the live value of id: the RRef went, or its
 * store failed. */
static void release_live(uint64_t id)
{
	rref_live_release_fn fn = atomic_load_explicit(&live_release, memory_order_acquire);

	if (fn)
		fn(id);
}

static struct {
	pthread_mutex_t lock;
	struct record *bucket[RECORD_BUCKETS];
} records = { .lock = PTHREAD_MUTEX_INITIALIZER };

static struct record **record_at(uint64_t id)
{
	struct record **at = &records.bucket[(id * 0x9e3779b97f4a7c15ull) >> 54];

	while (*at && (*at)->id != id)
		at = &(*at)->next;
	return at;
}

static void record_free(struct agent *ag, struct record *rec)
{
	if (rec->live)
		release_live(rec->id);
	tensor_list_free(&rec->held);
	if (rec->block && pool_unref(&ag->pool, ag->rank, rec->value_off))
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
	free(rec);
}

int rref_owner_check(struct agent *ag, uint64_t id, uint32_t slot)
{
	struct rref_info info;

	if (!ag->has_rrefs)
		return shmrpc__fail(-ENOTSUP, "this job has no RRef table");
	if (!rref_info_at(&ag->rrefs, slot, &info) || info.id != id || info.owner != ag->rank)
		return shmrpc__fail(-EBADMSG, "a remote call names an RRef (id %#" PRIx64 ", slot "
				    "%u) that is not ours in the RRef table", id, slot);
	return 0;
}

/* Encodes v into a new pool block, or into *off itself when it fits there
 * (*len then says so: RREF_VALUE_INLINE; it holds nothing, and *off is no
 * block); the tensors (by reference: an inline one's bytes are in the
 * block) and RRefs it holds get references of ours in held, and are
 * listed in sent. */
static int store_block(struct agent *ag, const shmrpc_value *v, uint64_t *off, uint64_t *len,
		       struct tensor_list *held, struct tensor_list *sent)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;
	int rc;

	sbuf_open(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	rc = value_pack(&pk, v, sent);
	if (rc == 0 && sb.size <= RREF_VALUE_INLINE_MAX && !sent->n && !sent->nr) {
		/* Nothing to hold, no block to take or free: the store and
		 * the collection of an empty result touch no pool lock. */
		*off = 0;
		memcpy(off, sb.data, sb.size);
		*len = sb.size | RREF_VALUE_INLINE;
		sbuf_close(&sb);
		return 0;
	}
	rc = rc ?: tensor_list_hold(sent, held);
	for (uint32_t i = 0; i < sent->nr && rc == 0; i++) {
		shmrpc_rref *r;

		rc = shmrpc_rref_retain(sent->r[i], &r) ?: tensor_list_add_rref(held, r);
	}
	if (rc == 0)
		rc = pool_alloc(&ag->pool, ag->rank, sb.size, off);
	if (rc == 0) {
		memcpy(pool_at(&ag->pool, *off, sb.size), sb.data, sb.size);
		*len = sb.size;
	}
	sbuf_close(&sb);
	return rc;
}

int rref_owner_store(struct agent *ag, uint64_t id, uint32_t slot, const shmrpc_value *result,
		     const shmrpc_value *error, bool live, struct tensor_list *sent)
{
	struct tensor_list held = { 0 };
	struct record *rec = NULL;
	uint64_t off = 0, len = 0;
	bool block;
	int rc = store_block(ag, error ? error : result, &off, &len, &held, sent);

	block = rc == 0 && !(len & RREF_VALUE_INLINE);
	/* A record is what the collection frees (a block, references, a live
	 * value): an inline value that is not live needs none. */
	if (rc == 0 && (block || (live && !error)) && !(rec = zalloc(sizeof(*rec))))
		rc = shmrpc__fail(-ENOMEM, "out of memory storing an RRef's value");
	if (rc) {
		char msg[1024];

		/* Our run's reference goes all the same; the creator's request
		 * fails with this error, and to_here() with it. */
		snprintf(msg, sizeof(msg), "%s", shmrpc_errmsg());
		tensor_list_free(&held);
		if (block && pool_unref(&ag->pool, ag->rank, off))
			fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
		if (live)
			release_live(id);
		if (rref_release(&ag->rrefs, slot, id, ag->rank, 1) == 1)
			rref_unreferenced(ag, id, slot, ag->rank);
		return shmrpc__fail(rc, "cannot store the RRef's value: %s", msg);
	}
	if (rec) {
		*rec = (struct record){ .id = id, .slot = slot, .value_off = off, .block = block,
					.held = held, .live = live && !error };
		pthread_mutex_lock(&records.lock);
		*record_at(id) = rec;
		pthread_mutex_unlock(&records.lock);
		/* From here readers may decode the value; our run's reference goes. */
		rc = rref_store(&ag->rrefs, slot, id, error ? RREF_ERROR : RREF_READY, off, len);
	} else {
		/* Nothing kept: the last live drop removes the entry itself.
		 * Not where forks go by message: there the owner checks the
		 * entry and then charges a child (rref_owner_hold) while a
		 * pending child's reference may still be dropped (a sweep of
		 * the parent, the parent's collection of a dead child), and a
		 * removal between the two would let it charge whatever RRef
		 * took the slot next; only the owner removes its entries
		 * there, under rref_forks.lock. */
		if (!rref_fork_mode_message())
			len |= RREF_VALUE_ALONE;
		rc = rref_store(&ag->rrefs, slot, id, error ? RREF_ERROR : RREF_READY, off, len);
	}
	if (rc == 1)
		rref_unreferenced(ag, id, slot, ag->rank);
	return rc < 0 ? rc : 0;
}

const void *rref_value_at(struct agent *ag, uint32_t slot, uint64_t *small, uint64_t *len)
{
	struct rref_entry *e = rref_entry_at(&ag->rrefs, slot);
	/* Relaxed: ordered by the acquire of the state that said READY/ERROR. */
	uint64_t l = atomic_load_explicit(&e->value_len, memory_order_relaxed);
	uint64_t off = atomic_load_explicit(&e->value_off, memory_order_relaxed);

	if (!(l & RREF_VALUE_INLINE)) {
		*len = l;
		return pool_at(&ag->pool, off, l);
	}
	/* Shared memory: a length past the word is refused, not read. */
	*len = l & ~(RREF_VALUE_INLINE | RREF_VALUE_ALONE);
	*small = off;
	return *len <= RREF_VALUE_INLINE_MAX ? small : NULL;
}

struct look {
	struct rref_table *t;
	uint32_t slot;
	uint64_t id;
	int st;
};

/* One look at the entry: a deadline already passed never sleeps. */
static bool looked_settled(void *arg)
{
	struct look *l = arg;

	l->st = rref_wait(l->t, l->slot, l->id, 1);
	return l->st != -ETIMEDOUT;
}

/* Waits for id to leave PENDING; see rref_impl.h. */
int rref_wait_ready(struct agent *ag, uint32_t slot, uint64_t id, shmrpc_future *reply,
		    uint64_t deadline_ns)
{
	struct look l = { &ag->rrefs, slot, id, 0 };
	bool came;

	if (looked_settled(&l)) /* no hand-off: nothing for the spin budget to learn */
		return l.st;
	if (executor_on_worker_thread()) {
		executor_block_begin();
		l.st = rref_wait(&ag->rrefs, slot, id, deadline_ns);
		executor_block_end();
		return l.st;
	}
	/* On remote()'s creator, where our loop thread sleeps (every mode but
	 * spin), the wait is the reply's, as rpc_sync's: future_wait_until
	 * spins taking our replies, having promised peers to (so that the
	 * reply rings nothing), then sleeps on the reply. A spin on the entry
	 * alone stopped watching at READY, just before the reply, which then
	 * woke the loop thread each time (a loaded machine runs the woken loop
	 * thread before the spinner: it even took the reply first) and only
	 * for it to complete a future nobody waits for. In spin mode no
	 * thread sleeps: the spin stays on the entry, READY a ring round trip
	 * before the reply. */
	if (reply && !shmrpc_future_done(reply) && ag->port.waiter.mode != IPC_WAIT_SPIN)
		return future_wait_until(reply, deadline_ns) == 0 && looked_settled(&l) ? l.st
											  : -ETIMEDOUT;
	came = shmrpc_spin_until(looked_settled, &l, worker_handoff_spin(deadline_ns));
	worker_handoff_spun(came);
	if (came)
		return l.st;
	if (reply && !shmrpc_future_done(reply))
		return future_sleep_until(reply, deadline_ns) == 0 && looked_settled(&l) ? l.st
											: -ETIMEDOUT;
	return rref_wait(&ag->rrefs, slot, id, deadline_ns);
}

int rref_owner_fetch(struct agent *ag, uint64_t id, uint32_t slot, uint64_t deadline_ns, void **buf,
		     size_t *len, uint32_t *state)
{
	int st = rref_wait_ready(ag, slot, id, NULL, deadline_ns);
	uint64_t small, l;
	const void *at;

	if (st < 0)
		return st == -ETIMEDOUT ? shmrpc__fail(st, "the RRef's value was not ready in time")
					: st;
	if (st != RREF_READY && st != RREF_ERROR)
		return shmrpc__fail(-EINVAL, "RRef %#" PRIx64 " is %s", id, rref_state_name((uint32_t)st));
	/* Ordered by the acquire of the state in rref_wait. */
	at = rref_value_at(ag, slot, &small, &l);
	if (!at || !(*buf = malloc(l ? l : 1)))
		return shmrpc__fail(at ? -ENOMEM : -EBADMSG, "cannot read RRef %#" PRIx64 "'s value",
				    id);
	pool_read(*buf, at, l);
	*len = l;
	*state = (uint32_t)st;
	return 0;
}

/* Frees what the UNREFERENCED RRef id of ours holds (taken off our
 * collect list); ignores anything else. */
static void owner_collect(struct agent *ag, uint64_t id, uint32_t slot)
{
	struct owner_forks *of, **fat;
	struct rref_info info;
	struct record *rec, **at;

	/* Only an UNREFERENCED entry: nobody can reach the value any more. */
	if (!rref_info_at(&ag->rrefs, slot, &info) || info.id != id ||
	    info.state != RREF_UNREFERENCED || info.owner != ag->rank)
		return;
	pthread_mutex_lock(&records.lock);
	at = record_at(id);
	rec = *at;
	if (rec)
		*at = rec->next;
	pthread_mutex_unlock(&records.lock);
	/* The fork ids go with the entry, under the lock of owner_hold. */
	pthread_mutex_lock(&rref_forks.lock);
	fat = rref_owner_forks_at(id);
	if ((of = *fat))
		*fat = of->next;
	/* Without a record it never got a value (its store failed), or
	 * the value was inline and not live: nothing to free but the entry. */
	rref_remove(&ag->rrefs, slot, id);
	pthread_mutex_unlock(&rref_forks.lock);
	if (of)
		free(of->fork);
	free(of);
	if (rec)
		record_free(ag, rec);
}

void rref_owner_collect_listed(struct agent *ag)
{
	uint32_t at = rref_collect_take(&ag->rrefs, ag->rank);

	/* A list is at most the table long; a bad link ends it. */
	for (uint32_t n = 0; at && n < ag->rrefs.capacity; n++) {
		uint32_t slot = at - 1;
		struct rref_info info;

		/* The link first: collecting frees the entry for reuse. */
		at = rref_collect_next(&ag->rrefs, slot);
		if (rref_info_at(&ag->rrefs, slot, &info))
			owner_collect(ag, info.id, slot);
	}
}

void rref_owner_collect_all(struct agent *ag)
{
	struct pending_child *gone = NULL, *c;

	/* Forks sent to a child that is gone: it will never accept them (its
	 * references were swept, the one the owner made for it included). */
	pthread_mutex_lock(&rref_forks.lock);
	for (uint32_t b = 0; b < FORK_BUCKETS; b++) {
		struct pending_child **at = &rref_forks.child[b];

		while ((c = *at)) {
			if (c->child != ag->rank && !rref_peer_running(ag, c->child)) {
				*at = c->next;
				c->next = gone;
				gone = c;
			} else {
				at = &c->next;
			}
		}
	}
	pthread_mutex_unlock(&rref_forks.lock);
	while ((c = gone)) {
		gone = c->next;
		rref_child_drop(ag, c);
	}
	/* What the sweep left unreferenced, it put on our list. */
	rref_owner_collect_listed(ag);
}

void rref_owner_free_all(struct agent *ag)
{
	/* The launcher sweeps the references the pending children hold. */
	pthread_mutex_lock(&rref_forks.lock);
	for (uint32_t b = 0; b < FORK_BUCKETS; b++) {
		struct pending_child *c;
		struct owner_forks *of;

		while ((c = rref_forks.child[b])) {
			rref_forks.child[b] = c->next;
			if (c->via && --c->via->refs == 0)
				free(c->via);
			free(c);
		}
		while ((of = rref_forks.owned[b])) {
			rref_forks.owned[b] = of->next;
			free(of->fork);
			free(of);
		}
	}
	pthread_mutex_unlock(&rref_forks.lock);
	for (uint32_t b = 0; b < RECORD_BUCKETS; b++) {
		struct record *rec;

		/* Freed outside the lock: a record's RRefs may be ours too. */
		pthread_mutex_lock(&records.lock);
		rec = records.bucket[b];
		records.bucket[b] = NULL;
		pthread_mutex_unlock(&records.lock);
		while (rec) {
			struct record *next = rec->next;

			record_free(ag, rec);
			rec = next;
		}
	}
}
