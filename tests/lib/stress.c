#include <errno.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "ipc/port.h"
#include "tests/lib/stress.h"
#include "tests/lib/testlib.h"

#define STRESS_TYPE 1
#define STRESS_WAIT_NS (5ull * 1000000000ull)
#define IDLE_LIMIT_NS (10ull * 1000000000ull)
#define STRESS_SEND_BURST 32
#define STRESS_POLL_MAX 256

static uint64_t mix(uint64_t x)
{
	/* splitmix64's finaliser: every input bit moves every output bit. */
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

uint32_t tl_payload(uint32_t src, uint32_t dst, uint64_t seq, uint8_t *buf)
{
	uint64_t key = mix(seq ^ mix(((uint64_t)src << 32) | dst));
	uint32_t len = (uint32_t)(key % (TL_PAYLOAD_MAX + 1));

	/* Word by word: generating the bytes must stay cheap beside the
	 * transport it checks. */
	for (uint32_t i = 0; i < len; i += 8) {
		uint64_t w = key + (i + 1) * 0x9e3779b97f4a7c15ull;

		w ^= w >> 31;
		memcpy(buf + i, &w, len - i < 8 ? len - i : 8);
	}
	return len;
}

bool tl_payload_ok(uint32_t src, uint32_t dst, uint64_t seq, const uint8_t *p, uint32_t len)
{
	uint8_t want[TL_PAYLOAD_MAX];

	return tl_payload(src, dst, seq, want) == len && memcmp(want, p, len) == 0;
}

void tl_idle_wait(struct tl_idle *s, struct ipc_port *p, uint64_t wait_ns, const char *who)
{
	uint64_t now = shmrpc_now_ns();

	if (!s->since)
		s->since = now;
	CHECK(now - s->since < IDLE_LIMIT_NS, "%s: no progress for 10 s: a hang", who);
	/* By the clock too: the uring wait may reap a stale completion and
	 * return 0 when its time ran out. */
	s->timed_out = ipc_port_wait(p, wait_ns) == -ETIMEDOUT || shmrpc_now_ns() - now >= wait_ns;
}

void tl_idle_busy(struct tl_idle *s, const char *who)
{
	CHECK(!s->timed_out, "%s: a wait ran out its time although work came: a lost wake-up", who);
	s->since = 0;
}

/* The next frame towards one peer, kept across EAGAINs. */
struct stress_tx {
	uint64_t seq;
	uint32_t len;
	uint8_t buf[TL_PAYLOAD_MAX];
};

struct stress_rx {
	uint32_t rank;
	uint64_t *next; /* by source: the sequence number expected next */
	uint64_t got;
};

static void stress_on_frame(void *arg, const struct ipc_frame *f)
{
	struct stress_rx *rx = arg;
	uint32_t src = f->hdr.src;
	uint64_t want = rx->next[src];
	uint64_t id = f->hdr.msg_id;

	CHECK(f->hdr.type == STRESS_TYPE, "worker %u: frame of type %u from %u", rx->rank,
	      f->hdr.type, src);
	CHECK(id == want, "worker %u: frame %llu from %u where %llu was due: %s", rx->rank,
	      (unsigned long long)id, src, (unsigned long long)want,
	      id > want ? "frames lost" : "frame duplicated or reordered");
	CHECK(tl_payload_ok(src, rx->rank, id, f->payload, f->hdr.payload_len),
	      "worker %u: frame %llu from %u: wrong payload (%u bytes)", rx->rank,
	      (unsigned long long)id, src, f->hdr.payload_len);
	rx->next[src]++;
	rx->got++;
}

/* Sends what fits towards peer now, at most a burst; returns how many. */
static int send_burst(struct ipc_port *port, uint32_t peer, struct stress_tx *tx, uint64_t frames)
{
	int n = 0;

	while (n < STRESS_SEND_BURST && tx->seq < frames) {
		struct iovec iov = { tx->buf, tx->len };
		struct ipc_msg m = { .type = STRESS_TYPE, .msg_id = tx->seq, .iov = &iov, .iovcnt = 1 };
		int rc = ipc_port_try_send(port, peer, &m);

		if (rc == -EAGAIN)
			break;
		CHECK(rc == 0, "worker %u: send to %u: %d (%s)", port->rank, peer, rc, shmrpc_errmsg());
		tx->len = tl_payload(port->rank, peer, ++tx->seq, tx->buf);
		n++;
	}
	return n;
}

/* The loop-thread rule of port.h: never block in a send; poll, ask for
 * space, and sleep in ipc_port_wait, so that two workers with full rings
 * towards each other both keep draining. */
static int stress_worker(struct shm_seg *seg, uint32_t rank, uint64_t frames,
			 enum ipc_wait_mode mode)
{
	uint32_t world = seg->world;
	uint64_t total = frames * (world - 1), sent = 0;
	struct stress_tx *tx = calloc(world, sizeof(*tx));
	struct stress_rx rx = { .rank = rank, .next = calloc(world, sizeof(*rx.next)) };
	struct tl_idle idle = { 0 };
	struct ipc_port port;
	char who[64];

	CHECK(tx && rx.next, "out of memory");
	CHECK_OK(ipc_port_open(&port, seg, rank, mode));
	snprintf(who, sizeof(who), "worker %u of %u (%s)", rank, world, ipc_wait_mode_name(mode));
	for (uint32_t peer = 0; peer < world; peer++)
		tx[peer].len = tl_payload(rank, peer, 0, tx[peer].buf);
	while (sent < total || rx.got < total) {
		bool space = false;
		int progress = 0;

		for (uint32_t i = 1; i < world; i++) {
			uint32_t peer = (rank + i) % world;
			int n = send_burst(&port, peer, &tx[peer], frames);

			sent += (uint64_t)n;
			progress += n;
		}
		progress += ipc_port_poll(&port, stress_on_frame, &rx, STRESS_POLL_MAX);
		if (progress) {
			tl_idle_busy(&idle, who);
			continue;
		}
		/* Every blocked peer must get the flag, so no short cut. */
		for (uint32_t peer = 0; peer < world; peer++)
			if (peer != rank && tx[peer].seq < frames)
				space |= ipc_port_want_space(&port, peer, tx[peer].len);
		if (!space)
			tl_idle_wait(&idle, &port, STRESS_WAIT_NS, who);
	}
	ipc_port_close(&port);
	free(tx);
	free(rx.next);
	return 0;
}

double tl_stress_all_to_all(uint32_t world, uint64_t frames, const char *mode)
{
	int m = ipc_wait_mode_parse(mode);
	struct shm_seg_params sp = { .world_size = world };
	uint64_t t0, total = frames * (world - 1);
	struct shm_seg seg;
	double secs;

	CHECK(m > 0, "wait mode %s: %s", mode, shmrpc_errmsg());
	CHECK_OK(shm_seg_create(&seg, &sp));
	t0 = shmrpc_now_ns();
	for (uint32_t r = 0; r < world; r++) {
		pid_t pid = fork();

		CHECK(pid >= 0, "fork failed");
		if (pid == 0)
			_exit(stress_worker(&seg, r, frames, (enum ipc_wait_mode)m));
	}
	CHECK(tl_wait_children(), "%u processes, mode %s: a worker failed", world, mode);
	secs = (double)(shmrpc_now_ns() - t0) / 1e9;
	/* The workers' own counters must agree with what they checked. */
	for (uint32_t r = 0; r < world; r++) {
		struct shm_worker *w = shm_worker(&seg, r);

		CHECK(atomic_load(&w->frames_sent) == total && atomic_load(&w->frames_recv) == total &&
			      atomic_load(&w->corrupt_frames) == 0,
		      "worker %u counters: sent %llu, received %llu, corrupt %llu; expected %llu", r,
		      (unsigned long long)atomic_load(&w->frames_sent),
		      (unsigned long long)atomic_load(&w->frames_recv),
		      (unsigned long long)atomic_load(&w->corrupt_frames), (unsigned long long)total);
	}
	shm_seg_detach(&seg);
	printf("%u processes, mode %-5s: %llu frames per ordered pair, %.2f s, %.2f M frames/s\n",
	       world, mode, (unsigned long long)frames, secs,
	       (double)total * world / secs / 1e6);
	fflush(stdout);
	return secs;
}
