/*
 * What rref.c (handles), rref_fork.c (fork data), rref_owner.c (the
 * owner's records) and rref_call.c (the API) share, and no other file.
 */
#ifndef SHMRPC_WORKER_RREF_IMPL_H
#define SHMRPC_WORKER_RREF_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"
#include "worker/link.h"
#include "worker/rref.h"

/* Fork data on the wire (little endian, as the machine). */
struct rref_wire {
	uint64_t id;
	uint64_t fork_id;
	uint32_t slot;
	uint32_t owner;
	uint32_t parent; /* the sender */
	uint32_t flags;  /* RREF_WIRE_* */
};
_Static_assert(sizeof(struct rref_wire) == 32, "fork data is 32 bytes");

/* The parent keeps a pending-child reference: the child confirms the fork
 * by message (SHMRPC_RREF_FORK=message); otherwise the sender charged it. */
#define RREF_WIRE_BY_MESSAGE 1u

/* A fork a user sent us, until its owner answers RREF_FORK_REQUEST
 * (torch's pending user). Its handles hold no reference yet: they owe one
 * each, as does each fork made from them meanwhile (a pending child with
 * via); the parent's pending-child reference keeps the RRef alive. */
struct pending_user {
	uint64_t id, fork_id;
	uint32_t slot, owner, parent;
	uint32_t refs;     /* the owing handles and children, and the request in flight */
	bool done, failed; /* answered; refused or lost (the handles stay without references) */
};

/* A fork we sent as a user, until its child accepts it (torch's pending
 * child): one reference of ours, or one owed by via. */
struct pending_child {
	struct pending_child *next;
	uint64_t fork_id, id;
	uint32_t slot, owner, child;
	struct pending_user *via;
};

/* The fork ids the owner has made references for, per RRef of ours
 * (torch's forks_): a repeated request finds its fork here. */
struct owner_forks {
	struct owner_forks *next;
	uint64_t id;
	uint32_t n, cap;
	uint64_t *fork;
};

#define FORK_BUCKETS 1024u

/* One lock for the three: the owner's removal of an entry also takes it,
 * so that a reference the owner makes for a child cannot meet a removal. */
struct rref_forks {
	pthread_mutex_t lock;
	struct pending_child *child[FORK_BUCKETS];
	struct owner_forks *owned[FORK_BUCKETS];
};
SHMRPC_HIDDEN extern struct rref_forks rref_forks;
/* Pending users made and not yet answered (rref_debug_counts). Relaxed:
 * a gauge, ordered with nothing. */
SHMRPC_HIDDEN extern _Atomic uint64_t rref_pending_users_open;

/* rref.c */
/* Ids made here: RRef ids and fork ids share the counter. */
SHMRPC_HIDDEN uint64_t rref_new_id(struct agent *ag);
/* *ag = the running agent, of a job with an RRef table: 0, -ENOTCONN or
 * -ENOTSUP. */
SHMRPC_HIDDEN int rref_agent(struct agent **ag);
/* rref_agent, for a handle: -ENOTCONN too when r was made in a job that
 * has shut down since (an RRef kept across init_rpc, shutdown, init_rpc). */
SHMRPC_HIDDEN int rref_handle_agent(const shmrpc_rref *r, struct agent **ag);
/* "GloballyUniqueId(created_on=R, local_id=N)", as torch says it. */
SHMRPC_HIDDEN int rref_id_text(uint64_t id, char *buf, size_t len);
/* The bucket of key in rref_forks' tables. */
SHMRPC_HIDDEN uint32_t rref_fork_bucket(uint64_t key);
/* SHMRPC_RREF_FORK (read once): message, and whether it is neither
 * table nor message. */
SHMRPC_HIDDEN bool rref_fork_mode_message(void);
SHMRPC_HIDDEN bool rref_fork_mode_bad(void);
/* r goes to another worker by message: we are a user, and the mode says
 * so or r itself is still pending (it holds no reference to charge from). */
SHMRPC_HIDDEN bool rref_by_message(const struct agent *ag, const shmrpc_rref *r);
/* One owing reference of p goes: a reference of ours in the table if the
 * owner confirmed p, nothing otherwise. ag NULL: the table is gone. */
