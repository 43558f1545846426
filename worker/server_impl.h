/*
 * What server.c (requests: queued, run, dispatched), server_reply.c (the
 * replies), server_call.c (running a call) and server_rref.c (the RRef
 * requests) share, and no other file.
 */
#ifndef SHMRPC_WORKER_SERVER_IMPL_H
#define SHMRPC_WORKER_SERVER_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/arena.h"
#include "worker/executor.h"
#include "worker/link.h"
#include "worker/profile.h"
#include "worker/python.h"
#include "worker/tensor.h"
#include "worker/trace.h"

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
	struct trace_mark received; /* its RECEIVED record, which its start may fold into */
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

/* server_reply.c: replies */
/* Gauges and counters of our slot, for inspectors. */
SHMRPC_HIDDEN void server_count(_Atomic uint64_t *c, int64_t delta);
/* The reply of type (buf) to rq's caller, wrapped with a profiled
 * request's events. */
SHMRPC_HIDDEN void server_send_reply(struct request_job *rq, uint16_t type, const void *buf,
				     size_t len);
/* An EXCEPTION whose text already names where it happened. */
SHMRPC_HIDDEN void server_reply_error(struct request_job *rq, const char *type, const char *text,
				      const char *bt);
/* "Error on worker R (name): msg" into text. */
SHMRPC_HIDDEN void server_error_text(struct agent *ag, const char *msg, char *text, size_t len);
/* An EXCEPTION of type with msg, named as this worker's (server_error_text). */
SHMRPC_HIDDEN void server_reply_exception(struct request_job *rq, const char *type, const char *msg,
					  const char *bt);
/* The handles in `sent` that the function made for its result (not the
 * call's arguments', not met before) are the call's to free once sent. */
SHMRPC_HIDDEN void server_free_result_handles(shmrpc_call *call, struct tensor_list *sent);
/* Sends result as the reply of type ret: its tensors pinned until the
 * caller's ack, its RRefs charged to the caller. */
SHMRPC_HIDDEN void server_reply_value(struct request_job *rq, shmrpc_call *call, const char *fn,
				      const shmrpc_value *result, uint16_t ret);

/* server_call.c: running a call */
/* A call answered with its result (in: a Python request decoded already). */
SHMRPC_HIDDEN void server_run_script_call(struct request_job *rq, shmrpc_call *call,
					  const struct python_request *in);
/* The Python package's request of type in buf, decoded into *in in the
 * call's arena (its RRefs and tensors are the call's); false with the call
 * failed. */
SHMRPC_HIDDEN bool server_python_decode(shmrpc_call *call, uint16_t type, const uint8_t *buf,
					size_t len, struct python_request *in);

/* Runs the call in buf: a SCRIPT_ call, or a Python package's request by
 * the binding (in: that request if decoded already; out: the handler's
 * reply, of the type the caller set, which *result holds). */
SHMRPC_HIDDEN void server_run_any(shmrpc_call *call, uint16_t type, const uint8_t *buf, size_t len,
				  const struct python_request *in, struct python_request *out,
				  const char **fn, shmrpc_value *result);

/* server_rref.c: the RRef requests */
/* SCRIPT_/PYTHON_REMOTE_CALL, or the one a FORWARD_AUTOGRAD_REQ wraps (in,
 * decoded: its RRef is inside): run the call and store its result, or its
 * error, in the RRef; REMOTE_RET says it is stored, wrapped in
 * FORWARD_AUTOGRAD_RESP as the request was. */
SHMRPC_HIDDEN void server_run_remote_call(struct request_job *rq, shmrpc_call *call,
					  const struct python_request *in);
/* FORWARD_AUTOGRAD_REQ: the PYTHON_CALL or PYTHON_REMOTE_CALL it wraps, run
 * as itself by the handler inside the context (which records the recv
 * functions), its reply wrapped in FORWARD_AUTOGRAD_RESP. Decoded once
 * here: decoding adopts the RRefs the request holds. */
SHMRPC_HIDDEN void server_run_forward(struct request_job *rq, shmrpc_call *call);
/* SCRIPT_RREF_FETCH_CALL: the value of an RRef of ours, once it has one. */
SHMRPC_HIDDEN void server_run_rref_fetch(struct request_job *rq, shmrpc_call *call);
/* RREF_USER_DELETE: the last reference to an RRef of ours went. */
SHMRPC_HIDDEN void server_run_rref_delete(struct request_job *rq, shmrpc_call *call);
/* RREF_FORK_REQUEST [rref_id, slot] fork_id: a child of a user's fork
 * wants its reference to an RRef of ours; a repeated one changes nothing. */
SHMRPC_HIDDEN void server_run_rref_fork_request(struct request_job *rq, shmrpc_call *call);
/* RREF_CHILD_ACCEPT fork_id: the owner confirmed a fork we sent; our
 * pending-child reference goes (an unknown fork id: nothing happens). */
SHMRPC_HIDDEN void server_run_rref_child_accept(struct request_job *rq, shmrpc_call *call);

#endif
