/*
 * The RPC agent of this process: one per process, started by shmrpc_init.
 *
 * Threads:
 *  - the loop thread polls the incoming rings and sleeps on the doorbell
 *    (ipc_port_wait). It never waits in a send (a full ring must not stop
 *    it from draining its own, or two workers could wait on each other for
 *    ever): it sends only what fits at once (a TENSOR_ACK), and never runs
 *    user code: requests go to the executor pool, replies complete
 *    futures, deaths and timeouts fail them.
 *  - executor threads run requests and callbacks and send replies.
 *  - user threads call rpc_sync / rpc_async, which send from the calling
 *    thread (ipc_port_send waits for ring space).
 * A thread that spins at a hand-off (worker_handoff_spin) polls the
 * rings itself while it spins (agent_poll): a waiting caller
 * then takes its own reply, an idle executor its next request, and a call
 * crosses two threads instead of four. Whoever polls does what the loop
 * thread would (on_frame: queue requests, complete futures); one at a
 * time, by poll_lock, because each ring has one consumer.
 */
#ifndef SHMRPC_WORKER_AGENT_H
#define SHMRPC_WORKER_AGENT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <msgpack.h>

#include "common/compiler.h"
#include "ipc/port.h"
#include "shm/pool.h"
#include "shm/rref_table.h"
#include "shm/segment.h"
#include "worker/tensor.h"

struct agent {
	struct shm_seg seg;
	struct ipc_port port;
	struct shm_pool pool;
	bool has_pool; /* the job has a tensor pool (shmrun makes one) */
	/* CPU tensors up to this many bytes from outside the pool travel in
	 * the frame (worker/tensor.h); SHMRPC_INLINE_MAX, 0: none. */
	uint32_t inline_max;
	struct tensor_view *view; /* the pool's mapping, shared with the tensor handles */
	struct rref_table rrefs;
	bool has_rrefs; /* the job has an RRef table (shmrun makes one) */
	uint64_t startup_timeout_ms; /* shmrpc_init's waits for the others (messages) */
	bool rref_fetch_by_message; /* SHMRPC_RREF_FETCH=message: to_here() asks the owner */
	uint32_t rank;
	uint32_t world;
	/* Which of this process's agents this is (1, 2, ... per shmrpc_init):
	 * handles made under an earlier one name another job's table. */
	uint64_t job;
	struct shm_worker *self;
	uint64_t default_timeout_ns; /* 0: none */
	pthread_t loop;
	pthread_mutex_t poll_lock; /* held by whoever consumes the incoming rings */
	_Atomic bool stop;
	/* A job to take our RRef collect list is queued and has not taken it
	 * yet (the loop thread queues one at most, agent.c). */
	_Atomic bool collect_queued;
	/* rref_drop_users ran: a graceful shutdown released every reference
	 * we held on other workers' RRefs, and their handles release none. */
	_Atomic bool users_dropped;
	/* Loop thread only: peers whose death was seen, and since when (ns;
	 * 0 once their calls were failed). */
	uint64_t *dying_since;
	bool *gone;
	bool *unwatched; /* no pidfd for this peer: its slot's state tells its end */
	/* The device maps that concern us (worker/devmap.h), by peer, its
	 * requests then its replies; NULL when no worker of the job has one.
	 * Set in shmrpc_init, read-only after. */
	struct devmap_landing *devmap;
	bool *devmap_mapped; /* the same places: a map applies */
};

/*
 * How long this thread spins at a hand-off between threads (waiting for a
 * reply, an RRef's value or, idle on the executor, a request) before it
 * sleeps, at most until deadline_ns (0: none): without bound in spin mode,
 * which never sleeps; SHMRPC_SPIN_NS when set; else a budget of the
 * thread's own that adapts (common/spin.h), told by worker_handoff_spun
 * whether the spin met the work. 0 while no agent runs.
 */
SHMRPC_HIDDEN uint64_t worker_handoff_spin(uint64_t deadline_ns);
SHMRPC_HIDDEN void worker_handoff_spun(bool came);

