/*
 * The executor pool: the threads that run requests and future callbacks,
 * never the loop thread (a function may itself call rpc_sync, and the loop
 * thread must keep draining the rings for that reply to arrive).
 *
 * Nested calls. An executor thread that waits for a future does not sleep
 * while work is queued: it runs queued jobs itself (executor_help_until).
 * A chain A->B->A->B... of any depth therefore completes with a pool of one
 * thread: each hop's waiting thread serves the next hop. The cost is that a
 * waiting call may return a little later than its reply (it finishes the job
 * it picked up first); docs/ARCHITECTURE.md compares this with growing the
 * pool, which bounds depth by a thread limit.
 */
#ifndef SHMRPC_WORKER_EXECUTOR_H
#define SHMRPC_WORKER_EXECUTOR_H

#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "shm/layout.h"

struct job {
	struct job *next;
	void (*run)(struct job *j); /* runs the job and frees it */
};

/* gauges: the slot whose thread_pool_size / num_idle_threads it keeps. */
SHMRPC_HIDDEN int executor_start(int nthreads, struct shm_worker *gauges);
/* Runs what is queued, then joins the threads. */
SHMRPC_HIDDEN void executor_stop(void);
SHMRPC_HIDDEN void executor_submit(struct job *j);
/* Between these, this thread's executor_submit calls are queued together
 * (the loop thread brackets each poll of the rings with them). */
SHMRPC_HIDDEN void executor_batch_begin(void);
SHMRPC_HIDDEN void executor_batch_end(void);
SHMRPC_HIDDEN int executor_submit_callback(shmrpc_future *f, void (*fn)(shmrpc_future *, void *),
					   void *arg);
/* An idle thread that spins (its hand-off budget, agent.h) polls ag's
 * rings meanwhile; NULL stops it. */
struct agent;
SHMRPC_HIDDEN void executor_poll_rings(struct agent *ag);
/* Wakes executor threads that wait on futures (one has completed). */
SHMRPC_HIDDEN void executor_kick(void);
SHMRPC_HIDDEN bool executor_on_worker_thread(void);
/* On an executor thread: runs queued jobs until f is done or the deadline
 * (0: none). 0 or -ETIMEDOUT. */
SHMRPC_HIDDEN int executor_help_until(shmrpc_future *f, uint64_t deadline_ns);
/* On an executor thread that waits for something other than a future:
 * runs one queued job; false when none was queued. */
SHMRPC_HIDDEN bool executor_help_once(void);

#endif
