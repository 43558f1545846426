/*
 * RRefs on the wire: fork data packed and unpacked, forks by message, a
 * message's RRefs charged to its receiver; see rref.h.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "worker/client.h"
#include "worker/executor.h"
#include "worker/future.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/rref.h"
#include "worker/rref_impl.h"
#include "worker/value.h"

/*
 * The forks this thread packed by message, in order, until a charge names
 * their receiver: the fork id is minted in rref_pack, which does not know
 * the receiver, and rref_charge, which does, gets the handles only. A
 * message is packed and charged on one thread with no pack between, so
 * its forks are the last ones logged, in the order of its list; earlier
 * ones belong to messages that never went (they hold nothing). After a
 * charge its forks stay at the front (`charged`) for rref_uncharge.
 */
struct fork_log {
	struct {
		const shmrpc_rref *r;
		uint64_t fork_id;
	} *e;
	uint32_t n, cap, charged;
};

static pthread_key_t log_key;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static void log_free(void *arg)
{
	struct fork_log *log = arg;

	free(log->e);
	free(log);
}

static void log_key_make(void)
{
	pthread_key_create(&log_key, log_free);
}

static struct fork_log *fork_log(void)
{
	struct fork_log *log;

	pthread_once(&log_once, log_key_make);
	if ((log = pthread_getspecific(log_key)))
		return log;
	if (!(log = calloc(1, sizeof(*log))) || pthread_setspecific(log_key, log)) {
		free(log);
		return NULL;
	}
	return log;
}

static int log_add(const shmrpc_rref *r, uint64_t fork_id)
{
	struct fork_log *log = fork_log();

	if (log && log->n == log->cap) {
		uint32_t cap = log->cap ? 2 * log->cap : 16;
		void *e = realloc(log->e, cap * sizeof(*log->e));

		if (e) {
			log->e = e;
			log->cap = cap;
		}
	}
	if (!log || log->n == log->cap)
		return shmrpc__fail(-ENOMEM, "out of memory forking an RRef");
	log->e[log->n].r = r;
	log->e[log->n++].fork_id = fork_id;
	return 0;
}

int rref_pack(msgpack_packer *pk, const shmrpc_rref *r)
{
	struct agent *ag = worker_agent;
	struct rref_wire w = {
		.id = r->id,
		.slot = r->slot,
		.owner = r->owner,
		.parent = ag ? ag->rank : 0,
	};

	if (!ag || !ag->has_rrefs)
		return shmrpc__fail(-ENOTCONN, "an RRef can only travel while the agent runs");
	w.fork_id = rref_new_id(ag);
	if (rref_by_message(ag, r)) {
		if (rref_fork_mode_bad())
			return shmrpc__fail(-EINVAL, "SHMRPC_RREF_FORK=%s: expected table or message",
					    getenv("SHMRPC_RREF_FORK"));
		if (log_add(r, w.fork_id))
			return -ENOMEM;
		w.flags = RREF_WIRE_BY_MESSAGE;
	}
	if (msgpack_pack_ext_with_body(pk, &w, sizeof(w), VALUE_EXT_RREF))
		return shmrpc__fail(-ENOMEM, "out of memory encoding an RRef");
	return 0;
}

int rref_request(struct agent *ag, uint32_t dst, uint16_t type, const struct rref_at *at,
		 const uint64_t *fork_id, int64_t timeout_ms, const char *what, shmrpc_future **f)
{
	struct tensor_list none = { 0 };
	msgpack_sbuffer sb;
	msgpack_packer pk;
	int rc;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if (at) {
		msgpack_pack_array(&pk, 2);
		msgpack_pack_uint64(&pk, at->id);
		msgpack_pack_uint32(&pk, at->slot);
	}
	if (fork_id)
		msgpack_pack_uint64(&pk, *fork_id);
	rc = client_request(ag, (int)dst, type, &sb, &none, timeout_ms, what, f);
	msgpack_sbuffer_destroy(&sb);
	return rc;
}

