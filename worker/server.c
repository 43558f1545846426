/*
 * The serving side: a request copied out of the ring runs on an executor
 * thread, and its reply (the result, or an EXCEPTION carrying the error's
 * type, text and this side's backtrace) goes back with the request's id.
 */
#include <errno.h>
#include <execinfo.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "worker/client.h"
#include "worker/devmap.h"
#include "worker/executor.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/pins.h"
#include "worker/profile.h"
#include "worker/python.h"
#include "worker/registry.h"
#include "worker/rref.h"
#include "worker/server.h"
#include "worker/tensor.h"
#include "worker/trace.h"
#include "worker/value.h"

struct request_job {
	struct job base;
	struct agent *ag;
	uint32_t src;
	uint16_t type;
	uint64_t msg_id;
	struct profile_events *profile; /* a profiled request's events; NULL otherwise */
	size_t len;
	uint32_t depth; /* nesting depth (ipc/frame.h), checked when it runs */
	struct help_chain up; /* the waits upstream of it (ipc/frame.h) */
	uint8_t payload[];
};

struct shmrpc_call {
	struct arena arena;
	struct tensor_list tensors; /* the arguments' tensors, ours until the reply is sent */
	uint32_t caller;
	char errtype[64];
	char errmsg[768];
	char *backtrace;
	bool failed;
	struct profile_events *profile; /* a profiled request's events, if set */
	unsigned profile_what;          /* what its caller asks (PROFILE_ bits) */
};

static void count(_Atomic uint64_t *c, int64_t delta)
{
	/* Relaxed: gauges and counters for inspectors. */
	atomic_fetch_add_explicit(c, (uint64_t)delta, memory_order_relaxed);
}

static void send_reply(struct request_job *rq, uint16_t type, const void *buf, size_t len)
{
	struct agent *ag = rq->ag;
	msgpack_sbuffer wrapped;
	int rc;

	if (rq->profile && type != MSG_EXCEPTION) {
		/* RUN_WITH_PROFILING_RESP [type, reply, events]. An error goes
		 * bare, without events (as torch's); so does a reply whose
		 * wrapper cannot be made (the profile misses its events). */
		msgpack_sbuffer_init(&wrapped);
		if (profile_wrap_reply(type, buf, len, rq->profile, ag->rank, &wrapped) == 0) {
			rq->profile = NULL;
			send_reply(rq, MSG_RUN_WITH_PROFILING_RESP, wrapped.data, wrapped.size);
			msgpack_sbuffer_destroy(&wrapped);
			return;
		}
		msgpack_sbuffer_destroy(&wrapped);
	}

	trace_rec(SHM_TRACE_FINISHED, rq->src, type, rq->msg_id, len, trace_reply_status(type));
	/* A caller that died needs no answer; anything else is ours to report.
	 * To ourselves, the reply completes the call at once (link.h). */
	rc = agent_send(ag, rq->src, type, rq->msg_id, 0, 0, NULL, buf, len);
	if (rc && rc != -SHMRPC_EPEERDEAD)
		fprintf(stderr, "shmrpc: worker %u: cannot answer worker %u: %s\n", ag->rank,
			rq->src, shmrpc_errmsg());
}

/* An EXCEPTION whose text already names where it happened. */
static void reply_error(struct request_job *rq, const char *type, const char *text, const char *bt)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_array(&pk, 3);
	msgpack_pack_str_with_body(&pk, type, strlen(type));
	msgpack_pack_str_with_body(&pk, text, strlen(text));
	msgpack_pack_str_with_body(&pk, bt ? bt : "", bt ? strlen(bt) : 0);
	count(&rq->ag->self->errors, 1);
	send_reply(rq, MSG_EXCEPTION, sb.data, sb.size);
	msgpack_sbuffer_destroy(&sb);
}

/* "Error on worker R (name): msg" into text. */
static void error_text(struct agent *ag, const char *msg, char *text, size_t len)
{
	char name[SHM_NAME_MAX];

	agent_peer_name(ag, ag->rank, name, sizeof(name));
	snprintf(text, len, "Error on worker %u (%s): %s", ag->rank, name, msg);
}

static void reply_exception(struct request_job *rq, const char *type, const char *msg,
			    const char *bt)
{
	char text[1024];

	error_text(rq->ag, msg, text, sizeof(text));
	reply_error(rq, type, text, bt);
}

