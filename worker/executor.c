/* The executor pool; see executor.h. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "ipc/doorbell.h"
#include "worker/executor_impl.h"
#include "worker/link.h"
#include "worker/trace.h"

static _Thread_local bool on_executor;
/* Jobs this thread runs for the calls it waits for, one inside another. */
static _Thread_local int help_levels;
/* This executor thread is counted busy: from the job it takes until it
 * finds the queue empty after one (busy_add), so a pool with jobs queued
 * stays all busy rather than saying so again at each job. */
static _Thread_local bool busy_held;

/* Jobs a thread queues between executor_batch_begin and _end (the loop
 * thread, for the frames of one poll): pushed together, with one wake-up. */
#define BATCH_MAX 32
static _Thread_local struct {
	struct job *head, *tail;
	int n;
	bool open;
} batch;

static void set_idle(int delta)
{
	ex.idle += delta;
	/* Relaxed: a gauge for inspectors. */
	atomic_store_explicit(&ex.gauges->num_idle_threads, (uint32_t)ex.idle, memory_order_relaxed);
}

/* Counts a thread into or out of the busy ones (ex.lock held) and tells
 * peers whether all are (the slot's servers_busy, ipc/doorbell.h): their
 * requests then ring nothing, since no thread could run one before a busy
 * one is done. True when that stops being so: the caller must then take
 * the requests that came unannounced (poll_unannounced). Only once the
 * rings can be polled (executor_poll_rings) are all ever said busy. What
 * we said is ex.said_busy: the slot's word is only what peers read. */
static bool busy_add(int delta)
{
	bool was_all = ex.busy == ex.nthreads;

	ex.busy += delta;
	/* seq_cst stores, in one order with the senders' fences (doorbell.h);
	 * acquire pairs with executor_poll_rings' release. said_busy: relaxed,
	 * written under ex.lock, read first without it by
	 * executor_check_busy_word, which takes ex.lock before acting. */
	if (ex.busy == ex.nthreads && !was_all &&
	    atomic_load_explicit(&ex.poll_agent, memory_order_acquire)) {
		atomic_store_explicit(&ex.said_busy, true, memory_order_relaxed);
		atomic_store_explicit(&ex.gauges->servers_busy, 1, memory_order_seq_cst);
	} else if (was_all && ex.busy != ex.nthreads &&
		   atomic_load_explicit(&ex.said_busy, memory_order_relaxed)) {
		atomic_store_explicit(&ex.said_busy, false, memory_order_relaxed);
		atomic_store_explicit(&ex.gauges->servers_busy, 0, memory_order_seq_cst);
		return true;
	}
	return false;
}

bool executor_check_busy_word(void)
{
	bool want;
	uint32_t have;

	/* Relaxed: a look; the lock below orders what is acted on. */
	if (!ex.gauges || atomic_load_explicit(&ex.gauges->servers_busy, memory_order_relaxed) ==
				  atomic_load_explicit(&ex.said_busy, memory_order_relaxed))
		return false;
	pthread_mutex_lock(&ex.lock);
	want = atomic_load_explicit(&ex.said_busy, memory_order_relaxed);
	have = atomic_load_explicit(&ex.gauges->servers_busy, memory_order_relaxed);
	if (have != want) /* seq_cst: as busy_add's stores */
		atomic_store_explicit(&ex.gauges->servers_busy, want, memory_order_seq_cst);
	pthread_mutex_unlock(&ex.lock);
	/* After a store of 0, the fence of busy_add's callers: the caller
	 * polls next, and a sender read 0 and rang, or the poll finds it. */
	if (have != want && !want)
		atomic_thread_fence(memory_order_seq_cst);
	return have != want;
}

/* Takes the requests that peers sent without a wake-up while every thread
 * was busy (busy_add said so); without ex.lock, which queueing takes. A
 * thread that polls meanwhile may have passed their ring: then our own
 * doorbell makes the loop thread poll before it sleeps (rather than this
 * thread waiting for the poller, with jobs queued). Not inlined: GCC 12
 * rejects a fence inlined into run_next under -fsanitize=thread (-Wtsan). */