/* Sends a fork message and forgets it, or keeps its request in *out. */
static int send_fork_msg(struct agent *ag, uint32_t dst, uint16_t type, uint64_t id, uint32_t slot,
			 uint64_t fork_id, shmrpc_future **out)
{
	bool request = type == MSG_RREF_FORK_REQUEST;
	shmrpc_future *f;
	/* No timeout: a live owner answers; a death fails the request. */
	int rc = rref_request(ag, dst, type, request ? &(struct rref_at){ id, slot } : NULL,
			      &fork_id, SHMRPC_TIMEOUT_NONE,
			      request ? "confirm an RRef fork with its owner" : "accept an RRef fork",
			      &f);

	if (rc == 0 && out)
		*out = f;
	else if (rc == 0)
		shmrpc_future_free(f);
	return rc;
}

int rref_send_fork_request(struct agent *ag, uint64_t id, uint32_t slot, uint32_t owner,
			   uint64_t fork_id, shmrpc_future **out)
{
	return send_fork_msg(ag, owner, MSG_RREF_FORK_REQUEST, id, slot, fork_id, out);
}

int rref_send_child_accept(struct agent *ag, uint32_t parent, uint64_t fork_id,
			   shmrpc_future **out)
{
	return send_fork_msg(ag, parent, MSG_RREF_CHILD_ACCEPT, 0, 0, fork_id, out);
}

/* The owner answered p's RREF_FORK_REQUEST (err 0) or could not: the
 * references p's handles and children owe are made (the owner made one),
 * and the parent hears that it may drop its own. From an executor thread. */
static void fork_answered(struct agent *ag, struct pending_user *p, int err, const char *why)
{
	uint64_t id = p->id, fork_id = p->fork_id;
	uint32_t slot = p->slot, owner = p->owner, parent = p->parent, owed;
	bool last;
	int rc = 0;

	if (err && err != -SHMRPC_EPEERDEAD && err != -ESHUTDOWN)
		fprintf(stderr, "shmrpc: worker %u: the owner did not confirm a fork of RRef %#"
			PRIx64 "; its handles here hold no reference: %s\n", ag->rank, id, why);
	/* Relaxed: a gauge (pending_users_open). */
	atomic_fetch_sub_explicit(&rref_pending_users_open, 1, memory_order_relaxed);
	pthread_mutex_lock(&rref_forks.lock);
	p->done = true;
	p->failed = err != 0;
	owed = p->refs - 1;
	/* Under the lock: a handle that goes after done drops its own. */
	if (!err && owed > 1)
		rc = rref_hold(&ag->rrefs, slot, id, ag->rank, owed - 1);
	last = --p->refs == 0;
	pthread_mutex_unlock(&rref_forks.lock);
	if (rc)
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
	if (!err && owed == 0) /* every handle went meanwhile */
		rref_drop(ag, id, slot, owner);
	if (last)
		free(p);
	/* A parent that died had its reference swept. */
	rref_send_child_accept(ag, parent, fork_id, NULL);
}

static void fork_request_done(shmrpc_future *f, void *arg)
{
	struct agent *ag = worker_agent;

	if (ag)
		fork_answered(ag, arg, f->err, f->errmsg ? f->errmsg : "");
}

struct fork_job {
	struct job base;
	struct agent *ag;
	struct pending_user *p; /* a request to send; NULL: an accept */
	uint32_t parent;
	uint64_t fork_id;
};

static void run_fork_job(struct job *j)
{
	struct fork_job *fj = (struct fork_job *)j;
	struct pending_user *p = fj->p;
	shmrpc_future *f;

	if (!p) {
		rref_send_child_accept(fj->ag, fj->parent, fj->fork_id, NULL);
	} else if (rref_send_fork_request(fj->ag, p->id, p->slot, p->owner, p->fork_id, &f)) {
		fork_answered(fj->ag, p, -SHMRPC_EPEERDEAD, shmrpc_errmsg());
	} else {
		if (shmrpc_future_then(f, fork_request_done, p))
			fork_answered(fj->ag, p, -ENOMEM, shmrpc_errmsg());
		shmrpc_future_free(f);
	}
	free(fj);
}