/* The call's error, set by its function or by the checks before it. */
static void call_fail(shmrpc_call *call, const char *type, const char *msg)
{
	snprintf(call->errtype, sizeof(call->errtype), "%s", type);
	snprintf(call->errmsg, sizeof(call->errmsg), "%s", msg);
	call->failed = true;
}

/* Decodes a call [fn, args] or [fn, flags, args] from buf and runs it:
 * 0 with *result, or call->failed with the error. *fn names it. */
static void run_call(shmrpc_call *call, uint16_t type, const uint8_t *buf, size_t len,
		     const char **fn, shmrpc_value *result)
{
	const struct registry_entry *e;
	const shmrpc_value *items, *args;
	shmrpc_value req, *proxied = NULL;
	uint32_t nargs, flags = 0;
	size_t used;
	char msg[400];
	int rc;

	*fn = "?";
	call->tensors.land = devmap_landing(worker_agent, call->caller, false);
	/* What the decoder refused (a corrupt tensor descriptor...) is said. */
	rc = value_unpack(buf, len, &call->arena, &req, &used, &call->tensors);
	if (rc || used != len || req.type != SHMRPC_LIST || (req.len != 2 && req.len != 3) ||
	    (items = req.u.items)[0].type != SHMRPC_STR ||
	    items[req.len - 1].type != SHMRPC_LIST ||
	    (req.len == 3 && items[1].type != SHMRPC_INT)) {
		snprintf(msg, sizeof(msg), "a malformed %s request came in%s%s",
			 worker_msg_name(type), rc ? ": " : "", rc ? shmrpc_errmsg() : "");
		call_fail(call, "RuntimeError", msg);
		return;
	}
	*fn = items[0].u.s;
	flags = req.len == 3 ? (uint32_t)items[1].u.i : 0;
	args = items[req.len - 1].u.items;
	nargs = items[req.len - 1].len;
	if (!(e = registry_find(*fn))) {
		snprintf(msg, sizeof(msg), "no function named \"%.256s\" is registered", *fn);
		call_fail(call, "RuntimeError", msg);
		return;
	}
	if (flags & CALL_F_PROXY) {
		/* fn(value of the RRef, args...): the RRef must be ours. */
		const shmrpc_value *v;

		if (!nargs || args[0].type != SHMRPC_RREF || !shmrpc_rref_is_owner(args[0].u.r) ||
		    !(proxied = shmrpc_call_alloc(call, nargs * sizeof(*proxied)))) {
			call_fail(call, "RuntimeError", "a call through an RRef came to a worker that "
				  "does not own the RRef");
			return;
		}
		if (rref_local_value(args[0].u.r, &v)) {
			call_fail(call, "RuntimeError", shmrpc_errmsg());
			return;
		}
		memcpy(proxied, args, nargs * sizeof(*proxied));
		proxied[0] = *v;
		args = proxied;
	}
	if (value_check_sig(*fn, e->sig, args, nargs)) {
		call_fail(call, "TypeError", shmrpc_errmsg());
		return;
	}
	rc = e->fn(call, args, nargs, result, e->user);
	if (rc && !call->failed) {
		snprintf(msg, sizeof(msg), "%.256s() failed: %s", *fn, shmrpc_strerror(rc));
		call_fail(call, "RuntimeError", msg);
	}
}

/* Whether this worker runs the Python package; if not, the call fails
 * saying so (a C-only worker answers its requests "not supported yet"). */
static bool python_here(shmrpc_call *call, uint16_t type)
{
	char msg[256];

	if (python_handler())
		return true;
	snprintf(msg, sizeof(msg), "request type %s is not supported yet: this worker runs no "
		 "Python (start it from the shmrpc Python package)", worker_msg_name(type));
	call_fail(call, "RuntimeError", msg);
	return false;
}

/* The Python package's request of type in buf, decoded into *in in the
 * call's arena (its RRefs and tensors are the call's); false with the call
 * failed. */
static bool python_decode(shmrpc_call *call, uint16_t type, const uint8_t *buf, size_t len,
			  struct python_request *in)
{
	shmrpc_value req;
	size_t used;
	char msg[400];
	int rc;

