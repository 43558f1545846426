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
#include "common/spare.h"
#include "worker/executor.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/profile.h"
#include "worker/python.h"
#include "worker/rref.h"
#include "worker/server.h"
#include "worker/server_impl.h"
#include "worker/tensor.h"
#include "worker/trace.h"
static void dispatch(struct request_job *rq, shmrpc_call *call);

/* A request's memory, malloc'd by the thread that takes it off the ring
 * and freed by the executor that ran it, is passed back to the next one
 * (common/spare.h). Small requests all take REQUEST_SMALL bytes, so that
 * any of them fits the block. */
#define REQUEST_SMALL 512u
_Static_assert(sizeof(struct request_job) < REQUEST_SMALL, "a small request has room for a payload");
static struct spare spare_request;

static struct request_job *request_alloc(size_t len)
{
	if (len > REQUEST_SMALL - sizeof(struct request_job))
		return malloc(sizeof(struct request_job) + len);
	return spare_take(&spare_request, REQUEST_SMALL);
}

static void request_free(struct request_job *rq)
{
	if (rq->len <= REQUEST_SMALL - sizeof(*rq))
		spare_put(&spare_request, rq);
	else
		free(rq);
}

static void run_request(struct job *j)
{
	struct request_job *rq = (struct request_job *)j;
	struct agent *ag = rq->ag;
	shmrpc_call call = { .caller = rq->src };
	struct arena_first first;
	const struct link_served me = { rq->src, rq->msg_id, rq->depth, &rq->up };
	const struct link_served *outer = link_serving_swap(&me);

	arena_init(&call.arena, &first);
	trace_started(&rq->received, rq->src, rq->type, rq->msg_id, rq->len);
	server_count(&ag->self->num_pending_futures, -1);
	server_count(&ag->self->server_active_calls, 1);
	if (rq->depth == 0 || rq->depth > SHMRPC_MAX_NESTING) {
		char msg[160];

		/* Our own sends never make one: the peer's memory is corrupt. */
		snprintf(msg, sizeof(msg), "a request at nesting depth %u came in from worker %u "
			 "(1 to %u are valid)", rq->depth, rq->src, SHMRPC_MAX_NESTING);
		server_reply_exception(rq, "RuntimeError", msg, NULL);
	} else {
		dispatch(rq, &call);
	}
	link_serving_swap(outer);
	server_count(&ag->self->server_active_calls, -1);
	server_count(&ag->self->calls_served, 1);
	arena_free(&call.arena);
	tensor_list_free(&call.tensors);
	free(call.backtrace);
	request_free(rq);
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
		server_reply_exception(rq, "RuntimeError", "a malformed RUN_WITH_PROFILING_REQ came in", NULL);
		return;
	}
	if (!(inner = malloc(sizeof(*inner) + len))) {
		server_reply_exception(rq, "RuntimeError", "out of memory running a profiled request", NULL);
		return;
	}
	*inner = (struct request_job){ rq->base, rq->ag, rq->src, type, rq->msg_id, &events, len,
				       rq->depth, rq->up, rq->received };
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
		server_run_script_call(rq, call, NULL);
		break;
	case MSG_FORWARD_AUTOGRAD_REQ:
		server_run_forward(rq, call);
		break;
	case MSG_SCRIPT_REMOTE_CALL:
	case MSG_PYTHON_REMOTE_CALL:
		server_run_remote_call(rq, call, NULL);
		break;
	case MSG_SCRIPT_RREF_FETCH_CALL:
		server_run_rref_fetch(rq, call);
		break;
	case MSG_RREF_USER_DELETE:
		server_run_rref_delete(rq, call);
		break;
	case MSG_RREF_FORK_REQUEST:
		server_run_rref_fork_request(rq, call);
		break;
	case MSG_RREF_CHILD_ACCEPT:
		server_run_rref_child_accept(rq, call);
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
		server_reply_exception(rq, "RuntimeError", msg, NULL);
	}
	}
}

void server_submit(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
		   uint64_t needed_by, uint32_t depth, const void *help, uint32_t help_n,
		   const void *payload, size_t len)
{
	struct request_job *rq = request_alloc(len);
	struct trace_mark received;

	trace_received(src, type, msg_id, len, &received);
	if (!rq) {
		/* Nothing can be queued: the caller will see its call time out. */
		fprintf(stderr, "shmrpc: worker %u: out of memory queueing a request from worker %u\n",
			ag->rank, src);
		return;
	}
	*rq = (struct request_job){ { .run = run_request, .needed_by = needed_by, .src = src },
				    ag, src, type, msg_id, NULL, len, depth, { .n = help_n },
				    received };
	if (help_n)
		memcpy(rq->up.e, help, help_n * sizeof(*rq->up.e));
	memcpy(rq->payload, payload, len);
	server_count(&ag->self->num_pending_futures, 1);
	executor_submit(&rq->base);
}
