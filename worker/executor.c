/* The executor pool; see executor.h. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/spin.h"
#include "ipc/doorbell.h"
#include "worker/agent.h"
#include "worker/executor.h"
#include "worker/future.h"

/* Idle executor threads spin at most this long, whatever the mode: several
 * per process spinning for ever would starve everything else of CPU. */
#define EXECUTOR_MAX_SPIN_NS 100000u

static struct {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct job *head, *tail;
	pthread_t *threads;
	int nthreads;
	int size; /* threads asked for */
	int busy; /* threads running a job, less those waiting in executor_help_* */
	int idle;
	int sleeping; /* idle threads asleep on the servers' bell (sleep_idle) */
	bool spinning; /* an idle thread spins (one at most: more only take CPU from the rest) */
	_Atomic int queued; /* jobs in the queue, for spinners that do not hold the lock */
	_Atomic int helpers; /* threads waiting on a future inside executor_help_until */
	_Atomic bool stop; /* written under the lock; read without it by spinners */
	_Atomic(struct agent *) poll_agent; /* whose rings idle spinners poll; NULL: none */
	struct shm_worker *gauges;
} ex = { .lock = PTHREAD_MUTEX_INITIALIZER };

static _Thread_local bool on_executor;
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

struct callback_job {
	struct job base;
	shmrpc_future *f;
	void (*fn)(shmrpc_future *, void *);
	void *arg;
};

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
 * rings can be polled (executor_poll_rings) are all ever said busy. */
