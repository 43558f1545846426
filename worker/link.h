/*
 * The link: this process's agent (struct agent, worker_agent), who the
 * peers are and whether they are there, sending (to oneself included),
 * taking what the rings hold, the startup wait and the hand-off spin.
 * Everything in worker/ above the leaves reaches the job through here;
 * what a frame means is for the levels above, which say it through the
 * hooks agent.c sets at init (struct link_hooks).
 *
 * The agent (agent.c) is one per process, started by shmrpc_init.
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
 * thread would (the hooks' frame: queue requests, complete futures); one at a
 * time, by poll_lock, because each ring has one consumer.
 */
#ifndef SHMRPC_WORKER_LINK_H
#define SHMRPC_WORKER_LINK_H

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
#include "shmrpc.h"

struct devmap_landing;
struct tensor_view;

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
/* How many of this thread's hand-off spins met the work, and how many ran
 * out so that it slept (bench/rpc prints the share). */
SHMRPC_HIDDEN void worker_handoff_counts(uint64_t *met, uint64_t *missed);

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
/* One such spinner per process at a time, waiting for its reply, may
 * promise peers to take the replies itself (the slot's replies_watched,
 * ipc/doorbell.h): their replies then ring nothing while it spins, where
 * each would wake the sleeping loop thread only for it to find the rings
 * empty (the spinner took the frame) and sleep again: a context switch
 * and a FUTEX_WAKE per call. Between agent_spin_begin and _end: true if
 * this thread promised (then agent_watch_end, which takes what came
 * meanwhile, or has the loop thread take it). */
SHMRPC_HIDDEN bool agent_watch_begin(struct agent *ag);
SHMRPC_HIDDEN void agent_watch_end(struct agent *ag);
/* Stores 0 in the slot's replies_watched if it holds a 1 that no thread of
 * ours stored (another process wrote it); true when it did: the caller
 * polls next. */
SHMRPC_HIDDEN bool agent_check_watch_word(struct agent *ag);

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

/* A spinner's poll: agent_poll(ag, false) if the rings hold a frame or
 * the agent has news (ipc_port_has_work), else 0 at the cost of reads:
 * the poll lock's line, which a trylock writes, stays unshared between
 * the threads that spin (the waiting caller, idle executors, the loop
 * thread in spin mode) until there is something to take. */
SHMRPC_HIDDEN int agent_poll_any(struct agent *ag);

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
/* Restores the slot's replies_taken to what agent_take_replies published
 * if another process wrote a 1 there (peers' replies would ring nothing
 * while no thread takes them); true when it did: the caller polls next. */
SHMRPC_HIDDEN bool agent_check_replies_word(struct agent *ag);
/* A user thread waits until done(arg) (a future's completion) or the
 * deadline (ns, 0: none) that way: false when the mode is off (or goes off
 * meanwhile): the caller waits its usual way. */
SHMRPC_HIDDEN bool agent_wait_reply(bool (*done)(void *arg), void *arg, uint64_t deadline_ns);
/* A user thread waits until done(arg) or the deadline (ns, 0: none) on the
 * slot's replies' bell, as agent_wait_reply, while its process takes its
 * replies the usual way: a reply that would wake the sleeping loop thread
 * wakes this thread instead (ipc_doorbell_notify), which takes it itself;
 * one the loop thread takes wakes it by the completion. One wake-up per
 * reply instead of two (the loop thread's, then the future's condition
 * variable). One such thread per process at a time (a reply wakes all of
 * the bell's); false for the others, and when no agent runs or it is
 * going: the caller waits its usual way. */
SHMRPC_HIDDEN bool agent_wait_alone(bool (*done)(void *arg), void *arg, uint64_t deadline_ns);
/* A future was completed: wakes the threads on the replies' bell. */
SHMRPC_HIDDEN void agent_future_done(void);
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
/* The rank of the worker named name, or -ENOENT (the error's sentence set). */
SHMRPC_HIDDEN int agent_rank_named(const struct agent *ag, const char *name);
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
 * and NULL for other frames. To ourselves (dst our rank), the frame goes
 * to the hooks' local at once, through no ring. */
