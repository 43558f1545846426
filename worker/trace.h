/*
 * The flight recorder: this worker's last messages and call steps, kept in
 * its ring of the job segment (shm/layout.h gives the format and the
 * protocol), read by shmrpc-inspect --trace and by shmrun
 * --dump-on-failure after a death.
 *
 * Writing costs a read of the time-stamp counter (CLOCK_MONOTONIC's vDSO
 * call where the counter is not invariant: shm/layout.h) and six stores
 * to a lane of the thread's own (the first lanes-1 threads of the worker
 * to record take one each, for their life); the other threads share lane
 * 0, where a record costs a fetch_add on its head and a CAS more. No
 * lock, no syscall. It is on by default; SHMRPC_TRACE=0 in a worker's
 * environment turns it off.
 *
 * What is recorded, and where:
 *   SENT       client_request, before the request goes (peer: the callee)
 *   RECEIVED   server_submit, a request queued for the executors (peer: the caller)
 *   STARTED    run_request, on an executor thread
 *   RECEIVED_STARTED  run_request, in place of STARTED when the thread
 *              that wrote the request's RECEIVED runs it before writing
 *              any other record: that RECEIVED becomes this (trace_started)
 *   FINISHED   send_reply, the reply about to go (ok, or error for an EXCEPTION)
 *   COMPLETED  a call of ours ended: its reply (ok, error, late), a failed
 *              send, a timeout, the callee's death, or shutdown
 *   PINNED     pins_add: the tensors of our request or reply handed over
 *              (how many, their bytes), pinned until the receiver has them
 *   UNPINNED   release_if: those pins released by the reply or TENSOR_ACK
 *              (ok), the receiver's death, or the agent's end
 *   BLOCKED    trace_send: a send found its ring full and waits for space
 *   UNBLOCKED  trace_send: that wait ended
 * TENSOR_ACK frames themselves are not recorded: the UNPINNED they cause is.
 */
#ifndef SHMRPC_WORKER_TRACE_H
#define SHMRPC_WORKER_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/segment.h"

/* This process's recorder; ctl is NULL while it is off. Set before the
 * agent's threads start, cleared after they end; trace_switch turns it
 * off and on meanwhile. */
struct trace_self {
	/* The lanes' control lines. Relaxed: it is only ever NULL or the
	 * ring that trace_ring_init set up before the threads that read it. */
	struct shm_trace_ctl *_Atomic ctl;
	struct shm_trace_ctl *ring; /* what ctl is when on */
	struct shm_trace_rec *recs;
	uint64_t mask;      /* a lane's length - 1 */
	uint32_t lanes;
	bool ticks;         /* times are time-stamp counter ticks (SHM_TRACE_CLOCK_TICKS) */
	uint64_t opening;   /* which trace_ring_init made it: a thread's lane is of one */
	_Atomic uint32_t given; /* lanes handed to threads (lanes 1..given) */
};
SHMRPC_HIDDEN extern struct trace_self trace_self;

/* Starts recording into rank's ring, unless SHMRPC_TRACE=0. */
SHMRPC_HIDDEN void trace_open(const struct shm_seg *seg, uint32_t rank);
SHMRPC_HIDDEN void trace_close(void);

/* Makes t write to the ring of `records` records (a power of two, at
 * least SHM_TRACE_MIN) at ctl, laid out as a worker's (bench/rpc times
 * records on a ring of its own). */
SHMRPC_HIDDEN void trace_ring_init(struct trace_self *t, struct shm_trace_ctl *ctl,
				   uint32_t records, bool ticks);

/* Turns this process's recorder off (on: false) or back on, while its
 * threads run: bench/rpc measures the calls both ways in one job. */
SHMRPC_HIDDEN void trace_switch(bool on);

/* Whether this process records. */
static inline bool trace_on(void)
{
	return atomic_load_explicit(&trace_self.ctl, memory_order_relaxed) != NULL;
}

/* Where a record was written: the ring (trace_ring_init's opening; 0:
 * nowhere, the recorder off or the record dropped), lane and index. */
struct trace_mark {
	uint64_t opening;
	uint64_t index;
	uint32_t lane;
};

/* Claims and writes one record into t's ring (nothing while it is off):
 * into this thread's lane, taken at its first record into t. Where it
 * went into *at (opening 0: nowhere), unless at is NULL. */
SHMRPC_HIDDEN void trace_put_to(struct trace_self *t, uint64_t msg_id, uint64_t info,
				struct trace_mark *at);

/* Rewrites the record at *at with info if this thread wrote it and has
 * written none since (into t, the shared lane included), and the
 * recorder is on; true when it did. Its id and time stay. */
SHMRPC_HIDDEN bool trace_fold_to(struct trace_self *t, const struct trace_mark *at,
				 uint64_t info);

/* Refuses this thread's next fold: it ran a job since its newest record,
 * maybe one that writes none (a Future's callback), and a request it took
 * before that waited for it (executor.c, after each job). */
SHMRPC_HIDDEN void trace_fold_forget(void);

/* Claims and writes one record (recording is on). */
static inline void trace_put(uint64_t msg_id, uint64_t info)
{
	trace_put_to(&trace_self, msg_id, info, NULL);
}

