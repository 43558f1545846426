/*
 * libFuzzer target for everything that decodes bytes another process
 * wrote. Whatever bytes sit in a ring, the consumer side (ipc_ring_peek,
 * then ipc_frame_decode on each record) must neither read outside the ring
 * nor accept a frame whose checksums do not hold; and whatever a payload
 * holds, the value decoder (worker/value.c) must neither read past it nor
 * allocate more than it can back. The input is [8-byte tail][ring bytes];
 * the ring is 4 KiB; the bytes after the tail are also decoded as a value,
 * and as an inline tensor's extension body (worker/tensor.h), which must
 * hold no more bytes than the input.
 */
#include <stdint.h>
#include <string.h>

#include "ipc/frame.h"
#include "ipc/ring.h"
#include "worker/arena.h"
#include "worker/tensor.h"
#include "worker/value.h"

#define FUZZ_RING 4096u

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static struct shm_ring_ctl ctl;
	static uint8_t ring[FUZZ_RING];
	struct ipc_ring r = { .ctl = &ctl, .data = ring, .size = FUZZ_RING, .mask = FUZZ_RING - 1 };
	uint64_t tail = 0;
	const uint8_t *rec;
	uint32_t len;

	if (size >= sizeof(tail)) {
		memcpy(&tail, data, sizeof(tail));
		data += sizeof(tail);
		size -= sizeof(tail);
	}
	memset(ring, 0, sizeof(ring));
	memcpy(ring, data, size < FUZZ_RING ? size : FUZZ_RING);
	atomic_store(&ctl.tail, tail);
	atomic_store(&ctl.head, 0);

	/* The decoder alone, on the raw input. */
	{
		struct ipc_frame f;

		if (ipc_frame_decode(data, (uint32_t)size, 1, 0, &f) == 0 &&
		    f.payload + f.hdr.payload_len > data + size)
			__builtin_trap();
	}
	/* The value decoder, as a request or reply payload (no tensors here). */
	{
		struct arena a = { 0 };
		shmrpc_value v;
		size_t used;

		if (value_unpack(data, size, &a, &v, &used, NULL) == 0 && used > size)
			__builtin_trap();
		arena_free(&a);
	}
	/* An inline tensor (it needs no agent: its bytes become our own). */
	{
		shmrpc_tensor *t;

		if (tensor_unpack_inline((const char *)data, (uint32_t)size, &t) == 0) {
			if (shmrpc_tensor_nbytes(t) > size)
				__builtin_trap();
			shmrpc_tensor_free(t);
		}
	}
	/* The ring walk, record after record, as a consumer does. */
	for (int n = 0; n < 1024 && ipc_ring_peek(&r, &rec, &len) == 1; n++) {
		struct ipc_frame f;

		if (rec < ring || rec + len > ring + FUZZ_RING)
			__builtin_trap();
		(void)ipc_frame_decode(rec, len, 1, 0, &f);
		ipc_ring_consume(&r, len);
	}
	return 0;
}