static __attribute__((noinline)) void poll_unannounced(void)
{
	/* seq_cst fence after the store of 0: pairs with the sender's fence
	 * (doorbell.h): it read 0 and rang, or this poll finds its frame.
	 * Acquire pairs with executor_poll_rings' release. */
	atomic_thread_fence(memory_order_seq_cst);
	struct agent *ag = atomic_load_explicit(&ex.poll_agent, memory_order_acquire);

	if (ag && agent_poll(ag, false) == -EBUSY)
		ipc_doorbell_ring(ex.gauges, NULL);
}

/* This executor thread leaves the busy ones, if counted, and takes what
 * they left unannounced; ex.lock held on entry and on return. */
static void busy_release(void)
{
	if (!busy_held)
		return;
	busy_held = false;
	if (busy_add(-1)) {
		pthread_mutex_unlock(&ex.lock);
		poll_unannounced();
		pthread_mutex_lock(&ex.lock);
	}
}

/* ... and is counted again; ex.lock held. */
static void busy_take(void)
{
	if (!busy_held) {
		busy_held = true;
		busy_add(1);
	}
}

/* Takes the next job; ex.lock held. */
static struct job *pop(void)
{
	struct job *j = ex.head;

	if (j) {
		ex.head = j->next;
		if (!ex.head)
			ex.tail = NULL;
		ex.tagged -= j->needed_by != 0;
		/* Relaxed: a hint for spinners; the queue itself is under the lock. */
		atomic_fetch_sub_explicit(&ex.queued, 1, memory_order_relaxed);
		/* More work than this thread: wake one more (push wakes only one). */
		if (ex.head && ex.sleeping && ex.idle == ex.sleeping)
			executor_wake_idle();
	}
	return j;
}

/* Runs the next queued job, if any, without the lock; ex.lock held on
 * entry and on return. */
static bool run_next(void)
{
	struct job *j = pop();

	if (!j) {
		busy_release(); /* another thread took what was queued */
		return false;
	}
	if (on_executor) /* others help only while they wait: never busy */
		busy_take();
	pthread_mutex_unlock(&ex.lock);
	j->run(j);
	trace_fold_forget();
	pthread_mutex_lock(&ex.lock);
	if (!ex.head)
		busy_release();
	return true;
}

/* Threads that take jobs: not retired, or told to come back. */
static int active(void)
{
	return ex.nthreads - ex.retired + ex.unretire;
}

/* A thread beyond the pool's size (more threads not blocked than asked
 * for: one started while others waited, theirs over) sleeps until
 * maybe_spawn needs it, so that a pool of N never runs more than N jobs at
 * once but for those blocked in a wait. ex.lock held. */
static void retire(void)
{
	busy_release();
	/* A job our own poll queued on the way to sleep woke no one (push,
	 * executor_announcing) and was ours to run: hand it on before we go. */
	if (ex.head && ex.sleeping && ex.idle == ex.sleeping)
		executor_wake_idle();
	ex.retired++;
	while (!ex.unretire && !ex.stop)
		pthread_cond_wait(&ex.retire_cond, &ex.lock);
	if (ex.unretire)
		ex.unretire--;
	ex.retired--;
}

/* arg: the thread's index, which picks its bit on the bell. */
static void *thread_main(void *arg)
{
	executor_idle_init((unsigned)(uintptr_t)arg);
	on_executor = true;
	pthread_mutex_lock(&ex.lock);
	for (;;) {
		if (active() - ex.blocked > ex.size && !ex.stop) {
			retire();
			continue;
		}
		if (run_next())
			continue;
		if (ex.stop)
			break;
		set_idle(1);
		executor_idle();
		set_idle(-1);
	}
	pthread_mutex_unlock(&ex.lock);
	return NULL;
}

/* Starts one more thread; ex.lock held. 0 or -errno. */
static int spawn(void)
{
	int rc;

	if (ex.nthreads == ex.room) {
		int room = ex.room ? 2 * ex.room : 8;
		pthread_t *t;

		if (room > EXECUTOR_MAX_THREADS)
			room = EXECUTOR_MAX_THREADS;
		if (!(t = realloc(ex.threads, (size_t)room * sizeof(*t))))
			return -ENOMEM;
		ex.threads = t;
		ex.room = room;
	}
	rc = pthread_create(&ex.threads[ex.nthreads], NULL, thread_main,
			    (void *)(uintptr_t)ex.nthreads);
	if (rc)
		return -rc;
	ex.nthreads++;
	/* Relaxed: a gauge. */
	atomic_store_explicit(&ex.gauges->thread_pool_size, (uint32_t)ex.nthreads,
			      memory_order_relaxed);
	return 0;
}

