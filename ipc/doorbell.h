/*
 * Doorbells: one futex word per worker (shm_worker.doorbell), a sequence
 * number that every waker bumps, and a count of sleepers so that a waker
 * makes a syscall only when somebody actually sleeps.
 *
 * Why no wake-up is lost. A sleeper reads seq = doorbell (acquire), checks
 * for work, adds itself to `sleepers` (seq_cst RMW), and waits for the word
 * to differ from seq (FUTEX_WAIT compares atomically in the kernel). A
 * waker publishes its work, bumps `doorbell` (seq_cst RMW) and then reads
 * `sleepers` (seq_cst). If the waker's read of `sleepers` comes before the
 * sleeper's increment in the single seq_cst order, its bump came before
 * too, so the kernel sees doorbell != seq and the wait returns at once;
 * otherwise the waker sees the sleeper and wakes it. And if the bump came
 * before the sleeper read seq, the published work came before it as well
 * and the sleeper's check finds it. tests/stress_*.c would hang otherwise.
 *
 * Frames skip the bump when nobody sleeps (ipc_doorbell_notify). The
 * waker publishes its frame (release store of the ring's tail), issues a
 * seq_cst fence, and reads `sleepers`; the sleeper increments `sleepers`,
 * issues a seq_cst fence, and then checks its rings and the doorbell
 * (ipc_waiter_sleep). Of two fences one comes first in the seq_cst order:
 * if the waker's, the sleeper's check sees the frame and it does not
 * sleep; if the sleeper's, the waker sees it counted and rings. A waiter
 * that spins instead of sleeping checks its rings as it spins.
 *
 * A request frame also skips it while the target's `servers_busy` is 1:
 * every thread that could run it runs a request already, so waking the
 * target's loop thread to queue it would gain nothing. The same pattern:
 * a server that finishes stores `servers_busy` = 0, issues a seq_cst
 * fence, and polls the rings; the waker's fence comes before that one (it
 * reads 0 and rings as usual) or after it (the poll finds the frame). A
 * reply frame skips it while `replies_taken` is 1, by the same pattern: a
 * thread of the target about to wait for a reply stores 0, fences, and
 * polls first; and while `replies_watched` is 1: a thread of the target
 * spins for its reply polling the rings, and when it stops it stores 0,
 * fences, and looks once more (`servers_watched`: the same for requests,
 * an idle executor thread spinning). And a request rings the servers' bell instead while some
 * of the target's executor threads sleep there: an idle server counts
 * itself in `servers_asleep` (seq_cst RMW) after reading the bell and
 * before it polls the rings, so the request either is seen by that poll
 * or sees the server counted and wakes it, the doorbell's argument again;
 * a reply, the replies' bell while waiters of the target sleep there.
 */
#ifndef SHMRPC_IPC_DOORBELL_H
#define SHMRPC_IPC_DOORBELL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/layout.h"

static inline uint32_t ipc_doorbell_seq(struct shm_worker *w)
{
	/* Acquire pairs with the waker's seq_cst bump: its work is visible. */
	return atomic_load_explicit(&w->doorbell, memory_order_acquire);
}

/* Rings target's doorbell; `me` (may be NULL) counts the syscall. For
 * events the target cannot see in its rings (space freed, a death, a
 * state change): the doorbell always moves. */
SHMRPC_HIDDEN void ipc_doorbell_ring(struct shm_worker *target, struct shm_worker *me);
/* Bumps a bell of a slot (servers_bell, replies_bell: layout.h) and wakes
 * up to n_max of the threads sleeping on it; `me` (may be NULL) counts it. */
SHMRPC_HIDDEN void ipc_bell_wake(_Atomic uint32_t *bell, struct shm_worker *me, int n_max);

/* What a frame is to its receiver, for ipc_doorbell_notify. */
enum ipc_frame_kind {
	IPC_FRAME_OTHER,
	IPC_FRAME_REQUEST, /* work for its servers */
	IPC_FRAME_REPLY,   /* the answer to one of its calls */
};

/* A frame is published in one of target's rings: rings only if target
 * sleeps or is about to (a spinning target watches its rings itself), so
 * the common case costs a fence and a read of a line nobody writes; a
 * request not while target's servers are all busy (and only them while
 * some sleep), a reply not while its threads take their replies themselves.
 * after_quiet: quiet frames lie before this one in the ring (port.h), which
 * those two exceptions would leave there until the target's busy servers
 * or waiting thread next poll: it is announced as they are not. */
SHMRPC_HIDDEN void ipc_doorbell_notify(struct shm_worker *target, struct shm_worker *me,
					 enum ipc_frame_kind kind, bool after_quiet);

/* Plain futex wait until the word differs from seq, a wake, or timeout
 * (ns, 0 = none). 0, -EAGAIN (already changed), -ETIMEDOUT or -EINTR. */
SHMRPC_HIDDEN int ipc_futex_wait(_Atomic uint32_t *word, uint32_t seq, uint64_t timeout_ns);
/* Wakes at most n_max waiters (INT_MAX: all); how many, or -errno. */
SHMRPC_HIDDEN int ipc_futex_wake(_Atomic uint32_t *word, int n_max);

#endif
