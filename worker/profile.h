/*
 * RPC profiling (torch's RUN_WITH_PROFILING_REQ / _RESP).
 *
 * While a process profiles (shmrpc_profile_start), every request it sends
 * goes out wrapped in RUN_WITH_PROFILING_REQ, [type, payload, what], what
 * being PROFILE_CALLS; so does a Python call made while torch's legacy
 * autograd profiler runs in the calling thread, with PROFILE_TORCH
 * (python/shmrpc/profiler.py). The callee runs the wrapped request as
 * usual; for PROFILE_CALLS it times the function it ran, for PROFILE_TORCH
 * the Python binding runs a Python function under torch's legacy profiler
 * (where torch is loaded) and gives the ops it recorded. The reply comes
 * back wrapped in RUN_WITH_PROFILING_RESP, [type, payload, events], events
 * being [[name, start_ns, end_ns, rank, thread], ...]. For PROFILE_CALLS
 * the caller records one event per call under the seeds' key
 * `rpc_sync#fn(caller -> callee)` (rpc_async, rpc_remote likewise) and the
 * callee's events beneath it, named `KEY#remote_op: fn`; for PROFILE_TORCH
 * the future keeps the callee's events for the binding. Every worker runs
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

/* What a profiled request asks of the callee (its wrapper's `what`). */
enum {
	PROFILE_CALLS = 1u, /* shmrpc's profiler: time the function */
	PROFILE_TORCH = 2u, /* torch's legacy profiler: the ops a Python function ran */
	PROFILE_SHAPES = 4u, /* with PROFILE_TORCH: the ops' input shapes (record_shapes) */
	PROFILE_MEMORY = 8u, /* with PROFILE_TORCH: their memory use (profile_memory) */
	PROFILE_ALL = 15u,
};

/* Whether this process profiles its calls now. */
SHMRPC_HIDDEN bool profile_on(void);
/* Names the next request this thread sends: kind "rpc_sync", "rpc_async"
 * (the default) or "rpc_remote", and the function (NULL: keep). */
SHMRPC_HIDDEN void profile_name_next(const char *kind, const char *fn);
/* The next request this thread sends is profiled for torch's profiler:
 * what, PROFILE_TORCH and the options of torch's profile (SHAPES, MEMORY). */
SHMRPC_HIDDEN void profile_torch_next(unsigned what);
/* The names given for the request this thread sends now (NULL if none)
 * and what torch's profiler asks of it (0: not profiled for torch); the
 * next request starts without. */
SHMRPC_HIDDEN void profile_take_names(const char **kind, const char **fn, unsigned *torch);
/* Forgets what was given for the next request (one refused before it went). */
SHMRPC_HIDDEN void profile_forget_next(void);
/* "rpc_sync#fn(caller -> callee)" in buf. */
SHMRPC_HIDDEN void profile_key(const char *kind, const char *fn, const char *caller,
			       const char *callee, char *buf, size_t len);
/* Records an event; its index (a parent for others), or -1. */
SHMRPC_HIDDEN int32_t profile_record(const char *name, uint32_t rank, uint64_t start_ns,
				     uint64_t end_ns, int32_t parent);

/* [type, payload, what] into out (what: PROFILE_ bits). */
SHMRPC_HIDDEN int profile_wrap_request(uint16_t type, const void *buf, size_t len, unsigned what,
				       msgpack_sbuffer *out);
/* The wrapped message of a RUN_WITH_PROFILING_REQ / _RESP, pointing into
 * buf; extra, decoded into a: a request's `what` (INT, PROFILE_ bits) or
 * a reply's events (LIST). */
SHMRPC_HIDDEN int profile_unwrap(const void *buf, size_t len, struct arena *a, uint16_t *type,
				 const void **inner, size_t *inner_len, shmrpc_value *extra);

/* A callee's events: for one profiled request (callee), or those a reply
 * brought for torch's profiler (caller). */
struct profile_events {
	uint32_t n, cap;
	unsigned what; /* on the callee: what the caller asked (PROFILE_ bits) */
	struct profile_event_rec {
		char name[256];
		uint64_t start_ns, end_ns;
		uint64_t thread; /* torch's id of the thread it ran on; 0 for the function's time */
		uint32_t rank;   /* the worker it ran on; PROFILE_HERE: the callee */
		int64_t cpu_mem; /* bytes allocated (PROFILE_MEMORY), else 0 */
		char *shapes;    /* its inputs' shapes as JSON (PROFILE_SHAPES), or NULL; owned */
	} *ev;
};

/* An event's rank: the callee's own (set when its reply is made). Others
 * are those of the calls the function made, which it ran under torch's
 * profiler. */
#define PROFILE_HERE UINT32_MAX

SHMRPC_HIDDEN void profile_events_add(struct profile_events *pe, const char *name,
				      uint64_t start_ns, uint64_t end_ns, uint64_t thread,
				      uint32_t rank, const char *shapes, int64_t cpu_mem);
SHMRPC_HIDDEN void profile_events_free(struct profile_events *pe);
/* A reply's events (as checked as everything received: malformed ones are
 * left out), in a new list; NULL if out of memory. */
SHMRPC_HIDDEN struct profile_events *profile_events_of(const shmrpc_value *events);
/* [type, payload, events] into out (rank: the callee's, for PROFILE_HERE). */
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
