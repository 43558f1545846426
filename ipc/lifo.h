/*
 * A bell whose sleepers are woken newest first (the servers' bell,
 * shm/layout.h: a worker's idle executor threads).
 *
 * Why: FUTEX_WAKE of one wakes the thread that has waited longest (the
 * kernel queues a futex's waiters in arrival order). For a pool of idle
 * threads that is the coldest one: its stack, its thread state (a Python
 * handler's, and its GIL state) and what it last touched have left the
 * caches, and a pool that serves one request at a time runs each on the
 * next thread in turn. The thread that went to sleep last is the one to
 * wake, and in a steady stream of calls it is the one that served the
 * last request.
 *
 * How: each sleeper waits with FUTEX_WAIT_BITSET and a bit of its own
 * (two threads may share one: a bit per thread modulo 32); the owner keeps
 * its sleepers in a stack, newest on top, under its own lock, and stores
 * the top's bit in a word of its slot (`servers_newest`) that wakers read:
 * they wake with FUTEX_WAKE_BITSET of that bit, and, when that wakes no
 * one (the word is a hint: its thread may have been woken already, or not
 * be in the kernel yet, or the word may have been written by anyone), any
 * one sleeper with a plain FUTEX_WAKE. So every wake still wakes a sleeper
 * if one sleeps, as FUTEX_WAKE of one did, and the bell's protocol
 * (ipc/doorbell.h: bump, then wake; sleepers read the word before they
 * count themselves) is unchanged: no wake-up can be lost to the hint.
 * The cost: a second syscall only when the hint missed.
 */
#ifndef SHMRPC_IPC_LIFO_H
#define SHMRPC_IPC_LIFO_H

#include <stdatomic.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/layout.h"

struct ipc_lifo_sleeper {
	struct ipc_lifo_sleeper *newer, *older;
	uint32_t bit; /* FUTEX_WAIT_BITSET's bitset: never 0 */
};

struct ipc_lifo {
	struct ipc_lifo_sleeper *top; /* the newest sleeper; NULL: none */
	_Atomic uint32_t *newest;     /* the word wakers read: top's bit, 0 if none */
};

/* The bit of the sleeper numbered n (an executor thread's index). */
static inline uint32_t ipc_lifo_bit(unsigned n)
{
	return 1u << (n % 32u);
}

/* s goes to sleep: it is the newest now. The owner's lock held. */
SHMRPC_HIDDEN void ipc_lifo_push(struct ipc_lifo *l, struct ipc_lifo_sleeper *s);
/* s woke (whoever woke it, from wherever in the stack). The owner's lock held. */
SHMRPC_HIDDEN void ipc_lifo_remove(struct ipc_lifo *l, struct ipc_lifo_sleeper *s);
/* Waits on bell as ipc_futex_wait (no timeout) with s's bit. 0, -EAGAIN or -EINTR. */
SHMRPC_HIDDEN int ipc_lifo_wait(_Atomic uint32_t *bell, uint32_t seq,
				const struct ipc_lifo_sleeper *s);
/* Bumps bell and wakes one of its sleepers, the one newest names if it
 * sleeps; `me` (may be NULL) counts the syscalls. */
SHMRPC_HIDDEN void ipc_lifo_wake(_Atomic uint32_t *bell, const _Atomic uint32_t *newest,
				 struct shm_worker *me);

#endif
