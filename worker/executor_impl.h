/*
 * What executor.c (the queue, the threads, the waits of executor threads)
 * and executor_idle.c (an idle thread's spin and sleep, and what they tell
 * peers) share, and no other file.
 */
#ifndef SHMRPC_WORKER_EXECUTOR_IMPL_H
#define SHMRPC_WORKER_EXECUTOR_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"
#include "ipc/lifo.h"
#include "shm/layout.h"
#include "worker/executor.h"

/* A thread waiting for a call of its own (executor_help_until): the jobs
 * that call needs (struct job's needed_by) are handed to it. Found by the
 * call's id in WAITER_BUCKETS lists, newest first: in a chain of nested
 * calls the waiter looked for is the newest, and one list of them all
 * made a chain of n calls cost n^2. */
#define WAITER_BUCKETS 256

struct waiter {
	struct waiter *next;
	uint64_t call;            /* the call's id (struct job's needed_by) */
	const _Atomic int *done; /* the call's completion */
	bool helps; /* takes the call's jobs now: below EXECUTOR_HELP_LEVELS, not running one */
	struct job *mail, *mail_tail; /* handed to it, not run yet */
	pthread_cond_t cond; /* signalled with ex.lock held: mail, or f done */
};

struct executor_state {
	pthread_mutex_t lock;
	struct job *head, *tail;
	pthread_t *threads;
	int nthreads; /* started; at most EXECUTOR_MAX_THREADS */
	int room; /* threads[] has room for this many */
	int size; /* threads asked for: the pool keeps this many that are not blocked */
	int busy; /* threads running a job, less those waiting (help_until, block_begin) */
	int blocked; /* threads counted out of the pool while they wait (maybe_spawn) */
	int retired; /* threads beyond the pool's size, asleep on retire_cond (retire) */
	int unretire; /* of those, how many were told to come back */
	pthread_cond_t retire_cond;
	int idle;
	int sleeping; /* idle threads asleep on the servers' bell (sleep_idle) */
	struct ipc_lifo asleep; /* those, newest first: whom the bell wakes (ipc/lifo.h) */
	int tagged; /* jobs in the queue with a needed_by */
	bool spinning; /* an idle thread spins (one at most: more only take CPU from the rest) */
	bool spawn_failed; /* said so on stderr once */
	struct waiter *waiters[WAITER_BUCKETS];
	_Atomic int queued; /* jobs in the queue, for spinners that do not hold the lock */
	_Atomic int helpers; /* waiters in the lists, for executor_kick's look without the lock */
	_Atomic bool stop; /* written under the lock; read without it by spinners */
	_Atomic(struct agent *) poll_agent; /* whose rings idle spinners poll; NULL: none */
	_Atomic bool said_busy; /* what busy_add stored in the slot's servers_busy */
	struct shm_worker *gauges;
};

SHMRPC_HIDDEN extern struct executor_state ex;

/* In this thread's last poll before it sleeps (executor_idle.c): push
 * wakes no one for what it queues there. */
SHMRPC_HIDDEN extern _Thread_local bool executor_announcing;

/* This executor thread is the one numbered n (its bit on the bell). */
SHMRPC_HIDDEN void executor_idle_init(unsigned n);
/* Wakes one idle thread, the newest asleep, as a peer's request does;
 * ex.lock held. */
SHMRPC_HIDDEN void executor_wake_idle(void);
/* This idle thread spins, or sleeps, until there may be work; ex.lock held
 * on entry and on return (released meanwhile). */
SHMRPC_HIDDEN void executor_idle(void);

#endif