	call->tensors.land = devmap_landing(worker_agent, call->caller, false);
	rc = value_unpack(buf, len, &call->arena, &req, &used, &call->tensors);
	if (rc == 0 && used == len && python_request_of(type, &req, &call->arena, in) == 0)
		return true;
	snprintf(msg, sizeof(msg), "a malformed %s request came in%s%s", worker_msg_name(type),
		 rc ? ": " : "", rc ? shmrpc_errmsg() : "");
	call_fail(call, "RuntimeError", msg);
	return false;
}

/* A request of the Python package (a pickled call, or one of distributed
 * autograd's) run by the binding's handler, which fills out's message and
 * autograd message id; *result is out (of the type the caller set) as a
 * payload, in the call's arena. The RRef and tensor handles the handler
 * made for it are freed once sent, as a C function's (free_result_handles). */
static void run_python(shmrpc_call *call, const struct python_request *in,
		       struct python_request *out, shmrpc_value *result)
{
	void *copy;
	int rc;

	if (python_handler()(call->caller, in, out,
			     call->profile_what & PROFILE_TORCH ? call->profile : NULL)) {
		call_fail(call, "RuntimeError", shmrpc_errmsg());
		return;
	}
	out->context_id = in->context_id; /* a FORWARD_AUTOGRAD_RESP's */
	copy = shmrpc_call_alloc(call, out->msg.len ? out->msg.len : 1);
	if (copy)
		memcpy(copy, out->msg.data, out->msg.len);
	free((void *)out->msg.data);
	out->msg.data = copy;
	rc = copy ? python_request_value(out, &call->arena, result)
		  : shmrpc__fail(-ENOMEM, "out of memory keeping a Python result");
	for (uint32_t i = 0; rc && i < out->msg.nrrefs; i++)
		shmrpc_rref_free(out->msg.rrefs[i]);
	for (uint32_t i = 0; rc && i < out->msg.ntensors; i++)
		shmrpc_tensor_free(out->msg.tensors[i]);
	free(out->msg.rrefs);
	free(out->msg.tensors);
	if (rc)
		call_fail(call, "RuntimeError", shmrpc_errmsg());
}

/* The handles in `sent` that the function made for its result (not the
 * call's arguments', not met before) are the call's to free once sent. */
static void free_result_handles(shmrpc_call *call, struct tensor_list *sent)
{
	for (uint32_t i = 0; i < sent->n; i++)
		if (!tensor_list_has(&call->tensors, sent->t[i]) &&
		    !tensor_list_has_before(sent, i, sent->t[i]))
			shmrpc_tensor_free(sent->t[i]);
	for (uint32_t i = 0; i < sent->nr; i++) {
		bool seen = false;

		for (uint32_t j = 0; j < call->tensors.nr && !seen; j++)
			seen = call->tensors.r[j] == sent->r[i];
		for (uint32_t j = 0; j < i && !seen; j++)
			seen = sent->r[j] == sent->r[i];
		if (!seen)
			shmrpc_rref_free(sent->r[i]);
	}
	tensor_list_forget(sent);
}

/* Sends result as the reply of type ret: its tensors pinned until the
 * caller's ack, its RRefs charged to the caller. */
static void reply_value(struct request_job *rq, shmrpc_call *call, const char *fn,
			const shmrpc_value *result, uint16_t ret)
{
	struct agent *ag = rq->ag;
	struct tensor_list sent = { 0 };
	msgpack_sbuffer sb;
	msgpack_packer pk;
	char msg[256];

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if (value_pack(&pk, result, &sent)) {
		reply_exception(rq, "TypeError", shmrpc_errmsg(), NULL);
	} else if (rq->src != ag->rank && sb.size > ipc_port_max_payload(&ag->port)) {
		snprintf(msg, sizeof(msg), "the result of %.64s() is %zu bytes; a reply carries at "
			 "most %u bytes (raise shmrun --ring-size)", fn, sb.size,
			 ipc_port_max_payload(&ag->port));
		reply_exception(rq, "RuntimeError", msg, NULL);
	} else if (devmap_check_send(ag, rq->src, true, &sent) ||
		   (sent.nr && rref_charge(ag, &sent, rq->src))) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	} else if (sent.n && pins_add(rq->src, rq->msg_id, PIN_REPLY, &sent)) {
		rref_uncharge(ag, &sent, rq->src);
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	} else {
		send_reply(rq, ret, sb.data, sb.size);
	}
	msgpack_sbuffer_destroy(&sb);
	free_result_handles(call, &sent);
}

/* Runs the call in buf: a SCRIPT_ call, or a Python package's request by
 * the binding (in: that request if decoded already; out: the handler's
 * reply, of the type the caller set, which *result holds). */
