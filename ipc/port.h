/*
 * A worker's port: its view of the job's rings (one outgoing ring towards
 * each peer, one incoming ring from each), its doorbell and its waiter.
 *
 * Threads. One thread (the loop thread) waits with ipc_port_wait; it
 * must never block in a send, or two workers whose rings towards each
 * other are full would wait on each other for ever: it uses
 * ipc_port_try_send, or hands the send to another thread. ipc_port_poll
 * may be called by any thread, one at a time (the caller serialises it):
 * the loop thread, or a thread spinning meanwhile; ipc_port_wait's checks
 * read only the rings' shared words, so they may run beside a poll.
 * Any other thread may use ipc_port_send, which waits for ring space;
 * sends towards one peer are serialised by a lock of this process.
 */
#ifndef SHMRPC_IPC_PORT_H
#define SHMRPC_IPC_PORT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/uio.h>

#include "common/compiler.h"
#include "ipc/doorbell.h"
#include "ipc/frame.h"
#include "ipc/ring.h"
#include "ipc/wait.h"
#include "shm/segment.h"

struct ipc_msg {
	uint16_t type;
	uint16_t flags; /* IPC_FRAME_F_MORE only; checksum flags are the port's */
	uint8_t kind; /* enum ipc_frame_kind: when the receiver need not be woken */
	uint64_t msg_id;
	uint64_t needed_by; /* a request's: the frame header's (ipc/frame.h) */
	uint32_t depth;
	uint32_t help_n; /* a request's: struct ipc_help entries its iov starts with */
	const struct iovec *iov;
	int iovcnt;
};

struct ipc_port {
	struct shm_seg *seg;
	uint32_t rank;
	uint32_t world;
	uint32_t generation;
	bool payload_csum;
	struct shm_worker *self;
	struct ipc_ring *out; /* [world], towards each peer */
	struct ipc_ring *in;  /* [world], from each peer */
	pthread_mutex_t *out_lock;
	/* [world]: when a frame sent quietly towards that peer (try_send_quiet)
	 * must have rung its doorbell at the latest (ns); 0: none owed. Set
	 * and cleared by senders under out_lock, claimed by flush_quiet. */
	_Atomic uint64_t *quiet_due;
	_Atomic bool *in_broken; /* a ring whose shared state went bad is not read again */
	uint32_t next_src;
	/* Loop thread: the doorbell as it was before ipc_port_want_space set
	 * a flag; the next ipc_port_wait compares with it, since the consumer
	 * may ring for the freed space before that wait reads the doorbell. */
	bool space_seq_set;
	uint32_t space_seq;
	/* Work besides frames that ipc_port_wait must not sleep through (the
	 * agent's RRef collect list): checked after the doorbell is read, as
	 * the rings are, so a waker that publishes then rings is never missed.
	 * NULL: none. Set before any thread may poll or look
	 * (ipc_port_has_work): the owner publishes the port after it. */
	bool (*news)(void *arg);
	void *news_arg;
	struct ipc_waiter waiter;
};

typedef void (*ipc_frame_fn)(void *arg, const struct ipc_frame *f);

/* Opens rank's port in an attached segment and records this process's pid
 * in its slot. mode: IPC_WAIT_AUTO reads SHMRPC_WAIT. */
SHMRPC_HIDDEN int ipc_port_open(struct ipc_port *p, struct shm_seg *seg, uint32_t rank,
				enum ipc_wait_mode mode);
SHMRPC_HIDDEN void ipc_port_close(struct ipc_port *p);

/* The largest payload one frame can carry. */
SHMRPC_HIDDEN uint32_t ipc_port_max_payload(const struct ipc_port *p);

/* Sends a frame: 0, -EAGAIN (try_send: ring full), -EMSGSIZE, -EINVAL (bad
 * rank or self), -SHMRPC_EPEERDEAD, -ETIMEDOUT (timeout_ns, 0 = none). */
SHMRPC_HIDDEN int ipc_port_try_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m);
SHMRPC_HIDDEN int ipc_port_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m,
				uint64_t timeout_ns);
/* try_send that never blocks (-EAGAIN also while another thread holds
 * dst's ring: ipc_port_send holds it as it waits for space) and leaves
 * dst's doorbell alone, for a frame that can wait: the next frame towards
 * dst wakes it for both (it lies before that one in the ring), or, if none
 * goes within delay_ns, ipc_port_flush_quiet does (the loop thread, at its
 * next turn). Saves a sleeping peer a wake-up per such frame when others
 * follow. */
SHMRPC_HIDDEN int ipc_port_try_send_quiet(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m,
					  uint64_t delay_ns);
/* Rings the doorbells owed since before now (any thread; each debt is
 * paid once); returns when the next one is due (UINT64_MAX: none). */
SHMRPC_HIDDEN uint64_t ipc_port_flush_quiet(struct ipc_port *p, uint64_t now);

/* One thread at a time: hands up to max frames to fn (their payload valid during the
 * call only); returns how many records were taken, corrupt ones included. */
SHMRPC_HIDDEN int ipc_port_poll(struct ipc_port *p, ipc_frame_fn fn, void *arg, int max);
/* Any thread: whether ipc_port_poll would find a frame, or the owner has
 * news (ipc_port.news). Reads only: a spinner that looks here first
 * leaves the poll lock's and its own lines alone while nothing came. */
SHMRPC_HIDDEN bool ipc_port_has_work(struct ipc_port *p);
/* Loop thread: asks to be woken when a frame of len payload bytes fits
 * towards dst; true if it fits already. */
SHMRPC_HIDDEN bool ipc_port_want_space(struct ipc_port *p, uint32_t dst, uint32_t len);
/* Loop thread: sleeps until a frame, ring space asked for, a death, or the
 * timeout (0: none). 0 or -ETIMEDOUT. */
SHMRPC_HIDDEN int ipc_port_wait(struct ipc_port *p, uint64_t timeout_ns);
/* Watches peer's process for death (pid from its slot, or given). */
SHMRPC_HIDDEN int ipc_port_watch(struct ipc_port *p, uint32_t peer, pid_t pid);
/* Loop thread: pops a peer whose death was not reported yet. */
SHMRPC_HIDDEN bool ipc_port_take_dead(struct ipc_port *p, uint32_t *peer);
/* Any thread: false once peer is known dead (slot state or pidfd), or its
 * ring to us is broken (its frames, replies included, are lost). */
SHMRPC_HIDDEN bool ipc_port_peer_alive(struct ipc_port *p, uint32_t peer);
/* Any thread: whether the ring from peer went bad and is no longer read. */
SHMRPC_HIDDEN bool ipc_port_ring_broken(const struct ipc_port *p, uint32_t peer);
/* Whether peer found our ring to it corrupt and reads it no more (its
 * requests, and our replies to its calls, are lost). */
SHMRPC_HIDDEN bool ipc_port_ring_abandoned(const struct ipc_port *p, uint32_t peer);

#endif
