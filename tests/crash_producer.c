/* A producer killed with SIGKILL at a random moment while it writes frames
 * as fast as it can: the consumer never sees a torn or corrupt frame (every
 * frame decodes, the sequence has no gap) and learns of the death through
 * ipc_port_take_dead. In every wait mode, on a fresh segment each round (a
 * killed producer may leave a reserved record that was never committed). */
#include <signal.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "ipc/port.h"
#include "tests/lib/stress.h"
#include "tests/lib/testlib.h"

#define ROUNDS 200
#define MAX_DELAY_US 5000
/* The issue asks for death notices within 100 ms; the test fails only past
 * 1 s so that a loaded machine does not make it flaky. A wait that missed
 * the death runs out its 1 s and fails it too. */
#define LATENCY_LIMIT_NS (1000ull * 1000000ull)
#define WAIT_NS LATENCY_LIMIT_NS

struct rx {
	uint64_t next;
};

static void on_frame(void *arg, const struct ipc_frame *f)
{
	struct rx *rx = arg;

	CHECK(f->hdr.src == 0 && f->hdr.msg_id == rx->next, "frame %llu from %u where %llu was due",
	      (unsigned long long)f->hdr.msg_id, f->hdr.src, (unsigned long long)rx->next);
	CHECK(tl_payload_ok(0, 1, f->hdr.msg_id, f->payload, f->hdr.payload_len),
	      "frame %llu: wrong payload (%u bytes)", (unsigned long long)f->hdr.msg_id,
	      f->hdr.payload_len);
	rx->next++;
}

/* Rank 0: sends until killed. It has nothing to poll, so it may block in
 * ipc_port_send. */
static int producer(struct shm_seg *seg, enum ipc_wait_mode mode)
{
	static uint8_t buf[TL_PAYLOAD_MAX];
	struct ipc_port port;

	CHECK_OK(ipc_port_open(&port, seg, 0, mode));
	for (uint64_t seq = 0;; seq++) {
		struct iovec iov = { buf, tl_payload(0, 1, seq, buf) };
		struct ipc_msg m = { .type = 1, .msg_id = seq, .iov = &iov, .iovcnt = 1 };

		CHECK_OK(ipc_port_send(&port, 1, &m, 0));
	}
}

/* Polls and waits until done(port, rx). */
static void consume_until(struct ipc_port *port, struct rx *rx,
			  bool (*done)(struct ipc_port *, struct rx *, void *), void *arg)
{
	struct tl_idle idle = { 0 };

	while (!done(port, rx, arg)) {
		if (ipc_port_poll(port, on_frame, rx, 64))
			tl_idle_busy(&idle, "consumer");
		else
			tl_idle_wait(&idle, port, WAIT_NS, "consumer");
	}
}

static bool got_frame(struct ipc_port *port, struct rx *rx, void *arg)
{
	(void)port, (void)arg;
	return rx->next > 0;
}

static bool past(struct ipc_port *port, struct rx *rx, void *deadline)
{
	(void)port, (void)rx;
	return shmrpc_now_ns() >= *(uint64_t *)deadline;
}

static bool got_death(struct ipc_port *port, struct rx *rx, void *arg)
{
	uint32_t peer;

	(void)rx, (void)arg;
	if (!ipc_port_take_dead(port, &peer))
		return false;
	CHECK(peer == 0, "death of rank %u reported", peer);
	return true;
}

/* One round; returns the death-notice latency in ns. */
static uint64_t round_trip(enum ipc_wait_mode mode, unsigned *seed, uint64_t *frames)
{
	struct shm_seg_params sp = { .world_size = 2 };
	struct rx rx = { 0 };
	struct ipc_port port;
	struct shm_seg seg;
	uint64_t deadline, killed, latency;
	int status;
	pid_t pid;

	CHECK_OK(shm_seg_create(&seg, &sp));
	pid = fork();
	CHECK(pid >= 0, "fork failed");
	if (pid == 0)
		_exit(producer(&seg, mode));
	CHECK_OK(ipc_port_open(&port, &seg, 1, mode));
	CHECK_OK(ipc_port_watch(&port, 0, pid));

	/* Once frames flow the producer is in its loop: kill it somewhere in
	 * the next few milliseconds while we keep draining. */
	consume_until(&port, &rx, got_frame, NULL);
	deadline = shmrpc_now_ns() + (uint64_t)(rand_r(seed) % MAX_DELAY_US) * 1000u;
	consume_until(&port, &rx, past, &deadline);
	killed = shmrpc_now_ns();
	CHECK(kill(pid, SIGKILL) == 0, "kill");
	consume_until(&port, &rx, got_death, NULL);
	latency = shmrpc_now_ns() - killed;

	/* What was committed arrives whole; nothing beyond the tail shows. */
	while (ipc_port_poll(&port, on_frame, &rx, 64))
		;
	CHECK(!port.in_broken[0] && atomic_load(&port.self->corrupt_frames) == 0,
	      "corrupt frames after the kill");
	CHECK(atomic_load(&port.in[0].ctl->tail) == port.in[0].pos,
	      "published bytes left unread: tail %llu, read up to %llu",
	      (unsigned long long)atomic_load(&port.in[0].ctl->tail),
	      (unsigned long long)port.in[0].pos);
	CHECK(!ipc_port_peer_alive(&port, 0), "dead producer still alive");
	CHECK(waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
	      "producer did not die of SIGKILL (status 0x%x)", status);
	ipc_port_close(&port);
	shm_seg_detach(&seg);
	*frames += rx.next;
	return latency;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

int main(void)
{
	int rounds = (int)(ROUNDS * tl_scale());
	uint64_t *lat = calloc((size_t)(rounds > 0 ? rounds : 1), sizeof(*lat));
	const char *modes[3];
	int n = tl_wait_modes(modes, 3);
	unsigned seed = 1;

	CHECK(lat && rounds > 0, "%d rounds", rounds);
	for (int i = 0; i < n; i++) {
		enum ipc_wait_mode mode = (enum ipc_wait_mode)ipc_wait_mode_parse(modes[i]);
		uint64_t frames = 0;

		for (int r = 0; r < rounds; r++)
			lat[r] = round_trip(mode, &seed, &frames);
		qsort(lat, (size_t)rounds, sizeof(*lat), cmp_u64);
		printf("mode %-5s: %d kills, %llu frames checked, death notice median %.3f ms, "
		       "max %.3f ms\n",
		       modes[i], rounds, (unsigned long long)frames, (double)lat[rounds / 2] / 1e6,
		       (double)lat[rounds - 1] / 1e6);
		fflush(stdout);
		CHECK(lat[rounds - 1] < LATENCY_LIMIT_NS, "mode %s: a death took %.3f ms to be noticed",
		      modes[i], (double)lat[rounds - 1] / 1e6);
	}
	free(lat);
	CHECK(tl_wait_children(), "a child failed");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
