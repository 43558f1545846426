/*
 * The calling side: encoding a call, the table of calls waiting for their
 * reply, and what completes them (a reply, a timeout, a death).
 */
#include <errno.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "worker/carry.h"
#include "worker/client.h"
#include "worker/devmap.h"
#include "worker/future.h"
#include "worker/msg.h"
#include "worker/pins.h"
#include "worker/profile.h"
#include "worker/sbuf.h"
#include "worker/tensor.h"
#include "worker/trace.h"
#include "worker/value.h"

#define PENDING_BUCKETS 65536u

static struct {
	pthread_mutex_t lock;
	shmrpc_future *bucket[PENDING_BUCKETS];
	uint64_t next_deadline; /* no pending call expires before this (ns) */
} pending = { .lock = PTHREAD_MUTEX_INITIALIZER, .next_deadline = UINT64_MAX };

/* Ids are unique within this process; a reply is matched by id and sender. */
static _Atomic uint64_t next_msg_id = 1;

static void count(_Atomic uint64_t *c, int64_t delta)
{
	/* Relaxed: gauges and counters for inspectors. */
	atomic_fetch_add_explicit(c, (uint64_t)delta, memory_order_relaxed);
}

static void pending_add(shmrpc_future *f)
{
	uint32_t b = (uint32_t)(f->msg_id % PENDING_BUCKETS);

	pthread_mutex_lock(&pending.lock);
	f->hnext = pending.bucket[b];
	pending.bucket[b] = f;
	if (f->deadline_ns && f->deadline_ns < pending.next_deadline)
		pending.next_deadline = f->deadline_ns;
	pthread_mutex_unlock(&pending.lock);
}

/* Removes and returns the call msg_id sent to dst; NULL if it is not waiting. */
static shmrpc_future *pending_take(uint64_t msg_id, uint32_t dst)
{
	shmrpc_future **at, *f;

	pthread_mutex_lock(&pending.lock);
	for (at = &pending.bucket[msg_id % PENDING_BUCKETS]; (f = *at); at = &f->hnext) {
		if (f->msg_id == msg_id && f->dst == dst) {
			*at = f->hnext;
			break;
		}
	}
	pthread_mutex_unlock(&pending.lock);
	return f;
}

/* Removes every call for which pred holds; returns them chained by hnext. */
static shmrpc_future *pending_take_if(bool (*pred)(shmrpc_future *, const void *), const void *arg)
{
	shmrpc_future *out = NULL;

	pthread_mutex_lock(&pending.lock);
	for (uint32_t b = 0; b < PENDING_BUCKETS; b++) {
		shmrpc_future **at = &pending.bucket[b], *f;

		while ((f = *at)) {
			if (pred(f, arg)) {
				*at = f->hnext;
				f->hnext = out;
				out = f;
			} else {
				at = &f->hnext;
			}
		}
	}
	pthread_mutex_unlock(&pending.lock);
	return out;
}

/* A call is over: the table's reference goes, and so does the active count. */
static void settled(struct agent *ag, shmrpc_future *f)
{
	if (f->profile_what & PROFILE_CALLS)
		profile_call_end();
	count(&ag->self->client_active_calls, -1);
	future_unref(f);
}

static void fail_chain(struct agent *ag, shmrpc_future *f, int err, const char *why, bool timeout);