/*
 * A user thread that spins at a wait polls the rings (above) between
 * agent_spin_begin, which gives the agent to poll (NULL: do not spin, the
 * thread takes its replies by agent_wait_reply, or no agent runs), and
 * agent_spin_end; each poll goes through agent_spin_poll, false once the
 * agent is going (stop spinning). shmrpc_shutdown waits for such threads
 * to leave before it frees the agent.
 */
SHMRPC_HIDDEN struct agent *agent_spin_begin(void);
SHMRPC_HIDDEN bool agent_spin_poll(struct agent *ag);
SHMRPC_HIDDEN void agent_spin_end(void);

/* The agent, or NULL before shmrpc_init / after shmrpc_shutdown. */
SHMRPC_HIDDEN extern struct agent *worker_agent;

/* *ag = the running agent: 0, or -ENOTCONN with the one sentence that says
 * no agent runs and how to start one (every public entry point that needs
 * the agent asks here, so they all say the same). */
SHMRPC_HIDDEN int agent_running(struct agent **ag);

/* Takes what the incoming rings hold, unless another thread is at it
 * (-EBUSY; wait: after it); returns how many frames. Any thread; never
 * waits in a send (a TENSOR_ACK goes only if it fits at once), never runs
 * user code. */
SHMRPC_HIDDEN int agent_poll(struct agent *ag, bool wait);

/*
 * Replies taken by their waiters (on: a data loader's trainer, which waits
 * for each batch in turn). While on and no user thread waits for a future,
 * peers' replies ring nothing (the slot's replies_taken, ipc/doorbell.h):
 * they wait in the rings until a thread about to wait for a reply polls
 * them itself; one that must sleep sleeps on the slot's replies' bell,
 * which a reply rings (and any completion of a future), and polls again.
 * The loop thread is woken for neither. Completions, and their callbacks,
 * are late meanwhile: only for a process whose calls are all waited for.
 * Off again, the rings are polled at once.
 */
SHMRPC_HIDDEN void agent_take_replies(struct agent *ag, bool on);
/* A user thread waits for f until the deadline (ns, 0: none) that way:
 * false when the mode is off (or goes off meanwhile): the caller waits
 * its usual way. */
SHMRPC_HIDDEN bool agent_wait_reply(shmrpc_future *f, uint64_t deadline_ns);
/* A future was completed: wakes the threads on the replies' bell. */
SHMRPC_HIDDEN void agent_future_done(void);
/* The calling thread (the loop thread, or one taking its replies) may
 * send a TENSOR_ACK quietly: someone flushes its debt (ipc_port_flush_quiet). */
SHMRPC_HIDDEN bool agent_acks_quietly(const struct agent *ag);
/* True on the loop thread, and on any thread while it handles a frame
 * (user threads poll too): nothing there may wait on the GPU or a peer. */
SHMRPC_HIDDEN bool agent_must_not_block(const struct agent *ag);

/* shmrpc_init: waits until arrived(ag, r) holds for every rank r (one that
 * arrived and ended since counts), or deadline (CLOCK_MONOTONIC ns) has
 * passed ("did not <what> within ag->startup_timeout_ms"), or a worker
 * ended before it arrived. */
SHMRPC_HIDDEN int agent_wait_all(struct agent *ag, uint64_t deadline,
				 bool (*arrived)(const struct agent *ag, uint32_t r), const char *what);

/* Name of rank r as its slot says ("worker3" if none). */
SHMRPC_HIDDEN void agent_peer_name(const struct agent *ag, uint32_t r, char *buf, size_t len);
/* Whether rank r died or left the job (it will answer no call). */
SHMRPC_HIDDEN bool agent_peer_gone(struct agent *ag, uint32_t r);
/* "worker 3 (worker3) died: killed by signal 9 (SIGKILL)" and similar. */
SHMRPC_HIDDEN void agent_peer_gone_text(const struct agent *ag, uint32_t r, char *buf, size_t len);
/* A request's waits upstream (struct ipc_help, ipc/frame.h), nearest first. */
struct help_chain {
	uint32_t n;
	struct ipc_help e[IPC_HELP_MAX];
};

