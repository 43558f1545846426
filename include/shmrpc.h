/*
 * shmrpc — single-node multi-process RPC over shared memory.
 *
 * Public C API. Every function returns 0 (or a non-negative count) on
 * success and a negative errno on failure, as liburing does;
 * shmrpc_strerror() names the code and shmrpc_errmsg() gives the full
 * sentence (what, where, what to do) recorded by the last failing call
 * on this thread.
 */
#ifndef SHMRPC_H
#define SHMRPC_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHMRPC_API __attribute__((visibility("default")))

#define SHMRPC_VERSION_MAJOR 0
#define SHMRPC_VERSION_MINOR 1
#define SHMRPC_VERSION_PATCH 0
#define SHMRPC_VERSION_STRING "0.1.0"

/* Error codes beyond plain errno meanings (each is a negative errno when returned). */
#define SHMRPC_EBADSEG EPROTO             /* the file is not a shmrpc segment */
#define SHMRPC_EVERSION EPROTONOSUPPORT   /* segment format this library cannot read */
#define SHMRPC_ETRUNC EOVERFLOW           /* segment shorter than its header says */
#define SHMRPC_ECORRUPT EBADMSG           /* a frame failed its checksum or bounds check */
#define SHMRPC_EPEERDEAD ECONNRESET       /* the peer worker died */

SHMRPC_API const char *shmrpc_strerror(int err);
SHMRPC_API const char *shmrpc_errmsg(void);
SHMRPC_API const char *shmrpc_version(void);

#ifdef __cplusplus
}
#endif

#endif