void client_complete(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
		     const void *payload, size_t len)
{
	shmrpc_future *f = pending_take(msg_id, src);
	struct arena pa = { 0 };
	/* A reply after the call's deadline is late even if the deadline scan
	 * has not run yet (a loaded machine): torch's timeout thread would
	 * have failed the call, and so do we, as the scan would have. Only a
	 * call that has a deadline reads the clock, and the coarse one (10 ns,
	 * not 43: this is on every call's path); it lags by at most a tick,
	 * so a reply is never failed before its deadline, and one less than a
	 * tick late may still pass. */
	bool late = !f || (f->deadline_ns && shmrpc_coarse_now_ns() >= f->deadline_ns);

	trace_rec(SHM_TRACE_COMPLETED, src, type, msg_id, len,
		  late ? SHM_TRACE_LATE : trace_reply_status(type));
	if (late) {
		/* Dropped unread: nothing of it is ours to keep. */
		pins_release(src, msg_id, PIN_REQUEST);
		count(&ag->self->late_replies, 1);
		if (f) {
			f->hnext = NULL; /* a chain of one */
			fail_chain(ag, f, -ETIMEDOUT, NULL, true);
		}
		return;
	}
	if (type == MSG_RUN_WITH_PROFILING_RESP) {
		shmrpc_value events;

		if (profile_unwrap(payload, len, &pa, &type, &payload, &len, &events) ||
		    events.type != SHMRPC_LIST) {
			type = MSG_EXCEPTION; /* decoded below as malformed */
			len = 0;
		} else {
			if (f->profile_what & PROFILE_CALLS)
				profile_call_done(f->profile_key, ag->rank, f->sent_ns, &events);
			/* Read by the binding once the future is done (finish()
			 * publishes it); out of memory, the events are lost. */
			if (f->profile_what & PROFILE_TORCH)
				f->callee_events = profile_events_of(&events);
		}
	} else if ((f->profile_what & PROFILE_CALLS) && type == MSG_EXCEPTION) {
		profile_call_done(f->profile_key, ag->rank, f->sent_ns, &(shmrpc_value){ 0 });
	}
	if (type == MSG_EXCEPTION) {
		struct arena a = { 0 };
		shmrpc_value v;
		size_t used;
		const shmrpc_value *it;

		/* The callee has its own references to our arguments' tensors
		 * now; an exception carries none. A value's unpack releases
		 * the pin after taking ours to what it carries back. */
		pins_release(src, msg_id, PIN_REQUEST);

		if (value_unpack(payload, len, &a, &v, &used, NULL) == 0 && v.type == SHMRPC_LIST &&
		    v.len == 3 && (it = v.u.items)[0].type == SHMRPC_STR &&
		    it[1].type == SHMRPC_STR && it[2].type == SHMRPC_STR)
			future_fail(f, -SHMRPC_EREMOTE, it[0].u.s, it[1].u.s, it[2].u.s);
		else
			future_fail(f, -EBADMSG, NULL, "a malformed EXCEPTION reply came back", NULL);
		arena_free(&a);
	} else if (future_complete_packed(f, payload, len)) {
		pins_ack(ag, src, msg_id);
	}
	arena_free(&pa);
	settled(ag, f);
}

static void fail_chain(struct agent *ag, shmrpc_future *f, int err, const char *why, bool timeout)
{
	while (f) {
		shmrpc_future *next = f->hnext;
		char msg[256];

		if (timeout) {
			snprintf(msg, sizeof(msg),
				 "RPC ran for more than the set timeout (%lld ms) and will now be "
				 "marked with an error",
				 (long long)f->timeout_ms);
			count(&ag->self->timeouts, 1);
		}
		trace_rec(SHM_TRACE_COMPLETED, f->dst, 0, f->msg_id, 0, trace_status_of(err));
		future_fail(f, err, NULL, timeout ? msg : why, NULL);
		settled(ag, f);
		f = next;
	}
}

static bool expired(shmrpc_future *f, const void *now)
{
	return f->deadline_ns && f->deadline_ns <= *(const uint64_t *)now;
}

static bool min_deadline(shmrpc_future *f, const void *arg)
{
	uint64_t *min = (uint64_t *)arg;

	if (f->deadline_ns && f->deadline_ns < *min)
		*min = f->deadline_ns;
	return false;
}

uint64_t client_expire(struct agent *ag, uint64_t now)
{
	uint64_t next = UINT64_MAX;
	bool due;

	pthread_mutex_lock(&pending.lock);
	due = now >= pending.next_deadline;
	if (due) /* recomputed below; a call added meanwhile lowers it again */
		pending.next_deadline = UINT64_MAX;
	else
		next = pending.next_deadline;
	pthread_mutex_unlock(&pending.lock);
	if (!due)
		return next;
	fail_chain(ag, pending_take_if(expired, &now), -ETIMEDOUT, NULL, true);
	pending_take_if(min_deadline, &next); /* takes nothing: finds the earliest */
	pthread_mutex_lock(&pending.lock);
	if (next < pending.next_deadline)
		pending.next_deadline = next;
	next = pending.next_deadline;
	pthread_mutex_unlock(&pending.lock);
	return next;
}