static void run_any(shmrpc_call *call, uint16_t type, const uint8_t *buf, size_t len,
		    const struct python_request *in, struct python_request *out, const char **fn,
		    shmrpc_value *result)
{
	bool timed = call->profile && (call->profile_what & PROFILE_CALLS);
	uint64_t start = timed ? shmrpc_now_ns() : 0;
	struct python_request decoded;

	if (python_is_request(type)) {
		*fn = "python";
		/* Asked first: a C-only worker decodes none of them. A remote
		 * call's RRef (out's) goes to the handler, which may keep the
		 * value under it. */
		if (python_here(call, type) && (in || python_decode(call, type, buf, len, &decoded))) {
			if (!in) {
				decoded.rref_id = out->rref_id;
				decoded.rref_slot = out->rref_slot;
			}
			run_python(call, in ? in : &decoded, out, result);
		}
	} else {
		run_call(call, type, buf, len, fn, result);
	}
	if (timed)
		profile_events_add(call->profile, *fn, start, shmrpc_now_ns(), 0, PROFILE_HERE, NULL,
				   0);
}

/* A call answered with its result (in: a Python request decoded already). */
static void run_script_call(struct request_job *rq, shmrpc_call *call,
			    const struct python_request *in)
{
	struct python_request out = { .type = python_reply_type(rq->type),
				      .wrapped = MSG_PYTHON_RET };
	shmrpc_value result = shmrpc_nil();
	const char *fn;

	run_any(call, rq->type, rq->payload, rq->len, in, &out, &fn, &result);
	if (call->failed)
		reply_exception(rq, call->errtype, call->errmsg, call->backtrace);
	else
		reply_value(rq, call, fn, &result,
			    rq->type == MSG_SCRIPT_CALL ? MSG_SCRIPT_RET : out.type);
}

/* [rref_id, slot] at the start of an RRef request; *used: its bytes. */
static int rref_header(struct request_job *rq, shmrpc_call *call, uint64_t *id, uint32_t *slot,
		       size_t *used)
{
	shmrpc_value h;

	if (value_unpack(rq->payload, rq->len, &call->arena, &h, used, NULL) ||
	    h.type != SHMRPC_LIST || h.len != 2 || h.u.items[0].type != SHMRPC_INT ||
	    h.u.items[1].type != SHMRPC_INT || h.u.items[1].u.i < 0 ||
	    h.u.items[1].u.i > UINT32_MAX)
		return shmrpc__fail(-EBADMSG, "a malformed %s request came in",
				    worker_msg_name(rq->type));
	*id = (uint64_t)h.u.items[0].u.i;
	*slot = (uint32_t)h.u.items[1].u.i;
	return 0;
}

/* Answers the FORWARD_AUTOGRAD_REQ in (a remote call, its result stored)
 * with FORWARD_AUTOGRAD_RESP wrapping REMOTE_RET, under the autograd
 * message id of the handler's reply out. */
static void reply_forward_remote(struct request_job *rq, shmrpc_call *call,
				 const struct python_request *in, const struct python_request *out)
{
	struct python_request resp = { .type = MSG_FORWARD_AUTOGRAD_RESP, .wrapped = MSG_REMOTE_RET,
				       .context_id = in->context_id,
				       .message_id = out->message_id };
	shmrpc_value v;

	if (python_request_value(&resp, &call->arena, &v))
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	else
		reply_value(rq, call, "python", &v, MSG_FORWARD_AUTOGRAD_RESP);
}

/* SCRIPT_/PYTHON_REMOTE_CALL, or the one a FORWARD_AUTOGRAD_REQ wraps (in,
 * decoded: its RRef is inside): run the call and store its result, or its
 * error, in the RRef; REMOTE_RET says it is stored, wrapped in
 * FORWARD_AUTOGRAD_RESP as the request was. */
