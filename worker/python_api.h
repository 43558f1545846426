/*
 * What the Python extension (python/_shmrpc.c and the files beside it)
 * reaches of worker/: the only worker header it includes. The requests
 * it sends and serves are worker/python.h's (included); the rest is here,
 * none of it naming the agent: functions that need it fail with -ENOTCONN
 * while none runs (no sentence: the binding says torch's).
 */
#ifndef SHMRPC_WORKER_PYTHON_API_H
#define SHMRPC_WORKER_PYTHON_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/msg.h"
#include "worker/python.h"

/* The requests (worker/python.c, rref_call.c). */
/* Installs the handler; without one, Python requests are answered
 * "request type PYTHON_CALL is not supported yet" (a C-only worker). */
SHMRPC_HIDDEN void python_set_handler(python_handler_fn fn);
/* The Python message of a reply to python_request_async: a PYTHON_RET or
 * _RESP payload, or the one a FORWARD_AUTOGRAD_RESP wraps (the future
 * does not keep the reply's type: the two shapes differ). */
SHMRPC_HIDDEN int python_reply_of(const shmrpc_value *v, struct arena *a, struct python_msg *m);
/* Sends r (a request type the binding sends: PYTHON_CALL or an autograd
 * one) to dst; the future's value is the reply (python_reply_of). */
SHMRPC_HIDDEN int python_request_async(int dst, const struct python_request *r,
				       int64_t timeout_ms, shmrpc_future **out);
/* Sends r, a PYTHON_REMOTE_CALL or a FORWARD_AUTOGRAD_REQ wrapping one, to
 * dst (rref_call.c); the RRef's value is the pickled result. */
SHMRPC_HIDDEN int python_remote(int dst, const struct python_request *r, int64_t timeout_ms,
				shmrpc_rref **out);
/* RRef(value) on this worker (rref_call.c): an owner RRef, ready at once,
 * whose value is pickled (a value no code can change), or, live, the
 * binding's own object (it keeps it under the RRef's id from now on). */
SHMRPC_HIDDEN int python_rref_local(const char *pickled, uint32_t len, bool live,
				    shmrpc_rref **out);

/* A call of the binding's: named for the profiler (kind "rpc_sync",
 * "rpc_async", "rpc_remote", or NULL; fn), profiled for torch's when
 * torch has PROFILE_TORCH (with PROFILE_SHAPES, PROFILE_MEMORY), and,
 * sync, an rpc_sync (worker/client.h). python_call_end after the send,
 * sent or refused. */
SHMRPC_HIDDEN void python_call_begin(const char *kind, const char *fn, unsigned torch, bool sync);
SHMRPC_HIDDEN void python_call_end(void);

/* A call profiled for torch's profiler, once completed (waited for here). */
struct python_profiled {
	const char *key;
	uint64_t sent_ns, done_ns;
	const struct profile_events *events; /* the callee's; NULL if it failed */
};
/* False for a call not profiled so. */
SHMRPC_HIDDEN bool python_profiled(shmrpc_future *f, struct python_profiled *out);

/* The same for the remote() call that made r (RRef.profiled). */
SHMRPC_HIDDEN bool python_rref_profiled(const shmrpc_rref *r, struct python_profiled *out);
/* r's id (torch's GloballyUniqueId as one number: RREF_ID, worker/rref.h). */
SHMRPC_HIDDEN uint64_t python_rref_id(const shmrpc_rref *r);

/* Around a wait of the calling thread on something other than a call (a
 * Python Future): an executor thread is counted out of the pool. */
SHMRPC_HIDDEN void python_blocking(bool on);
/* Whether the calling thread is an executor thread. */
SHMRPC_HIDDEN bool python_on_executor(void);
/* Replies taken by the threads that wait for them (worker/link.h);
 * turning it off without an agent is nothing. */
SHMRPC_HIDDEN int python_take_replies(bool on);

/* A received message's tensor t made the binding's own: a new handle in
 * *out with t's reference, t keeping none (tensor_take_over), where
 * nothing reads t's bytes after: a request's tensors in the handler that
 * serves it, a reply's taken by the one waiting for it. */
SHMRPC_HIDDEN int python_tensor_take(shmrpc_tensor *t, shmrpc_tensor **out);
/* future_hook (worker/future.h): cb run by a thread waiting for f, if one
 * is when f completes, else on an executor. 0, or -ENOMEM. */
SHMRPC_HIDDEN int python_future_hook(shmrpc_future *f, void (*cb)(shmrpc_future *f, void *arg),
				     void *arg);

/* The handle of a reply's tensor that is the request's tensor t (the same
 * pool block, bytes, dtype and shape), served in the binding's fast path:
 * without a reference of its own (tensor_described), the caller's request
 * pin keeping the block; a device or heap tensor's is retained. */
SHMRPC_HIDDEN int python_tensor_echoed(shmrpc_tensor *t, shmrpc_tensor **out);

/* The rank of the worker named name (a call's destination by name):
 * shmrpc_get_worker_info's, without formatting its name; -ENOENT or
 * -ENOTCONN, with the error's sentence. */
SHMRPC_HIDDEN int python_rank_named(const char *name);

/* Which of this process's agents runs (struct agent.job: 1, 2, ... per
 * shmrpc_init), 0 when none: what a worker's name means stays so while it
 * is the same. */
SHMRPC_HIDDEN uint64_t python_agent_job(void);
/* Whether rank is gone (*gone), and then whether it died rather than left
 * (*died) and why, as a call to it would fail. -EINVAL: no such rank (the
 * job's size in *world). */
SHMRPC_HIDDEN int python_peer_gone(int rank, bool *gone, bool *died, char *why, size_t len,
				   uint32_t *world);

/* This worker's agent gauges (its slot's) and torch's RRef counts. */
struct python_gauges {
	uint64_t thread_pool_size, num_idle_threads, client_active_calls, server_active_calls,
		server_pending_calls, calls_served;
	uint64_t owner_rrefs, pending_owner_rrefs, forks, pending_users;
};
SHMRPC_HIDDEN int python_gauges(struct python_gauges *out);

/* This process's mapping of its job's tensor pool: false when there is
 * none (no agent, or a job without a pool). */
SHMRPC_HIDDEN bool python_pool_mapping(void **base, uint64_t *size);

/* A graceful shutdown's RRef steps (worker/rref.h): every reference held
 * on other workers' RRefs goes; the leak check's text. */
SHMRPC_HIDDEN int python_rref_drop_users(void);
SHMRPC_HIDDEN int python_rref_leaks(char *buf, size_t len);
/* The binding keeps live values (python_rref_local): fn drops the one of
 * an RRef id once the RRef has gone (rref_set_live_release). */
SHMRPC_HIDDEN void python_set_live_release(void (*fn)(uint64_t id));

#endif
