/* Frame checksums and validation. */
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "shmrpc.h"
#include "common/error.h"
#include "ipc/frame.h"

static uint64_t hdr_hash(const struct ipc_frame_hdr *h)
{
	return XXH3_64bits(h, offsetof(struct ipc_frame_hdr, hdr_csum));
}

void ipc_frame_seal(struct ipc_frame_hdr *h, const void *payload, bool payload_csum)
{
	if (payload_csum) {
		h->flags &= (uint16_t)~IPC_FRAME_F_NO_PAYLOAD_CSUM;
		h->payload_csum = XXH3_64bits(payload, h->payload_len);
	} else {
		h->flags |= IPC_FRAME_F_NO_PAYLOAD_CSUM;
		h->payload_csum = 0;
	}
	h->hdr_csum = hdr_hash(h);
}

int ipc_frame_decode(const uint8_t *rec, uint32_t len, uint32_t src, uint32_t dst,
		     struct ipc_frame *out)
{
	struct ipc_frame_hdr *h = &out->hdr;

	if (len < sizeof(*h))
		return shmrpc__fail(-SHMRPC_ECORRUPT,
				    "corrupted frame from worker %u: %u bytes, shorter than a header",
				    src, len);
	/* Copy the header out: the bytes in the ring are the producer's. */
	memcpy(h, rec, sizeof(*h));
	if (hdr_hash(h) != h->hdr_csum)
		return shmrpc__fail(-SHMRPC_ECORRUPT,
				    "corrupted frame from worker %u, message id %llu (unverified): "
				    "header checksum mismatch",
				    src, (unsigned long long)h->msg_id);
	if (h->payload_len != len - sizeof(*h) || h->src != src || h->dst != dst ||
	    h->type == 0 || (h->flags & ~IPC_FRAME_F_KNOWN) || h->help_n > IPC_HELP_MAX ||
	    (uint64_t)h->help_n * sizeof(struct ipc_help) > h->payload_len)
		return shmrpc__fail(-SHMRPC_ECORRUPT,
				    "corrupted frame from worker %u, message id %llu: header says "
				    "%u -> %u, type %u, flags 0x%x, %u help entries, %u payload bytes "
				    "in a %u-byte record",
				    src, (unsigned long long)h->msg_id, h->src, h->dst, h->type,
				    h->flags, h->help_n, h->payload_len, len);
	out->payload = rec + sizeof(*h);
	if (!(h->flags & IPC_FRAME_F_NO_PAYLOAD_CSUM) &&
	    XXH3_64bits(out->payload, h->payload_len) != h->payload_csum)
		return shmrpc__fail(-SHMRPC_ECORRUPT,
				    "corrupted frame from worker %u, message id %llu: checksum mismatch",
				    src, (unsigned long long)h->msg_id);
	return 0;
}