static bool to_peer(shmrpc_future *f, const void *peer)
{
	return f->dst == *(const uint32_t *)peer;
}

static bool any(shmrpc_future *f, const void *arg)
{
	(void)f;
	(void)arg;
	return true;
}

void client_fail_peer(struct agent *ag, uint32_t peer, const char *why)
{
	fail_chain(ag, pending_take_if(to_peer, &peer), -SHMRPC_EPEERDEAD, why, false);
}

void client_fail_all(struct agent *ag, const char *why)
{
	fail_chain(ag, pending_take_if(any, NULL), -ESHUTDOWN, why, false);
}

/* ---- public API ---- */

int client_encode_call(msgpack_sbuffer *sb, const char *fn, const shmrpc_value *args,
		       uint32_t nargs, uint32_t flags, struct tensor_list *sent)
{
	msgpack_packer pk;
	shmrpc_value list = shmrpc_list(args, nargs);
	size_t n = strlen(fn);

	msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
	if (n == 0 || n > UINT32_MAX)
		return shmrpc__fail(-EINVAL, "a function name cannot be empty");
	if (msgpack_pack_array(&pk, flags ? 3 : 2) || msgpack_pack_str_with_body(&pk, fn, n))
		return shmrpc__fail(-ENOMEM, "out of memory encoding a call");
	if (flags && msgpack_pack_uint32(&pk, flags))
		return shmrpc__fail(-ENOMEM, "out of memory encoding a call");
	return value_pack(&pk, &list, sent);
}

/* The request in sb becomes RUN_WITH_PROFILING_REQ [type, payload, what],
 * and f remembers the call's key, what it asks and when it went. */
static int profile_wrap(struct agent *ag, int dst, const char *kind, const char *fn,
			unsigned what, shmrpc_future *f, uint16_t *type, msgpack_sbuffer *sb)
{
	char me[SHM_NAME_MAX], peer[SHM_NAME_MAX], key[320];
	msgpack_sbuffer wrapped;
	int rc;

	agent_peer_name(ag, ag->rank, me, sizeof(me));
	agent_peer_name(ag, (uint32_t)dst, peer, sizeof(peer));
	profile_key(kind, fn, me, peer, key, sizeof(key));
	msgpack_sbuffer_init(&wrapped);
	rc = profile_wrap_request(*type, sb->data, sb->size, what, &wrapped);
	if (rc == 0 && !(f->profile_key = strdup(key)))
		rc = shmrpc__fail(-ENOMEM, "out of memory profiling a call");
	if (rc) {
		msgpack_sbuffer_destroy(&wrapped);
		return rc;
	}
	msgpack_sbuffer_destroy(sb);
	*sb = wrapped; /* the caller destroys it */
	*type = MSG_RUN_WITH_PROFILING_REQ;
	f->profile_what = what;
	f->sent_ns = shmrpc_now_ns();
	if (what & PROFILE_CALLS)
		profile_call_begin(); /* ended by settled() */
	return 0;
}

/* client_sync_next was called for the next request this thread sends. */
static _Thread_local bool sync_next;

void client_sync_next(bool on)
{
	sync_next = on;
}

/* The waits upstream of an rpc_sync made while serving caller's call
 * served: that call, then those upstream of it (up), the nearest one per
 * worker, as many as a frame carries. A chain of rpc_syncs through any
 * workers thus finds, on each, the thread that waits for it. */
static void help_upstream(struct help_chain *out, uint32_t caller, uint64_t served,
			  const struct help_chain *up)
{
	out->e[0] = (struct ipc_help){ .msg_id = served, .rank = caller };
	out->n = 1;
	for (uint32_t i = 0; i < up->n && out->n < IPC_HELP_MAX; i++) {
		uint32_t j = 0;

		while (j < out->n && out->e[j].rank != up->e[i].rank)
			j++;
		if (j == out->n)
			out->e[out->n++] = up->e[i];
	}
}

/* The call of dst's that help names, or 0. */
static uint64_t help_find(const struct help_chain *help, uint32_t dst)
{
	for (uint32_t i = 0; i < help->n; i++)
		if (help->e[i].rank == dst)
			return help->e[i].msg_id;
	return 0;
}