SHMRPC_HIDDEN int agent_send(struct agent *ag, uint32_t dst, uint16_t type, uint64_t msg_id,
			     uint64_t needed_by, uint32_t depth, const struct help_chain *help,
			     const void *payload, size_t len);

/* What the levels above do with a frame (agent.c sets them at init,
 * before the first poll; they stay until the process ends). */
struct link_hooks {
	/* A frame taken from a ring, on the thread that polls (agent_poll). */
	void (*frame)(struct agent *ag, const struct ipc_frame *f);
	/* A frame sent to ourselves (agent_send), on the sending thread. */
	void (*local)(struct agent *ag, uint16_t type, uint64_t msg_id, uint64_t needed_by,
		      uint32_t depth, const struct help_chain *help, const void *payload,
		      size_t len);
	/* Around each poll of the rings (the executor's batch of jobs). */
	void (*poll_begin)(void);
	/* Before the frames of each poll, within the batch: the agent's news
	 * that is not in the rings (RRefs to collect), on the polling thread.
	 * Before, so that what a peer did before it sent the frames (its last
	 * drop, then a call) is queued before them. */
	void (*polled)(struct agent *ag);
	void (*poll_end)(void);
};
SHMRPC_HIDDEN void link_set_hooks(const struct link_hooks *h);

/* The request this thread serves (the innermost, if it serves another
 * while it waits): its caller, id, depth and the waits upstream of it. */
struct link_served {
	uint32_t src;
	uint64_t msg_id;
	uint32_t depth;
	const struct help_chain *up;
};
/* The server says which request this thread serves from now on (NULL:
 * none) and gets the one before, to give back when it is done. */
SHMRPC_HIDDEN const struct link_served *link_serving_swap(const struct link_served *s);
/* The request this thread serves; NULL on a thread that serves none. */
SHMRPC_HIDDEN const struct link_served *link_serving(void);

/* A peer's slot, as the launcher and the peer publish it. */
static inline uint32_t link_agent_state(const struct agent *ag, uint32_t r)
{
	/* Acquire pairs with the owner's release store of its state. */
	return atomic_load_explicit(&shm_worker(&ag->seg, r)->agent_state, memory_order_acquire);
}

static inline uint32_t link_worker_state(const struct agent *ag, uint32_t r)
{
	/* Acquire pairs with the launcher's release of DEAD/EXITED (exit_info before it). */
	return atomic_load_explicit(&shm_worker(&ag->seg, r)->state, memory_order_acquire);
}

/* How rank r ended: read after link_worker_state said DEAD or EXITED. */
static inline uint32_t link_exit_info(const struct agent *ag, uint32_t r)
{
	/* Relaxed: published by the state's store, which link_worker_state acquired. */
	return atomic_load_explicit(&shm_worker(&ag->seg, r)->exit_info, memory_order_relaxed);
}

/* Publishes our agent_state (release: what we did before is visible with
 * it) and rings every peer to see it. */
SHMRPC_HIDDEN void link_set_agent_state(struct agent *ag, uint32_t st);

/* shmrpc_init, once the port is open: the hand-off spin of the port's
 * wait mode; shmrpc_shutdown: 0 again. */
SHMRPC_HIDDEN void link_handoff_open(const struct agent *ag);
SHMRPC_HIDDEN void link_handoff_close(void);
/* User threads may poll ag's rings while they spin (agent_spin_begin);
 * NULL: no more, and returns once none does (shutdown). */
SHMRPC_HIDDEN void link_spin_agent(struct agent *ag);
/* A child forked from this process waits for no reply of ours. */
SHMRPC_HIDDEN void link_forget_in_child(void);

#endif