/* One reference for rank unless the RRef is unreferenced already (its
 * parent died and was swept before the owner heard of the fork): torch's
 * owner would have counted the fork by then. Under rref_forks.lock, on the
 * owner: its removal of the entry waits for us. */
int rref_owner_hold(struct agent *ag, uint64_t id, uint32_t slot, uint32_t rank)
{
	struct rref_entry *e = rref_entry_at(&ag->rrefs, slot);
	struct rref_info info;
	uint32_t total;

	if (!rref_info_at(&ag->rrefs, slot, &info) || info.id != id || info.owner != ag->rank ||
	    rank >= ag->world)
		return shmrpc__fail(-EBADMSG, "a fork names an RRef (id %#" PRIx64 ", slot %u) that "
				    "is not ours in the RRef table", id, slot);
	/* seq_cst, as rref_hold: the child's state is read after. A total of
	 * 0 stays 0 (nobody holds a reference to make another from). */
	total = atomic_load_explicit(&e->total, memory_order_seq_cst);
	do {
		if (total == 0)
			return shmrpc__fail(-ENOENT, "RRef %#" PRIx64 " was deleted before its owner "
					    "heard of the fork (its parent is gone)", id);
	} while (!atomic_compare_exchange_weak_explicit(&e->total, &total, total + 1,
							memory_order_seq_cst, memory_order_seq_cst));
	atomic_fetch_add_explicit(&e->counts[rank], 1, memory_order_seq_cst);
	return 0;
}

bool rref_peer_running(struct agent *ag, uint32_t r)
{
	uint32_t st = atomic_load_explicit(&shm_worker(&ag->seg, r)->state, memory_order_seq_cst);

	return st != SHM_WORKER_DEAD && st != SHM_WORKER_EXITED;
}

struct owner_forks **rref_owner_forks_at(uint64_t id)
{
	struct owner_forks **at = &rref_forks.owned[rref_fork_bucket(id)];

	while (*at && (*at)->id != id)
		at = &(*at)->next;
	return at;
}

int rref_owner_add_fork(struct agent *ag, uint64_t id, uint32_t slot, uint64_t fork_id,
			uint32_t child)
{
	struct owner_forks **at, *of;
	int rc = 0;

	pthread_mutex_lock(&rref_forks.lock);
	at = rref_owner_forks_at(id);
	if (!(of = *at) && (of = calloc(1, sizeof(*of)))) {
		of->id = id;
		*at = of;
	}
	for (uint32_t i = 0; of && i < of->n; i++)
		if (of->fork[i] == fork_id)
			goto out; /* a repeated request: the reference exists */
	if (of && of->n == of->cap) {
		uint32_t cap = of->cap ? 2 * of->cap : 4;
		uint64_t *fk = realloc(of->fork, cap * sizeof(*fk));

		if (fk) {
			of->fork = fk;
			of->cap = cap;
		}
	}
	/* Under our lock: the parent's pending-child reference keeps the
	 * entry, or its last drop left it to us (by message, no value is
	 * RREF_VALUE_ALONE: rref_owner_store). */
	if (!of || of->n == of->cap) {
		rc = shmrpc__fail(-ENOMEM, "out of memory recording an RRef fork");
	} else {
		if (!(rc = rref_owner_hold(ag, id, slot, child)))
			of->fork[of->n++] = fork_id;
	}
	if (rc && of && !of->n) { /* nothing to remember */
		*at = of->next;
		free(of->fork);
		free(of);
	}
out:
	pthread_mutex_unlock(&rref_forks.lock);
	/* The child's reference, then its state (seq_cst both), as rref_charge. */
	if (rc == 0 && child != ag->rank && !rref_peer_running(ag, child) &&
	    rref_sweep_entry(&ag->rrefs, slot, id, child) == 1)
		rref_unreferenced(ag, id, slot, ag->rank);
	return rc;
}

/* Takes the pending child of fork_id out; NULL if there is none. */
static struct pending_child *child_take(uint64_t fork_id)
{
	struct pending_child **at, *c;

