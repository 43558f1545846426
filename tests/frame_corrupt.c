/* A corrupt frame is never delivered, and the ring it came on is no longer
 * read, its sender told: frames sent through a port (ranks 0 and 1 in one
 * process) are damaged inside the ring before the consumer polls.
 * Oversized payloads are refused with both sizes named, and
 * ipc_frame_decode refuses short records, wrong ranks, unknown flags and
 * bad checksums. */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "shmrpc.h"
#include "ipc/port.h"
#include "tests/lib/testlib.h"

#define PAYLOAD 100

struct rx {
	uint64_t ids[16];
	int n;
};

static void on_frame(void *arg, const struct ipc_frame *f)
{
	struct rx *rx = arg;

	CHECK(rx->n < 16, "too many frames");
	CHECK(f->hdr.payload_len == 0 || f->payload[0] == (uint8_t)f->hdr.msg_id,
	      "frame %llu: wrong payload", (unsigned long long)f->hdr.msg_id);
	rx->ids[rx->n++] = f->hdr.msg_id;
}

/* A frame to rank 1 whose payload bytes all equal the id's low byte. */
static int send_id(struct ipc_port *p, uint64_t id, uint32_t len)
{
	static uint8_t buf[64 * 1024];
	struct iovec iov = { buf, len };
	struct ipc_msg m = { .type = 7, .msg_id = id, .iov = &iov, .iovcnt = 1 };

	CHECK(len <= sizeof(buf), "payload of %u bytes", len);
	memset(buf, (uint8_t)id, len);
	return ipc_port_try_send(p, 1, &m);
}

/* Polls with stderr sent to a memfd; returns what the port wrote there. */
static const char *poll_capturing(struct ipc_port *p, struct rx *rx, int max, int *taken)
{
	static char text[4096];
	int fd = memfd_create("stderr", 0), saved = dup(2);
	ssize_t n;

	CHECK(fd >= 0 && saved >= 0, "memfd/dup");
	CHECK(dup2(fd, 2) == 2, "dup2");
	*taken = ipc_port_poll(p, on_frame, rx, max);
	CHECK(dup2(saved, 2) == 2, "dup2 back");
	close(saved);
	n = pread(fd, text, sizeof(text) - 1, 0);
	close(fd);
	text[n > 0 ? n : 0] = '\0';
	return text;
}

/* The record of the next frame from 0 to 1, still in the ring. */
static uint8_t *next_record(struct ipc_port *rcv, uint32_t *len)
{
	const uint8_t *rec;

	CHECK(ipc_ring_peek(&rcv->in[0], &rec, len) == 1, "no record in the ring");
	return (uint8_t *)rec;
}

struct pair {
	struct shm_seg seg;
	struct ipc_port snd, rcv; /* ranks 0 and 1 */
};

static void pair_open(struct pair *pr)
{
	struct shm_seg_params sp = { .world_size = 2 };

	CHECK_OK(shm_seg_create(&pr->seg, &sp));
	CHECK_OK(ipc_port_open(&pr->snd, &pr->seg, 0, IPC_WAIT_FUTEX));
	CHECK_OK(ipc_port_open(&pr->rcv, &pr->seg, 1, IPC_WAIT_FUTEX));
}

static void pair_close(struct pair *pr)
{
	ipc_port_close(&pr->snd);
	ipc_port_close(&pr->rcv);
	shm_seg_detach(&pr->seg);
}

/*
 * Frame 1 arrives; frame 2 is damaged at byte `at` of its record before
 * the poll: nothing is delivered, the error names the frame and `why`, the
 * ring is no longer read (frame 3 behind it stays unread), and the sender
 * sees it abandoned, so both sides' calls on the link fail at once.
 */
static void damaged(uint32_t at, const char *why)
{
	struct rx rx = { .n = 0 };
	struct pair pr;
	const char *err;
	uint32_t len;
	int taken;

	pair_open(&pr);
	CHECK_OK(send_id(&pr.snd, 1, PAYLOAD));
	CHECK(ipc_port_poll(&pr.rcv, on_frame, &rx, 16) == 1 && rx.n == 1 && rx.ids[0] == 1,
	      "good frame 1 not received");
	CHECK_OK(send_id(&pr.snd, 2, PAYLOAD));
	CHECK_OK(send_id(&pr.snd, 3, PAYLOAD));
	next_record(&pr.rcv, &len)[at] ^= 0x40;
	err = poll_capturing(&pr.rcv, &rx, 16, &taken);
	CHECK(taken == 0 && rx.n == 1, "%s: %d frames taken after the damaged one", why, taken);
	CHECK(strstr(shmrpc_errmsg(), "corrupted frame from worker 0, message id 2") &&
		      strstr(shmrpc_errmsg(), why) &&
		      strstr(shmrpc_errmsg(), "the ring from worker 0 is no longer read: corrupted frame"),
	      "errmsg: %s", shmrpc_errmsg());
	CHECK(strstr(err, "shmrpc: worker 1: the ring from worker 0 is no longer read: corrupted frame from worker 0, message id 2"),
	      "stderr: %s", err);
	CHECK(atomic_load(&pr.rcv.self->corrupt_frames) == 1, "corrupt_frames %llu",
	      (unsigned long long)atomic_load(&pr.rcv.self->corrupt_frames));
	CHECK(ipc_port_ring_broken(&pr.rcv, 0), "the receiver still reads the ring");
	CHECK(ipc_port_ring_abandoned(&pr.snd, 1), "the sender is not told");
	CHECK(ipc_port_poll(&pr.rcv, on_frame, &rx, 16) == 0 && rx.n == 1,
	      "a frame behind the damaged one was delivered");
	pair_close(&pr);
}

