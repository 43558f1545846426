/* RRef handles: ids, the fork mode, made, copied and freed; see rref.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/zalloc.h"
#include "ipc/doorbell.h"
#include "worker/client.h"
#include "worker/executor.h"
#include "worker/future.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/rref.h"
#include "worker/rref_impl.h"

/* Ids made here: RRef ids and fork ids share the counter, from 0 as
 * torch's (programs and tests print them; RREF_ID keeps 0 off the
 * table's keys). Relaxed: only uniqueness matters. */
static _Atomic uint64_t next_local_id = 0;

uint64_t rref_new_id(struct agent *ag)
{
	return RREF_ID(ag->rank, atomic_fetch_add_explicit(&next_local_id, 1, memory_order_relaxed));
}

/* *ag = the running agent, of a job with an RRef table: 0, -ENOTCONN or
 * -ENOTSUP. */
int rref_agent(struct agent **ag)
{
	int rc = agent_running(ag);

	if (rc)
		return rc;
	if (!(*ag)->has_rrefs || !(*ag)->has_pool)
		return shmrpc__fail(-ENOTSUP, "this job has no RRef table: start it with shmrun "
				    "(--max-rrefs sets its size)");
	return 0;
}

/* rref_agent, for a handle: -ENOTCONN too when r was made in a job that
 * has shut down since (an RRef kept across init_rpc, shutdown, init_rpc). */
int rref_handle_agent(const shmrpc_rref *r, struct agent **ag)
{
	int rc = rref_agent(ag);
	char id[96];

	if (rc || !r || r->job == (*ag)->job)
		return rc;
	rref_id_text(r->id, id, sizeof(id));
	return shmrpc__fail(-ENOTCONN, "RRef %s belongs to an RPC job that has shut down (it "
			    "was deleted then): an RRef lives in the job that made it", id);
}

int rref_id_text(uint64_t id, char *buf, size_t len)
{
	return snprintf(buf, len, "GloballyUniqueId(created_on=%u, local_id=%" PRIu64 ")",
			RREF_ID_RANK(id), (uint64_t)RREF_ID_LOCAL(id));
}

/* ---- forks by message: state (the protocol is below) ---- */

struct rref_forks rref_forks = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* Pending users made and not yet answered (rref_debug_counts). Relaxed:
 * a gauge, ordered with nothing. */
_Atomic uint64_t rref_pending_users_open;

uint32_t rref_fork_bucket(uint64_t key)
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

bool rref_fork_mode_message(void)
{
	pthread_once(&fork_mode_once, read_fork_mode);
	return fork_by_message;
}

bool rref_fork_mode_bad(void)
{
	pthread_once(&fork_mode_once, read_fork_mode);
	return fork_mode_bad;
}

/* r goes to another worker by message: we are a user, and the mode says
 * so or r itself is still pending (it holds no reference to charge from). */
bool rref_by_message(const struct agent *ag, const shmrpc_rref *r)
{
	return r->owner != ag->rank && (rref_fork_mode_message() || r->pending);
}

/* One owing reference of p goes: a reference of ours in the table if the
 * owner confirmed p, nothing otherwise. ag NULL: the table is gone. */
void rref_pending_put(struct agent *ag, struct pending_user *p)
{
	/* Read while our share holds p: once it is dropped, another
	 * thread's put may be the last and free p before we release. */
	uint64_t id = p->id;
	uint32_t slot = p->slot, owner = p->owner;
	bool counted, last;

	pthread_mutex_lock(&rref_forks.lock);
	counted = p->done && !p->failed;
	last = --p->refs == 0;
	pthread_mutex_unlock(&rref_forks.lock);
	if (last)
		free(p);
	if (counted && ag)
		rref_drop(ag, id, slot, owner);
}

/* ---- handles ---- */

/* rref_owner.c's rref_owner_collect_listed (rref_set_collect). */
static void (*collect_own)(struct agent *ag);

void rref_set_collect(void (*collect)(struct agent *ag))
{
	collect_own = collect;
}

/* A handle for a reference this rank already holds in the table. */
shmrpc_rref *rref_handle_new(struct agent *ag, uint64_t id, uint64_t fork_id, uint32_t slot,
			       uint32_t owner)
{
	shmrpc_rref *r = zalloc(sizeof(*r));

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
void rref_unreferenced(struct agent *ag, uint64_t id, uint32_t slot, uint32_t owner)
{
	bool first = rref_collect_push(&ag->rrefs, slot);
	struct delete_job *d;

	if (owner == ag->rank) {
		collect_own(ag);
		return;
	}
	if (!rref_fork_mode_message()) {
		/* Wakes the owner only if it sleeps, and as a request does:
		 * every thread of the owner that polls its rings looks at the
		 * list after (collect_if_due, agent.c), so its servers, busy or
		 * idle-spinning, collect without a wake-up, and one asleep on
		 * their bell is woken rather than the loop thread, which would
		 * only queue the work for it; awake, the loop thread looks at
		 * the list before it sleeps (ipc_port.news). Issue 23: the
		 * loop thread's wake-up made a free 5-14 µs in the default
		 * wait mode (0.3 µs spinning). */
		if (first)
			ipc_doorbell_notify(shm_worker(&ag->seg, owner), ag->self,
					    IPC_FRAME_REQUEST, false);
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
void rref_drop(struct agent *ag, uint64_t id, uint32_t slot, uint32_t owner)
{
	int rc;

	/* Acquire, pairs with rref_drop_users' release store: its drops
	 * came before, and ours is one of them. */
	if (owner != ag->rank && atomic_load_explicit(&ag->users_dropped, memory_order_acquire))
		return;
	rc = rref_release(&ag->rrefs, slot, id, ag->rank, 1);

	if (rc == 1)
		rref_unreferenced(ag, id, slot, owner);
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
		rref_pending_put(ag, r->pending);
	else if (ag)
		rref_drop(ag, r->id, r->slot, r->owner);
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
	int rc = rref_handle_agent(r, &ag);

	if (rc)
		return rc;
	if (r->pending) {
		/* Not confirmed yet: the copy owes its reference too. */
		pthread_mutex_lock(&rref_forks.lock);
		p = r->pending->done ? NULL : r->pending;
		failed = r->pending->failed;
		if (p)
			p->refs++;
		pthread_mutex_unlock(&rref_forks.lock);
		if (failed)
			return shmrpc__fail(-SHMRPC_EPEERDEAD, "RRef %#" PRIx64 ": its owner never "
					    "confirmed the fork that brought it here", r->id);
	}
	rc = p ? 0 : rref_hold(&ag->rrefs, r->slot, r->id, ag->rank, 1);
	if (rc)
		return rc;
	if (!(n = rref_handle_new(ag, r->id, r->owner == ag->rank ? r->id : rref_new_id(ag), r->slot,
			     r->owner))) {
		if (p)
			rref_pending_put(ag, p);
		else
			rref_drop(ag, r->id, r->slot, r->owner);
		return -ENOMEM;
	}
	n->forked = true;
	n->pending = p;
	*out = n;
	return 0;
}
