/* RRef handles, fork data, the owner's records and the RRef API; see rref.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/spin.h"
#include "ipc/doorbell.h"
#include "worker/client.h"
#include "worker/devmap.h"
#include "worker/executor.h"
#include "worker/future.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/profile.h"
#include "worker/python.h"
#include "worker/rref.h"
#include "worker/value.h"

/* Fork data on the wire (little endian, as the machine). */
struct rref_wire {
	uint64_t id;
	uint64_t fork_id;
	uint32_t slot;
	uint32_t owner;
	uint32_t parent; /* the sender */
	uint32_t flags;  /* RREF_WIRE_* */
};
_Static_assert(sizeof(struct rref_wire) == 32, "fork data is 32 bytes");

/* The parent keeps a pending-child reference: the child confirms the fork
 * by message (SHMRPC_RREF_FORK=message); otherwise the sender charged it. */
#define RREF_WIRE_BY_MESSAGE 1u

/* Ids made here: RRef ids and fork ids share the counter, from 0 as
 * torch's (programs and tests print them; RREF_ID keeps 0 off the
 * table's keys). Relaxed: only uniqueness matters. */
static _Atomic uint64_t next_local_id = 0;

static uint64_t new_id(struct agent *ag)
{
	return RREF_ID(ag->rank, atomic_fetch_add_explicit(&next_local_id, 1, memory_order_relaxed));
}

/* *ag = the running agent, of a job with an RRef table: 0, -ENOTCONN or
 * -ENOTSUP. */
static int rref_agent(struct agent **ag)
{
	int rc = agent_running(ag);

	if (rc)
		return rc;
	if (!(*ag)->has_rrefs || !(*ag)->has_pool)
		return shmrpc__fail(-ENOTSUP, "this job has no RRef table: start it with shmrun "
				    "(--max-rrefs sets its size)");
	return 0;
}

static int id_text(uint64_t id, char *buf, size_t len);

/* rref_agent, for a handle: -ENOTCONN too when r was made in a job that
 * has shut down since (an RRef kept across init_rpc, shutdown, init_rpc). */
static int handle_agent(const shmrpc_rref *r, struct agent **ag)
{
	int rc = rref_agent(ag);
	char id[96];

	if (rc || !r || r->job == (*ag)->job)
		return rc;
	id_text(r->id, id, sizeof(id));
	return shmrpc__fail(-ENOTCONN, "RRef %s belongs to an RPC job that has shut down (it "
			    "was deleted then): an RRef lives in the job that made it", id);
}

static int id_text(uint64_t id, char *buf, size_t len)
{
	return snprintf(buf, len, "GloballyUniqueId(created_on=%u, local_id=%" PRIu64 ")",
			RREF_ID_RANK(id), (uint64_t)RREF_ID_LOCAL(id));
}

/* ---- forks by message: state (the protocol is below) ---- */

/* A fork a user sent us, until its owner answers RREF_FORK_REQUEST
 * (torch's pending user). Its handles hold no reference yet: they owe one
 * each, as does each fork made from them meanwhile (a pending child with
 * via); the parent's pending-child reference keeps the RRef alive. */
struct pending_user {
	uint64_t id, fork_id;
	uint32_t slot, owner, parent;
	uint32_t refs;     /* the owing handles and children, and the request in flight */
	bool done, failed; /* answered; refused or lost (the handles stay without references) */
};

/* A fork we sent as a user, until its child accepts it (torch's pending
 * child): one reference of ours, or one owed by via. */
struct pending_child {
	struct pending_child *next;
	uint64_t fork_id, id;
	uint32_t slot, owner, child;
	struct pending_user *via;
};

/* The fork ids the owner has made references for, per RRef of ours
 * (torch's forks_): a repeated request finds its fork here. */
struct owner_forks {
	struct owner_forks *next;
	uint64_t id;
	uint32_t n, cap;
	uint64_t *fork;
};

#define FORK_BUCKETS 1024u

/* One lock for the three: the owner's removal of an entry also takes it,
 * so that a reference the owner makes for a child cannot meet a removal. */
static struct {
	pthread_mutex_t lock;
	struct pending_child *child[FORK_BUCKETS];
	struct owner_forks *owned[FORK_BUCKETS];
} forks = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* Pending users made and not yet answered (rref_debug_counts). Relaxed:
 * a gauge, ordered with nothing. */
static _Atomic uint64_t pending_users_open;

static uint32_t fork_bucket(uint64_t key)
{
	return (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> 54);
}

/* SHMRPC_RREF_FORK: table (default) or message; read once. */
static pthread_once_t fork_mode_once = PTHREAD_ONCE_INIT;
static bool fork_by_message, fork_mode_bad;

static void read_fork_mode(void)
{
	const char *m = getenv("SHMRPC_RREF_FORK");

	fork_by_message = m && !strcmp(m, "message");
	fork_mode_bad = m && !fork_by_message && strcmp(m, "table");
}

/* r goes to another worker by message: we are a user, and the mode says
 * so or r itself is still pending (it holds no reference to charge from). */
static bool by_message(const struct agent *ag, const shmrpc_rref *r)
{
	pthread_once(&fork_mode_once, read_fork_mode);
	return r->owner != ag->rank && (fork_by_message || r->pending);
}

static void release(struct agent *ag, uint64_t id, uint32_t slot, uint32_t owner);

/* One owing reference of p goes: a reference of ours in the table if the
 * owner confirmed p, nothing otherwise. ag NULL: the table is gone. */
static void pending_put(struct agent *ag, struct pending_user *p)
{
	/* Read while our share holds p: once it is dropped, another
	 * thread's put may be the last and free p before we release. */
	uint64_t id = p->id;
	uint32_t slot = p->slot, owner = p->owner;
	bool counted, last;

	pthread_mutex_lock(&forks.lock);
	counted = p->done && !p->failed;
	last = --p->refs == 0;
	pthread_mutex_unlock(&forks.lock);
	if (last)
		free(p);
	if (counted && ag)
		release(ag, id, slot, owner);
}

/* ---- handles ---- */

