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

#include "common/error.h"
#include "worker/agent.h"
#include "worker/executor.h"
#include "worker/msg.h"
#include "worker/registry.h"
#include "worker/tensor.h"
#include "worker/value.h"

struct request_job {
	struct job base;
	struct agent *ag;
	uint32_t src;
	uint16_t type;
	uint64_t msg_id;
	size_t len;
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
};

static void count(_Atomic uint64_t *c, int64_t delta)
{
	/* Relaxed: gauges and counters for inspectors. */
	atomic_fetch_add_explicit(c, (uint64_t)delta, memory_order_relaxed);
}

static void send_reply(struct request_job *rq, uint16_t type, const void *buf, size_t len)
{
	struct agent *ag = rq->ag;
	int rc;

	if (rq->src == ag->rank) {
		client_complete_local(ag, type, rq->msg_id, buf, len);
		return;
	}
	/* A caller that died needs no answer; anything else is ours to report. */
	rc = agent_send(ag, rq->src, type, rq->msg_id, buf, len);
	if (rc && rc != -SHMRPC_EPEERDEAD)
		fprintf(stderr, "shmrpc: worker %u: cannot answer worker %u: %s\n", ag->rank,
			rq->src, shmrpc_errmsg());
}

static void reply_exception(struct request_job *rq, const char *type, const char *msg,
			    const char *bt)
{
	struct agent *ag = rq->ag;
	char name[SHM_NAME_MAX], text[1024];
	msgpack_sbuffer sb;
	msgpack_packer pk;

	agent_peer_name(ag, ag->rank, name, sizeof(name));
	snprintf(text, sizeof(text), "Error on worker %u (%s): %s", ag->rank, name, msg);
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_array(&pk, 3);
	msgpack_pack_str_with_body(&pk, type, strlen(type));
	msgpack_pack_str_with_body(&pk, text, strlen(text));
	msgpack_pack_str_with_body(&pk, bt ? bt : "", bt ? strlen(bt) : 0);
	count(&ag->self->errors, 1);
	send_reply(rq, MSG_EXCEPTION, sb.data, sb.size);
	msgpack_sbuffer_destroy(&sb);
}

/* Runs fn on the decoded call [name, [args...]]; fills *result or call's error. */
static void run_script_call(struct request_job *rq, shmrpc_call *call)
{
	struct agent *ag = rq->ag;
	const struct registry_entry *e;
	shmrpc_value req, result = shmrpc_nil();
	struct tensor_list sent = { 0 };
	const char *fn;
	msgpack_sbuffer sb;
	msgpack_packer pk;
	size_t used;
	int rc;

	if (value_unpack(rq->payload, rq->len, &call->arena, &req, &used, &call->tensors) ||
	    used != rq->len ||
	    req.type != SHMRPC_LIST || req.len != 2 || req.u.items[0].type != SHMRPC_STR ||
	    req.u.items[1].type != SHMRPC_LIST) {
		reply_exception(rq, "RuntimeError", "a malformed SCRIPT_CALL request came in", NULL);
		return;
	}
	fn = req.u.items[0].u.s;
	if (!(e = registry_find(fn))) {
		char msg[400];

		snprintf(msg, sizeof(msg), "no function named \"%.256s\" is registered", fn);
		reply_exception(rq, "RuntimeError", msg, NULL);
		return;
	}
	if (value_check_sig(fn, e->sig, req.u.items[1].u.items, req.u.items[1].len)) {
		reply_exception(rq, "TypeError", shmrpc_errmsg(), NULL);
		return;
	}
	rc = e->fn(call, req.u.items[1].u.items, req.u.items[1].len, &result, e->user);
	if (rc || call->failed) {
		if (!call->failed)
			snprintf(call->errmsg, sizeof(call->errmsg), "%s() failed: %s", fn,
				 shmrpc_strerror(rc ? rc : -EIO));
		reply_exception(rq, call->failed ? call->errtype : "RuntimeError", call->errmsg,
				call->backtrace);
		return;
	}
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	if (value_pack(&pk, &result, &sent))
		reply_exception(rq, "TypeError", shmrpc_errmsg(), NULL);
	else if (rq->src != ag->rank && sb.size > ipc_port_max_payload(&ag->port)) {
		char msg[256];

		snprintf(msg, sizeof(msg), "the result of %s() is %zu bytes; a reply carries at most "
			 "%u bytes (raise shmrun --ring-size)", fn, sb.size,
			 ipc_port_max_payload(&ag->port));
		reply_exception(rq, "RuntimeError", msg, NULL);
	} else if (sent.n && pins_add(rq->src, rq->msg_id, PIN_REPLY, &sent)) {
		reply_exception(rq, "RuntimeError", shmrpc_errmsg(), NULL);
	} else {
		send_reply(rq, MSG_SCRIPT_RET, sb.data, sb.size);
	}
	msgpack_sbuffer_destroy(&sb);
	/* Tensors the function made for its result are the call's to free; the
	 * pins keep them alive until the caller holds them. */
	for (uint32_t i = 0; i < sent.n; i++)
		if (!tensor_list_has(&call->tensors, sent.t[i]) && !tensor_list_has_before(&sent, i, sent.t[i]))
			shmrpc_tensor_free(sent.t[i]);
	tensor_list_forget(&sent);
}

