/*
 * The serving side: a request copied out of the ring runs on an executor
 * thread, and its reply goes back with the request's id.
 */
#ifndef SHMRPC_WORKER_SERVER_H
#define SHMRPC_WORKER_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"
#include "worker/link.h"

/* A request, copied out of the ring, run on an executor thread.
 * needed_by, depth: the frame header's (ipc/frame.h); help (help_n
 * entries, unaligned), the waits upstream of it. */
SHMRPC_HIDDEN void server_submit(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
				 uint64_t needed_by, uint32_t depth, const void *help,
				 uint32_t help_n, const void *payload, size_t len);

#endif
