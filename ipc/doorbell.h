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

/* Rings target's doorbell; `me` (may be NULL) counts the syscall. */
SHMRPC_HIDDEN void ipc_doorbell_ring(struct shm_worker *target, struct shm_worker *me);

/* Plain futex wait until the word differs from seq, a wake, or timeout
 * (ns, 0 = none). 0, -EAGAIN (already changed), -ETIMEDOUT or -EINTR. */
SHMRPC_HIDDEN int ipc_futex_wait(_Atomic uint32_t *word, uint32_t seq, uint64_t timeout_ns);
SHMRPC_HIDDEN int ipc_futex_wake(_Atomic uint32_t *word);

#endif
