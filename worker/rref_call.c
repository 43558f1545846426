/*
 * The RRef API: reading the value (to_here), what an RRef says of itself,
 * remote(), the proxies; see rref.h.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "worker/client.h"
#include "worker/devmap.h"
#include "worker/future.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/profile.h"
#include "worker/python.h"
#include "worker/python_api.h"
#include "worker/rref.h"
#include "worker/rref_impl.h"
#include "worker/sbuf.h"
#include "worker/value.h"

/* ---- reading the value ---- */

/* Decodes the block of a READY or ERROR entry into f (no one else sees f
 * yet), then checks the entry still says so: a value decoded from the
 * block of an owner that died meanwhile may be garbage (its pool blocks go
 * after its entries are marked), and is dropped. */
static int decode_entry(struct agent *ag, const shmrpc_rref *r, uint32_t state, shmrpc_future *f)
{
	struct rref_entry *e = rref_entry_at(&ag->rrefs, r->slot);
	uint64_t small, len;
	const void *at = rref_value_at(ag, r->slot, &small, &len);
	/* An inline value is copied already (small): no block to copy. */
	void *copy = at == &small ? &small : at ? malloc(len ? len : 1) : NULL;
	size_t used;
	int rc;

	if (!copy)
		return shmrpc__fail(at ? -ENOMEM : -EBADMSG, "cannot read the value of RRef %#"
				    PRIx64, r->id);
	/* Copied, then checked, then decoded: a seqlock reader's order. */
	if (copy != &small)
		pool_read(copy, at, len);
	/* The re-read is an acq_rel RMW that changes nothing: its release
	 * orders the copy above before it, and an owner sweep that marks the
	 * entry later reads it, so the pool frees the block only after our
	 * copy. A block of an owner that died meanwhile may hold garbage. */
	if (RREF_STATE(atomic_fetch_or_explicit(&e->state, 0, memory_order_acq_rel)) != state ||
	    atomic_load_explicit(&e->key, memory_order_relaxed) != r->id) {
		if (copy != &small)
			free(copy);
		return -SHMRPC_EPEERDEAD;
	}
	f->tensors.take = true;
	/* The owner's value, as its reply to a fetch would bring it. */
	f->tensors.land = devmap_landing(ag, r->owner, true);
	rc = value_unpack(copy, len, &f->arena, &f->value, &used, &f->tensors);
	if (copy != &small)
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
 * request that failed (timeout, lost) leaves the entry pending for ever.
 * On remote()'s creator the wait sleeps on that request's reply rather than
 * the entry (rref_wait_ready). */
static int wait_value(struct agent *ag, shmrpc_rref *r, uint64_t deadline_ns)
{
	for (;;) {
		uint64_t now = shmrpc_now_ns(), slice = now + 50000000u; /* 50 ms */
		int st = creation_failed(r, now);

		if (st)
			return st;
		if (r->created && r->created->deadline_ns > now && r->created->deadline_ns < slice)
			slice = r->created->deadline_ns;
		st = rref_wait_ready(ag, r->slot, r->id, r->created,
				     deadline_ns && deadline_ns < slice ? deadline_ns : slice);
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
	shmrpc_future *f;
	int rc = rref_request(ag, r->owner, MSG_SCRIPT_RREF_FETCH_CALL,
			      &(struct rref_at){ r->id, r->slot }, NULL, timeout_ms,
			      "fetch an RRef's value", &f);

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
	if ((rc = rref_handle_agent(r, &ag)))
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
	int rc = rref_handle_agent(r, &ag);

	if (rc)
		return rc;
	pthread_mutex_lock(&r->lock);
	if (!r->local_loaded) {
		if (!(f = future_new())) {
			rc = shmrpc__fail(-ENOMEM, "out of memory reading an RRef's value");
		} else {
			/* The future's decoded value moves into the handle and
			 * outlives f: in malloc's chunks, not in f's own. */
			f->arena = (struct arena){ 0 };
			if (!(rc = read_value(ag, r, SHMRPC_TIMEOUT_DEFAULT, f))) {
				r->arena = f->arena;
				r->local = f->value;
				r->local_held = f->tensors;
				f->arena = (struct arena){ 0 };
				f->tensors = (struct tensor_list){ 0 };
				r->local_loaded = true;
			}
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
	int rc = rref_handle_agent(r, &ag);

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

		pthread_mutex_lock(&rref_forks.lock);
		confirmed = r->pending->done && !r->pending->failed;
		pthread_mutex_unlock(&rref_forks.lock);
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

	rref_id_text(r->id, id, sizeof(id));
	if (ag && r->owner == ag->rank)
		return snprintf(buf, len, "OwnerRRef(%s)", id);
	rref_id_text(r->fork_id, fork, sizeof(fork));
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
	id = rref_new_id(ag);
	rc = rref_insert(&ag->rrefs, id, (uint32_t)dst, ag->rank, 0, &slot);
	if (rc)
		return rc;
	if (!(r = rref_handle_new(ag, id, (uint32_t)dst == ag->rank ? id : rref_new_id(ag), slot,
			     (uint32_t)dst))) {
		rref_release(&ag->rrefs, slot, id, ag->rank, 1);
		rref_release(&ag->rrefs, slot, id, (uint32_t)dst, 1);
		rref_remove(&ag->rrefs, slot, id);
		return -ENOMEM;
	}
	sbuf_open(&sb);
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
	sbuf_close(&sb);
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
	id = rref_new_id(ag);
	rc = rref_insert(&ag->rrefs, id, ag->rank, ag->rank, 0, &slot);
	if (rc)
		return rc;
	if (!(r = rref_handle_new(ag, id, id, slot, ag->rank))) {
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
		rref_unreferenced(ag, id, slot, ag->rank);
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
	int rc = rref_handle_agent(r, &ag);

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
		sbuf_open(&sb);
		rc = client_encode_call(&sb, fn, all, nargs + 1, CALL_F_PROXY, &sent);
		client_what(what, "call", fn, " through an RRef");
		profile_name_next(kind == PROXY_SYNC ? "rpc_sync" : "rpc_async", fn);
		if (rc)
			tensor_list_forget(&sent);
		else
			rc = client_request(ag, (int)r->owner, MSG_SCRIPT_CALL, &sb, &sent, timeout_ms,
					    what, &f);
		sbuf_close(&sb);
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

	/* Release, pairs with rref_drop()'s acquire load: a handle freed from
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
				rref_unreferenced(ag, info.id, slot, info.owner);
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
			rref_id_text(info.id, id, sizeof(id));
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
	out->pending_users = atomic_load_explicit(&rref_pending_users_open, memory_order_relaxed);
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
