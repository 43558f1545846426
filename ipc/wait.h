/*
 * Waiting on a doorbell, and learning of deaths while waiting.
 *
 * Three modes (SHMRPC_WAIT=uring|futex|spin forces one):
 *  - uring: after a short adaptive spin, one io_uring_enter waits for the
 *    doorbell (IORING_OP_FUTEX_WAIT), the watched processes' pidfds
 *    (POLL_ADD) and the timeout together. The default where it works.
 *  - futex: FUTEX_WAIT on the doorbell; a watcher thread polls the pidfds
 *    and rings the doorbell when one fires. Chosen, with one line on
 *    stderr, where io_uring or its futex ops are unavailable.
 *  - spin: never sleeps (pause, yield now and then); the watcher thread
 *    reports deaths. For measurements and dedicated cores: where the
 *    job's processes outnumber the CPUs, it naps 20 us instead of yielding.
 *
 * A death is reported once per watched id by ipc_waiter_take_dead(); the
 * waiter also rings its own doorbell so that every thread of the process
 * sleeping on it wakes and re-checks.
 */
#ifndef SHMRPC_IPC_WAIT_H
#define SHMRPC_IPC_WAIT_H

#include <liburing.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/compiler.h"
#include "common/spin.h"
#include "shm/layout.h"

enum ipc_wait_mode {
	IPC_WAIT_AUTO = 0,
	IPC_WAIT_URING = 1,
	IPC_WAIT_FUTEX = 2,
	IPC_WAIT_SPIN = 3,
};

struct ipc_waiter {
	enum ipc_wait_mode mode;
	struct shm_worker *self;
	uint32_t max_ids;
	int32_t fixed_spin_ns; /* SHMRPC_SPIN_NS, or -1: adaptive */
	bool crowded;          /* max_ids processes outnumber our CPUs */
	struct shmrpc_spin_budget spin; /* adaptive, when not fixed */
	int *pidfds;                 /* by id; -1 when not watched */
	_Atomic uint64_t *dead_bits; /* set by whoever saw the death (release) */
	uint64_t *reported_bits;     /* owned by the thread calling take_dead */
	/* uring */
	struct io_uring ring;
	bool ring_ok;
	bool futex_armed;
	/* futex / spin: the pidfd watcher thread */
	pthread_t watcher;
	bool watcher_running;
	int watcher_efd;
	pthread_mutex_t lock; /* guards pidfds for the watcher thread */
};

/* mode IPC_WAIT_AUTO reads SHMRPC_WAIT, else picks uring where it works. */
SHMRPC_HIDDEN int ipc_waiter_init(struct ipc_waiter *w, struct shm_worker *self, uint32_t max_ids,
				  enum ipc_wait_mode mode);
SHMRPC_HIDDEN void ipc_waiter_destroy(struct ipc_waiter *w);
/* Watches process pid under id (< max_ids). Call from the sleeping thread. */
SHMRPC_HIDDEN int ipc_waiter_watch(struct ipc_waiter *w, uint32_t id, pid_t pid);
/*
 * Sleeps until the doorbell differs from seq (read by the caller with
 * ipc_doorbell_seq before it checked for work), ready(arg) holds, a watched
 * process dies, or timeout_ns passes (0: no timeout). 0 or -ETIMEDOUT.
 * ready is the caller's own check for work (its rings): frames are
 * published with ipc_doorbell_notify, which bumps the doorbell only when
 * the receiver sleeps, so a spinning waiter must look at the rings.
 */
SHMRPC_HIDDEN int ipc_waiter_sleep(struct ipc_waiter *w, uint32_t seq, uint64_t timeout_ns,
				   bool (*ready)(void *arg), void *arg);
/* Notices deaths already reported by the kernel, without blocking. */
SHMRPC_HIDDEN void ipc_waiter_poll(struct ipc_waiter *w);
/* True once the death of id was seen (any thread may ask). */
SHMRPC_HIDDEN bool ipc_waiter_is_dead(struct ipc_waiter *w, uint32_t id);
/* True when take_dead has something to report. */
SHMRPC_HIDDEN bool ipc_waiter_has_news(struct ipc_waiter *w);
/* Pops one id whose death was not reported yet; false when none. */
SHMRPC_HIDDEN bool ipc_waiter_take_dead(struct ipc_waiter *w, uint32_t *id);

SHMRPC_HIDDEN const char *ipc_wait_mode_name(enum ipc_wait_mode m);
/* Parses "uring", "futex" or "spin"; IPC_WAIT_AUTO for NULL, -EINVAL otherwise. */
SHMRPC_HIDDEN int ipc_wait_mode_parse(const char *s);

#endif
