/* The RRef requests: remote() calls, fetches, deletes, forks. */
#include <errno.h>
#include <execinfo.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdlib.h>

#include "common/clock.h"
#include "common/error.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/python.h"
#include "worker/rref.h"
#include "worker/server_impl.h"
#include "worker/tensor.h"
#include "worker/value.h"
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
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	else
		server_reply_value(rq, call, "python", &v, MSG_FORWARD_AUTOGRAD_RESP);
}

/* SCRIPT_/PYTHON_REMOTE_CALL, or the one a FORWARD_AUTOGRAD_REQ wraps (in,
 * decoded: its RRef is inside): run the call and store its result, or its
 * error, in the RRef; REMOTE_RET says it is stored, wrapped in
 * FORWARD_AUTOGRAD_RESP as the request was. */
void server_run_remote_call(struct request_job *rq, shmrpc_call *call,
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
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	if (rref_owner_check(ag, id, slot)) {
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	out.rref_id = id;
	out.rref_slot = slot;
	server_run_any(call, rq->type, rq->payload + used, rq->len - used, in, &out, &fn, &result);
	/* The handler keeps the value itself (python.h): its object is the value. */
	live = !call->failed && out.live;
	if (call->failed) {
		server_error_text(ag, call->errmsg, text, sizeof(text));
		err[0] = shmrpc_str(call->errtype);
		err[1] = shmrpc_str(text);
		err[2] = shmrpc_str(call->backtrace ? call->backtrace : "");
	}
	errv = shmrpc_list(err, 3);
	if (rref_owner_store(ag, id, slot, &result, call->failed ? &errv : NULL, live, &sent)) {
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	} else if (in && call->failed) {
		/* Stored, and the handler made no reply to wrap (a C-only
		 * worker's "not supported yet"): the caller hears it at once. */
		server_reply_error(rq, call->errtype, text, call->backtrace);
	} else {
		if (call->failed)
			server_count(&ag->self->errors, 1); /* stored only: no EXCEPTION counts it */
		if (in)
			reply_forward_remote(rq, call, in, &out);
		else
			server_send_reply(rq, MSG_REMOTE_RET, "\xc0", 1); /* nil */
	}
	/* Handles the function made for its result: the RRef holds its own. */
	server_free_result_handles(call, &sent);
}

/* FORWARD_AUTOGRAD_REQ: the PYTHON_CALL or PYTHON_REMOTE_CALL it wraps, run
 * as itself by the handler inside the context (which records the recv
 * functions), its reply wrapped in FORWARD_AUTOGRAD_RESP. Decoded once
 * here: decoding adopts the RRefs the request holds. */
void server_run_forward(struct request_job *rq, shmrpc_call *call)
{
	struct python_request in;

	if (!server_python_decode(call, rq->type, rq->payload, rq->len, &in))
		server_reply_exception(rq, call->errtype, call->errmsg, NULL);
	else if (in.wrapped == MSG_PYTHON_REMOTE_CALL)
		server_run_remote_call(rq, call, &in);
	else
		server_run_script_call(rq, call, &in);
}

/* SCRIPT_RREF_FETCH_CALL: the value of an RRef of ours, once it has one. */
void server_run_rref_fetch(struct request_job *rq, shmrpc_call *call)
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
		server_reply_exception(rq, "RuntimeError", "a fetch came in for an RRef this worker does "
				"not own", NULL);
		return;
	}
	if (rref_owner_fetch(ag, id, slot, ag->default_timeout_ns ? shmrpc_now_ns() +
					   ag->default_timeout_ns : 0, &buf, &len, &state)) {
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	/* Our own references to what the value holds, for the reply to charge. */
	call->tensors.take = true;
	if (value_unpack(buf, len, &call->arena, &v, &used, &call->tensors))
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	else if (state == RREF_ERROR && v.type == SHMRPC_LIST && v.len == 3 &&
		 v.u.items[0].type == SHMRPC_STR && v.u.items[1].type == SHMRPC_STR &&
		 v.u.items[2].type == SHMRPC_STR)
		server_reply_error(rq, v.u.items[0].u.s, v.u.items[1].u.s, v.u.items[2].u.s);
	else
		server_reply_value(rq, call, "to_here", &v, MSG_SCRIPT_RREF_FETCH_RET);
	free(buf);
}

/* RREF_USER_DELETE: the last reference to an RRef of ours went. */
void server_run_rref_delete(struct request_job *rq, shmrpc_call *call)
{
	uint64_t id;
	uint32_t slot;
	size_t used;

	if (rref_header(rq, call, &id, &slot, &used)) {
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	/* The user put it on our collect list before it sent this. */
	rref_owner_collect_listed(rq->ag);
	server_send_reply(rq, MSG_RREF_ACK, "\xc0", 1); /* nil */
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
void server_run_rref_fork_request(struct request_job *rq, shmrpc_call *call)
{
	uint64_t id, fork_id;
	uint32_t slot;
	size_t used;

	if (rref_header(rq, call, &id, &slot, &used) || fork_id_at(rq, call, used, &fork_id) ||
	    rref_owner_add_fork(rq->ag, id, slot, fork_id, rq->src))
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	else
		server_send_reply(rq, MSG_RREF_ACK, "\xc0", 1); /* nil */
}

/* RREF_CHILD_ACCEPT fork_id: the owner confirmed a fork we sent; our
 * pending-child reference goes (an unknown fork id: nothing happens). */
void server_run_rref_child_accept(struct request_job *rq, shmrpc_call *call)
{
	uint64_t fork_id;

	if (fork_id_at(rq, call, 0, &fork_id)) {
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
		return;
	}
	rref_child_accepted(rq->ag, fork_id);
	server_send_reply(rq, MSG_RREF_ACK, "\xc0", 1); /* nil */
}