static void run_request(struct job *j)
{
	struct request_job *rq = (struct request_job *)j;
	struct agent *ag = rq->ag;
	shmrpc_call call = { .caller = rq->src };

	count(&ag->self->num_pending_futures, -1);
	count(&ag->self->server_active_calls, 1);
	if (rq->type == MSG_SCRIPT_CALL) {
		run_script_call(rq, &call);
	} else {
		char msg[128];
		const char *name = worker_msg_name(rq->type);

		if (name)
			snprintf(msg, sizeof(msg), "request type %s is not supported yet", name);
		else
			snprintf(msg, sizeof(msg), "unknown message type %u", rq->type);
		reply_exception(rq, "RuntimeError", msg, NULL);
	}
	count(&ag->self->server_active_calls, -1);
	count(&ag->self->calls_served, 1);
	arena_free(&call.arena);
	tensor_list_free(&call.tensors);
	free(call.backtrace);
	free(rq);
}

struct ack_job {
	struct job base;
	struct agent *ag;
	uint32_t peer;
	uint64_t msg_id;
};

static void run_ack(struct job *j)
{
	struct ack_job *a = (struct ack_job *)j;
	int rc = agent_send(a->ag, a->peer, MSG_TENSOR_ACK, a->msg_id, NULL, 0);

	/* A peer that died has had its pins released by its own sweep. */
	if (rc && rc != -SHMRPC_EPEERDEAD)
		fprintf(stderr, "shmrpc: worker %u: cannot acknowledge tensors to worker %u: %s\n",
			a->ag->rank, a->peer, shmrpc_errmsg());
	free(a);
}

void server_ack_tensors(struct agent *ag, uint32_t peer, uint64_t msg_id)
{
	struct ack_job *a;

	if (peer == ag->rank) {
		pins_release(peer, msg_id, PIN_REPLY);
		return;
	}
	/* Sent from an executor thread: the loop thread never sends. */
	if (!(a = malloc(sizeof(*a)))) {
		fprintf(stderr, "shmrpc: worker %u: out of memory acknowledging tensors; worker %u "
			"keeps them until it ends\n", ag->rank, peer);
		return;
	}
	*a = (struct ack_job){ { NULL, run_ack }, ag, peer, msg_id };
	executor_submit(&a->base);
}

void server_submit(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
		   const void *payload, size_t len)
{
	struct request_job *rq = malloc(sizeof(*rq) + len);

	if (!rq) {
		/* Nothing can be queued: the caller will see its call time out. */
		fprintf(stderr, "shmrpc: worker %u: out of memory queueing a request from worker %u\n",
			ag->rank, src);
		return;
	}
	*rq = (struct request_job){ { NULL, run_request }, ag, src, type, msg_id, len };
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