/* Keeps ex.size threads that are not blocked while jobs are queued: a
 * queued job that no thread can take gets a retired thread back, or a new
 * one, up to EXECUTOR_MAX_THREADS (then it waits for a thread to finish).
 * ex.lock held. */
static void maybe_spawn(void)
{
	int rc;

	if (!ex.head || ex.idle || ex.stop || active() - ex.blocked >= ex.size)
		return;
	if (ex.retired > ex.unretire) {
		ex.unretire++;
		pthread_cond_signal(&ex.retire_cond);
		return;
	}
	if (ex.nthreads >= EXECUTOR_MAX_THREADS)
		return;
	rc = spawn();
	if (rc && !ex.spawn_failed) {
		ex.spawn_failed = true;
		fprintf(stderr, "shmrpc: cannot start executor thread %d (%s): queued requests wait "
			"for one of the %d running (%d of them blocked in a wait); raise the "
			"process or thread limit (ulimit -u, kernel.threads-max)\n",
			ex.nthreads + 1, strerror(-rc), ex.nthreads, ex.blocked);
	}
}

int executor_start(int nthreads, struct shm_worker *gauges)
{
	int rc = 0;

	ex.gauges = gauges;
	ex.asleep.top = NULL;
	ex.asleep.newest = &gauges->servers_newest;
	atomic_store_explicit(ex.asleep.newest, 0, memory_order_relaxed); /* a hint (ipc/lifo.h) */
	ex.stop = false;
	ex.idle = 0;
	ex.busy = 0;
	atomic_store_explicit(&ex.said_busy, false, memory_order_relaxed); /* a new slot says 0 */
	ex.blocked = 0;
	ex.retired = 0;
	ex.unretire = 0;
	ex.spawn_failed = false;
	ex.size = nthreads;
	pthread_cond_init(&ex.retire_cond, NULL);
	pthread_mutex_lock(&ex.lock);
	while (ex.nthreads < nthreads && !(rc = spawn()))
		;
	pthread_mutex_unlock(&ex.lock);
	if (rc) {
		executor_stop();
		return shmrpc__fail(rc, "cannot start executor thread %d of %d", ex.nthreads + 1,
				    nthreads);
	}
	return 0;
}

void executor_stop(void)
{
	int n;

	pthread_mutex_lock(&ex.lock);
	ex.stop = true;
	/* Before the wake-ups: a thread woken from the bell takes no request
	 * of an agent that is going (sleep_idle reads it again). Release:
	 * pairs with the acquire loads of the spinners and sleepers. */
	atomic_store_explicit(&ex.poll_agent, NULL, memory_order_release);
	ipc_bell_wake(&ex.gauges->servers_bell, NULL, INT_MAX);
	pthread_cond_broadcast(&ex.retire_cond);
	/* No thread starts after stop (maybe_spawn), so n is all of them. */
	n = ex.nthreads;
	pthread_mutex_unlock(&ex.lock);
	for (int i = 0; i < n; i++)
		pthread_join(ex.threads[i], NULL);
	free(ex.threads);
	ex.threads = NULL;
	ex.nthreads = 0;
	ex.room = 0;
	pthread_cond_destroy(&ex.retire_cond);
}

/* Hands j to the thread waiting for the call that needs it, if that thread
 * takes such jobs now; ex.lock held. */
static struct waiter **bucket(uint64_t msg_id)
{
	return &ex.waiters[msg_id % WAITER_BUCKETS];
}

static bool hand_to_waiter(struct job *j)
{
	for (struct waiter *w = *bucket(j->needed_by); w; w = w->next) {
		if (!w->helps || w->call != j->needed_by)
			continue;
		j->next = NULL;
		if (w->mail_tail)
			w->mail_tail->next = j;
		else
			w->mail = j;
		w->mail_tail = j;
		pthread_cond_signal(&w->cond);
		return true;
	}
	return false;
}

