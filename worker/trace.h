/*
 * The flight recorder: this worker's last messages and call steps, kept in
 * its ring of the job segment (shm/layout.h gives the format and the
 * protocol), read by shmrpc-inspect --trace and by shmrun
 * --dump-on-failure after a death.
 *
 * Writing costs a clock read (vDSO), a fetch_add on the ring's head, a
 * CAS, and four stores to one record: no lock, no syscall. It is on by
 * default; SHMRPC_TRACE=0 in a worker's environment turns it off.
 *
 * What is recorded, and where:
 *   SENT       client_request, before the request goes (peer: the callee)
 *   RECEIVED   server_submit, a request queued for the executors (peer: the caller)
 *   STARTED    run_request, on an executor thread
 *   FINISHED   send_reply, the reply about to go (ok, or error for an EXCEPTION)
 *   COMPLETED  a call of ours ended: its reply (ok, error, late), a failed
 *              send, a timeout, the callee's death, or shutdown
 * Tensor acks are not recorded: they belong to the call they follow.
 */
#ifndef SHMRPC_WORKER_TRACE_H
#define SHMRPC_WORKER_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/segment.h"

/* This process's recorder; ctl is NULL while it is off. Set before the
 * agent's threads start, cleared after they end. */
struct trace_self {
	struct shm_trace_ctl *ctl;
	struct shm_trace_rec *recs;
	uint64_t mask;
};
SHMRPC_HIDDEN extern struct trace_self trace_self;

/* Starts recording into rank's ring, unless SHMRPC_TRACE=0. */
SHMRPC_HIDDEN void trace_open(const struct shm_seg *seg, uint32_t rank);
SHMRPC_HIDDEN void trace_close(void);

SHMRPC_HIDDEN void trace_write(uint32_t kind, uint32_t peer, uint32_t type, uint64_t msg_id,
			       size_t size, uint32_t status);

/* Records one step (SHM_TRACE_* kind and status). */
static inline void trace_rec(uint32_t kind, uint32_t peer, uint32_t type, uint64_t msg_id,
			     size_t size, uint32_t status)
{
	if (trace_self.ctl)
		trace_write(kind, peer, type, msg_id, size, status);
}

/* The status of a call that ended with error err (0: ok). */
SHMRPC_HIDDEN uint32_t trace_status_of(int err);
/* The status of a reply of this message type: error for an EXCEPTION. */
SHMRPC_HIDDEN uint32_t trace_reply_status(uint32_t type);

/* ---- reading (inspectors, the launcher) ---- */

/* One record as read whole. */
struct trace_entry {
	uint64_t index; /* the record's number in the worker's life, from 0 */
	uint64_t msg_id;
	uint64_t time_ns;
	uint32_t size, peer, type, kind, status;
};

/*
 * Reads the last `max` records of rank's ring (at most its length), oldest
 * first, into out; records being written or overwritten meanwhile are
 * skipped. Returns how many were read; *head gets the records the worker
 * has claimed in all, *dropped those it gave up.
 */
SHMRPC_HIDDEN size_t trace_read(const struct shm_seg *seg, uint32_t rank, size_t max,
				struct trace_entry *out, uint64_t *head, uint64_t *dropped);

/* "sent", "received", ...; "?" for no kind. */
SHMRPC_HIDDEN const char *trace_kind_name(uint32_t kind);
/* "ok", "error", "timeout", "peer-dead", "shutdown", "late"; "?" otherwise. */
SHMRPC_HIDDEN const char *trace_status_name(uint32_t status);
/* The time from the previous step of e[i]'s call (the same peer and id
 * in e[0..i)) to e[i], in *ns, and its name: "waited" (received to
 * started), "ran" (started to finished), "took" (sent to completed).
 * NULL when that step is not in e[0..i), or e[i] follows no step. */
SHMRPC_HIDDEN const char *trace_step(const struct trace_entry *e, size_t i, uint64_t *ns);
/* The newest time among e[0..n). */
SHMRPC_HIDDEN uint64_t trace_newest_ns(const struct trace_entry *e, size_t n);

/* The column header, and one line (no newline) for e[i], its time
 * relative to newest_ns, for the text of the inspector and the launcher. */
SHMRPC_HIDDEN const char *trace_header(void);
SHMRPC_HIDDEN void trace_format(const struct trace_entry *e, size_t i, uint64_t newest_ns,
				char *buf, size_t len);

#endif
