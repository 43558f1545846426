/*
 * Frames: what travels in a ring record. A fixed 56-byte header, then the
 * payload. The header carries an XXH3 checksum of its first 48 bytes,
 * always; the payload's XXH3 checksum can be switched off per job
 * (SHM_F_NO_PAYLOAD_CSUM), and the frame says so in its flags.
 * docs/PROTOCOL.md describes the format field by field.
 */
#ifndef SHMRPC_IPC_FRAME_H
#define SHMRPC_IPC_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"

#define IPC_FRAME_F_NO_PAYLOAD_CSUM 0x0001u /* payload_csum is not set */
#define IPC_FRAME_F_MORE 0x0002u            /* a fragment: more of this message follows */
#define IPC_FRAME_F_KNOWN 0x0003u

/* A request's waits upstream (worker/client.c): the calls, on the workers
 * of a chain of rpc_syncs that led to it, that cannot complete before it
 * does. help_n of them start its payload, nearest first, one per worker. */
struct ipc_help {
	uint64_t msg_id; /* a call of that worker's */
	uint32_t rank;
	uint32_t pad;    /* 0 */
};
_Static_assert(sizeof(struct ipc_help) == 16, "a help entry is 16 bytes");
#define IPC_HELP_MAX 8u

struct ipc_frame_hdr {
	uint16_t type;        /* message type (worker/msg.h); 0 is invalid */
	uint16_t flags;       /* IPC_FRAME_F_* */
	uint32_t payload_len; /* bytes after the header */
	uint64_t msg_id;      /* the request's id; a response repeats it */
	uint16_t src;         /* sender's rank */
	uint16_t dst;         /* receiver's rank */
	uint32_t src_gen;     /* sender's generation, to recognise stale frames */
	uint64_t needed_by;   /* a request: the receiver's call that waits for it, or 0 */
	uint32_t depth;       /* a request: its nesting depth (1: not made inside a request) */
	uint32_t help_n;      /* a request: struct ipc_help entries the payload starts with */
	uint64_t payload_csum;
	uint64_t hdr_csum;    /* XXH3-64 of bytes [0, 48) */
};
_Static_assert(sizeof(struct ipc_frame_hdr) == 56, "frame header is 56 bytes");
_Static_assert(offsetof(struct ipc_frame_hdr, hdr_csum) == 48, "hdr_csum covers [0, 48)");

/* A decoded frame; payload points into the ring and is valid only until
 * the record is consumed. */
struct ipc_frame {
	struct ipc_frame_hdr hdr;
	const uint8_t *payload;
};

/* Fills both checksums of a header whose payload is already in place. */
SHMRPC_HIDDEN void ipc_frame_seal(struct ipc_frame_hdr *h, const void *payload, bool payload_csum);

/*
 * Checks a record as a frame from `src` to `dst`: size, checksums, ranks,
 * flags. 0 and *out filled, or -SHMRPC_ECORRUPT with the reason in
 * shmrpc_errmsg() ("corrupted frame from worker 3, message id 77: checksum
 * mismatch"). Never reads outside [rec, rec + len).
 */
SHMRPC_HIDDEN int ipc_frame_decode(const uint8_t *rec, uint32_t len, uint32_t src, uint32_t dst,
				   struct ipc_frame *out);

#endif