	pthread_mutex_lock(&rref_forks.lock);
	for (at = &rref_forks.child[rref_fork_bucket(fork_id)]; (c = *at) && c->fork_id != fork_id;
	     at = &c->next)
		;
	if (c)
		*at = c->next;
	pthread_mutex_unlock(&rref_forks.lock);
	return c;
}

void rref_child_drop(struct agent *ag, struct pending_child *c)
{
	if (c->via)
		rref_pending_put(ag, c->via);
	else
		rref_drop(ag, c->id, c->slot, c->owner);
	free(c);
}

void rref_child_accepted(struct agent *ag, uint64_t fork_id)
{
	struct pending_child *c = child_take(fork_id);

	if (c)
		rref_child_drop(ag, c);
}

/* Our pending-child reference for the fork of r we are sending to child. */
static int child_add(struct agent *ag, const shmrpc_rref *r, uint64_t fork_id, uint32_t child)
{
	struct pending_child *c = malloc(sizeof(*c));
	uint32_t b = rref_fork_bucket(fork_id);
	int rc = 0;

	if (!c)
		return shmrpc__fail(-ENOMEM, "out of memory forking an RRef");
	*c = (struct pending_child){ NULL, fork_id, r->id, r->slot, r->owner, child, NULL };
	pthread_mutex_lock(&rref_forks.lock);
	if (r->pending && r->pending->failed)
		rc = shmrpc__fail(-SHMRPC_EPEERDEAD, "RRef %#" PRIx64 ": its owner never confirmed "
				  "the fork that brought it here", r->id);
	else if (r->pending && !r->pending->done)
		r->pending->refs++; /* owed, as r's own */
	else
		rc = rref_hold(&ag->rrefs, r->slot, r->id, ag->rank, 1);
	if (rc == 0) {
		c->via = r->pending && !r->pending->done ? r->pending : NULL;
		c->next = rref_forks.child[b];
		rref_forks.child[b] = c;
	}
	pthread_mutex_unlock(&rref_forks.lock);
	if (rc)
		free(c);
	return rc;
}

int rref_unpack(const char *data, uint32_t len, bool take, shmrpc_rref **out)
{
	struct agent *ag = worker_agent;
	struct pending_user *p = NULL;
	struct fork_job *fj = NULL;
	struct rref_info info;
	struct rref_wire w;
	shmrpc_rref *r;
	int rc = 0;

	if (!ag || !ag->has_rrefs)
		return shmrpc__fail(-ENOTSUP, "an RRef came in, but this job has no RRef table");
	if (len != sizeof(w))
		return shmrpc__fail(-EBADMSG, "malformed RRef fork data (%u bytes, not %zu)", len,
				    sizeof(w));
	memcpy(&w, data, sizeof(w));
	/* Checked against the table, never trusted: the slot must hold the id. */
	if (!rref_info_at(&ag->rrefs, w.slot, &info) || info.id != w.id || info.owner != w.owner ||
	    w.parent >= ag->world)
		return shmrpc__fail(-EBADMSG, "an RRef came in that the RRef table does not hold "
				    "(id %#" PRIx64 ", slot %u)", w.id, w.slot);
	if (take || !(w.flags & RREF_WIRE_BY_MESSAGE)) {
		if (take && rref_hold(&ag->rrefs, w.slot, w.id, ag->rank, 1))
			return -EBADMSG;
	} else if (!(fj = malloc(sizeof(*fj))) ||
		   (w.owner != ag->rank && !(p = malloc(sizeof(*p))))) {
		rc = shmrpc__fail(-ENOMEM, "out of memory receiving an RRef");
	} else if (w.owner == ag->rank) {
		/* By message to its owner: it makes its own reference (the
		 * parent's keeps the RRef alive until then) and tells the parent. */
		pthread_mutex_lock(&rref_forks.lock);
		rc = rref_owner_hold(ag, w.id, w.slot, ag->rank);
		pthread_mutex_unlock(&rref_forks.lock);
	} else {
		/* To a user: pending until the owner answers; the handle and the
		 * request each hold a share of p. */
		*p = (struct pending_user){ w.id, w.fork_id, w.slot, w.owner, w.parent, 2, false, false };
	}
	if (rc == 0 && !(r = rref_handle_new(ag, w.id, w.owner == ag->rank ? w.id : w.fork_id, w.slot,
					w.owner))) {
		if (!p)
			rref_drop(ag, w.id, w.slot, w.owner);
		rc = -ENOMEM;
	}
	if (rc) {
		free(fj);
		free(p);
		return rc == -ENOMEM ? rc : -EBADMSG;
	}
	r->forked = true;
	r->pending = p;
	if (p) /* Relaxed: a gauge (pending_users_open). */
		atomic_fetch_add_explicit(&rref_pending_users_open, 1, memory_order_relaxed);
	if (fj) { /* from an executor thread: this may be the loop thread */
		*fj = (struct fork_job){ { .run = run_fork_job }, ag, p, w.parent, w.fork_id };
		executor_submit(&fj->base);
	}
	*out = r;
	return 0;
}