/* Sends a frame from a non-loop thread; the text of a failure in errmsg.
 * needed_by, depth, help: a request's (ipc/frame.h; help NULL: none); 0
 * and NULL for other frames. */
SHMRPC_HIDDEN int agent_send(struct agent *ag, uint32_t dst, uint16_t type, uint64_t msg_id,
			     uint64_t needed_by, uint32_t depth, const struct help_chain *help,
			     const void *payload, size_t len);

/* client.c: the table of calls waiting for their reply (loop thread side). */
SHMRPC_HIDDEN void client_on_reply(struct agent *ag, const struct ipc_frame *f);
SHMRPC_HIDDEN void client_complete_local(struct agent *ag, uint16_t type, uint64_t msg_id,
					 const void *payload, size_t len);
SHMRPC_HIDDEN uint64_t client_expire(struct agent *ag, uint64_t now);
SHMRPC_HIDDEN void client_fail_peer(struct agent *ag, uint32_t peer, const char *why);
SHMRPC_HIDDEN void client_fail_all(struct agent *ag, const char *why);

/* client.c: a call's payload, [fn, args] or [fn, flags, args]; the
 * tensors and RRefs in args are added to sent. */
#define CALL_F_PROXY 1u /* args[0] is an RRef owned by the callee: pass its value */
SHMRPC_HIDDEN int client_encode_call(msgpack_sbuffer *sb, const char *fn, const shmrpc_value *args,
				     uint32_t nargs, uint32_t flags, struct tensor_list *sent);
/* client.c: "<verb> fn()<tail>" (fn cut at 256 bytes) in what, for
 * client_request's errors. Made on every call, so by hand: snprintf costs
 * more than the rest of encoding a call. verb and tail are short literals. */
#define CLIENT_WHAT_MAX 320
SHMRPC_HIDDEN void client_what(char what[static CLIENT_WHAT_MAX], const char *verb,
			       const char *fn, const char *tail);
/* client.c: sends a request (payload sb) to dst and makes its future.
 * sent: the tensors (pinned until the reply) and RRefs (charged to dst)
 * the payload holds; the list is consumed. what: "call foo()", for errors. */
SHMRPC_HIDDEN int client_request(struct agent *ag, int dst, uint16_t type, msgpack_sbuffer *sb,
				 struct tensor_list *sent, int64_t timeout_ms, const char *what,
				 shmrpc_future **out);

/* client.c: waits for f; its value in *out, or its error (f freed). */
SHMRPC_HIDDEN int client_sync_wait(shmrpc_future *f, shmrpc_future **out);

/* server.c: tells peer that the tensors of its reply msg_id are ours now. */
SHMRPC_HIDDEN void server_ack_tensors(struct agent *ag, uint32_t peer, uint64_t msg_id);
/* server.c: a request, copied out of the ring, run on an executor thread.
 * needed_by, depth: the frame header's (ipc/frame.h); help (help_n
 * entries, unaligned), the waits upstream of it. */
SHMRPC_HIDDEN void server_submit(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
				 uint64_t needed_by, uint32_t depth, const void *help,
				 uint32_t help_n, const void *payload, size_t len);
/* server.c: the request this thread serves (its innermost, if it helps
 * with another while it waits): its caller, id, depth and the waits
 * upstream of it; false on a thread that serves none. */
SHMRPC_HIDDEN bool server_serving(uint32_t *caller, uint64_t *msg_id, uint32_t *depth,
				  const struct help_chain **up);

/* client.c: on, the next request this thread sends is an rpc_sync (it will
 * wait for it before anything else), which lets the caller of the request
 * it serves run it while waiting (worker/executor.h); off after the send,
 * for a call refused before it. */
SHMRPC_HIDDEN void client_sync_next(bool on);

#endif