int client_request(struct agent *ag, int dst, uint16_t type, msgpack_sbuffer *sb,
		   struct tensor_list *sent, int64_t timeout_ms, const char *what,
		   shmrpc_future **out)
{
	shmrpc_future *f = NULL;
	const char *kind, *name;
	char why[256];
	unsigned asks, torch; /* of a profiled call's callee: PROFILE_ bits */
	bool sync = sync_next, nested;
	uint32_t caller = 0, depth = 0;
	uint64_t served = 0, needed_by;
	const struct help_chain *up = NULL;
	const struct link_served *sv;
	struct help_chain help = { 0 };
	int rc;

	*out = NULL;
	sync_next = false;
	profile_take_names(&kind, &name, &torch);
	asks = (profile_on() ? PROFILE_CALLS : 0u) | torch;
	if ((sv = link_serving())) {
		caller = sv->src;
		served = sv->msg_id;
		depth = sv->depth;
		up = sv->up;
	}
	nested = sv != NULL;
	depth++;
	if (depth > SHMRPC_MAX_NESTING)
		rc = shmrpc__fail(-SHMRPC_ENESTING, "cannot %s on worker %d: calls would nest "
				  "%u deep (each made by the function serving the one before), "
				  "beyond shmrpc's limit of %u (SHMRPC_MAX_NESTING): make the chain "
				  "shorter, e.g. turn the recursion into a loop", what, dst, depth,
				  SHMRPC_MAX_NESTING);
	else if (dst < 0 || (uint32_t)dst >= ag->world)
		rc = shmrpc__fail(-EINVAL, "cannot %s on rank %d: the job has %u workers "
				  "(ranks 0 to %u)", what, dst, ag->world, ag->world - 1);
	else if ((uint32_t)dst != ag->rank && !ipc_port_peer_alive(&ag->port, (uint32_t)dst))
		rc = shmrpc__fail(-SHMRPC_EPEERDEAD, "cannot %s: %s", what,
				  (agent_peer_gone_text(ag, (uint32_t)dst, why, sizeof(why)), why));
	else if (timeout_ms < 0 && timeout_ms != SHMRPC_TIMEOUT_DEFAULT)
		rc = shmrpc__fail(-EINVAL, "timeout %lld ms: give a positive number, "
				  "SHMRPC_TIMEOUT_DEFAULT or SHMRPC_TIMEOUT_NONE", (long long)timeout_ms);
	else if (!(f = future_new()))
		rc = shmrpc__fail(-ENOMEM, "out of memory making a future");
	else
		rc = devmap_check_send(ag, (uint32_t)dst, false, sent);
	if (rc)
		goto out;
	/* Each step below is undone, in reverse order, by the label of the
	 * same name when a later one fails. */
	if (sent->nr && (rc = rref_ops.charge(ag, sent, (uint32_t)dst)))
		goto out;
	if (timeout_ms == SHMRPC_TIMEOUT_DEFAULT)
		timeout_ms = (int64_t)(ag->default_timeout_ns / 1000000u);
	/* Relaxed: only uniqueness matters. */
	f->msg_id = atomic_fetch_add_explicit(&next_msg_id, 1, memory_order_relaxed);
	/* The arguments' tensors stay alive until the callee holds them. */
	f->sent_tensors = sent->n != 0;
	if (sent->n && (rc = pins_add((uint32_t)dst, f->msg_id, PIN_REQUEST, sent)))
		goto charged;
	if (asks && (rc = profile_wrap(ag, dst, kind, name, asks, f, &type, sb)))
		goto pinned;
	f->dst = (uint32_t)dst;
	/* Who may run the request while waiting for a call of its own
	 * (worker/executor.h): for a call to ourselves, whoever waits for it;
	 * for an rpc_sync made while serving a call, dst's thread waiting for
	 * a call that led here through rpc_syncs alone (the served one, or
	 * one upstream of it): that call completes only after this one. */
	if (sync && nested)
		help_upstream(&help, caller, served, up);
	needed_by = (uint32_t)dst == ag->rank ? f->msg_id : help_find(&help, (uint32_t)dst);
	f->tensors.land = devmap_landing(ag, (uint32_t)dst, true);
	f->timeout_ms = timeout_ms;
	f->deadline_ns = timeout_ms ? shmrpc_now_ns() + (uint64_t)timeout_ms * 1000000u : 0;
	future_ref(f); /* the table's reference */
	count(&ag->self->client_active_calls, 1);
	/* In the table before it is sent: the reply may come back at once. */
	pending_add(f);
	trace_rec(SHM_TRACE_SENT, f->dst, type, f->msg_id, sb->size, SHM_TRACE_OK);
	/* To ourselves, the request is queued at once (link.h). */
	if ((rc = agent_send(ag, (uint32_t)dst, type, f->msg_id, needed_by, depth, &help,
				    sb->data, sb->size))) {
		char msg[1024];

		snprintf(msg, sizeof(msg), "%s", shmrpc_errmsg());
		rc = shmrpc__fail(rc, "cannot %s on worker %d: %s", what, dst, msg);
		trace_rec(SHM_TRACE_COMPLETED, f->dst, type, f->msg_id, 0, trace_status_of(rc));
		/* Still in the table unless its deadline passed meanwhile. */
		if (pending_take(f->msg_id, f->dst))
			settled(ag, f);
		goto pinned;
	}
	tensor_list_forget(sent);
	*out = f;
	return 0;
pinned:
	pins_release((uint32_t)dst, f->msg_id, PIN_REQUEST);
charged:
	rref_ops.uncharge(ag, sent, (uint32_t)dst);
out:
	tensor_list_forget(sent);
	if (f)
		future_unref(f);
	return rc;
}