static void test_port(void)
{
	struct rx rx = { .n = 0 };
	struct pair pr;
	uint32_t max;
	char want[64];
	int rc;

	/* A flipped header byte (src_gen): the header checksum fails. */
	damaged(20, "header checksum mismatch");
	/* A flipped payload byte: the payload checksum fails. */
	damaged((uint32_t)sizeof(struct ipc_frame_hdr) + PAYLOAD / 2, "checksum mismatch");

	/* The largest frame goes through; one byte more is refused, both
	 * sizes named. */
	pair_open(&pr);
	max = ipc_port_max_payload(&pr.snd);
	CHECK_OK(send_id(&pr.snd, 5, max));
	CHECK(ipc_port_poll(&pr.rcv, on_frame, &rx, 16) == 1 && rx.n == 1 && rx.ids[0] == 5,
	      "the largest frame was not received");
	rc = send_id(&pr.snd, 6, max + 1);
	CHECK(rc == -EMSGSIZE, "oversized send returned %d", rc);
	snprintf(want, sizeof(want), "a %u-byte payload", max + 1);
	CHECK(strstr(shmrpc_errmsg(), want), "errmsg does not name %u: %s", max + 1, shmrpc_errmsg());
	snprintf(want, sizeof(want), "at most %u bytes", max);
	CHECK(strstr(shmrpc_errmsg(), want), "errmsg does not name %u: %s", max, shmrpc_errmsg());
	CHECK(ipc_port_poll(&pr.rcv, on_frame, &rx, 16) == 0, "refused frame arrived");
	pair_close(&pr);
}

static struct {
	struct ipc_frame_hdr h;
	uint8_t payload[32];
} rec;

/* A sealed frame from 0 to 1, flags as given before sealing. */
static void make_frame(uint16_t flags, bool payload_csum)
{
	memset(&rec, 0, sizeof(rec));
	rec.h = (struct ipc_frame_hdr){ .type = 3, .flags = flags, .payload_len = 32, .msg_id = 77,
					.src = 0, .dst = 1, .src_gen = 1 };
	for (int i = 0; i < 32; i++)
		rec.payload[i] = (uint8_t)i;
	ipc_frame_seal(&rec.h, rec.payload, payload_csum);
}

static void refused(uint32_t len, uint32_t src, uint32_t dst, const char *text)
{
	struct ipc_frame f;
	int rc = ipc_frame_decode((const uint8_t *)&rec, len, src, dst, &f);

	CHECK(rc == -SHMRPC_ECORRUPT, "decode accepted (%s)", text);
	CHECK(strstr(shmrpc_errmsg(), text), "errmsg \"%s\" lacks \"%s\"", shmrpc_errmsg(), text);
}

static void test_decode(void)
{
	struct ipc_frame f;

	make_frame(0, true);
	CHECK(ipc_frame_decode((const uint8_t *)&rec, sizeof(rec), 0, 1, &f) == 0, "good frame: %s",
	      shmrpc_errmsg());
	CHECK(f.hdr.msg_id == 77 && f.payload == rec.payload, "decoded wrongly");

	refused(sizeof(struct ipc_frame_hdr) - 1, 0, 1, "55 bytes, shorter than a header");
	refused(sizeof(rec) - 8, 0, 1, "32 payload bytes in a 80-byte record");
	refused(sizeof(rec), 2, 1, "header says 0 -> 1");
	refused(sizeof(rec), 0, 2, "header says 0 -> 1");

	make_frame(0x10, true);
	refused(sizeof(rec), 0, 1, "flags 0x10");

	make_frame(0, true);
	rec.payload[5] ^= 0x80;
	refused(sizeof(rec), 0, 1, "message id 77: checksum mismatch");

	/* Payload checksum off (the job's choice): the flag says so and a
	 * damaged payload goes through, the header is still checked. */
	make_frame(0, false);
	CHECK(rec.h.flags & IPC_FRAME_F_NO_PAYLOAD_CSUM, "flag not set by seal");
	rec.payload[5] ^= 0x80;
	CHECK(ipc_frame_decode((const uint8_t *)&rec, sizeof(rec), 0, 1, &f) == 0,
	      "frame without payload checksum refused: %s", shmrpc_errmsg());
	rec.h.msg_id++;
	refused(sizeof(rec), 0, 1, "header checksum mismatch");
}

int main(void)
{
	test_port();
	test_decode();
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
