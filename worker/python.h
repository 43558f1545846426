/*
 * The hooks the Python binding (python/) uses. A Python object travels as
 * a pickle plus the RRefs and tensors it refers to (the pickle names them
 * by index): the wire value [bin, [rref, ...], [tensor, ...]], so that the
 * RRefs are counted and forked like any other (docs/RREF.md) and the
 * tensors handed over through the pool, while the pickle stays opaque.
 * PYTHON_CALL and PYTHON_REMOTE_CALL carry a pickled call; the binding's
 * handler runs it on an executor thread, and its pickled result (a value,
 * or the binding's RemoteException) comes back in PYTHON_RET or is stored
 * in the RRef. Distributed autograd's messages (struct python_request) go
 * to the same handler.
 */
#ifndef SHMRPC_WORKER_PYTHON_H
#define SHMRPC_WORKER_PYTHON_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/arena.h"
#include "worker/profile.h"
#include "worker/tensor.h"

struct python_msg {
	const void *data; /* the pickle */
	size_t len;
	shmrpc_rref **rrefs;
	uint32_t nrrefs;
	shmrpc_tensor **tensors;
	uint32_t ntensors;
};

/*
 * A message of the Python package: a pickled call or result, or one of
 * distributed autograd's (python/shmrpc/autograd.py), with the autograd
 * metadata torch's carry (docs/PROTOCOL.md gives each one's payload):
 *   PYTHON_CALL, PYTHON_REMOTE_CALL, PYTHON_RET: msg;
 *   FORWARD_AUTOGRAD_REQ / _RESP: the message of type wrapped (a
 *     PYTHON_CALL or PYTHON_REMOTE_CALL / a PYTHON_RET or REMOTE_RET, which
 *     has no msg) made inside context_id, message_id naming it in the
 *     context; a PYTHON_REMOTE_CALL's RRef is (rref_id, rref_slot);
 *   BACKWARD_AUTOGRAD_REQ: gradients (pickled in msg) for sends of context_id;
 *   CLEANUP_AUTOGRAD_CONTEXT_REQ: context_id only;
 *   RREF_BACKWARD_REQ: backward from msg.rrefs[0]'s value in context_id;
 *   PYTHON_RREF_FETCH_CALL: the value of msg.rrefs[0], an RRef of the
 *     receiver's, pickled in context_id (-1: none) as it is now;
 *     PYTHON_RREF_FETCH_RET: msg, that pickle;
 *   BACKWARD_AUTOGRAD_RESP, CLEANUP_AUTOGRAD_CONTEXT_RESP, RREF_BACKWARD_RESP:
 *     msg, the pickled outcome (None, or the error raised).
 */
/*
 * A remote call's handler may keep the result itself, as a live object
 * (torch's OwnerRRef: the Python package keeps it under the RRef's id) and
 * say so (out->live): the owner's record then calls the live-release hook
 * (worker/rref.h) when the RRef goes. What the RRef stores is then either
 * the one byte "\x02" (no pickle starts with it: protocol 2 and above
 * start with 0x80), telling a reader other than the owner to ask the owner
 * with PYTHON_RREF_FETCH_CALL, which pickles the object as it is then; or,
 * for a value no code can change (None, numbers, strings, bytes, tuples of
 * them), its pickle, which users read without a message and which cannot
 * go stale. The binding decides; the agent only stores what it gets.
 */

struct python_request {
	uint16_t type;
	uint16_t wrapped;
	int64_t context_id;
	int64_t message_id;
	bool retain_graph;
	uint64_t rref_id;   /* a remote call's RRef (0: none), for its handler too */
	uint32_t rref_slot;
	bool live;          /* a remote call's handler keeps the result (above) */
	/* python_request_async: msg's tensor handles are the binding's to
	 * give, which it frees after the call returns: the request's pin
	 * takes their references over (tensor_list.give). Those it took are
	 * spent, sent or not (their free drops nothing); those it did not (a
	 * send refused before the pin, a tensor inline) keep theirs. */
	bool give;
	struct python_msg msg;
};

/* Runs the request in from caller (a request type python_is_request
 * accepts); fills out->msg with the pickled result (data and the arrays
 * of handles in a, the call's arena, or data a constant that the binding
 * owns (its one-byte mark of a reply of tensors alone): read only, never
 * freed; the handles new ones, the agent's to free once sent) and, for a FORWARD_AUTOGRAD_REQ, out->message_id with
 * the reply's. ops, if set (a request profiled for torch's profiler,
 * worker/profile.h): the function runs under torch's profiler and the ops
 * it ran are added there. 0, or -errno with the text in shmrpc_errmsg()
 * (sent as an EXCEPTION), out->msg then holding no handle. */
typedef int (*python_handler_fn)(uint32_t caller, const struct python_request *in,
				 struct python_request *out, struct profile_events *ops,
				 struct arena *a);

SHMRPC_HIDDEN python_handler_fn python_handler(void);
/* Whether the binding's handler serves requests of this type. */
SHMRPC_HIDDEN bool python_is_request(uint32_t type);
/* The type that answers a request python_is_request accepts. */
SHMRPC_HIDDEN uint16_t python_reply_type(uint16_t type);
/* m as a value, [bin, [rref...], [tensor...]], built in a (for value_pack). */
SHMRPC_HIDDEN int python_msg_value(const struct python_msg *m, struct arena *a, shmrpc_value *out);
/* The message a value holds (pointing into it); -EBADMSG if it is none. */
SHMRPC_HIDDEN int python_msg_of(const shmrpc_value *v, struct arena *a, struct python_msg *m);
/* r as the value its type's payload is, built in a. */
SHMRPC_HIDDEN int python_request_value(const struct python_request *r, struct arena *a,
				       shmrpc_value *out);
/* The request of type in len bytes at buf where it is a bare message with
 * no RRefs and no tensors ([bin, [], []], a common call's), read in place
 * (r points into buf): whether it was; any other payload is for
 * value_unpack and python_request_of. */
SHMRPC_HIDDEN bool python_request_plain(uint16_t type, const void *buf, size_t len,
					struct python_request *r);
/* The request of type a value holds (pointing into it); -EBADMSG with a
 * sentence if the value is not that type's payload. */
SHMRPC_HIDDEN int python_request_of(uint16_t type, const shmrpc_value *v, struct arena *a,
				    struct python_request *r);

/* How many requests of type this process sent (python_request_async,
 * python_remote); python_count_sent counts one more. */
SHMRPC_HIDDEN uint64_t python_sent(uint16_t type);
SHMRPC_HIDDEN void python_count_sent(uint16_t type);

/* Packs r (as python_remote takes it) as its payload for the new RRef
 * (id, slot); sent gets its tensors and RRefs (value_pack's). */
SHMRPC_HIDDEN int python_remote_pack(msgpack_packer *pk, const struct python_request *r,
				     uint64_t id, uint32_t slot, struct tensor_list *sent);

#endif