/* A record's info word (SHM_TRACE_* kind and status); type and size saturate. */
static inline uint64_t trace_info(uint32_t kind, uint32_t peer, uint32_t type, size_t size,
				  uint32_t status)
{
	return SHM_TRACE_INFO(kind, status, type > 0xffu ? 0xffu : type, peer,
			      size > UINT32_MAX ? UINT32_MAX : size);
}

/* Records one step. */
static inline void trace_rec(uint32_t kind, uint32_t peer, uint32_t type, uint64_t msg_id,
			     size_t size, uint32_t status)
{
	if (trace_on())
		trace_put(msg_id, trace_info(kind, peer, type, size, status));
}

/* RECEIVED of request msg_id from src; where it went into *at, for
 * trace_started (opening 0 when nothing was written). */
SHMRPC_HIDDEN void trace_received(uint32_t src, uint32_t type, uint64_t msg_id, size_t size,
				  struct trace_mark *at);
/* The request whose RECEIVED is at *at starts on this thread: that record
 * becomes RECEIVED_STARTED if this thread wrote it and nothing since (it
 * took the request off the ring and runs it at once: one record for the
 * two steps); otherwise STARTED is a record of its own, and the wait
 * between the two shows. */
SHMRPC_HIDDEN void trace_started(const struct trace_mark *at, uint32_t src, uint32_t type,
				 uint64_t msg_id, size_t size);

/* Records PINNED or UNPINNED of the pins of one message to peer: our
 * request msg_id, or (reply) our reply to its request msg_id, which
 * carries `tensors` tensors of `bytes` in all. */
SHMRPC_HIDDEN void trace_pins(uint32_t kind, uint32_t peer, bool reply, uint64_t msg_id,
			      uint32_t tensors, uint64_t bytes, uint32_t status);

/* ipc_port_send without a timeout, for a thread that may block (not the
 * loop thread): when the ring to dst is full, the wait for space is
 * recorded, BLOCKED before and UNBLOCKED after. A frame that fits costs
 * what ipc_port_send costs: one try, no clock read. */
struct ipc_port;
struct ipc_msg;
SHMRPC_HIDDEN int trace_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m);

/* The status of a call that ended with error err (0: ok). */
SHMRPC_HIDDEN uint32_t trace_status_of(int err);
/* The status of a reply of this message type: error for an EXCEPTION. */
SHMRPC_HIDDEN uint32_t trace_reply_status(uint32_t type);

/* ---- reading (inspectors, the launcher) ---- */

/* One record as read whole. */
struct trace_entry {
	uint64_t index; /* the record's number in its lane's life, from 0 */
	uint32_t lane;  /* 0: the shared lane; else one thread's */
	uint64_t msg_id;
	uint64_t time_ns; /* CLOCK_MONOTONIC, whatever the ring's clock */
	/* Payload bytes; PINNED, UNPINNED: the tensors' bytes (to the KiB
	 * from 2 GiB). */
	uint64_t size;
	uint32_t peer, type, kind, status;
	uint32_t tensors; /* PINNED, UNPINNED: how many (saturated); else 0 */
	bool reply;       /* PINNED, UNPINNED: they went with our reply, not our request */
};

/*
 * Reads the last `max` records of rank's ring (at most its length), oldest
 * first, into out: each lane's last ones, merged by time (in a lane, by
 * index); records being written or overwritten meanwhile are skipped.
 * Returns how many were read (0 also when out of memory); *head gets the
 * records the worker has claimed in all, *dropped those it gave up.
 */
SHMRPC_HIDDEN size_t trace_read(const struct shm_seg *seg, uint32_t rank, size_t max,
				struct trace_entry *out, uint64_t *head, uint64_t *dropped);
/* The records rank has claimed in all, its lanes' heads (relaxed). */
SHMRPC_HIDDEN uint64_t trace_claimed(const struct shm_seg *seg, uint32_t rank);

/* "sent", "received", ...; "?" for no kind. */
SHMRPC_HIDDEN const char *trace_kind_name(uint32_t kind);
/* "ok", "error", "timeout", "peer-dead", "shutdown", "late"; "?" otherwise. */
SHMRPC_HIDDEN const char *trace_status_name(uint32_t status);
/* True for PINNED and UNPINNED, whose type is none and size the tensors'. */
static inline bool trace_is_pin(uint32_t kind)
{
	return kind == SHM_TRACE_PINNED || kind == SHM_TRACE_UNPINNED;
}
/* The time from the previous step of e[i]'s call (the same peer and id
 * in e[0..i)) to e[i], in *ns, and its name: "waited" (received to
 * started), "ran" (started, or received and started, to finished: from
 * the arrival then), "took" (sent to completed),
 * "held" (pinned to unpinned, the same message), "blocked" (blocked to
 * unblocked, the same type). NULL when that step is not in e[0..i), or
 * e[i] follows no step. */
SHMRPC_HIDDEN const char *trace_step(const struct trace_entry *e, size_t i, uint64_t *ns);
/* The newest time among e[0..n). */
SHMRPC_HIDDEN uint64_t trace_newest_ns(const struct trace_entry *e, size_t n);

/* The column header, and one line (no newline) for e[i], its time
 * relative to newest_ns, for the text of the inspector and the launcher. */
SHMRPC_HIDDEN const char *trace_header(void);
SHMRPC_HIDDEN void trace_format(const struct trace_entry *e, size_t i, uint64_t newest_ns,
				char *buf, size_t len);

#endif