static void run_remote_call(struct request_job *rq, shmrpc_call *call,
			    const struct python_request *in)
{
	struct agent *ag = rq->ag;
	struct python_request out = { .type = MSG_PYTHON_RET }; /* what the RRef stores */
	shmrpc_value result = shmrpc_nil(), err[3], errv;
	struct tensor_list sent = { 0 };
	char text[1024];
	const char *fn;
	uint64_t id;
	uint32_t slot;
	size_t used = rq->len;
	bool live;

	if (in) {
		id = in->rref_id;
		slot = in->rref_slot;
	} else if (rref_header(rq, call, &id, &slot, &used)) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	if (rref_owner_check(ag, id, slot)) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	out.rref_id = id;
	out.rref_slot = slot;
	run_any(call, rq->type, rq->payload + used, rq->len - used, in, &out, &fn, &result);
	/* The handler keeps the value itself (python.h): its object is the value. */
	live = !call->failed && out.live;
	if (call->failed) {
		error_text(ag, call->errmsg, text, sizeof(text));
		err[0] = shmrpc_str(call->errtype);
		err[1] = shmrpc_str(text);
		err[2] = shmrpc_str(call->backtrace ? call->backtrace : "");
	}
	errv = shmrpc_list(err, 3);
	if (rref_owner_store(ag, id, slot, &result, call->failed ? &errv : NULL, live, &sent)) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	} else if (in && call->failed) {
		/* Stored, and the handler made no reply to wrap (a C-only
		 * worker's "not supported yet"): the caller hears it at once. */
		reply_error(rq, call->errtype, text, call->backtrace);
	} else {
		if (call->failed)
			count(&ag->self->errors, 1); /* stored only: no EXCEPTION counts it */
		if (in)
			reply_forward_remote(rq, call, in, &out);
		else
			send_reply(rq, MSG_REMOTE_RET, "\xc0", 1); /* nil */
	}
	/* Handles the function made for its result: the RRef holds its own. */
	free_result_handles(call, &sent);
}

/* FORWARD_AUTOGRAD_REQ: the PYTHON_CALL or PYTHON_REMOTE_CALL it wraps, run
 * as itself by the handler inside the context (which records the recv
 * functions), its reply wrapped in FORWARD_AUTOGRAD_RESP. Decoded once
 * here: decoding adopts the RRefs the request holds. */
static void run_forward(struct request_job *rq, shmrpc_call *call)
{
	struct python_request in;

	if (!python_decode(call, rq->type, rq->payload, rq->len, &in))
		reply_exception(rq, call->errtype, call->errmsg, NULL);
	else if (in.wrapped == MSG_PYTHON_REMOTE_CALL)
		run_remote_call(rq, call, &in);
	else
		run_script_call(rq, call, &in);
}

/* SCRIPT_RREF_FETCH_CALL: the value of an RRef of ours, once it has one. */
static void run_rref_fetch(struct request_job *rq, shmrpc_call *call)
{
	struct agent *ag = rq->ag;
	shmrpc_value v;
	uint64_t id;
	uint32_t slot, state;
	size_t used, len;
	void *buf = NULL;
	struct rref_info info;

	if (rref_header(rq, call, &id, &slot, &used) || !rref_info_at(&ag->rrefs, slot, &info) ||
	    info.id != id || info.owner != ag->rank) {
		reply_exception(rq, "RuntimeError", "a fetch came in for an RRef this worker does "
				"not own", NULL);
		return;
	}
	if (rref_owner_fetch(ag, id, slot, ag->default_timeout_ns ? shmrpc_now_ns() +
					   ag->default_timeout_ns : 0, &buf, &len, &state)) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	/* Our own references to what the value holds, for the reply to charge. */
	call->tensors.take = true;
	if (value_unpack(buf, len, &call->arena, &v, &used, &call->tensors))
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	else if (state == RREF_ERROR && v.type == SHMRPC_LIST && v.len == 3 &&
		 v.u.items[0].type == SHMRPC_STR && v.u.items[1].type == SHMRPC_STR &&
		 v.u.items[2].type == SHMRPC_STR)
		reply_error(rq, v.u.items[0].u.s, v.u.items[1].u.s, v.u.items[2].u.s);
	else
		reply_value(rq, call, "to_here", &v, MSG_SCRIPT_RREF_FETCH_RET);
	free(buf);
}

/* RREF_USER_DELETE: the last reference to an RRef of ours went. */
static void run_rref_delete(struct request_job *rq, shmrpc_call *call)
{
	uint64_t id;
	uint32_t slot;
	size_t used;

	if (rref_header(rq, call, &id, &slot, &used)) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	/* The user put it on our collect list before it sent this. */
	rref_owner_collect_listed(rq->ag);
	send_reply(rq, MSG_RREF_ACK, "\xc0", 1); /* nil */
}

