/*
 * RPC profiling (torch's RUN_WITH_PROFILING_REQ / _RESP).
 *
 * While a process profiles (shmrpc_profile_start), every request it sends
 * goes out wrapped in RUN_WITH_PROFILING_REQ, [type, payload]. The callee
 * runs the wrapped request as usual and times the function it ran; its
 * reply comes back wrapped in RUN_WITH_PROFILING_RESP, [type, payload,
 * events], events being [[name, start_ns, end_ns, rank], ...]. The caller
 * records one event per call under the seeds' key
 * `rpc_sync#fn(caller -> callee)` (rpc_async, rpc_remote likewise) and the
 * callee's events beneath it, named `KEY#remote_op: fn`. Every worker runs
 * on one machine and one CLOCK_MONOTONIC, so the callee's times need no
 * translation.
 */
#ifndef SHMRPC_WORKER_PROFILE_H
#define SHMRPC_WORKER_PROFILE_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/arena.h"

/* Whether this process profiles its calls now. */
SHMRPC_HIDDEN bool profile_on(void);
/* Names the next request this thread sends: kind "rpc_sync", "rpc_async"
 * (the default) or "rpc_remote", and the function (NULL: keep). */
SHMRPC_HIDDEN void profile_name_next(const char *kind, const char *fn);
/* The names given for the request this thread sends now (NULL if none);
 * the next request starts without. */
SHMRPC_HIDDEN void profile_take_names(const char **kind, const char **fn);
/* "rpc_sync#fn(caller -> callee)" in buf. */
SHMRPC_HIDDEN void profile_key(const char *kind, const char *fn, const char *caller,
			       const char *callee, char *buf, size_t len);
/* Records an event; its index (a parent for others), or -1. */
SHMRPC_HIDDEN int32_t profile_record(const char *name, uint32_t rank, uint64_t start_ns,
				     uint64_t end_ns, int32_t parent);

/* [type, payload] into out. */
SHMRPC_HIDDEN int profile_wrap_request(uint16_t type, const void *buf, size_t len,
				       msgpack_sbuffer *out);
/* The wrapped message of a RUN_WITH_PROFILING_REQ / _RESP, pointing into
 * buf; events (a reply's) decoded into a, NIL for a request. */
SHMRPC_HIDDEN int profile_unwrap(const void *buf, size_t len, struct arena *a, uint16_t *type,
				 const void **inner, size_t *inner_len, shmrpc_value *events);

/* The callee's events for one profiled request. */
struct profile_events {
	uint32_t n, cap;
	struct profile_event_rec {
		char name[96];
		uint64_t start_ns, end_ns;
	} *ev;
};

SHMRPC_HIDDEN void profile_events_add(struct profile_events *pe, const char *name,
				      uint64_t start_ns, uint64_t end_ns);
SHMRPC_HIDDEN void profile_events_free(struct profile_events *pe);
/* [type, payload, events] into out (events from rank). */
SHMRPC_HIDDEN int profile_wrap_reply(uint16_t type, const void *buf, size_t len,
				     const struct profile_events *pe, uint32_t rank,
				     msgpack_sbuffer *out);
/* A profiled call went out / settled (by a reply, a failure, a timeout or
 * a death): shmrpc_profile_stop waits for those in flight, so that a call
 * made while profiling is in the profile even if its reply comes late
 * (remote()'s does, after to_here() has read the value from the table). */
SHMRPC_HIDDEN void profile_call_begin(void);
SHMRPC_HIDDEN void profile_call_end(void);
/* Records a completed profiled call and the callee's events under it. */
SHMRPC_HIDDEN void profile_call_done(const char *key, uint32_t rank, uint64_t start_ns,
				     const shmrpc_value *events);

#endif
