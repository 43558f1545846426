/* A request's reply: its value, or an EXCEPTION with the error's type, text
 * and this side's backtrace; to the caller, or to ourselves. */
#include <errno.h>
#include <execinfo.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "worker/devmap.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/pins.h"
#include "worker/profile.h"
#include "worker/rref.h"
#include "worker/sbuf.h"
#include "worker/server_impl.h"
#include "worker/tensor.h"
#include "worker/trace.h"
#include "worker/value.h"
void server_count(_Atomic uint64_t *c, int64_t delta)
{
	/* Relaxed: gauges and counters for inspectors. */
	atomic_fetch_add_explicit(c, (uint64_t)delta, memory_order_relaxed);
}

void server_send_reply(struct request_job *rq, uint16_t type, const void *buf, size_t len)
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
			server_send_reply(rq, MSG_RUN_WITH_PROFILING_RESP, wrapped.data, wrapped.size);
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
void server_reply_error(struct request_job *rq, const char *type, const char *text, const char *bt)
{
	msgpack_sbuffer sb;
	msgpack_packer pk;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_array(&pk, 3);
	msgpack_pack_str_with_body(&pk, type, strlen(type));
	msgpack_pack_str_with_body(&pk, text, strlen(text));
	msgpack_pack_str_with_body(&pk, bt ? bt : "", bt ? strlen(bt) : 0);
	server_count(&rq->ag->self->errors, 1);
	server_send_reply(rq, MSG_EXCEPTION, sb.data, sb.size);
	msgpack_sbuffer_destroy(&sb);
}

/* "Error on worker R (name): msg" into text. */
void server_error_text(struct agent *ag, const char *msg, char *text, size_t len)
{
	char name[SHM_NAME_MAX];

	agent_peer_name(ag, ag->rank, name, sizeof(name));
	snprintf(text, len, "Error on worker %u (%s): %s", ag->rank, name, msg);
}

void server_reply_exception(struct request_job *rq, const char *type, const char *msg,
			    const char *bt)
{
	char text[1024];

	server_error_text(rq->ag, msg, text, sizeof(text));
	server_reply_error(rq, type, text, bt);
}

/* The handles in `sent` that the function made for its result (not the
 * call's arguments', not met before) are the call's to free once sent. */
void server_free_result_handles(shmrpc_call *call, struct tensor_list *sent)
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
 * caller's ack, but for those the request carried (the caller's pin of its
 * request keeps them until it has unpacked this reply,
 * future_complete_packed); its RRefs charged to the caller. */
void server_reply_value(struct request_job *rq, shmrpc_call *call, const char *fn,
			const shmrpc_value *result, uint16_t ret)
{
	struct agent *ag = rq->ag;
	struct tensor_list sent = { .covers = &call->tensors };
	msgpack_sbuffer sb;
	msgpack_packer pk;
	char msg[256];

	sbuf_open(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if (value_pack(&pk, result, &sent)) {
		server_reply_exception(rq, "TypeError", shmrpc_errmsg(), NULL);
	} else if (rq->src != ag->rank && sb.size > ipc_port_max_payload(&ag->port)) {
		snprintf(msg, sizeof(msg), "the result of %.64s() is %zu bytes; a reply carries at "
			 "most %u bytes (raise shmrun --ring-size)", fn, sb.size,
			 ipc_port_max_payload(&ag->port));
		server_reply_exception(rq, "RuntimeError", msg, NULL);
	} else if (devmap_check_send(ag, rq->src, true, &sent) ||
		   (sent.nr && rref_charge(ag, &sent, rq->src))) {
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	} else if (sent.n && pins_add(rq->src, rq->msg_id, PIN_REPLY, &sent)) {
		rref_uncharge(ag, &sent, rq->src);
		server_reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	} else {
		server_send_reply(rq, ret, sb.data, sb.size);
	}
	sbuf_close(&sb);
	server_free_result_handles(call, &sent);
}