/* A handle for a reference this rank already holds in the table. */
static shmrpc_rref *handle_new(struct agent *ag, uint64_t id, uint64_t fork_id, uint32_t slot,
			       uint32_t owner)
{
	shmrpc_rref *r = calloc(1, sizeof(*r));

	if (!r)
		return shmrpc__fail(-ENOMEM, "out of memory making an RRef handle"), NULL;
	r->id = id;
	r->fork_id = fork_id;
	r->slot = slot;
	r->owner = owner;
	r->job = ag->job;
	agent_peer_name(ag, owner, r->owner_name, sizeof(r->owner_name));
	pthread_mutex_init(&r->lock, NULL);
	return r;
}

/* rref_release's answer 1: nobody holds id any more; its owner frees it. */
struct delete_job {
	struct job base;
	struct agent *ag;
	uint64_t id;
	uint32_t slot, owner;
};

static void run_delete(struct job *j)
{
	struct delete_job *d = (struct delete_job *)j;
	struct tensor_list none = { 0 };
	shmrpc_future *f;
	msgpack_sbuffer sb;
	msgpack_packer pk;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_array(&pk, 2);
	msgpack_pack_uint64(&pk, d->id);
	msgpack_pack_uint32(&pk, d->slot);
	/* The RREF_ACK completes a future no one waits for. A dead owner
	 * needs no word: the launcher's sweep removes its entries. */
	if (client_request(d->ag, (int)d->owner, MSG_RREF_USER_DELETE, &sb, &none,
			   SHMRPC_TIMEOUT_DEFAULT, "delete an RRef", &f) == 0)
		shmrpc_future_free(f);
	msgpack_sbuffer_destroy(&sb);
	free(d);
}

/* Our drop made id (at slot) unreferenced (rref_release returned 1): it
 * goes on its owner's collect list (rref_table.h), and the owner is told
 * unless it has been already: we are the owner (we collect now), or the
 * list was not empty (its first pusher told it). In message mode the owner
 * is told by RREF_USER_DELETE, as torch tells it. */
static void unreferenced(struct agent *ag, uint64_t id, uint32_t slot, uint32_t owner)
{
	bool first = rref_collect_push(&ag->rrefs, slot);
	struct delete_job *d;

	if (owner == ag->rank) {
		rref_owner_collect_listed(ag);
		return;
	}
	pthread_once(&fork_mode_once, read_fork_mode);
	if (!fork_by_message) {
		/* Wakes the owner only if it sleeps: awake, its loop thread
		 * looks at the list before it sleeps (ipc_port.news). */
		if (first)
			ipc_doorbell_notify(shm_worker(&ag->seg, owner), ag->self, IPC_FRAME_OTHER,
					    false);
		return;
	}
	/* Shutting down: the owner leaves too, and the launcher's sweep of it
	 * removes what it no longer needs to free. Relaxed: a hint. */
	if (atomic_load_explicit(&ag->stop, memory_order_relaxed))
		return;
	/* Sent from an executor thread: this may be the loop thread. */
	if (!(d = malloc(sizeof(*d)))) {
		fprintf(stderr, "shmrpc: worker %u: out of memory telling worker %u to free an "
			"RRef; it is freed when that worker next sees a death or ends\n", ag->rank,
			owner);
		return;
	}
	*d = (struct delete_job){ { .run = run_delete }, ag, id, slot, owner };
	executor_submit(&d->base);
}

/* Drops one of our references to (id, slot, owner). */
static void release(struct agent *ag, uint64_t id, uint32_t slot, uint32_t owner)
{
	int rc;

	/* Acquire, pairs with rref_drop_users' release store: its drops
	 * came before, and ours is one of them. */
	if (owner != ag->rank && atomic_load_explicit(&ag->users_dropped, memory_order_acquire))
		return;
	rc = rref_release(&ag->rrefs, slot, id, ag->rank, 1);

	if (rc == 1)
		unreferenced(ag, id, slot, owner);
	else if (rc < 0)
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
}

void shmrpc_rref_free(shmrpc_rref *r)
{
	struct agent *ag = worker_agent;

	if (!r)
		return;
	/* After shutdown the table is gone (another job's, after init_rpc
	 * again); the launcher swept our references. */
	if (!ag || !ag->has_rrefs || ag->job != r->job)
		ag = NULL;
	if (r->pending)
		pending_put(ag, r->pending);
	else if (ag)
		release(ag, r->id, r->slot, r->owner);
	if (r->created)
		future_unref(r->created);
	arena_free(&r->arena);
	tensor_list_free(&r->local_held);
	pthread_mutex_destroy(&r->lock);
	free(r);
}

int shmrpc_rref_retain(shmrpc_rref *r, shmrpc_rref **out)
{
	struct agent *ag;
	struct pending_user *p = NULL;
	bool failed = false;
	shmrpc_rref *n;
	int rc = handle_agent(r, &ag);

	if (rc)
		return rc;
	if (r->pending) {
		/* Not confirmed yet: the copy owes its reference too. */
		pthread_mutex_lock(&forks.lock);
		p = r->pending->done ? NULL : r->pending;
		failed = r->pending->failed;
		if (p)
			p->refs++;
		pthread_mutex_unlock(&forks.lock);
		if (failed)
			return shmrpc__fail(-SHMRPC_EPEERDEAD, "RRef %#" PRIx64 ": its owner never "
					    "confirmed the fork that brought it here", r->id);
	}
	rc = p ? 0 : rref_hold(&ag->rrefs, r->slot, r->id, ag->rank, 1);
	if (rc)
		return rc;
	if (!(n = handle_new(ag, r->id, r->owner == ag->rank ? r->id : new_id(ag), r->slot,
			     r->owner))) {
		if (p)
			pending_put(ag, p);
		else
			release(ag, r->id, r->slot, r->owner);
		return -ENOMEM;
	}
	n->forked = true;
	n->pending = p;
	*out = n;
	return 0;
}