/* The fork id after a fork message's header (used bytes in). */
static int fork_id_at(struct request_job *rq, shmrpc_call *call, size_t used, uint64_t *fork_id)
{
	shmrpc_value v;
	size_t n;

	if (value_unpack(rq->payload + used, rq->len - used, &call->arena, &v, &n, NULL) ||
	    used + n != rq->len || v.type != SHMRPC_INT)
		return shmrpc__fail(-EBADMSG, "a malformed %s request came in",
				    worker_msg_name(rq->type));
	*fork_id = (uint64_t)v.u.i;
	return 0;
}

/* RREF_FORK_REQUEST [rref_id, slot] fork_id: a child of a user's fork
 * wants its reference to an RRef of ours; a repeated one changes nothing. */
static void run_rref_fork_request(struct request_job *rq, shmrpc_call *call)
{
	uint64_t id, fork_id;
	uint32_t slot;
	size_t used;

	if (rref_header(rq, call, &id, &slot, &used) || fork_id_at(rq, call, used, &fork_id) ||
	    rref_owner_add_fork(rq->ag, id, slot, fork_id, rq->src))
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	else
		send_reply(rq, MSG_RREF_ACK, "\xc0", 1); /* nil */
}

/* RREF_CHILD_ACCEPT fork_id: the owner confirmed a fork we sent; our
 * pending-child reference goes (an unknown fork id: nothing happens). */
static void run_rref_child_accept(struct request_job *rq, shmrpc_call *call)
{
	uint64_t fork_id;

	if (fork_id_at(rq, call, 0, &fork_id)) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	rref_child_accepted(rq->ag, fork_id);
	send_reply(rq, MSG_RREF_ACK, "\xc0", 1); /* nil */
}

static void dispatch(struct request_job *rq, shmrpc_call *call);

static void run_request(struct job *j)
{
	struct request_job *rq = (struct request_job *)j;
	struct agent *ag = rq->ag;
	shmrpc_call call = { .caller = rq->src };
	const struct link_served me = { rq->src, rq->msg_id, rq->depth, &rq->up };
	const struct link_served *outer = link_serving_swap(&me);

	trace_rec(SHM_TRACE_STARTED, rq->src, rq->type, rq->msg_id, rq->len, SHM_TRACE_OK);
	count(&ag->self->num_pending_futures, -1);
	count(&ag->self->server_active_calls, 1);
	if (rq->depth == 0 || rq->depth > SHMRPC_MAX_NESTING) {
		char msg[160];

		/* Our own sends never make one: the peer's memory is corrupt. */
		snprintf(msg, sizeof(msg), "a request at nesting depth %u came in from worker %u "
			 "(1 to %u are valid)", rq->depth, rq->src, SHMRPC_MAX_NESTING);
		reply_exception(rq, "RuntimeError", msg, NULL);
	} else {
		dispatch(rq, &call);
	}
	link_serving_swap(outer);
	count(&ag->self->server_active_calls, -1);
	count(&ag->self->calls_served, 1);
	arena_free(&call.arena);
	tensor_list_free(&call.tensors);
	free(call.backtrace);
	free(rq);
}

/* RUN_WITH_PROFILING_REQ: the wrapped request, run as itself with its
 * function timed and/or (a Python function) under torch's profiler, as its
 * caller asks; send_reply wraps its reply with the events. */
static void run_profiled(struct request_job *rq, shmrpc_call *call)
{
	struct profile_events events = { 0 };
	struct request_job *inner;
	const void *buf;
	size_t len;
	uint16_t type;
	shmrpc_value what;

	if (profile_unwrap(rq->payload, rq->len, &call->arena, &type, &buf, &len, &what) ||
	    what.type != SHMRPC_INT || what.u.i <= 0 ||
	    what.u.i > PROFILE_ALL ||
	    type == MSG_RUN_WITH_PROFILING_REQ || !worker_msg_is_request(type)) {
		reply_exception(rq, "RuntimeError", "a malformed RUN_WITH_PROFILING_REQ came in", NULL);
		return;
	}
	if (!(inner = malloc(sizeof(*inner) + len))) {
		reply_exception(rq, "RuntimeError", "out of memory running a profiled request", NULL);
		return;
	}
	*inner = (struct request_job){ rq->base, rq->ag, rq->src, type, rq->msg_id, &events, len,
				       rq->depth, rq->up };
	memcpy(inner->payload, buf, len);
	call->profile = &events;
	call->profile_what = events.what = (unsigned)what.u.i;
	dispatch(inner, call);
	call->profile = NULL;
	call->profile_what = 0;
	profile_events_free(&events);
	free(inner);
}

