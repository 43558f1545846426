/*
 * The message types of the RPC protocol: every request and response of
 * torch.distributed.rpc's request callbacks (DESIGN.md's table), one enum.
 * The value is the frame's `type`; 0 is never used. docs/PROTOCOL.md gives
 * each one's payload. TENSOR_ACK is shmrpc's own: a caller tells the callee
 * that it holds the tensors of a reply (worker/tensor.h).
 */
#ifndef SHMRPC_WORKER_MSG_H
#define SHMRPC_WORKER_MSG_H

#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"

#define WORKER_MSG_TYPES(X)                                   \
	X(SCRIPT_CALL, 1, true)                               \
	X(SCRIPT_RET, 2, false)                               \
	X(PYTHON_CALL, 3, true)                               \
	X(PYTHON_RET, 4, false)                               \
	X(SCRIPT_REMOTE_CALL, 5, true)                        \
	X(PYTHON_REMOTE_CALL, 6, true)                        \
	X(REMOTE_RET, 7, false)                               \
	X(SCRIPT_RREF_FETCH_CALL, 8, true)                    \
	X(PYTHON_RREF_FETCH_CALL, 9, true)                    \
	X(SCRIPT_RREF_FETCH_RET, 10, false)                   \
	X(PYTHON_RREF_FETCH_RET, 11, false)                   \
	X(RREF_USER_DELETE, 12, true)                         \
	X(RREF_CHILD_ACCEPT, 13, true)                        \
	X(RREF_FORK_REQUEST, 14, true)                        \
	X(RREF_ACK, 15, false)                                \
	X(FORWARD_AUTOGRAD_REQ, 16, true)                     \
	X(FORWARD_AUTOGRAD_RESP, 17, false)                   \
	X(BACKWARD_AUTOGRAD_REQ, 18, true)                    \
	X(BACKWARD_AUTOGRAD_RESP, 19, false)                  \
	X(CLEANUP_AUTOGRAD_CONTEXT_REQ, 20, true)             \
	X(CLEANUP_AUTOGRAD_CONTEXT_RESP, 21, false)           \
	X(RUN_WITH_PROFILING_REQ, 22, true)                   \
	X(RUN_WITH_PROFILING_RESP, 23, false)                 \
	X(RREF_BACKWARD_REQ, 24, true)                        \
	X(RREF_BACKWARD_RESP, 25, false)                      \
	X(EXCEPTION, 26, false)                               \
	X(TENSOR_ACK, 27, false)

enum worker_msg_type {
#define X(name, value, is_request) MSG_##name = value,
	WORKER_MSG_TYPES(X)
#undef X
	MSG_TYPE_END
};

/* "SCRIPT_CALL", or NULL for a value that is no message type. */
SHMRPC_HIDDEN const char *worker_msg_name(uint32_t type);
SHMRPC_HIDDEN bool worker_msg_is_request(uint32_t type);

#endif