/* Takes back the first n references of l charged to dst (charge order). */
static void charge_undo(struct agent *ag, const struct tensor_list *l, uint32_t n, uint32_t dst,
			bool sweep)
{
	struct fork_log *log = fork_log();
	uint32_t j = 0;

	for (uint32_t i = 0; i < n; i++)
		if (rref_by_message(ag, l->r[i]))
			rref_child_accepted(ag, log->e[j++].fork_id);
		else if (sweep)
			rref_sweep_entry(&ag->rrefs, l->r[i]->slot, l->r[i]->id, dst);
		else
			rref_release(&ag->rrefs, l->r[i]->slot, l->r[i]->id, dst, 1);
	if (log)
		log->n = log->charged = 0;
}

int rref_charge(struct agent *ag, const struct tensor_list *l, uint32_t dst)
{
	struct fork_log *log = NULL;
	char why[160];
	uint32_t i, j, k = 0;
	int rc = 0;

	if (!ag->has_rrefs)
		return shmrpc__fail(-ENOTSUP, "this job has no RRef table");
	for (i = 0; i < l->nr; i++) {
		if ((rc = rref_handle_agent(l->r[i], &ag)))
			return rc;
		k += rref_by_message(ag, l->r[i]);
	}
	if (k) {
		/* This message's forks, at the end of the log, to the front. */
		if (!(log = fork_log()) || log->n - log->charged < k)
			return shmrpc__fail(-EPROTO, "an RRef fork was charged that was not packed");
		memmove(log->e, log->e + log->n - k, k * sizeof(*log->e));
		log->n = log->charged = k;
	}
	for (i = 0, j = 0; i < l->nr && rc == 0; i++) {
		if (!rref_by_message(ag, l->r[i]))
			rc = rref_hold(&ag->rrefs, l->r[i]->slot, l->r[i]->id, dst, 1);
		else if (log->e[j].r != l->r[i])
			rc = shmrpc__fail(-EPROTO, "an RRef fork was charged that was not packed");
		else
			rc = child_add(ag, l->r[i], log->e[j++].fork_id, dst);
	}
	if (rc) {
		charge_undo(ag, l, i - 1, dst, false);
		return rc;
	}
	/* The counts (seq_cst RMWs in rref_hold), then dst's state (seq_cst):
	 * either we see dst gone, or the launcher's sweep of dst, which
	 * follows its seq_cst store of the state, sees our counts. A gone
	 * dst's counts are all garbage; our pending children for it go too
	 * (or a peer-death collection took them first). */
	if (dst != ag->rank && !rref_peer_running(ag, dst)) {
		charge_undo(ag, l, l->nr, dst, true);
		agent_peer_gone_text(ag, dst, why, sizeof(why));
		return shmrpc__fail(-SHMRPC_EPEERDEAD, "%s", why);
	}
	return 0;
}

void rref_uncharge(struct agent *ag, const struct tensor_list *l, uint32_t dst)
{
	/* We hold our own reference to each: none of these is the last. */
	charge_undo(ag, l, l->nr, dst, dst != ag->rank && !ipc_port_peer_alive(&ag->port, dst));
}
