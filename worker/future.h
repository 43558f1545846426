/*
 * Futures: the result of a call, completed once by the loop thread (a
 * reply, a timeout, a death) or by the caller (a failed send). Waiters are
 * user threads (condition variable) or executor threads, which run what
 * the call needs while they wait (executor.h) so that nested calls cannot
 * starve the pool.
 */
#ifndef SHMRPC_WORKER_FUTURE_H
#define SHMRPC_WORKER_FUTURE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/arena.h"
#include "worker/tensor.h"

struct future_cb {
	struct future_cb *next;
	void (*fn)(shmrpc_future *f, void *arg);
	void *arg;
	bool by_waiter; /* future_hook's: a waiter may run it (finish) */
};

struct shmrpc_future {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	_Atomic int done; /* release by the completer, acquire by readers */
	_Atomic int refs;
	int err;
	char *errmsg;
	char *errtype;
	char *backtrace;
	shmrpc_value value;
	struct arena arena; /* starts in first (a value that moves out must not: rref_local_value) */
	struct arena_first first;
	struct tensor_list tensors; /* handles of the tensors in value */
	struct future_cb *cbs;
	/* Threads in shmrpc_future_wait: incremented relaxed on the way in (one
	 * finish() does not see runs its hooks on an executor, as before);
	 * decremented under lock, where finish() reads it, on the way out. */
	_Atomic uint32_t waiters;
	struct future_cb *for_waiter; /* future_hook's callbacks finish() left to a waiter; under lock */
	/* The call it stands for (client side). */
	uint64_t msg_id;
	uint32_t dst;
	/* Tensors went with the request, so it may have a pin (pins.h) that
	 * the reply takes; false: it has none, and no one looks for it. */
	bool sent_tensors;
	uint64_t deadline_ns; /* 0: none */
	int64_t timeout_ms;
	char *profile_key;      /* profiled call: its key (malloc); NULL otherwise */
	unsigned profile_what;  /* profiled call: PROFILE_ bits (worker/profile.h) */
	uint64_t sent_ns;       /* profiled call: when it went */
	uint64_t done_ns;       /* profiled call: when it completed */
	struct profile_events *callee_events; /* PROFILE_TORCH: the reply's events */
	struct shmrpc_future *hnext; /* pending table chain */
};

SHMRPC_HIDDEN shmrpc_future *future_new(void);
SHMRPC_HIDDEN void future_ref(shmrpc_future *f);
SHMRPC_HIDDEN void future_unref(shmrpc_future *f);
/* Completes with a MessagePack value: decoded into the future's arena,
 * then the request's pin released (it covers the reply's tensors that the
 * request carried). Returns how many tensors it received by reference
 * that the sender pinned and for which it waits for an ack (inline and
 * covered ones need none). */
SHMRPC_HIDDEN uint32_t future_complete_packed(shmrpc_future *f, const void *buf, size_t len);
/* Completes with an error; type and backtrace may be NULL. */
SHMRPC_HIDDEN void future_fail(shmrpc_future *f, int err, const char *type, const char *msg,
			       const char *backtrace);
/* shmrpc_future_then for a callback that settles what the waiter itself
 * would and takes no lock a waiter may hold (the Python Future's
 * _from_call): run by a thread waiting in shmrpc_future_wait when f
 * completes, if one is, else on an executor; by the caller at once if f
 * is done already. A waiter that takes its own
 * reply then runs it itself, with no executor woken and no GIL handed
 * between two threads. 0, or -ENOMEM. */
SHMRPC_HIDDEN int future_hook(shmrpc_future *f, void (*cb)(shmrpc_future *f, void *arg), void *arg);
/* Waits until done or deadline_ns (0: none); an executor thread runs what
 * the call needs meanwhile (executor.h). 0, or -ETIMEDOUT. */
SHMRPC_HIDDEN int future_wait_until(shmrpc_future *f, uint64_t deadline_ns);
/* The same wait on a user thread, without the spin first (the caller has
 * spun already): taking its replies or alone on the replies' bell, where
 * a reply wakes it directly, else on the future. 0, or -ETIMEDOUT. */
SHMRPC_HIDDEN int future_sleep_until(shmrpc_future *f, uint64_t deadline_ns);

#endif