void client_what(char what[static CLIENT_WHAT_MAX], const char *verb, const char *fn,
		 const char *tail)
{
	size_t v = strnlen(verb, 24), n = strnlen(fn, 256), t = strnlen(tail, 32);
	char *at = what;

	at = mempcpy(at, verb, v);
	*at++ = ' ';
	at = mempcpy(at, fn, n);
	at = mempcpy(at, "()", 2);
	at = mempcpy(at, tail, t);
	*at = '\0';
}

int shmrpc_rpc_async(int dst, const char *fn, const shmrpc_value *args, uint32_t nargs,
		     int64_t timeout_ms, shmrpc_future **out)
{
	struct agent *ag;
	struct tensor_list sent = { 0 };
	msgpack_sbuffer sb;
	char what[CLIENT_WHAT_MAX];
	int rc;

	if (!out || !fn || (nargs && !args))
		return shmrpc__fail(-EINVAL, "shmrpc_rpc_async: fn, out and args must be given");
	*out = NULL;
	if ((rc = agent_running(&ag)))
		return rc;
	sbuf_open(&sb);
	rc = client_encode_call(&sb, fn, args, nargs, 0, &sent);
	client_what(what, "call", fn, "");
	profile_name_next("rpc_async", fn);
	if (rc)
		tensor_list_forget(&sent);
	else
		rc = client_request(ag, dst, MSG_SCRIPT_CALL, &sb, &sent, timeout_ms, what, out);
	sbuf_close(&sb);
	return rc;
}

int shmrpc_rpc_sync(int dst, const char *fn, const shmrpc_value *args, uint32_t nargs,
		    int64_t timeout_ms, shmrpc_future **out)
{
	shmrpc_future *f;
	int rc;

	if (!out)
		return shmrpc__fail(-EINVAL, "shmrpc_rpc_sync: out must be given");
	*out = NULL;
	profile_name_next("rpc_sync", NULL);
	client_sync_next(true);
	rc = shmrpc_rpc_async(dst, fn, args, nargs, timeout_ms, &f);
	client_sync_next(false); /* a call refused before client_request */
	return rc ? rc : client_sync_wait(f, out);
}

int client_sync_wait(shmrpc_future *f, shmrpc_future **out)
{
	int rc;

	future_wait_until(f, 0);
	if (f->err) {
		rc = shmrpc__fail(f->err, "%s", f->errmsg ? f->errmsg : "unknown error");
		future_unref(f);
		return rc;
	}
	*out = f;
	return 0;
}
