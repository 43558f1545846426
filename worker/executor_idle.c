/* An idle executor thread: its spin and its sleep, and the slot's words
 * that tell peers about them (servers_watched, servers_asleep and
 * servers_newest on the servers' bell); see executor.h and executor_impl.h. */
#include <errno.h>

#include "common/spin.h"
#include "ipc/doorbell.h"
#include "ipc/lifo.h"
#include "worker/executor_impl.h"
#include "worker/link.h"

/* Idle executor threads spin at most this long, whatever the mode: several
 * per process spinning for ever would starve everything else of CPU. */
#define EXECUTOR_MAX_SPIN_NS 100000u

/* Defined here, the lower level of the two files (tests/layers). */
struct executor_state ex = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* This executor thread in ex.asleep while it sleeps on the servers' bell. */
static _Thread_local struct ipc_lifo_sleeper asleep_entry;
/* In announce_sleep's poll: what this thread queues there, it runs next
 * (it does not sleep after taking a frame), so push wakes no one for it:
 * counted asleep already, it would wake itself, which is not in the kernel
 * yet, and so another thread, the one asleep longest (ipc/lifo.h). */
_Thread_local bool executor_announcing;

void executor_idle_init(unsigned n)
{
	asleep_entry.bit = ipc_lifo_bit(n);
}

void executor_wake_idle(void)
{
	ipc_lifo_wake(&ex.gauges->servers_bell, ex.asleep.newest, NULL);
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
	executor_announcing = true;
	int n = agent_poll(ag, false);

	executor_announcing = false;
	return n;
}

/* An idle thread sleeps on the servers' bell (shm/layout.h), where a peer's
 * request wakes it directly rather than through the loop thread; woken, it
 * takes what the rings hold itself. The newest sleeper is woken first
 * (ex.asleep, ipc/lifo.h): in a stream of calls one at a time, the thread
 * that served the last one, warm, serves the next. Before the rings can be
 * polled (executor_poll_rings) it is not counted there, and only pushes
 * wake it. ex.lock held on entry and on return. */
static void sleep_idle(void)
{
	/* Acquire pairs with executor_poll_rings' release; the bell's, with
	 * the waker's seq_cst bump (pushers bump it under ex.lock). */
	struct agent *ag = atomic_load_explicit(&ex.poll_agent, memory_order_acquire);
	uint32_t seq = atomic_load_explicit(&ex.gauges->servers_bell, memory_order_acquire);

	ex.sleeping++;
	ipc_lifo_push(&ex.asleep, &asleep_entry);
	pthread_mutex_unlock(&ex.lock);
	if (!ag || announce_sleep(ag) <= 0)
		ipc_lifo_wait(&ex.gauges->servers_bell, seq, &asleep_entry);
	if (ag) /* seq_cst: as the increment */
		atomic_fetch_sub_explicit(&ex.gauges->servers_asleep, 1, memory_order_seq_cst);
	pthread_mutex_lock(&ex.lock);
	ex.sleeping--;
	ipc_lifo_remove(&ex.asleep, &asleep_entry);
	/* Again: executor_stop clears it before it wakes us. Acquire as above. */
	if (ag && (ag = atomic_load_explicit(&ex.poll_agent, memory_order_acquire))) {
		pthread_mutex_unlock(&ex.lock);
		agent_poll(ag, true);
		pthread_mutex_lock(&ex.lock);
	}
}

/* The idle spinner (one at a time: ex.spinning) promises peers to take
 * their requests while it polls (the slot's servers_watched, ipc/doorbell.h),
 * where each would wake a sleeping thread, which found the request taken
 * and slept again, the newest asleep, so that the next request woke it
 * rather than the spinner's thread (ipc/lifo.h): the pool's threads served
 * in turn again, and each woke for nothing every other call. Off, it stores
 * 0, fences and looks once more: a request that saw 1 rang no one.
 * Not inlined, as executor.c's poll_unannounced. */
static __attribute__((noinline)) void watch_requests(bool on)
{
	/* seq_cst stores and fence: in one order with the senders' fences
	 * (ipc/doorbell.h). Acquire pairs with executor_poll_rings' release:
	 * NULL once the agent goes (executor_stop), when we must not poll and
	 * the ring is for the record (shutdown has failed the calls), or
	 * another thread polls now and may have passed the ring: the loop
	 * thread looks then (executor.c's poll_unannounced). */
	atomic_store_explicit(&ex.gauges->servers_watched, on, memory_order_seq_cst);
	if (on)
		return;
	atomic_thread_fence(memory_order_seq_cst);
	struct agent *ag = atomic_load_explicit(&ex.poll_agent, memory_order_acquire);

	if (!ag || agent_poll_any(ag) == -EBUSY)
		ipc_doorbell_ring(ex.gauges, NULL);
}

bool executor_check_watch_word(void)
{
	bool stray;

	/* Relaxed: a look; under ex.lock, ex.spinning false means no spinner
	 * is between its store of 1 and that of 0 (it sets the flag before
	 * the one and clears it after the other, both under the lock). */
	if (!ex.gauges ||
	    atomic_load_explicit(&ex.gauges->servers_watched, memory_order_relaxed) != 1)
		return false;
	pthread_mutex_lock(&ex.lock);
	stray = !ex.spinning &&
		atomic_load_explicit(&ex.gauges->servers_watched, memory_order_relaxed) == 1;
	if (stray) /* seq_cst, and the fence: as watch_requests' */
		atomic_store_explicit(&ex.gauges->servers_watched, 0, memory_order_seq_cst);
	pthread_mutex_unlock(&ex.lock);
	if (stray)
		atomic_thread_fence(memory_order_seq_cst);
	return stray;
}

/* An idle spinning thread takes requests off the rings itself (link.h):
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
		agent_poll_any(ag);
	return atomic_load_explicit(&ex.queued, memory_order_relaxed) > 0;
}

void executor_idle(void)
{
	/* One idle thread spins at a time; the others look once and sleep:
	 * a second spinner finds nothing the first would not, and on a
	 * busy machine takes the CPU the first, or the work, needs. */
	bool spin = !ex.spinning, work;

	ex.spinning |= spin;
	pthread_mutex_unlock(&ex.lock);
	if (spin) {
		uint64_t budget = worker_handoff_spin(0);
		/* Acquire: as spin_work's. */
		bool watch = atomic_load_explicit(&ex.poll_agent, memory_order_acquire);

		if (watch)
			watch_requests(true);
		work = shmrpc_spin_until(spin_work, NULL, budget < EXECUTOR_MAX_SPIN_NS
							  ? budget
							  : EXECUTOR_MAX_SPIN_NS);
		if (watch)
			watch_requests(false);
		worker_handoff_spun(work);
	} else {
		work = spin_work(NULL);
	}
	pthread_mutex_lock(&ex.lock);
	if (spin)
		ex.spinning = false;
	if (!work && !ex.head && !ex.stop)
		sleep_idle();
}
