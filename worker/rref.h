/*
 * RRefs as the agent handles them (docs/RREF.md).
 *
 * A handle (struct shmrpc_rref) is one reference, counted for this rank in
 * the job's RRef table (shm/rref_table.h). Making a handle takes a count,
 * freeing it drops one; the drop that leaves none hands the RRef to its
 * owner, which frees the value.
 *
 * In messages an RRef travels as fork data (MessagePack extension 2). The
 * sender makes the receiver's reference before the message goes
 * (rref_charge: the sender still holds its own, so the RRef cannot vanish
 * meanwhile) and the receiver adopts it when it decodes the message. A
 * value read from the table (to_here) holds RRefs that the reader must take
 * references to itself (rref_unpack with take).
 *
 * With SHMRPC_RREF_FORK=message (read once, at the first fork), a user
 * that forks an RRef it does not own follows torch's protocol instead: it
 * keeps a pending-child reference of its own, keyed by the fork id; the
 * child sends RREF_FORK_REQUEST to the owner, which makes the child's
 * reference (once per fork id) and answers RREF_ACK; the child then sends
 * RREF_CHILD_ACCEPT to the parent, which drops its pending-child reference.
 * Until the owner's answer the child's handles are pending: they owe their
 * references, and the parent's keeps the RRef alive. docs/RREF.md.
 *
 * The owner keeps, per RRef with a value, a record: the pool block of the
 * encoded value and the tensors and RRefs it holds (their references are
 * the owner's). The record goes when the table says UNREFERENCED. A
 * Python value lives in the owner's interpreter instead: the block holds
 * only a mark, and the record's end tells the binding (live release).
 */
#ifndef SHMRPC_WORKER_RREF_H
#define SHMRPC_WORKER_RREF_H

#include <msgpack.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "shm/layout.h"
#include "worker/arena.h"
#include "worker/tensor.h"

struct agent;
struct pending_user;

struct shmrpc_rref {
	uint64_t id;
	uint64_t fork_id;  /* == id for an OwnerRRef */
	uint32_t slot;     /* in the table */
	uint32_t owner;
	uint64_t job;      /* the agent's (struct agent.job) whose table holds it */
	bool forked;       /* came in a message: its owner's table had it at once */
	struct pending_user *pending; /* came forked by message: the owner's answer; fixed */
	char owner_name[SHM_NAME_MAX];
	shmrpc_future *created; /* remote()'s request, on the creator only */
	pthread_mutex_t lock;   /* the local value, below */
	bool local_loaded;
	shmrpc_value local;
	struct arena arena;
	struct tensor_list local_held;
};

/* Fork data of r for a message (the receiver's count is rref_charge's). */
SHMRPC_HIDDEN int rref_pack(msgpack_packer *pk, const shmrpc_rref *r);
/* Fork data received: a handle. take: make its count now (a value read from
 * the table); otherwise the sender made it. */
SHMRPC_HIDDEN int rref_unpack(const char *data, uint32_t len, bool take, shmrpc_rref **out);
/* References for dst to every RRef in l, before a message to dst goes; on
 * failure none is left. rref_uncharge takes them back (the message did
 * not go). */
SHMRPC_HIDDEN int rref_charge(struct agent *ag, const struct tensor_list *l, uint32_t dst);
SHMRPC_HIDDEN void rref_uncharge(struct agent *ag, const struct tensor_list *l, uint32_t dst);

/* The owner's side (server.c). */
/* RREF_FORK_REQUEST: the child's reference to id (once per fork id; a
 * repeated request changes nothing). */
SHMRPC_HIDDEN int rref_owner_add_fork(struct agent *ag, uint64_t id, uint32_t slot,
				      uint64_t fork_id, uint32_t child);
/* RREF_CHILD_ACCEPT: our pending-child reference for fork_id goes (none
 * left: nothing happens). */
SHMRPC_HIDDEN void rref_child_accepted(struct agent *ag, uint64_t fork_id);
/* The child's messages, sent as the protocol does; tests call them again
 * by hand to check that a repeated request changes nothing. *out: the
 * request (RREF_ACK, or the error). */
SHMRPC_HIDDEN int rref_send_fork_request(struct agent *ag, uint64_t id, uint32_t slot,
					 uint32_t owner, uint64_t fork_id, shmrpc_future **out);
