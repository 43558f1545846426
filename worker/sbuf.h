/*
 * A message's encoding buffer (msgpack-c's msgpack_sbuffer), taken from
 * and given back to its thread's spare: msgpack_sbuffer_init starts empty
 * and its first write mallocs, its destroy frees, on every message. A
 * thread keeps one buffer of up to SBUF_KEEP bytes between messages
 * instead (freed when the thread ends). Buffers opened inside another's
 * use (a profiled call's wrapper) start empty, as before.
 */
#ifndef SHMRPC_WORKER_SBUF_H
#define SHMRPC_WORKER_SBUF_H

#include <msgpack.h>

#include "common/compiler.h"

/* Larger buffers (a message that carried a big value) go back to malloc. */
#define SBUF_KEEP (64u << 10)

/* sb empty, with the thread's spare as its storage if it has one. */
SHMRPC_HIDDEN void sbuf_open(msgpack_sbuffer *sb);
/* sb's storage kept as the thread's spare (if it has none and sb's is at
 * most SBUF_KEEP bytes) or freed; sb is empty after. */
SHMRPC_HIDDEN void sbuf_close(msgpack_sbuffer *sb);

#endif
