/*
 * The executor pool: the threads that run requests and future callbacks,
 * never the loop thread (a function may itself call rpc_sync, and the loop
 * thread must keep draining the rings for that reply to arrive).
 *
 * Waiting executor threads (docs/ARCHITECTURE.md says why this way).
 * A thread that waits for a call of its own (executor_help_until) runs, on
 * its stack, only the jobs that call needs: the call's own request, for a
 * call to ourselves, and a request that the call's callee sent us with
 * rpc_sync while serving it (the callee answers only after that request,
 * so the wait could not end before it anyway: running it here never
 * delays what this thread's frames would do). Those are marked by their
 * senders (struct job's needed_by, the frame header's). It runs them
 * EXECUTOR_HELP_LEVELS deep at most; and nothing else, so a request that
 * waits for what a frame below it produces is never run above that frame.
 * Everything else is for the pool, which keeps `size` threads that are not
 * blocked: a wait longer than EXECUTOR_GRACE_NS, or one on something other
 * than a call (executor_block_begin: an RRef's value, a Python Future),
 * counts its thread out, and a job queued with no thread free starts a new
 * one, up to EXECUTOR_MAX_THREADS. A chain A->B->A->B... thus runs
 * EXECUTOR_HELP_LEVELS hops per thread, a burst of requests that each wait
 * on a nested call runs on the pool (plus the threads started while they
 * wait), and SHMRPC_MAX_NESTING (shmrpc.h) bounds any chain.
 */
#ifndef SHMRPC_WORKER_EXECUTOR_H
#define SHMRPC_WORKER_EXECUTOR_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "shm/layout.h"

/* Jobs run for one's own calls, one inside another, per thread: each
 * costs stack (a few KiB in C; a Python handler's frames count towards its
 * interpreter's recursion limit of 1000). */
#define EXECUTOR_HELP_LEVELS 64
/* Threads at most: enough for a chain of SHMRPC_MAX_NESTING calls to
 * ourselves at EXECUTOR_HELP_LEVELS per thread. Threads started beyond the
 * pool's size stay until shutdown: when more than `size` are not blocked,
 * those that finish a job sleep (retire) until the pool needs them again,
 * so no more than `size` run jobs at once but for those blocked. */
#define EXECUTOR_MAX_THREADS 2048
/* How long a thread waits for a call before it is counted out of the pool. */
#define EXECUTOR_GRACE_NS 100000u

struct job {
	struct job *next;
	void (*run)(struct job *j); /* runs the job and frees it */
	/* The id of a call of ours that cannot complete before this job
	 * does, or 0; src: the worker that call went to. */
	uint64_t needed_by;
	uint32_t src;
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
/* An idle thread that spins (its hand-off budget, link.h) polls ag's
 * rings meanwhile; NULL stops it. */
struct agent;
SHMRPC_HIDDEN void executor_poll_rings(struct agent *ag);
/* Wakes the executor threads that wait for call (done: its completion,
 * just stored). */
SHMRPC_HIDDEN void executor_kick(uint64_t call, const _Atomic int *done);
SHMRPC_HIDDEN bool executor_on_worker_thread(void);
/* Restores the slot's servers_busy to what the pool last said if another
 * process wrote it (a stray 1 would let peers' requests ring nothing while
 * threads idle); true when it did: the caller polls the rings next. */
SHMRPC_HIDDEN bool executor_check_busy_word(void);
/* The same for the slot's servers_watched (a stray 1 would let peers'
 * requests ring nothing while the threads sleep). */
SHMRPC_HIDDEN bool executor_check_watch_word(void);
/* On an executor thread: waits until call, one of ours (its id: struct
 * job's needed_by), is done (*done, acquire: pairs with the completer's
 * release) or the deadline (0: none) passes, running the jobs the call
 * needs meanwhile (above). 0 or -ETIMEDOUT. */
SHMRPC_HIDDEN int executor_help_until(uint64_t call, const _Atomic int *done,
				      uint64_t deadline_ns);
/* Around any other wait of an executor thread: it is counted out of the
 * pool meanwhile (above). Nothing on other threads. */
SHMRPC_HIDDEN void executor_block_begin(void);
SHMRPC_HIDDEN void executor_block_end(void);

#endif