SHMRPC_HIDDEN void rref_pending_put(struct agent *ag, struct pending_user *p);
/* A handle for a reference this rank already holds in the table. */
SHMRPC_HIDDEN shmrpc_rref *rref_handle_new(struct agent *ag, uint64_t id, uint64_t fork_id,
					    uint32_t slot, uint32_t owner);
/* Our drop made id (at slot) unreferenced (rref_release returned 1): it
 * goes on its owner's collect list (rref_table.h), and the owner is told
 * unless it has been already: we are the owner (we collect now), or the
 * list was not empty (its first pusher told it). In message mode the owner
 * is told by RREF_USER_DELETE, as torch tells it. */
SHMRPC_HIDDEN void rref_unreferenced(struct agent *ag, uint64_t id, uint32_t slot,
				     uint32_t owner);
/* Drops one of our references to (id, slot, owner). */
SHMRPC_HIDDEN void rref_drop(struct agent *ag, uint64_t id, uint32_t slot, uint32_t owner);

/* rref_fork.c */
/* Where an RRef is: its id and its RRef table slot. */
struct rref_at {
	uint64_t id;
	uint32_t slot;
};
/* Sends a request about an RRef to dst (client_request, with what): its
 * payload [id, slot] when at is given, then *fork_id when given (an
 * RREF_FORK_ACCEPT's is that alone). */
SHMRPC_HIDDEN int rref_request(struct agent *ag, uint32_t dst, uint16_t type,
			       const struct rref_at *at, const uint64_t *fork_id,
			       int64_t timeout_ms, const char *what, shmrpc_future **f);
/* A pending child goes: its reference (or its via's owed one) with it. */
SHMRPC_HIDDEN void rref_child_drop(struct agent *ag, struct pending_child *c);
/* One reference for rank unless the RRef is unreferenced already (its
 * parent died and was swept before the owner heard of the fork): torch's
 * owner would have counted the fork by then. Under rref_forks.lock, on the
 * owner: its removal of the entry waits for us. */
SHMRPC_HIDDEN int rref_owner_hold(struct agent *ag, uint64_t id, uint32_t slot,
				  uint32_t rank);
/* Where rref_forks.owned has (or would put) the fork ids recorded for id;
 * rref_forks.lock held. */
SHMRPC_HIDDEN struct owner_forks **rref_owner_forks_at(uint64_t id);
/* Rank r has not ended (nor left the job). */
SHMRPC_HIDDEN bool rref_peer_running(struct agent *ag, uint32_t r);

/* rref_owner.c */
/* Waits for id to leave PENDING. An executor thread is counted out of its
 * pool meanwhile (executor_block_begin), which runs the owner's job for
 * the value, if queued, on another thread: run here, it could wait for
 * what a frame below produces. Elsewhere the wait spins first as long as a
 * hand-off does (worker_handoff_spin), since the owner's store wakes a
 * futex sleeper only with a syscall. reply (NULL: none), remote()'s
 * request on its creator, which the owner answers after its store: the
 * thread waits for that reply as rpc_sync's caller does
 * (future_wait_until: a spin that takes our replies, having promised
 * peers to, then a sleep on the reply), so that the reply wakes neither
 * our loop thread nor, when the thread must sleep, the entry's futex
 * besides (issue 23). In spin mode, where no loop thread sleeps, the spin
 * stays on the entry, which says READY before the reply comes (a thread
 * that must sleep there still sleeps on the reply).
 * -ETIMEDOUT also when the reply came and the entry is still pending: the
 * request failed, and the caller says why. */
SHMRPC_HIDDEN int rref_wait_ready(struct agent *ag, uint32_t slot, uint64_t id,
				  shmrpc_future *reply, uint64_t deadline_ns);

/* Where the encoded value or error of our READY/ERROR entry at slot is
 * (read after the acquire that said so): in the pool, or *small, a copy of
 * an inline one (RREF_VALUE_INLINE); *len its bytes. NULL if the entry's
 * words are no value: a peer wrote them outside shmrpc. */
SHMRPC_HIDDEN const void *rref_value_at(struct agent *ag, uint32_t slot, uint64_t *small,
					uint64_t *len);

#endif
