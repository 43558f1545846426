/*
 * The calling side: a request's payload, its sending and its future, and
 * the table of calls waiting for their reply (completed by the loop
 * thread, or by whoever polls; failed on a timeout or a death).
 */
#ifndef SHMRPC_WORKER_CLIENT_H
#define SHMRPC_WORKER_CLIENT_H

#include <stdbool.h>
#include <stdint.h>

#include <msgpack.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "ipc/frame.h"
#include "worker/link.h"
#include "worker/tensor.h"

/* The table of calls waiting for their reply (loop thread side). */
/* A reply from src (ourselves included) to our call msg_id completes it. */
SHMRPC_HIDDEN void client_complete(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
				   const void *payload, size_t len);
SHMRPC_HIDDEN uint64_t client_expire(struct agent *ag, uint64_t now);
SHMRPC_HIDDEN void client_fail_peer(struct agent *ag, uint32_t peer, const char *why);
SHMRPC_HIDDEN void client_fail_all(struct agent *ag, const char *why);

/* A call's payload, [fn, args] or [fn, flags, args]; the tensors and
 * RRefs in args are added to sent. */
#define CALL_F_PROXY 1u /* args[0] is an RRef owned by the callee: pass its value */
SHMRPC_HIDDEN int client_encode_call(msgpack_sbuffer *sb, const char *fn, const shmrpc_value *args,
				     uint32_t nargs, uint32_t flags, struct tensor_list *sent);
/* "<verb> fn()<tail>" (fn cut at 256 bytes) in what, for client_request's
 * errors. Made on every call, so by hand: snprintf costs more than the
 * rest of encoding a call. verb and tail are short literals. */
#define CLIENT_WHAT_MAX 320
SHMRPC_HIDDEN void client_what(char what[static CLIENT_WHAT_MAX], const char *verb,
			       const char *fn, const char *tail);
/* Sends a request (payload sb) to dst and makes its future. sent: the
 * tensors (pinned until the reply) and RRefs (charged to dst) the payload
 * holds; the list is consumed. what: "call foo()", for errors. */
SHMRPC_HIDDEN int client_request(struct agent *ag, int dst, uint16_t type, msgpack_sbuffer *sb,
				 struct tensor_list *sent, int64_t timeout_ms, const char *what,
				 shmrpc_future **out);

/* Waits for f; its value in *out, or its error (f freed). */
SHMRPC_HIDDEN int client_sync_wait(shmrpc_future *f, shmrpc_future **out);

/* On, the next request this thread sends is an rpc_sync (it will wait for
 * it before anything else), which lets the caller of the request it serves
 * run it while waiting (worker/executor.h); off after the send, for a call
 * refused before it. */
SHMRPC_HIDDEN void client_sync_next(bool on);

#endif
