/*
 * Pins: the tensors a message of ours carries by reference stay alive
 * until the receiver holds its own references (worker/tensor.h): a
 * request's until its reply, a reply's until the caller's TENSOR_ACK,
 * which pins_ack sends on the caller's side.
 */
#ifndef SHMRPC_WORKER_PINS_H
#define SHMRPC_WORKER_PINS_H

#include <stdint.h>

#include "common/compiler.h"
#include "worker/link.h"
#include "worker/tensor.h"

enum pin_kind {
	PIN_REQUEST = 0, /* our request to peer: released by its reply */
	PIN_REPLY = 1,   /* our reply to peer's request: released by its TENSOR_ACK */
};

/* Pins the tensors of a message (peer, msg_id, kind); 0 or -errno. */
SHMRPC_HIDDEN int pins_add(uint32_t peer, uint64_t msg_id, enum pin_kind kind,
			   struct tensor_list *sent);
SHMRPC_HIDDEN void pins_release(uint32_t peer, uint64_t msg_id, enum pin_kind kind);
/* pins_release in two steps, for the reply that releases a request's pin
 * (future_complete_packed): the pin of (peer, msg_id, kind) taken out of
 * the list (NULL: none), its handles (pins_held) lent to the reply's
 * decoding meanwhile (tensor_list.pinned), then pins_drop. */
struct pin;
SHMRPC_HIDDEN struct pin *pins_take(uint32_t peer, uint64_t msg_id, enum pin_kind kind);
SHMRPC_HIDDEN struct tensor_list *pins_held(struct pin *pin);
SHMRPC_HIDDEN void pins_drop(struct pin *pin);
/* peer died: its pins, both kinds, go. */
SHMRPC_HIDDEN void pins_release_peer(uint32_t peer);
/* The agent stops: every pin goes. */
SHMRPC_HIDDEN void pins_release_all(void);

/* Tells peer that the tensors of its reply msg_id are ours now (the
 * TENSOR_ACK); to ourselves, releases the pins at once. */
SHMRPC_HIDDEN void pins_ack(struct agent *ag, uint32_t peer, uint64_t msg_id);

#endif