/* ---- fork data ---- */

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
	w.fork_id = new_id(ag);
	if (by_message(ag, r)) {
		if (fork_mode_bad)
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

/* Sends a fork message and forgets it, or keeps its request in *out. */
static int send_fork_msg(struct agent *ag, uint32_t dst, uint16_t type, uint64_t id, uint32_t slot,
			 uint64_t fork_id, shmrpc_future **out)
{
	struct tensor_list none = { 0 };
	msgpack_sbuffer sb;
	msgpack_packer pk;
	shmrpc_future *f;
	int rc;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if (type == MSG_RREF_FORK_REQUEST) {
		msgpack_pack_array(&pk, 2);
		msgpack_pack_uint64(&pk, id);
		msgpack_pack_uint32(&pk, slot);
	}
	msgpack_pack_uint64(&pk, fork_id);
	/* No timeout: a live owner answers; a death fails the request. */
	rc = client_request(ag, (int)dst, type, &sb, &none, SHMRPC_TIMEOUT_NONE,
			    type == MSG_RREF_FORK_REQUEST ? "confirm an RRef fork with its owner"
							  : "accept an RRef fork", &f);
	msgpack_sbuffer_destroy(&sb);
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
	atomic_fetch_sub_explicit(&pending_users_open, 1, memory_order_relaxed);
	pthread_mutex_lock(&forks.lock);
	p->done = true;
	p->failed = err != 0;
	owed = p->refs - 1;
	/* Under the lock: a handle that goes after done drops its own. */
	if (!err && owed > 1)
		rc = rref_hold(&ag->rrefs, slot, id, ag->rank, owed - 1);
	last = --p->refs == 0;
	pthread_mutex_unlock(&forks.lock);
	if (rc)
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
	if (!err && owed == 0) /* every handle went meanwhile */
		release(ag, id, slot, owner);
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
 * owner would have counted the fork by then. Under forks.lock, on the
 * owner: its removal of the entry waits for us. */
static int owner_hold(struct agent *ag, uint64_t id, uint32_t slot, uint32_t rank)
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

static bool peer_running(struct agent *ag, uint32_t r)
{
	uint32_t st = atomic_load_explicit(&shm_worker(&ag->seg, r)->state, memory_order_seq_cst);

	return st != SHM_WORKER_DEAD && st != SHM_WORKER_EXITED;
}

int rref_owner_add_fork(struct agent *ag, uint64_t id, uint32_t slot, uint64_t fork_id,
			uint32_t child)
{
	struct owner_forks **at, *of;
	int rc = 0;

	pthread_mutex_lock(&forks.lock);
	for (at = &forks.owned[fork_bucket(id)]; *at && (*at)->id != id; at = &(*at)->next)
		;
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
	if (!of || of->n == of->cap)
		rc = shmrpc__fail(-ENOMEM, "out of memory recording an RRef fork");
	else if (!(rc = owner_hold(ag, id, slot, child)))
		of->fork[of->n++] = fork_id;
	if (rc && of && !of->n) { /* nothing to remember */
		*at = of->next;
		free(of->fork);
		free(of);
	}
out:
	pthread_mutex_unlock(&forks.lock);
	/* The child's reference, then its state (seq_cst both), as rref_charge. */
	if (rc == 0 && child != ag->rank && !peer_running(ag, child) &&
	    rref_sweep_entry(&ag->rrefs, slot, id, child) == 1)
		unreferenced(ag, id, slot, ag->rank);
	return rc;
}

/* Takes the pending child of fork_id out; NULL if there is none. */
static struct pending_child *child_take(uint64_t fork_id)
{
	struct pending_child **at, *c;

	pthread_mutex_lock(&forks.lock);
	for (at = &forks.child[fork_bucket(fork_id)]; (c = *at) && c->fork_id != fork_id;
	     at = &c->next)
		;
	if (c)
		*at = c->next;
	pthread_mutex_unlock(&forks.lock);
	return c;
}

static void child_drop(struct agent *ag, struct pending_child *c)
{
	if (c->via)
		pending_put(ag, c->via);
	else
		release(ag, c->id, c->slot, c->owner);
	free(c);
}

void rref_child_accepted(struct agent *ag, uint64_t fork_id)
{
	struct pending_child *c = child_take(fork_id);

	if (c)
		child_drop(ag, c);
}

/* Our pending-child reference for the fork of r we are sending to child. */
static int child_add(struct agent *ag, const shmrpc_rref *r, uint64_t fork_id, uint32_t child)
{
	struct pending_child *c = malloc(sizeof(*c));
	uint32_t b = fork_bucket(fork_id);
	int rc = 0;

	if (!c)
		return shmrpc__fail(-ENOMEM, "out of memory forking an RRef");
	*c = (struct pending_child){ NULL, fork_id, r->id, r->slot, r->owner, child, NULL };
	pthread_mutex_lock(&forks.lock);
	if (r->pending && r->pending->failed)
		rc = shmrpc__fail(-SHMRPC_EPEERDEAD, "RRef %#" PRIx64 ": its owner never confirmed "
				  "the fork that brought it here", r->id);
	else if (r->pending && !r->pending->done)
		r->pending->refs++; /* owed, as r's own */
	else
		rc = rref_hold(&ag->rrefs, r->slot, r->id, ag->rank, 1);
	if (rc == 0) {
		c->via = r->pending && !r->pending->done ? r->pending : NULL;
		c->next = forks.child[b];
		forks.child[b] = c;
	}
	pthread_mutex_unlock(&forks.lock);
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
		pthread_mutex_lock(&forks.lock);
		rc = owner_hold(ag, w.id, w.slot, ag->rank);
		pthread_mutex_unlock(&forks.lock);
	} else {
		/* To a user: pending until the owner answers; the handle and the
		 * request each hold a share of p. */
		*p = (struct pending_user){ w.id, w.fork_id, w.slot, w.owner, w.parent, 2, false, false };
	}
	if (rc == 0 && !(r = handle_new(ag, w.id, w.owner == ag->rank ? w.id : w.fork_id, w.slot,
					w.owner))) {
		if (!p)
			release(ag, w.id, w.slot, w.owner);
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
		atomic_fetch_add_explicit(&pending_users_open, 1, memory_order_relaxed);
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
		if (by_message(ag, l->r[i]))
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
		if ((rc = handle_agent(l->r[i], &ag)))
			return rc;
		k += by_message(ag, l->r[i]);
	}
	if (k) {
		/* This message's forks, at the end of the log, to the front. */
		if (!(log = fork_log()) || log->n - log->charged < k)
			return shmrpc__fail(-EPROTO, "an RRef fork was charged that was not packed");
		memmove(log->e, log->e + log->n - k, k * sizeof(*log->e));
		log->n = log->charged = k;
	}
	for (i = 0, j = 0; i < l->nr && rc == 0; i++) {
		if (!by_message(ag, l->r[i]))
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
	if (dst != ag->rank && !peer_running(ag, dst)) {
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

/* ---- the owner's records ---- */

#define RECORD_BUCKETS 1024u

struct record {
	struct record *next;
	uint64_t id;
	uint32_t slot;
	uint64_t value_off;     /* our pool block with the encoded value or error */
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
	if (pool_unref(&ag->pool, ag->rank, rec->value_off))
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

/* Encodes v into a new pool block; the tensors (by reference: an inline
 * one's bytes are in the block) and RRefs it holds get references of ours
 * in held, and are listed in sent. */
static int store_block(struct agent *ag, const shmrpc_value *v, uint64_t *off, uint64_t *len,
		       struct tensor_list *held, struct tensor_list *sent)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;
	int rc;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	rc = value_pack(&pk, v, sent) ?: tensor_list_hold(sent, held);
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
	msgpack_sbuffer_destroy(&sb);
	return rc;
}

int rref_owner_store(struct agent *ag, uint64_t id, uint32_t slot, const shmrpc_value *result,
		     const shmrpc_value *error, bool live, struct tensor_list *sent)
{
	struct record *rec = calloc(1, sizeof(*rec));
	uint64_t len = 0;
	int rc = rec ? 0 : shmrpc__fail(-ENOMEM, "out of memory storing an RRef's value");

	if (rc == 0) {
		rec->id = id;
		rec->slot = slot;
		rec->live = live && !error;
		rc = store_block(ag, error ? error : result, &rec->value_off, &len, &rec->held, sent);
	}
	if (rc) {
		char msg[1024];

		/* Our run's reference goes all the same; the creator's request
		 * fails with this error, and to_here() with it. */
		snprintf(msg, sizeof(msg), "%s", shmrpc_errmsg());
		if (rec)
			tensor_list_free(&rec->held);
		free(rec);
		if (live)
			release_live(id);
		if (rref_release(&ag->rrefs, slot, id, ag->rank, 1) == 1)
			unreferenced(ag, id, slot, ag->rank);
		return shmrpc__fail(rc, "cannot store the RRef's value: %s", msg);
	}
	pthread_mutex_lock(&records.lock);
	*record_at(id) = rec;
	pthread_mutex_unlock(&records.lock);
	/* From here readers may decode the block; our run's reference goes. */
	rc = rref_store(&ag->rrefs, slot, id, error ? RREF_ERROR : RREF_READY, rec->value_off, len);
	if (rc == 1)
		unreferenced(ag, id, slot, ag->rank);
	return rc < 0 ? rc : 0;
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

/* Waits for id to leave PENDING. An executor thread is counted out of its
 * pool meanwhile (executor_block_begin), which runs the owner's job for
 * the value, if queued, on another thread: run here, it could wait for
 * what a frame below produces. Elsewhere the wait spins first as long as a
 * hand-off does (worker_handoff_spin), since the owner's store wakes a
 * futex sleeper only with a syscall. */
static int wait_ready(struct agent *ag, uint32_t slot, uint64_t id, uint64_t deadline_ns)
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
	came = shmrpc_spin_until(looked_settled, &l, worker_handoff_spin(deadline_ns));
	worker_handoff_spun(came);
	return came ? l.st : rref_wait(&ag->rrefs, slot, id, deadline_ns);
}

int rref_owner_fetch(struct agent *ag, uint64_t id, uint32_t slot, uint64_t deadline_ns, void **buf,
		     size_t *len, uint32_t *state)
{
	struct rref_entry *e;
	int st = wait_ready(ag, slot, id, deadline_ns);
	const void *at;

	if (st < 0)
		return st == -ETIMEDOUT ? shmrpc__fail(st, "the RRef's value was not ready in time")
					: st;
	if (st != RREF_READY && st != RREF_ERROR)
		return shmrpc__fail(-EINVAL, "RRef %#" PRIx64 " is %s", id, rref_state_name((uint32_t)st));
	e = rref_entry_at(&ag->rrefs, slot);
	/* Relaxed: ordered by the acquire of the state in rref_wait. */
	*len = atomic_load_explicit(&e->value_len, memory_order_relaxed);
	at = pool_at(&ag->pool, atomic_load_explicit(&e->value_off, memory_order_relaxed), *len);
	if (!at || !(*buf = malloc(*len ? *len : 1)))
		return shmrpc__fail(at ? -ENOMEM : -EBADMSG, "cannot read RRef %#" PRIx64 "'s value",
				    id);
	pool_read(*buf, at, *len);
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
	pthread_mutex_lock(&forks.lock);
	for (fat = &forks.owned[fork_bucket(id)]; (of = *fat) && of->id != id; fat = &of->next)
		;
	if (of)
		*fat = of->next;
	/* Without a record it never got a value (its store failed). */
	rref_remove(&ag->rrefs, slot, id);
	pthread_mutex_unlock(&forks.lock);
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
	pthread_mutex_lock(&forks.lock);
	for (uint32_t b = 0; b < FORK_BUCKETS; b++) {
		struct pending_child **at = &forks.child[b];

		while ((c = *at)) {
			if (c->child != ag->rank && !peer_running(ag, c->child)) {
				*at = c->next;
				c->next = gone;
				gone = c;
			} else {
				at = &c->next;
			}
		}
	}
	pthread_mutex_unlock(&forks.lock);
	while ((c = gone)) {
		gone = c->next;
		child_drop(ag, c);
	}
	/* What the sweep left unreferenced, it put on our list. */
	rref_owner_collect_listed(ag);
}

void rref_owner_free_all(struct agent *ag)
{
	/* The launcher sweeps the references the pending children hold. */
	pthread_mutex_lock(&forks.lock);
	for (uint32_t b = 0; b < FORK_BUCKETS; b++) {
		struct pending_child *c;
		struct owner_forks *of;

		while ((c = forks.child[b])) {
			forks.child[b] = c->next;
			if (c->via && --c->via->refs == 0)
				free(c->via);
			free(c);
		}
		while ((of = forks.owned[b])) {
			forks.owned[b] = of->next;
			free(of->fork);
			free(of);
		}
	}
	pthread_mutex_unlock(&forks.lock);
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

/* ---- reading the value ---- */

/* Decodes the block of a READY or ERROR entry into f (no one else sees f
 * yet), then checks the entry still says so: a value decoded from the
 * block of an owner that died meanwhile may be garbage (its pool blocks go
 * after its entries are marked), and is dropped. */
static int decode_entry(struct agent *ag, const shmrpc_rref *r, uint32_t state, shmrpc_future *f)
{
	struct rref_entry *e = rref_entry_at(&ag->rrefs, r->slot);
	/* Relaxed: ordered by the acquire of the state that said READY/ERROR. */
	uint64_t len = atomic_load_explicit(&e->value_len, memory_order_relaxed);
	const void *at = pool_at(&ag->pool, atomic_load_explicit(&e->value_off, memory_order_relaxed),
				 len);
	void *copy = at ? malloc(len ? len : 1) : NULL;
	size_t used;
	int rc;

	if (!copy)
		return shmrpc__fail(at ? -ENOMEM : -EBADMSG, "cannot read the value of RRef %#"
				    PRIx64, r->id);
	/* Copied, then checked, then decoded: a seqlock reader's order. */
	pool_read(copy, at, len);
	/* The re-read is an acq_rel RMW that changes nothing: its release
	 * orders the copy above before it, and an owner sweep that marks the
	 * entry later reads it, so the pool frees the block only after our
	 * copy. A block of an owner that died meanwhile may hold garbage. */
	if (RREF_STATE(atomic_fetch_or_explicit(&e->state, 0, memory_order_acq_rel)) != state ||
	    atomic_load_explicit(&e->key, memory_order_relaxed) != r->id) {
		free(copy);
		return -SHMRPC_EPEERDEAD;
	}
	f->tensors.take = true;
	/* The owner's value, as its reply to a fetch would bring it. */
	f->tensors.land = devmap_landing(ag, r->owner, true);
	rc = value_unpack(copy, len, &f->arena, &f->value, &used, &f->tensors);
	free(copy);
	if (rc) {
		char why[512];

		/* Copied first: the error's own buffer is where it is written. */
		snprintf(why, sizeof(why), "%s", shmrpc_errmsg());
		return shmrpc__fail(-EBADMSG, "the stored value of RRef %#" PRIx64 " cannot be "
				    "decoded: %s", r->id, why);
	}
	return 0;
}

static int owner_gone(struct agent *ag, const shmrpc_rref *r)
{
	char rs[160], why[160];

	shmrpc_rref_str(r, rs, sizeof(rs));
	agent_peer_gone_text(ag, r->owner, why, sizeof(why));
	/* "worker 2 (w2) died: ..." becomes "the owner worker 2 (w2) of RRef ... died: ..." */
	return shmrpc__fail(-SHMRPC_EPEERDEAD, "the owner worker %u (%s) of %s is gone: %s",
			    r->owner, r->owner_name, rs, why);
}

/* The stored error [type, text, backtrace] as a failed future's fields. */
static int fail_with_stored(shmrpc_future *f)
{
	const shmrpc_value *it = f->value.u.items;

	if (f->value.type != SHMRPC_LIST || f->value.len != 3 || it[0].type != SHMRPC_STR ||
	    it[1].type != SHMRPC_STR || it[2].type != SHMRPC_STR)
		return shmrpc__fail(-EBADMSG, "an RRef's stored error is malformed");
	f->errtype = strdup(it[0].u.s);
	f->backtrace = strdup(it[2].u.s);
	return shmrpc__fail(-SHMRPC_EREMOTE, "%s", it[1].u.s);
}

static uint64_t deadline_of(struct agent *ag, int64_t timeout_ms)
{
	if (timeout_ms == SHMRPC_TIMEOUT_DEFAULT)
		return ag->default_timeout_ns ? shmrpc_now_ns() + ag->default_timeout_ns : 0;
	return timeout_ms > 0 ? shmrpc_now_ns() + (uint64_t)timeout_ms * 1000000u : 0;
}

/* remote()'s request failed, or ran past its deadline (the loop fails it
 * soon): the RRef fails too, and stays failed even if the owner stores a
 * value later (as torch's, whose words these are for a timeout). 0 when the
 * request has not failed. */
static int creation_failed(shmrpc_rref *r, uint64_t now)
{
	shmrpc_future *f = r->created;
	bool done = f && shmrpc_future_done(f);

	if (!f || (done && !f->err) || (!done && !(f->deadline_ns && now >= f->deadline_ns)))
		return 0;
	if (done && f->err != -ETIMEDOUT)
		return shmrpc__fail(f->err, "%s", f->errmsg);
	return shmrpc__fail(-ETIMEDOUT, "RRef creation via rpc.remote() timed out, and it is "
			    "possible that the RRef on the owner node has not been created: RPC "
			    "ran for more than the set timeout (%lld ms)", (long long)f->timeout_ms);
}

/* Waits for r's entry to leave PENDING, watching remote()'s request too: a
 * request that failed (timeout, lost) leaves the entry pending for ever. */
static int wait_value(struct agent *ag, shmrpc_rref *r, uint64_t deadline_ns)
{
	for (;;) {
		uint64_t now = shmrpc_now_ns(), slice = now + 50000000u; /* 50 ms */
		int st = creation_failed(r, now);

		if (st)
			return st;
		if (r->created && r->created->deadline_ns > now && r->created->deadline_ns < slice)
			slice = r->created->deadline_ns;
		st = wait_ready(ag, r->slot, r->id, deadline_ns && deadline_ns < slice ? deadline_ns
											: slice);
		if (st != -ETIMEDOUT)
			return st;
		if (deadline_ns && shmrpc_now_ns() >= deadline_ns)
			return -ETIMEDOUT;
	}
}

static int read_value(struct agent *ag, shmrpc_rref *r, int64_t timeout_ms, shmrpc_future *f)
{
	int st = wait_value(ag, r, deadline_of(ag, timeout_ms));
	char rs[160];

	if (st == -ETIMEDOUT && creation_failed(r, shmrpc_now_ns()))
		return st; /* creation_failed() said why */
	if (st == -ETIMEDOUT) {
		shmrpc_rref_str(r, rs, sizeof(rs));
		return shmrpc__fail(-ETIMEDOUT, "the value of %s was not ready within %lld ms "
				    "(owner: worker %u (%s))", rs, (long long)timeout_ms, r->owner,
				    r->owner_name);
	}
	/* remote()'s request failed with the owner's death (it went to the
	 * owner) before the launcher's sweep marked the entry: the same error. */
	if (st == RREF_OWNER_DEAD || st == -SHMRPC_EPEERDEAD)
		return owner_gone(ag, r);
	if (st < 0)
		return st;
	if (st != RREF_READY && st != RREF_ERROR)
		return shmrpc__fail(-EINVAL, "RRef %#" PRIx64 " is %s while referenced", r->id,
				    rref_state_name((uint32_t)st));
	st = decode_entry(ag, r, (uint32_t)st, f) ?: st;
	if (st == -SHMRPC_EPEERDEAD)
		return owner_gone(ag, r);
	return st == RREF_ERROR ? fail_with_stored(f) : st < 0 ? st : 0;
}

/* to_here() by SCRIPT_RREF_FETCH_CALL: the owner answers with the value
 * (for values that live in the owner's process; here on request). */
static int fetch_by_message(struct agent *ag, shmrpc_rref *r, int64_t timeout_ms,
			    shmrpc_future **out)
{
	struct tensor_list none = { 0 };
	msgpack_sbuffer sb;
	msgpack_packer pk;
	shmrpc_future *f;
	int rc;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_array(&pk, 2);
	msgpack_pack_uint64(&pk, r->id);
	msgpack_pack_uint32(&pk, r->slot);
	rc = client_request(ag, (int)r->owner, MSG_SCRIPT_RREF_FETCH_CALL, &sb, &none, timeout_ms,
			    "fetch an RRef's value", &f);
	msgpack_sbuffer_destroy(&sb);
	return rc ? rc : client_sync_wait(f, out);
}

int shmrpc_rref_to_here(shmrpc_rref *r, int64_t timeout_ms, shmrpc_future **out)
{
	struct agent *ag;
	shmrpc_future *f;
	int rc;

	if (!out || !r)
		return shmrpc__fail(-EINVAL, "shmrpc_rref_to_here: r and out must be given");
	*out = NULL;
	if ((rc = handle_agent(r, &ag)))
		return rc;
	if (timeout_ms < 0 && timeout_ms != SHMRPC_TIMEOUT_DEFAULT)
		return shmrpc__fail(-EINVAL, "timeout %lld ms: give a positive number, "
				    "SHMRPC_TIMEOUT_DEFAULT or SHMRPC_TIMEOUT_NONE", (long long)timeout_ms);
	if (r->owner != ag->rank && ag->rref_fetch_by_message) {
		/* The owner answers once it has stored; remote()'s request may
		 * have failed before or meanwhile (wait_value's rule). */
		rc = creation_failed(r, shmrpc_now_ns()) ?: fetch_by_message(ag, r, timeout_ms, out);
		if (!rc && (rc = creation_failed(r, shmrpc_now_ns()))) {
			future_unref(*out);
			*out = NULL;
		}
		return rc;
	}
	if (!(f = future_new()))
		return shmrpc__fail(-ENOMEM, "out of memory making a future");
	rc = read_value(ag, r, timeout_ms, f);
	if (rc) {
		future_unref(f);
		return rc;
	}
	atomic_store_explicit(&f->done, 1, memory_order_release); /* f is ours alone still */
	*out = f;
	return 0;
}

int rref_local_value(shmrpc_rref *r, const shmrpc_value **out)
{
	struct agent *ag;
	shmrpc_future *f;
	int rc = handle_agent(r, &ag);

	if (rc)
		return rc;
	pthread_mutex_lock(&r->lock);
	if (!r->local_loaded) {
		if (!(f = future_new())) {
			rc = shmrpc__fail(-ENOMEM, "out of memory reading an RRef's value");
		} else if (!(rc = read_value(ag, r, SHMRPC_TIMEOUT_DEFAULT, f))) {
			/* The future's decoded value moves into the handle. */
			r->arena = f->arena;
			r->local = f->value;
			r->local_held = f->tensors;
			f->arena = (struct arena){ 0 };
			f->tensors = (struct tensor_list){ 0 };
			r->local_loaded = true;
		}
		if (f)
			future_unref(f);
	}
	pthread_mutex_unlock(&r->lock);
	if (rc == 0)
		*out = &r->local;
	return rc;
}

int shmrpc_rref_local_value(shmrpc_rref *r, const shmrpc_value **out)
{
	struct agent *ag;
	char rs[160], me[SHM_NAME_MAX];
	int rc = handle_agent(r, &ag);

	if (rc)
		return rc;
	if (!r || !out)
		return shmrpc__fail(-EINVAL, "shmrpc_rref_local_value: r and out must be given");
	if (r->owner != ag->rank) {
		shmrpc_rref_str(r, rs, sizeof(rs));
		agent_peer_name(ag, ag->rank, me, sizeof(me));
		return shmrpc__fail(-EPERM, "For %s, can't call localValue() on user worker %u (%s). "
				    "Call it on owner worker %u (%s)", rs, ag->rank, me, r->owner,
				    r->owner_name);
	}
	return rref_local_value(r, out);
}

/* ---- what an RRef says of itself ---- */

int shmrpc_rref_owner(const shmrpc_rref *r)
{
	return (int)r->owner;
}

const char *shmrpc_rref_owner_name(const shmrpc_rref *r)
{
	return r->owner_name;
}

int shmrpc_rref_is_owner(const shmrpc_rref *r)
{
	struct agent *ag = worker_agent;

	return ag && r->owner == ag->rank;
}

int shmrpc_rref_confirmed_by_owner(const shmrpc_rref *r)
{
	struct agent *ag = worker_agent;
	struct rref_info info;

	/* A fork's reference is in the table before the fork leaves its
	 * parent, or once the owner has answered its fork request; remote()'s
	 * once the owner has stored the result. */
	if (!ag || !ag->has_rrefs)
		return 0;
	if (r->pending) {
		bool confirmed;

		pthread_mutex_lock(&forks.lock);
		confirmed = r->pending->done && !r->pending->failed;
		pthread_mutex_unlock(&forks.lock);
		return confirmed;
	}
	if (r->owner == ag->rank || r->forked)
		return 1;
	return rref_info_at(&ag->rrefs, r->slot, &info) && info.id == r->id &&
	       info.state != RREF_PENDING;
}

int shmrpc_rref_str(const shmrpc_rref *r, char *buf, size_t len)
{
	struct agent *ag = worker_agent;
	char id[96], fork[96];

	id_text(r->id, id, sizeof(id));
	if (ag && r->owner == ag->rank)
		return snprintf(buf, len, "OwnerRRef(%s)", id);
	id_text(r->fork_id, fork, sizeof(fork));
	return snprintf(buf, len, "UserRRef(RRefId = %s, ForkId = %s)", id, fork);
}

/* ---- making RRefs ---- */

/* remote()'s request could not go: the reference of the owner's run and
 * ours are dropped, and the entry, which no one else knows, removed. */
static void abandon(struct agent *ag, shmrpc_rref *r)
{
	if (r->owner != ag->rank)
		rref_sweep_entry(&ag->rrefs, r->slot, r->id, r->owner);
	if (rref_release(&ag->rrefs, r->slot, r->id, ag->rank, r->owner == ag->rank ? 2 : 1) == 1)
		rref_remove(&ag->rrefs, r->slot, r->id);
	pthread_mutex_destroy(&r->lock);
	free(r);
}

/* remote() of fn(args), or of a Python call (py not NULL: python_remote's
 * request; fn names it for errors). */
static int remote(struct agent *ag, int dst, const char *fn, const shmrpc_value *args,
		  uint32_t nargs, uint32_t flags, const struct python_request *py,
		  int64_t timeout_ms, shmrpc_rref **out)
{
	struct tensor_list sent = { 0 };
	msgpack_sbuffer sb;
	msgpack_packer pk;
	shmrpc_rref *r;
	uint64_t id;
	uint32_t slot;
	char what[CLIENT_WHAT_MAX];
	int rc;

	*out = NULL;
	if (dst < 0 || (uint32_t)dst >= ag->world)
		return shmrpc__fail(-EINVAL, "cannot make a remote %s() on rank %d: the job has %u "
				    "workers (ranks 0 to %u)", fn, dst, ag->world, ag->world - 1);
	id = new_id(ag);
	rc = rref_insert(&ag->rrefs, id, (uint32_t)dst, ag->rank, 0, &slot);
	if (rc)
		return rc;
	if (!(r = handle_new(ag, id, (uint32_t)dst == ag->rank ? id : new_id(ag), slot,
			     (uint32_t)dst))) {
		rref_release(&ag->rrefs, slot, id, ag->rank, 1);
		rref_release(&ag->rrefs, slot, id, (uint32_t)dst, 1);
		rref_remove(&ag->rrefs, slot, id);
		return -ENOMEM;
	}
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if (py)
		rc = python_remote_pack(&pk, py, id, slot, &sent);
	else if (msgpack_pack_array(&pk, 2) || msgpack_pack_uint64(&pk, id) ||
		 msgpack_pack_uint32(&pk, slot))
		rc = shmrpc__fail(-ENOMEM, "out of memory encoding a remote call");
	else
		rc = client_encode_call(&sb, fn, args, nargs, flags, &sent);
	client_what(what, "make a remote", fn, "");
	profile_name_next("rpc_remote", py ? NULL : fn);
	if (rc)
		tensor_list_forget(&sent);
	else
		rc = client_request(ag, dst, py ? py->type : MSG_SCRIPT_REMOTE_CALL,
				    &sb, &sent, timeout_ms, what, &r->created);
	msgpack_sbuffer_destroy(&sb);
	if (rc) {
		abandon(ag, r);
		return rc;
	}
	*out = r;
	return 0;
}

int shmrpc_remote(int dst, const char *fn, const shmrpc_value *args, uint32_t nargs,
		  int64_t timeout_ms, shmrpc_rref **out)
{
	struct agent *ag;

	if (!out || !fn || (nargs && !args))
		return shmrpc__fail(-EINVAL, "shmrpc_remote: fn, out and args must be given");
	*out = NULL;
	return rref_agent(&ag) ?: remote(ag, dst, fn, args, nargs, 0, NULL, timeout_ms, out);
}

int python_remote(int dst, const struct python_request *r, int64_t timeout_ms, shmrpc_rref **out)
{
	struct agent *ag;
	int rc;

	*out = NULL;
	if ((rc = rref_agent(&ag)))
		return rc;
	rc = remote(ag, dst, "Python function", NULL, 0, 0, r, timeout_ms, out);
	if (rc == 0)
		python_count_sent(r->type);
	return rc;
}

int python_rref_local(const char *pickled, uint32_t len, bool live, shmrpc_rref **out)
{
	struct agent *ag;
	struct python_request v = { .type = MSG_PYTHON_RET };
	struct tensor_list sent = { 0 };
	struct arena a = { 0 };
	shmrpc_value value;
	shmrpc_rref *r;
	uint64_t id;
	uint32_t slot;
	int rc;

	*out = NULL;
	if ((rc = rref_agent(&ag)))
		return rc;
	/* As a remote() to ourselves, stored at once: the creator's
	 * reference is the handle's, the pending run's goes in the store. */
	id = new_id(ag);
	rc = rref_insert(&ag->rrefs, id, ag->rank, ag->rank, 0, &slot);
	if (rc)
		return rc;
	if (!(r = handle_new(ag, id, id, slot, ag->rank))) {
		rref_release(&ag->rrefs, slot, id, ag->rank, 2);
		rref_remove(&ag->rrefs, slot, id);
		return -ENOMEM;
	}
	v.msg.data = pickled;
	v.msg.len = len;
	v.rref_id = id;
	v.rref_slot = slot;
	rc = python_request_value(&v, &a, &value);
	if (rc == 0) {
		/* A pickle alone: the list stays empty, its arrays go. */
		rc = rref_owner_store(ag, id, slot, &value, NULL, live, &sent);
		tensor_list_forget(&sent);
	} else if (rref_release(&ag->rrefs, slot, id, ag->rank, 1) == 1) {
		unreferenced(ag, id, slot, ag->rank);
	}
	arena_free(&a);
	if (rc) {
		shmrpc_rref_free(r);
		return rc;
	}
	*out = r;
	return 0;
}

/* ---- the proxies: fn(value of r, args...) on r's owner ---- */

enum proxy_kind { PROXY_SYNC, PROXY_ASYNC, PROXY_REMOTE };

static int proxy(shmrpc_rref *r, enum proxy_kind kind, const char *fn, const shmrpc_value *args,
		 uint32_t nargs, int64_t timeout_ms, void *out)
{
	struct agent *ag;
	shmrpc_value *all;
	int rc = handle_agent(r, &ag);

	if (rc)
		return rc;
	if (!r || !fn || !out || (nargs && !args))
		return shmrpc__fail(-EINVAL, "RRef proxy: r, fn, out and args must be given");
	if (!(all = malloc(((size_t)nargs + 1) * sizeof(*all))))
		return shmrpc__fail(-ENOMEM, "out of memory calling through an RRef");
	all[0] = shmrpc_rref_value(r);
	if (nargs) /* args may be NULL then */
		memcpy(all + 1, args, (size_t)nargs * sizeof(*all));
	if (kind == PROXY_REMOTE) {
		rc = remote(ag, (int)r->owner, fn, all, nargs + 1, CALL_F_PROXY, NULL, timeout_ms, out);
	} else {
		struct tensor_list sent = { 0 };
		msgpack_sbuffer sb;
		char what[CLIENT_WHAT_MAX];
		shmrpc_future **fut = out, *f;

		*fut = NULL;
		msgpack_sbuffer_init(&sb);
		rc = client_encode_call(&sb, fn, all, nargs + 1, CALL_F_PROXY, &sent);
		client_what(what, "call", fn, " through an RRef");
		profile_name_next(kind == PROXY_SYNC ? "rpc_sync" : "rpc_async", fn);
		if (rc)
			tensor_list_forget(&sent);
		else
			rc = client_request(ag, (int)r->owner, MSG_SCRIPT_CALL, &sb, &sent, timeout_ms,
					    what, &f);
		msgpack_sbuffer_destroy(&sb);
		if (rc == 0 && kind == PROXY_SYNC)
			rc = client_sync_wait(f, fut);
		else if (rc == 0)
			*fut = f;
	}
	free(all);
	return rc;
}

int shmrpc_rref_rpc_sync(shmrpc_rref *r, const char *fn, const shmrpc_value *args, uint32_t nargs,
			 int64_t timeout_ms, shmrpc_future **out)
{
	return proxy(r, PROXY_SYNC, fn, args, nargs, timeout_ms, out);
}

int shmrpc_rref_rpc_async(shmrpc_rref *r, const char *fn, const shmrpc_value *args,
			  uint32_t nargs, int64_t timeout_ms, shmrpc_future **out)
{
	return proxy(r, PROXY_ASYNC, fn, args, nargs, timeout_ms, out);
}

int shmrpc_rref_remote(shmrpc_rref *r, const char *fn, const shmrpc_value *args, uint32_t nargs,
		       int64_t timeout_ms, shmrpc_rref **out)
{
	return proxy(r, PROXY_REMOTE, fn, args, nargs, timeout_ms, out);
}

void rref_drop_users(struct agent *ag)
{
	struct rref_info info;

	/* Release, pairs with release()'s acquire load: a handle freed from
	 * now on leaves its reference to the walk below. One freed while we
	 * set it may drop its own too; ours then stops at 0 (rref_release
	 * refuses to go below). */
	atomic_store_explicit(&ag->users_dropped, true, memory_order_release);
	if (!ag->has_rrefs)
		return;
	for (uint32_t slot = 0; slot < ag->rrefs.capacity; slot++) {
		uint32_t held;

		if (!rref_info_at(&ag->rrefs, slot, &info) || info.owner == ag->rank ||
		    info.owner >= ag->world)
			continue;
		held = rref_count_of(&ag->rrefs, slot, ag->rank);
		for (uint32_t n = 0; n < held; n++) {
			int rc = rref_release(&ag->rrefs, slot, info.id, ag->rank, 1);

			if (rc == 1)
				unreferenced(ag, info.id, slot, info.owner);
			if (rc != 0)
				break;
		}
	}
}

size_t rref_leaks(struct agent *ag, char *buf, size_t len)
{
	struct rref_info info;
	size_t leaks = 0, at = 0;
	char id[96];

	if (len)
		buf[0] = '\0';
	if (!ag->has_rrefs)
		return 0;
	for (uint32_t slot = 0; slot < ag->rrefs.capacity; slot++) {
		if (!rref_info_at(&ag->rrefs, slot, &info) || info.owner != ag->rank)
			continue;
		for (uint32_t r = 0; r < ag->world; r++) {
			uint32_t held = r == ag->rank ? 0 : rref_count_of(&ag->rrefs, slot, r);
			char name[SHM_NAME_MAX];
			int n;

			if (!held)
				continue;
			leaks++;
			id_text(info.id, id, sizeof(id));
			agent_peer_name(ag, r, name, sizeof(name));
			n = snprintf(buf + at, len - at, "Leaking RRef %s held by worker %u (%s): %u %s\n",
				     id, r, name, held, held == 1 ? "reference" : "references");
			/* Full: the count still counts; the text ends where it fit. */
			if (n > 0 && (size_t)n < len - at)
				at += (size_t)n;
			else
				at = len ? len - 1 : 0;
		}
	}
	return leaks;
}

void rref_debug_counts(struct agent *ag, struct rref_debug_counts *out)
{
	struct rref_info info;

	*out = (struct rref_debug_counts){ 0 };
	/* Relaxed: a gauge (pending_users_open). */
	out->pending_users = atomic_load_explicit(&pending_users_open, memory_order_relaxed);
	if (!ag->has_rrefs)
		return;
	for (uint32_t slot = 0; slot < ag->rrefs.capacity; slot++) {
		uint64_t held = 0;

		if (!rref_info_at(&ag->rrefs, slot, &info) || info.owner != ag->rank ||
		    (info.state != RREF_PENDING && info.state != RREF_READY && info.state != RREF_ERROR))
			continue;
		for (uint32_t r = 0; r < ag->world; r++)
			held += r != ag->rank && rref_count_of(&ag->rrefs, slot, r);
		/* As torch's owners_: an RRef(value) joins only once shared,
		 * and leaves when no other worker holds it; a remote call's
		 * result is held by its caller from the start. */
		if (!held)
			continue;
		out->owners++;
		out->pending_owners += info.state == RREF_PENDING;
		out->forks += held;
	}
}
