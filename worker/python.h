/*
 * The hooks the Python binding (python/) uses. A Python object travels as
 * a pickle plus the RRefs and tensors it refers to (the pickle names them
 * by index): the wire value [bin, [rref, ...], [tensor, ...]], so that the
 * RRefs are counted and forked like any other (docs/RREF.md) and the
 * tensors handed over through the pool, while the pickle stays opaque.
 * PYTHON_CALL and PYTHON_REMOTE_CALL carry a pickled call; the binding's
 * handler runs it on an executor thread, and its pickled result (a value,
 * or the binding's RemoteException) comes back in PYTHON_RET or is stored
 * in the RRef.
 */
#ifndef SHMRPC_WORKER_PYTHON_H
#define SHMRPC_WORKER_PYTHON_H

#include <stddef.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/arena.h"

struct python_msg {
	const void *data; /* the pickle */
	size_t len;
	shmrpc_rref **rrefs;
	uint32_t nrrefs;
	shmrpc_tensor **tensors;
	uint32_t ntensors;
};

/* Runs the pickled call in from caller; fills out with the pickled result
 * (data, rrefs and tensors malloc'd; the handles are the agent's to free
 * once sent). 0, or -errno with the text in shmrpc_errmsg() (sent as an
 * EXCEPTION). */
typedef int (*python_handler_fn)(uint32_t caller, const struct python_msg *in,
				 struct python_msg *out);

/* Installs the handler; without one, Python requests are answered
 * "request type PYTHON_CALL is not supported yet" (a C-only worker). */
SHMRPC_HIDDEN void python_set_handler(python_handler_fn fn);
SHMRPC_HIDDEN python_handler_fn python_handler(void);
/* m as a value, [bin, [rref...], [tensor...]], built in a (for value_pack). */
SHMRPC_HIDDEN int python_msg_value(const struct python_msg *m, struct arena *a, shmrpc_value *out);
/* The message a value holds (pointing into it); -EBADMSG if it is none. */
SHMRPC_HIDDEN int python_msg_of(const shmrpc_value *v, struct arena *a, struct python_msg *m);
/* PYTHON_CALL to dst; the future's value is the pickled result. */
SHMRPC_HIDDEN int python_rpc_async(int dst, const struct python_msg *m, int64_t timeout_ms,
				   shmrpc_future **out);
/* PYTHON_REMOTE_CALL to dst; the RRef's value is the pickled result. */
SHMRPC_HIDDEN int python_remote(int dst, const struct python_msg *m, int64_t timeout_ms,
				shmrpc_rref **out);

#endif