/* Appends j to the queue; ex.lock held. */
static void enqueue(struct job *j)
{
	j->next = NULL;
	if (ex.tail)
		ex.tail->next = j;
	else
		ex.head = j;
	ex.tail = j;
	ex.tagged += j->needed_by != 0;
	/* Relaxed: a hint for spinners; the queue itself is under the lock. */
	atomic_fetch_add_explicit(&ex.queued, 1, memory_order_relaxed);
}

/* Queues the chain head..tail of n jobs; a job that a waiting thread needs
 * goes to that thread (hand_to_waiter). One thread is woken, and only if
 * none is idle and awake (spinning): a thread that takes a job and sees
 * more wakes the next (pop), so a burst wakes threads as it needs them, not
 * one per job; when none is idle and the pool is short of threads that are
 * not blocked, one is started (maybe_spawn). */
static void push(struct job *head, struct job *tail, int n)
{
	pthread_mutex_lock(&ex.lock);
	/* Relaxed: it changes under the lock, which we hold. */
	if (!atomic_load_explicit(&ex.helpers, memory_order_relaxed)) {
		if (ex.tail)
			ex.tail->next = head;
		else
			ex.head = head;
		ex.tail = tail;
		for (struct job *j = head; j; j = j->next)
			ex.tagged += j->needed_by != 0;
		/* Relaxed: a hint for spinners; the queue itself is under the lock. */
		atomic_fetch_add_explicit(&ex.queued, n, memory_order_relaxed);
	} else {
		for (struct job *j = head, *next; j; j = next) {
			next = j->next;
			if (!j->needed_by || !hand_to_waiter(j))
				enqueue(j);
		}
	}
	if (ex.head && ex.sleeping && ex.idle == ex.sleeping && !executor_announcing)
		executor_wake_idle();
	maybe_spawn();
	pthread_mutex_unlock(&ex.lock);
}

void executor_submit(struct job *j)
{
	j->next = NULL;
	if (!batch.open) {
		push(j, j, 1);
		return;
	}
	if (batch.tail)
		batch.tail->next = j;
	else
		batch.head = j;
	batch.tail = j;
	if (++batch.n == BATCH_MAX) {
		push(batch.head, batch.tail, batch.n);
		batch.head = batch.tail = NULL;
		batch.n = 0;
	}
}

void executor_batch_begin(void)
{
	batch.open = true;
}

void executor_batch_end(void)
{
	if (batch.head)
		push(batch.head, batch.tail, batch.n);
	batch.head = batch.tail = NULL;
	batch.n = 0;
	batch.open = false;
}

void executor_kick(uint64_t call, const _Atomic int *done)
{
	/* seq_cst fence: after the completer's store of done, before reading
	 * helpers; pairs with the fence in executor_help_until (a waiter
	 * counted after this load sees done; one counted before is woken). */
	atomic_thread_fence(memory_order_seq_cst);
	if (!atomic_load_explicit(&ex.helpers, memory_order_relaxed))
		return;
	pthread_mutex_lock(&ex.lock);
	for (struct waiter *w = *bucket(call); w; w = w->next)
		if (w->done == done)
			pthread_cond_signal(&w->cond);
	pthread_mutex_unlock(&ex.lock);
}

void executor_poll_rings(struct agent *ag)
{
	/* Release: the agent is complete before a spinner uses it. */
	atomic_store_explicit(&ex.poll_agent, ag, memory_order_release);
}

bool executor_on_worker_thread(void)
{
	return on_executor;
}

/* Moves the queued jobs that w's call needs to w; ex.lock held. A queue
 * holds such jobs only when they came before w began to wait (a call to
 * ourselves, queued as it was made), so the walk is rare. */
static void take_queued(struct waiter *w)
{
	for (struct job **at = &ex.head, *j, *last = NULL; (j = *at);) {
		if (j->needed_by != w->call) {
			last = j;
			at = &j->next;
			continue;
		}
		*at = j->next;
		if (ex.tail == j)
			ex.tail = last;
		ex.tagged--;
		/* Relaxed: a hint for spinners, as in pop. */
		atomic_fetch_sub_explicit(&ex.queued, 1, memory_order_relaxed);
		hand_to_waiter(j);
	}
}

/* Runs j, which w's call needs, on this thread; ex.lock held on entry and
 * on return. Meanwhile w takes no more (a second job for the same call
 * cannot come before this one is done: see executor.h), and the thread is
 * busy. */