static bool busy_add(int delta)
{
	bool was_all = ex.busy == ex.size;

	ex.busy += delta;
	/* seq_cst stores, in one order with the senders' fences (doorbell.h);
	 * acquire pairs with executor_poll_rings' release. */
	if (ex.busy == ex.size && !was_all &&
	    atomic_load_explicit(&ex.poll_agent, memory_order_acquire))
		atomic_store_explicit(&ex.gauges->servers_busy, 1, memory_order_seq_cst);
	else if (was_all && ex.busy != ex.size &&
		 atomic_load_explicit(&ex.gauges->servers_busy, memory_order_relaxed)) {
		atomic_store_explicit(&ex.gauges->servers_busy, 0, memory_order_seq_cst);
		return true;
	}
	return false;
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

/* Wakes up to n idle threads (sleep_idle); ex.lock held. */
static void wake_idle(int n)
{
	ipc_bell_wake(&ex.gauges->servers_bell, NULL, n);
}

/* Says this idle thread sleeps on the servers' bell, then polls the rings
 * once: a request published before the count was seen by the poll, one
 * after it finds the count and rings the bell (ipc/doorbell.h). If another
 * thread polls meanwhile, it queues what it takes and wakes us for it, and
 * a request it missed rings the bell (its loop thread asleep) or is taken
 * by the loop thread (awake): no need to wait for it. How many frames the
 * poll took (-EBUSY: none). Not inlined, as poll_unannounced. */
static __attribute__((noinline)) int announce_sleep(struct agent *ag)
{
	/* seq_cst RMW and fence: pairs with the requester's fence before its
	 * load of servers_asleep. */
	atomic_fetch_add_explicit(&ex.gauges->servers_asleep, 1, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
	return agent_poll(ag, false);
}

/* An idle thread sleeps on the servers' bell (shm/layout.h), where a peer's
 * request wakes it directly rather than through the loop thread; woken, it
 * takes what the rings hold itself. Before the rings can be polled
 * (executor_poll_rings) it is not counted there, and only pushes wake it.
 * ex.lock held on entry and on return. */
static void sleep_idle(void)
{
	/* Acquire pairs with executor_poll_rings' release; the bell's, with
	 * the waker's seq_cst bump (pushers bump it under ex.lock). */
	struct agent *ag = atomic_load_explicit(&ex.poll_agent, memory_order_acquire);
	uint32_t seq = atomic_load_explicit(&ex.gauges->servers_bell, memory_order_acquire);

	ex.sleeping++;
	pthread_mutex_unlock(&ex.lock);
	if (!ag || announce_sleep(ag) <= 0)
		ipc_futex_wait(&ex.gauges->servers_bell, seq, 0);
	if (ag) /* seq_cst: as the increment */
		atomic_fetch_sub_explicit(&ex.gauges->servers_asleep, 1, memory_order_seq_cst);
	pthread_mutex_lock(&ex.lock);
	ex.sleeping--;
	/* Again: executor_stop clears it before it wakes us. Acquire as above. */
	if (ag && (ag = atomic_load_explicit(&ex.poll_agent, memory_order_acquire))) {
		pthread_mutex_unlock(&ex.lock);
		agent_poll(ag, true);
		pthread_mutex_lock(&ex.lock);
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
		/* Relaxed: a hint for spinners; the queue itself is under the lock. */
		atomic_fetch_sub_explicit(&ex.queued, 1, memory_order_relaxed);
		/* More work than this thread: wake one more (push wakes only one). */
		if (ex.head && ex.sleeping && ex.idle == ex.sleeping)
			wake_idle(1);
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
	pthread_mutex_lock(&ex.lock);
	if (!ex.head)
		busy_release();
	return true;
}

/* An idle spinning thread takes requests off the rings itself (agent.h):
 * what it queues, it runs next (push wakes no one while it is awake). */
static bool spin_work(void *arg)
{
	(void)arg;
	/* Relaxed: only hints to stop spinning; the lock orders the queue. */
	if (atomic_load_explicit(&ex.queued, memory_order_relaxed) > 0 ||
	    atomic_load_explicit(&ex.stop, memory_order_relaxed))
		return true;
	/* Acquire pairs with the release in executor_poll_rings. */
	struct agent *ag = atomic_load_explicit(&ex.poll_agent, memory_order_acquire);

	if (ag)
		agent_poll(ag, false);
	return atomic_load_explicit(&ex.queued, memory_order_relaxed) > 0;
}

static void *thread_main(void *arg)
{
	(void)arg;
	on_executor = true;
	pthread_mutex_lock(&ex.lock);
	for (;;) {
		if (run_next())
			continue;
		if (ex.stop)
			break;
		set_idle(1);
		/* One idle thread spins at a time; the others look once and sleep:
		 * a second spinner finds nothing the first would not, and on a
		 * busy machine takes the CPU the first, or the work, needs. */
		bool spin = !ex.spinning, work;

		ex.spinning |= spin;
		pthread_mutex_unlock(&ex.lock);
		if (spin) {
			uint64_t budget = worker_handoff_spin(0);

			work = shmrpc_spin_until(spin_work, NULL, budget < EXECUTOR_MAX_SPIN_NS
								  ? budget
								  : EXECUTOR_MAX_SPIN_NS);
			worker_handoff_spun(work);
		} else {
			work = spin_work(NULL);
		}
		pthread_mutex_lock(&ex.lock);
		if (spin)
			ex.spinning = false;
		if (!work && !ex.head && !ex.stop)
			sleep_idle();
		set_idle(-1);
	}
	pthread_mutex_unlock(&ex.lock);
	return NULL;
}

int executor_start(int nthreads, struct shm_worker *gauges)
{
	pthread_condattr_t ca;

	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&ex.cond, &ca);
	pthread_condattr_destroy(&ca);
	ex.gauges = gauges;
	ex.stop = false;
	ex.idle = 0;
	ex.busy = 0;
	ex.size = nthreads;
	ex.threads = calloc((size_t)nthreads, sizeof(*ex.threads));
	if (!ex.threads)
		return shmrpc__fail(-ENOMEM, "out of memory starting %d executor threads", nthreads);
	for (ex.nthreads = 0; ex.nthreads < nthreads; ex.nthreads++) {
		int rc = pthread_create(&ex.threads[ex.nthreads], NULL, thread_main, NULL);

		if (rc) {
			executor_stop();
			return shmrpc__fail(-rc, "cannot start executor thread %d of %d", ex.nthreads + 1,
					    nthreads);
		}
	}
	/* Relaxed: a gauge. */
	atomic_store_explicit(&gauges->thread_pool_size, (uint32_t)nthreads, memory_order_relaxed);
	return 0;
}

void executor_stop(void)
{
	pthread_mutex_lock(&ex.lock);
	ex.stop = true;
	/* Before the wake-ups: a thread woken from the bell takes no request
	 * of an agent that is going (sleep_idle reads it again). Release:
	 * pairs with the acquire loads of the spinners and sleepers. */
	atomic_store_explicit(&ex.poll_agent, NULL, memory_order_release);
	pthread_cond_broadcast(&ex.cond);
	wake_idle(INT_MAX);
	pthread_mutex_unlock(&ex.lock);
	for (int i = 0; i < ex.nthreads; i++)
		pthread_join(ex.threads[i], NULL);
	free(ex.threads);
	ex.threads = NULL;
	ex.nthreads = 0;
	pthread_cond_destroy(&ex.cond);
}

/* Queues the chain head..tail of n jobs. One thread is woken, and only if
 * none is idle and awake (spinning): a thread that takes a job and sees
 * more wakes the next (pop), so a burst wakes threads as it needs them,
 * not one per job. Helpers are all woken: any of them may take it. */
static void push(struct job *head, struct job *tail, int n)
{
	pthread_mutex_lock(&ex.lock);
	if (ex.tail)
		ex.tail->next = head;
	else
		ex.head = head;
	ex.tail = tail;
	atomic_fetch_add_explicit(&ex.queued, n, memory_order_relaxed);
	/* Relaxed: helpers changes under the lock, which we hold. */
	if (atomic_load_explicit(&ex.helpers, memory_order_relaxed))
		pthread_cond_broadcast(&ex.cond);
	if (ex.sleeping && ex.idle == ex.sleeping)
		wake_idle(1);
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

static void run_callback(struct job *j)
{
	struct callback_job *c = (struct callback_job *)j;

	c->fn(c->f, c->arg);
	future_unref(c->f);
	free(c);
}

int executor_submit_callback(shmrpc_future *f, void (*fn)(shmrpc_future *, void *), void *arg)
{
	struct callback_job *c = malloc(sizeof(*c));

	if (!c)
		return shmrpc__fail(-ENOMEM, "out of memory queueing a future callback");
	future_ref(f);
	*c = (struct callback_job){ { NULL, run_callback }, f, fn, arg };
	executor_submit(&c->base);
	return 0;
}

void executor_kick(void)
{
	/* seq_cst fence: after the completer's store of done, before reading
	 * helpers; pairs with the fence in executor_help_until (a helper
	 * counted after this load sees done; one counted before is woken). */
	atomic_thread_fence(memory_order_seq_cst);
	if (!atomic_load_explicit(&ex.helpers, memory_order_relaxed))
		return;
	pthread_mutex_lock(&ex.lock);
	pthread_cond_broadcast(&ex.cond);
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

int executor_help_until(shmrpc_future *f, uint64_t deadline_ns)
{
	struct timespec ts = { (time_t)(deadline_ns / 1000000000u), (long)(deadline_ns % 1000000000u) };

	pthread_mutex_lock(&ex.lock);
	/* Not busy while it waits: requests must wake us to be served. */
	busy_release();
	/* Counted before done is read, with a seq_cst fence between: pairs
	 * with executor_kick (a completion either sees us or we see done). */
	atomic_fetch_add_explicit(&ex.helpers, 1, memory_order_relaxed);
	atomic_thread_fence(memory_order_seq_cst);
	/* Acquire pairs with the completer's release of done. */
	while (!atomic_load_explicit(&f->done, memory_order_acquire)) {
		if (run_next())
			continue;
		if (deadline_ns && shmrpc_now_ns() >= deadline_ns)
			break;
		if (deadline_ns)
			pthread_cond_timedwait(&ex.cond, &ex.lock, &ts);
		else
			pthread_cond_wait(&ex.cond, &ex.lock);
	}
	atomic_fetch_sub_explicit(&ex.helpers, 1, memory_order_relaxed);
	busy_take(); /* for the job it is in */
	pthread_mutex_unlock(&ex.lock);
	return atomic_load_explicit(&f->done, memory_order_acquire) ? 0 : -ETIMEDOUT;
}

bool executor_help_once(void)
{
	bool ran;

	/* A thread of ours leaves the busy ones meanwhile, and so takes
	 * what waits unannounced; another thread takes only queued jobs. */
	pthread_mutex_lock(&ex.lock);
	busy_release();
	ran = run_next();
	if (on_executor)
		busy_take(); /* for the job it is in */
	pthread_mutex_unlock(&ex.lock);
	return ran;
}