static void dispatch(struct request_job *rq, shmrpc_call *call)
{
	switch (rq->type) {
	case MSG_SCRIPT_CALL:
	case MSG_PYTHON_CALL:
	case MSG_BACKWARD_AUTOGRAD_REQ:
	case MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ:
	case MSG_RREF_BACKWARD_REQ:
	case MSG_PYTHON_RREF_FETCH_CALL:
		run_script_call(rq, call, NULL);
		break;
	case MSG_FORWARD_AUTOGRAD_REQ:
		run_forward(rq, call);
		break;
	case MSG_SCRIPT_REMOTE_CALL:
	case MSG_PYTHON_REMOTE_CALL:
		run_remote_call(rq, call, NULL);
		break;
	case MSG_SCRIPT_RREF_FETCH_CALL:
		run_rref_fetch(rq, call);
		break;
	case MSG_RREF_USER_DELETE:
		run_rref_delete(rq, call);
		break;
	case MSG_RREF_FORK_REQUEST:
		run_rref_fork_request(rq, call);
		break;
	case MSG_RREF_CHILD_ACCEPT:
		run_rref_child_accept(rq, call);
		break;
	case MSG_RUN_WITH_PROFILING_REQ:
		run_profiled(rq, call);
		break;
	default: {
		char msg[128];
		const char *name = worker_msg_name(rq->type);

		if (name)
			snprintf(msg, sizeof(msg), "request type %s is not supported yet", name);
		else
			snprintf(msg, sizeof(msg), "unknown message type %u", rq->type);
		reply_exception(rq, "RuntimeError", msg, NULL);
	}
	}
}

/* How long a quiet TENSOR_ACK may wait for a frame to ride with: longer
 * than a data loader's trainer takes between a worker's reply and its next
 * request to it (a few batches' time), short next to a training step. */
void server_submit(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
		   uint64_t needed_by, uint32_t depth, const void *help, uint32_t help_n,
		   const void *payload, size_t len)
{
	struct request_job *rq = malloc(sizeof(*rq) + len);

	trace_rec(SHM_TRACE_RECEIVED, src, type, msg_id, len, SHM_TRACE_OK);
	if (!rq) {
		/* Nothing can be queued: the caller will see its call time out. */
		fprintf(stderr, "shmrpc: worker %u: out of memory queueing a request from worker %u\n",
			ag->rank, src);
		return;
	}
	*rq = (struct request_job){ { .run = run_request, .needed_by = needed_by, .src = src },
				    ag, src, type, msg_id, NULL, len, depth, { .n = help_n } };
	if (help_n)
		memcpy(rq->up.e, help, help_n * sizeof(*rq->up.e));
	memcpy(rq->payload, payload, len);
	count(&ag->self->num_pending_futures, 1);
	executor_submit(&rq->base);
}

/* ---- public API for functions ---- */

void *shmrpc_call_alloc(shmrpc_call *call, size_t n)
{
	return arena_alloc(&call->arena, n);
}

int shmrpc_call_caller(const shmrpc_call *call)
{
	return (int)call->caller;
}

/* This side's stack, one frame a line, for the caller to see. */
static char *capture_backtrace(void)
{
	void *frames[48];
	int n = backtrace(frames, 48);
	char **sym = backtrace_symbols(frames, n);
	size_t len = 0;
	char *out;

	if (!sym)
		return NULL;
	for (int i = 0; i < n; i++)
		len += strlen(sym[i]) + 1;
	if ((out = malloc(len + 1))) {
		out[0] = '\0';
		for (int i = 1; i < n; i++) /* frame 0 is this function */
			strcat(strcat(out, sym[i]), "\n");
	}
	free(sym);
	return out;
}

int shmrpc_call_error(shmrpc_call *call, const char *type, const char *fmt, ...)
{
	va_list ap;

	snprintf(call->errtype, sizeof(call->errtype), "%s", type && *type ? type : "RuntimeError");
	va_start(ap, fmt);
	vsnprintf(call->errmsg, sizeof(call->errmsg), fmt, ap);
	va_end(ap);
	free(call->backtrace);
	call->backtrace = capture_backtrace();
	call->failed = true;
	return -SHMRPC_EREMOTE;
}