SHMRPC_HIDDEN int rref_send_child_accept(struct agent *ag, uint32_t parent, uint64_t fork_id,
					 shmrpc_future **out);

/* Runs checks on a SCRIPT_REMOTE_CALL's (id, slot): the entry is ours and pending. */
SHMRPC_HIDDEN int rref_owner_check(struct agent *ag, uint64_t id, uint32_t slot);
/* Stores result (error NULL) or the error [type, text, backtrace] for id
 * and drops the reference of the owner's run (also when it fails). sent
 * gets the handles the value holds (the record took its own). live: result
 * is the mark of a value the binding keeps itself (worker/python.h), let
 * go through the live-release hook when the record goes or the store
 * fails. */
SHMRPC_HIDDEN int rref_owner_store(struct agent *ag, uint64_t id, uint32_t slot,
				   const shmrpc_value *result, const shmrpc_value *error, bool live,
				   struct tensor_list *sent);
/* The hook a binding that keeps values itself (the Python package: an
 * RRef's value is its owner's live object) sets at init: called with the
 * RRef's id when the owner's record of such a value goes (the RRef was
 * deleted everywhere, a user's death left it unreferenced, or the agent
 * stops), on whichever thread frees it, holding no lock of ours. */
typedef void (*rref_live_release_fn)(uint64_t id);
SHMRPC_HIDDEN void rref_set_live_release(rref_live_release_fn fn);
/* The encoded value or error of a ready RRef of ours, copied into *buf
 * (malloc); *state READY or ERROR. */
SHMRPC_HIDDEN int rref_owner_fetch(struct agent *ag, uint64_t id, uint32_t slot, uint64_t deadline_ns,
				   void **buf, size_t *len, uint32_t *state);
/* Frees what the RRefs on our collect list hold (rref_table.h), and
 * removes them: the last drop of each put it there. Any thread. */
SHMRPC_HIDDEN void rref_owner_collect_listed(struct agent *ag);
/* What a drop of ours that unreferenced an RRef we own runs at once:
 * rref_owner_collect_listed, set by agent.c at init (rref_owner.c is of
 * a level above the handles'). */
SHMRPC_HIDDEN void rref_set_collect(void (*collect)(struct agent *ag));
/* A peer died (its references were swept): collects every RRef of ours it
 * left unreferenced (the sweep listed them), and drops our pending-child
 * references to forks sent to a child that is gone. From an executor thread. */
SHMRPC_HIDDEN void rref_owner_collect_all(struct agent *ag);
/* The agent stops: every record goes, the owner's fork ids and pending
 * children too (the launcher sweeps the table). */
SHMRPC_HIDDEN void rref_owner_free_all(struct agent *ag);

/* torch's _delete_all_user_and_unforked_owner_rrefs, a graceful
 * shutdown's step before its leak check: every reference this worker holds
 * on another worker's RRef goes now, and the handles holding them release
 * nothing later (their RRefs' values are the owners' to free). */
SHMRPC_HIDDEN void rref_drop_users(struct agent *ag);
/* torch's RRef leak check (RRefContext::checkRRefLeaks): the RRefs this
 * worker owns that another worker still holds, one line each per holder
 * in buf (cut at len); returns how many lines there are. */
SHMRPC_HIDDEN size_t rref_leaks(struct agent *ag, char *buf, size_t len);

/* torch's RRef debug counts (RRefContext::getDebugInfo) for this worker:
 * the RRefs it owns that another worker holds (as torch's owners_: an
 * RRef(value) counts once shared, until no other worker holds it), those
 * of them still waiting for their value, the other
 * workers' references to them (its users' forks, one per worker holding
 * any), and forks it received by message that the owner has not
 * confirmed yet. A walk of the table: for debugging, not the hot path. */
struct rref_debug_counts {
	uint64_t owners, pending_owners, forks, pending_users;
};
SHMRPC_HIDDEN void rref_debug_counts(struct agent *ag, struct rref_debug_counts *out);

/* The local value of an RRef we own, decoded once (for proxies on the owner). */
SHMRPC_HIDDEN int rref_local_value(shmrpc_rref *r, const shmrpc_value **out);

#endif
