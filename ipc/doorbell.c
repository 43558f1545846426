/* Doorbell ring and the futex syscalls; the protocol is in doorbell.h. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ipc/doorbell.h"
#include "ipc/lifo.h"

/* Shared futexes (no FUTEX_PRIVATE_FLAG): sleeper and waker are different processes. */
int ipc_futex_wait(_Atomic uint32_t *word, uint32_t seq, uint64_t timeout_ns)
{
	struct timespec ts, *tsp = NULL;

	if (timeout_ns) {
		ts.tv_sec = (time_t)(timeout_ns / 1000000000u);
		ts.tv_nsec = (long)(timeout_ns % 1000000000u);
		tsp = &ts;
	}
	if (syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, seq, tsp, NULL, 0) == 0)
		return 0;
	return -errno == -EWOULDBLOCK ? -EAGAIN : -errno;
}

int ipc_futex_wake(_Atomic uint32_t *word, int n_max)
{
	long n = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, n_max, NULL, NULL, 0);

	return n < 0 ? -errno : (int)n;
}

void ipc_doorbell_ring(struct shm_worker *target, struct shm_worker *me)
{
	/* seq_cst RMW, then seq_cst load of sleepers: pairs with the sleeper's
	 * seq_cst increment of sleepers before its FUTEX_WAIT (doorbell.h). */
	atomic_fetch_add_explicit(&target->doorbell, 1, memory_order_seq_cst);
	if (atomic_load_explicit(&target->sleepers, memory_order_seq_cst) == 0)
		return;
	ipc_futex_wake(&target->doorbell, INT_MAX);
	if (me) /* relaxed: a statistic read by inspectors only */
		atomic_fetch_add_explicit(&me->wakeups_sent, 1, memory_order_relaxed);
}

void ipc_bell_wake(_Atomic uint32_t *bell, struct shm_worker *me, int n_max)
{
	/* seq_cst RMW: a sleeper that read the bell before this bump sees the
	 * word changed in its FUTEX_WAIT (the doorbell's argument, doorbell.h). */
	atomic_fetch_add_explicit(bell, 1, memory_order_seq_cst);
	ipc_futex_wake(bell, n_max);
	if (me) /* relaxed: a statistic read by inspectors only */
		atomic_fetch_add_explicit(&me->wakeups_sent, 1, memory_order_relaxed);
}

void ipc_doorbell_notify(struct shm_worker *target, struct shm_worker *me,
			 enum ipc_frame_kind kind, bool after_quiet)
{
	/* seq_cst fence between the tail store that published the frame and
	 * the loads below: pairs with the sleeper's fence after its increment
	 * (doorbell.h), and with the fence after the target's store of 0 to
	 * servers_busy, servers_watched, replies_taken or replies_watched
	 * before it polls (the frame either sees 0 and rings, or that poll
	 * sees the frame). */
	atomic_thread_fence(memory_order_seq_cst);
	/* Only a 1 is a promise: any other value was written by no thread of
	 * the target's, and the frame rings as usual. */
	if (kind == IPC_FRAME_REQUEST && !after_quiet &&
	    (atomic_load_explicit(&target->servers_busy, memory_order_relaxed) == 1 ||
	     atomic_load_explicit(&target->servers_watched, memory_order_relaxed) == 1))
		return;
	if (kind == IPC_FRAME_REPLY && !after_quiet &&
	    (atomic_load_explicit(&target->replies_taken, memory_order_relaxed) == 1 ||
	     atomic_load_explicit(&target->replies_watched, memory_order_relaxed) == 1))
		return;
	/* Nobody asleep on the doorbell: the target's loop thread polls before
	 * it sleeps, and wakes whom the frame concerns (a burst of requests
	 * to a busy loop thread costs no syscall each). */
	if (atomic_load_explicit(&target->sleepers, memory_order_relaxed) == 0)
		return;
	/* Else, rather than waking the loop thread, wake whom the frame is
	 * for directly, if they sleep on their bell: they poll themselves
	 * (a request, the server that slept last: ipc/lifo.h). */
	if (kind == IPC_FRAME_REQUEST &&
	    atomic_load_explicit(&target->servers_asleep, memory_order_relaxed)) {
		ipc_lifo_wake(&target->servers_bell, &target->servers_newest, me);
		return;
	}
	if (kind == IPC_FRAME_REPLY &&
	    atomic_load_explicit(&target->replies_asleep, memory_order_relaxed)) {
		ipc_bell_wake(&target->replies_bell, me, INT_MAX); /* whose reply: any */
		return;
	}
	ipc_doorbell_ring(target, me);
}