static void run_for(struct waiter *w, struct job *j)
{
	w->helps = false;
	busy_take();
	help_levels++;
	pthread_mutex_unlock(&ex.lock);
	j->run(j);
	trace_fold_forget();
	pthread_mutex_lock(&ex.lock);
	help_levels--;
	busy_release();
	w->helps = true;
}

int executor_help_until(uint64_t call, const _Atomic int *done, uint64_t deadline_ns)
{
	struct waiter w = { .call = call, .done = done, .helps = help_levels < EXECUTOR_HELP_LEVELS };
	uint64_t grace = shmrpc_now_ns() + EXECUTOR_GRACE_NS;
	bool blocked = false;
	pthread_condattr_t ca;

	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&w.cond, &ca);
	pthread_condattr_destroy(&ca);
	pthread_mutex_lock(&ex.lock);
	/* Not busy while it waits (busy_add): requests must ring to be served. */
	busy_release();
	w.next = *bucket(call);
	*bucket(call) = &w;
	/* Counted before done is read, with a seq_cst fence between: pairs
	 * with executor_kick (a completion either sees us or we see done).
	 * Relaxed: the count changes under the lock, which we hold. */
	atomic_fetch_add_explicit(&ex.helpers, 1, memory_order_relaxed);
	atomic_thread_fence(memory_order_seq_cst);
	if (w.helps && ex.tagged)
		take_queued(&w);
	/* Acquire pairs with the completer's release of done. */
	while (!atomic_load_explicit(done, memory_order_acquire)) {
		struct job *j = w.mail;
		uint64_t now, until;
		struct timespec ts;

		if (j) {
			w.mail = j->next;
			if (!w.mail)
				w.mail_tail = NULL;
			/* The thread runs again: a wait inside the job counts it
			 * out if need be, and this one starts its grace anew. */
			if (blocked) {
				blocked = false;
				ex.blocked--;
			}
			run_for(&w, j);
			grace = shmrpc_now_ns() + EXECUTOR_GRACE_NS;
			continue;
		}
		now = shmrpc_now_ns();
		if (deadline_ns && now >= deadline_ns)
			break;
		/* Past its grace, a wait is counted out of the pool, which
		 * then starts a thread for what is queued: most nested calls
		 * are answered within it, and a burst of them would otherwise
		 * start a thread each. */
		if (!blocked && now >= grace) {
			blocked = true;
			ex.blocked++;
			maybe_spawn();
			continue;
		}
		until = blocked ? deadline_ns : deadline_ns && deadline_ns < grace ? deadline_ns : grace;
		if (!until) {
			pthread_cond_wait(&w.cond, &ex.lock);
			continue;
		}
		ts = (struct timespec){ (time_t)(until / 1000000000u), (long)(until % 1000000000u) };
		pthread_cond_timedwait(&w.cond, &ex.lock, &ts);
	}
	for (struct waiter **at = bucket(call);; at = &(*at)->next)
		if (*at == &w) {
			*at = w.next;
			break;
		}
	atomic_fetch_sub_explicit(&ex.helpers, 1, memory_order_relaxed);
	/* Jobs handed over after a timeout or failure: anyone's now, first. */
	if (w.mail) {
		int n = 0;

		for (struct job *j = w.mail; j; j = j->next)
			n++, ex.tagged++;
		w.mail_tail->next = ex.head;
		ex.head = w.mail;
		if (!ex.tail)
			ex.tail = w.mail_tail;
		atomic_fetch_add_explicit(&ex.queued, n, memory_order_relaxed);
		executor_wake_idle();
	}
	if (blocked)
		ex.blocked--;
	busy_take(); /* for the job it is in */
	maybe_spawn();
	pthread_mutex_unlock(&ex.lock);
	pthread_cond_destroy(&w.cond);
	return atomic_load_explicit(done, memory_order_acquire) ? 0 : -ETIMEDOUT;
}

void executor_block_begin(void)
{
	if (!on_executor)
		return;
	pthread_mutex_lock(&ex.lock);
	busy_release();
	ex.blocked++;
	maybe_spawn();
	pthread_mutex_unlock(&ex.lock);
}

void executor_block_end(void)
{
	if (!on_executor)
		return;
	pthread_mutex_lock(&ex.lock);
	ex.blocked--;
	busy_take();
	pthread_mutex_unlock(&ex.lock);
}
