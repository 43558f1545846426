/*
 * The hooks the Python binding (python/) uses: Python functions travel
 * pickled, as one MessagePack bin, in PYTHON_CALL / PYTHON_REMOTE_CALL
 * requests, and the binding's handler runs them on executor threads. The
 * result (a value, or the binding's pickled RemoteException) comes back
 * as bytes: in PYTHON_RET, or stored in the RRef.
 */
#ifndef SHMRPC_WORKER_PYTHON_H
#define SHMRPC_WORKER_PYTHON_H

#include <stddef.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"

/* Runs a pickled call from caller: *out (malloc) the pickled result.
 * 0, or -errno with the text in shmrpc_errmsg() (sent as an EXCEPTION). */
typedef int (*python_handler_fn)(uint32_t caller, const void *in, size_t len, void **out,
				 size_t *outlen);

/* Installs the handler; without one, Python requests are answered
 * "request type PYTHON_CALL is not supported yet" (a C-only worker). */
SHMRPC_HIDDEN void python_set_handler(python_handler_fn fn);
SHMRPC_HIDDEN python_handler_fn python_handler(void);
/* PYTHON_CALL to dst; the future's value is the result's bytes. */
SHMRPC_HIDDEN int python_rpc_async(int dst, const void *pickled, size_t len, int64_t timeout_ms,
				   shmrpc_future **out);
/* PYTHON_REMOTE_CALL to dst; the RRef's value is the result's bytes. */
SHMRPC_HIDDEN int python_remote(int dst, const void *pickled, size_t len, int64_t timeout_ms,
				shmrpc_rref **out);

#endif
