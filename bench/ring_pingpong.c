/*
 * bench/ring_pingpong: what the transport costs, beside the raw floor
 * measured in the same run (figures move by 10x between runs on shared
 * VMs; only ratios within one run mean anything). Two forked processes:
 *   BENCH floor mode=spin|futex|uring|pipe median_ns= p99_ns=
 *       a round trip on one bare shared word: busy spin, FUTEX_WAIT,
 *       io_uring FUTEX_WAIT (woken by FUTEX_WAKE), and a pipe pair;
 *   BENCH ring_rtt mode=uring|futex|spin median_ns= p99_ns= vs_floor=
 *       an empty frame there and back through the job segment's rings,
 *       doorbells and waiters (ipc_port_*), over the floor of its mode;
 *   BENCH ring_stream size=S mode=uring payload_csum=on|off frames_per_s= MB_per_s=|GB_per_s=
 *       one-way frames as fast as the producer can send them.
 * -q: fewer iterations (the demo).
 */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "ipc/doorbell.h"
#include "ipc/port.h"

/* io_uring's futex op (kernel >= 6.7), filled by hand: liburing 2.3 has no helper. */
#define OP_FUTEX_WAIT 51
#define FUTEX2_SIZE_U32 0x02

/* A hung peer ends the run instead of the bench hanging for ever. */
#define WATCHDOG_S 300
#define WAIT_NS (100u * 1000u * 1000u)

enum floor_mode { FLOOR_SPIN, FLOOR_FUTEX, FLOOR_URING, FLOOR_PIPE, FLOOR_MODES };
static const char *const floor_names[FLOOR_MODES] = { "spin", "futex", "uring", "pipe" };

/* Frame types between the measuring parent (rank 0) and the child (rank 1). */
enum { T_PING = 1, T_PONG, T_DATA, T_STOP };

/* err: a negative errno or SHMRPC code; the library's own message follows
 * when it left one. */
static void die(const char *what, int err)
{
	fprintf(stderr, "bench/ring_pingpong: %s: %s%s%s\n", what, shmrpc_strerror(err),
		*shmrpc_errmsg() ? ": " : "", shmrpc_errmsg());
	exit(1);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Sorts t and prints its median and p99 after head; returns the median. */
static uint64_t print_rtt(const char *head, uint64_t *t, int n)
{
	uint64_t med;

	qsort(t, (size_t)n, sizeof(*t), cmp_u64);
	med = t[n / 2];
	printf("%s median_ns=%llu p99_ns=%llu n=%d", head, (unsigned long long)med,
	       (unsigned long long)t[(size_t)n * 99 / 100], n);
	return med;
}

/* Forks a child that dies with us (so no spinner outlives a failed run). */
static pid_t fork_child(void)
{
	pid_t parent = getpid(), pid;

	fflush(NULL);
	pid = fork();
	if (pid < 0)
		die("fork", -errno);
	if (pid == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) || getppid() != parent))
		_exit(1);
	return pid;
}

static void reap(pid_t pid, const char *what)
{
	int status;

	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR)
			die("waitpid", -errno);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "bench/ring_pingpong: the %s child failed (status 0x%x)\n", what,
			status);
		exit(1);
	}
}

/* --- the floor: one shared word, no library ------------------------------ */

struct floor {
	enum floor_mode mode;
	_Atomic uint32_t *word;
	int rfd, wfd;          /* pipe mode: our read end and write end */
	struct io_uring ring;  /* uring mode, set up after the fork */
};

/* A FUTEX_WAIT through io_uring on word while it holds val: the CQE's res
 * (0 after a wake, -EAGAIN if the word had already changed). */
static int uring_futex_wait(struct io_uring *ring, _Atomic uint32_t *word, uint32_t val)
{
	struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
	struct io_uring_cqe *cqe;
	int err, res;

	if (!sqe) /* one wait at a time: the queue is never full */
		return -EBUSY;
	memset(sqe, 0, sizeof(*sqe));
	sqe->opcode = OP_FUTEX_WAIT;
	sqe->fd = FUTEX2_SIZE_U32; /* not FUTEX2_PRIVATE: the waker is the other process */
	sqe->addr = (uint64_t)(uintptr_t)word;
	sqe->addr2 = val;
	sqe->addr3 = 0xffffffffu;
	err = io_uring_submit_and_wait(ring, 1);
	if (err < 0)
		return err;
	err = io_uring_wait_cqe(ring, &cqe);
	if (err)
		return err;
	res = cqe->res;
	io_uring_cqe_seen(ring, cqe);
	return res;
}

/* Sets up a ring that knows FUTEX_WAIT: a wait on a word that does not hold
 * the expected value answers -EAGAIN where the op exists, -EINVAL where not. */
static bool uring_open(struct io_uring *ring)
{
	_Atomic uint32_t word = 0;

	if (io_uring_queue_init(4, ring, 0))
		return false;
	if (uring_futex_wait(ring, &word, 1) == -EAGAIN)
		return true;
	io_uring_queue_exit(ring);
	return false;
}

static void floor_post(struct floor *f, uint32_t v)
{
	char c = 0;

	if (f->mode == FLOOR_PIPE) {
		if (write(f->wfd, &c, 1) != 1)
			die("pipe write", -errno);
		return;
	}
	/* Release: the waiter's acquire load sees the value. */
	atomic_store_explicit(f->word, v, memory_order_release);
	if (f->mode != FLOOR_SPIN)
		ipc_futex_wake(f->word, 1); /* its one waiter */
}

static void floor_wait(struct floor *f, uint32_t want)
{
	uint32_t cur;
	char c;

	if (f->mode == FLOOR_PIPE) {
		if (read(f->rfd, &c, 1) != 1)
			die("pipe read", -EIO);
		return;
	}
	while ((cur = atomic_load_explicit(f->word, memory_order_acquire)) != want) {
		if (f->mode == FLOOR_SPIN)
			shmrpc_cpu_relax();
		else if (f->mode == FLOOR_FUTEX)
			ipc_futex_wait(f->word, cur, 0);
		else
			uring_futex_wait(&f->ring, f->word, cur);
	}
}

/* Round trips of one floor mode: the parent posts odd values and times
 * until the child answers with the next even one. */
static uint64_t floor_run(enum floor_mode mode, _Atomic uint32_t *word, int warm, int n,
			  uint64_t *t)
{
	struct floor f = { .mode = mode, .word = word, .rfd = -1, .wfd = -1 };
	int to_child[2] = { -1, -1 }, to_parent[2] = { -1, -1 };
	char head[64];
	uint64_t med;
	pid_t pid;

	atomic_store(word, 0);
	if (mode == FLOOR_PIPE && (pipe(to_child) || pipe(to_parent)))
		die("pipe", -errno);
	pid = fork_child();
	if (pid == 0) {
		if (mode == FLOOR_PIPE) {
			close(to_child[1]);
			close(to_parent[0]);
			f.rfd = to_child[0];
			f.wfd = to_parent[1];
		}
		if (mode == FLOOR_URING && !uring_open(&f.ring))
			_exit(1);
		for (int i = 0; i < warm + n; i++) {
			floor_wait(&f, 2u * (uint32_t)i + 1);
			floor_post(&f, 2u * (uint32_t)i + 2);
		}
		_exit(0);
	}
	if (mode == FLOOR_PIPE) {
		close(to_child[0]);
		close(to_parent[1]);
		f.rfd = to_parent[0];
		f.wfd = to_child[1];
	}
	if (mode == FLOOR_URING && !uring_open(&f.ring))
		die("io_uring", -EOPNOTSUPP);
	for (int i = 0; i < warm + n; i++) {
		uint64_t t0 = shmrpc_now_ns();

		floor_post(&f, 2u * (uint32_t)i + 1);
		floor_wait(&f, 2u * (uint32_t)i + 2);
		if (i >= warm)
			t[i - warm] = shmrpc_now_ns() - t0;
	}
	reap(pid, floor_names[mode]);
	if (mode == FLOOR_PIPE) {
		close(f.rfd);
		close(f.wfd);
	}
	if (mode == FLOOR_URING)
		io_uring_queue_exit(&f.ring);
	snprintf(head, sizeof(head), "BENCH floor mode=%s", floor_names[mode]);
	med = print_rtt(head, t, n);
	printf("\n");
	return med;
}

/* --- the real thing: frames through the job segment ---------------------- */

struct rx {
	uint64_t frames;
	uint64_t pings;
	bool stop;
};

static void on_frame(void *arg, const struct ipc_frame *f)
{
	struct rx *rx = arg;

	rx->frames++;
	if (f->hdr.type == T_PING)
		rx->pings++;
	else if (f->hdr.type == T_STOP)
		rx->stop = true;
}

/* Takes what has arrived, or sleeps as a loop thread does. */
static void pump(struct ipc_port *p, struct rx *rx)
{
	if (ipc_port_poll(p, on_frame, rx, 64))
		return;
	if (!ipc_port_peer_alive(p, 1 - p->rank))
		die("the peer died", -SHMRPC_EPEERDEAD);
	ipc_port_wait(p, WAIT_NS);
}

static void await_frames(struct ipc_port *p, struct rx *rx, uint64_t want)
{
	while (rx->frames < want)
		pump(p, rx);
}

/* Sends as a loop thread must: never blocking in the send itself. */
static void send_frame(struct ipc_port *p, uint16_t type, const void *buf, uint32_t len)
{
	struct iovec iov = { (void *)buf, len };
	struct ipc_msg m = { .type = type, .iov = &iov, .iovcnt = len ? 1 : 0 };
	uint32_t dst = 1 - p->rank;
	int rc;

	while ((rc = ipc_port_try_send(p, dst, &m)) == -EAGAIN)
		if (!ipc_port_want_space(p, dst, len))
			ipc_port_wait(p, WAIT_NS);
	if (rc)
		die("send", rc);
}

/* Opens our port once the peer's is open too, and watches the peer. */
static void port_open(struct ipc_port *p, struct shm_seg *seg, uint32_t rank,
		      enum ipc_wait_mode mode)
{
	uint32_t peer = 1 - rank, pid;
	int err = ipc_port_open(p, seg, rank, mode);

	if (err)
		die("ipc_port_open", err);
	/* Acquire pairs with the peer's release of its pid in ipc_port_open. */
	while ((pid = atomic_load_explicit(&shm_worker(seg, peer)->pid, memory_order_acquire)) == 0)
		usleep(100);
	err = ipc_port_watch(p, peer, (pid_t)pid);
	if (err)
		die("ipc_port_watch", err);
}

/* Rank 1: answers every ping with a pong until told to stop. */
static int serve(struct shm_seg *seg, enum ipc_wait_mode mode)
{
	struct ipc_port port;
	struct rx rx = { 0 };
	uint64_t answered = 0;

	port_open(&port, seg, 1, mode);
	while (!rx.stop) {
		pump(&port, &rx);
		for (; answered < rx.pings; answered++)
			send_frame(&port, T_PONG, NULL, 0);
	}
	ipc_port_close(&port);
	return 0;
}

/* A job segment and the two processes using it: we are rank 0, the
 * child serving pings is rank 1. */
struct job {
	struct shm_seg seg;
	struct ipc_port port;
	struct rx rx;
	pid_t pid;
};

static void job_start(struct job *j, enum ipc_wait_mode mode, uint32_t flags)
{
	/* A 64 KiB frame needs a ring of more than 128 KiB (a record is at most
	 * half a ring); 1 MiB lets the producer run ahead by 15 of them. */
	struct shm_seg_params sp = { .world_size = 2, .ring_size = 1u << 20, .flags = flags };
	int err;

	memset(j, 0, sizeof(*j));
	err = shm_seg_create(&j->seg, &sp);
	if (err)
		die("shm_seg_create", err);
	j->pid = fork_child();
	if (j->pid == 0)
		_exit(serve(&j->seg, mode));
	port_open(&j->port, &j->seg, 0, mode);
}

static void job_stop(struct job *j)
{
	send_frame(&j->port, T_STOP, NULL, 0);
	reap(j->pid, ipc_wait_mode_name(j->port.waiter.mode));
	ipc_port_close(&j->port);
	shm_seg_detach(&j->seg);
}

/* Round trips of an empty frame in one wait mode, over the same mode's
 * floor (the only fair ratio; 0: no floor measured). */
static void ring_rtt(enum ipc_wait_mode mode, uint64_t floor_med, int warm, int n, uint64_t *t)
{
	struct job j;
	char head[64];
	uint64_t med;

	job_start(&j, mode, 0);
	if (j.port.waiter.mode != mode) {
		fprintf(stderr, "bench/ring_pingpong: no %s wait here; ring_rtt mode=%s skipped\n",
			ipc_wait_mode_name(mode), ipc_wait_mode_name(mode));
		job_stop(&j);
		return;
	}
	for (int i = 0; i < warm + n; i++) {
		uint64_t t0 = shmrpc_now_ns();

		send_frame(&j.port, T_PING, NULL, 0);
		await_frames(&j.port, &j.rx, j.rx.frames + 1);
		if (i >= warm)
			t[i - warm] = shmrpc_now_ns() - t0;
	}
	job_stop(&j);
	snprintf(head, sizeof(head), "BENCH ring_rtt mode=%s", ipc_wait_mode_name(mode));
	med = print_rtt(head, t, n);
	if (floor_med)
		printf(" vs_floor=%.2f", (double)med / (double)floor_med);
	printf("\n");
}

/* n frames of size bytes one way, then a ping whose pong says all arrived. */
static void ring_stream(struct job *j, uint32_t size, int n)
{
	void *buf = malloc(size);
	uint64_t t0, ns;
	double per_s;

	if (!buf)
		die("malloc", -ENOMEM);
	memset(buf, 0x5a, size);
	t0 = shmrpc_now_ns();
	for (int i = 0; i < n; i++)
		send_frame(&j->port, T_DATA, buf, size);
	send_frame(&j->port, T_PING, NULL, 0);
	await_frames(&j->port, &j->rx, j->rx.frames + 1);
	ns = shmrpc_now_ns() - t0;
	per_s = (double)n * 1e9 / (double)ns;
	printf("BENCH ring_stream size=%u mode=%s payload_csum=%s frames_per_s=%.0f ", size,
	       ipc_wait_mode_name(j->port.waiter.mode), j->port.payload_csum ? "on" : "off", per_s);
	if (size >= 4096)
		printf("GB_per_s=%.2f", per_s * size / 1e9);
	else
		printf("MB_per_s=%.0f", per_s * size / 1e6);
	printf(" n=%d\n", n);
	free(buf);
}

int main(int argc, char **argv)
{
	bool quick = argc > 1 && strcmp(argv[1], "-q") == 0;
	/* Syscall floors are 10-100x slower than spinning: fewer of them. */
	int n_spin = quick ? 10000 : 200000, n_sys = quick ? 2000 : 50000, n_ring = n_spin;
	/* By ipc_wait_mode: the floor each ring mode is compared with. */
	uint64_t floor_med[IPC_WAIT_SPIN + 1] = { 0 };
	_Atomic uint32_t *word;
	struct io_uring probe;
	struct job j;
	uint64_t *t;

	setvbuf(stdout, NULL, _IOLBF, 0);
	alarm(WATCHDOG_S);
	t = malloc((size_t)n_spin * sizeof(*t));
	word = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (!t || word == MAP_FAILED)
		die("out of memory", -ENOMEM);

	floor_med[IPC_WAIT_SPIN] = floor_run(FLOOR_SPIN, word, n_spin / 10, n_spin, t);
	floor_med[IPC_WAIT_FUTEX] = floor_run(FLOOR_FUTEX, word, n_sys / 10, n_sys, t);
	if (uring_open(&probe)) {
		io_uring_queue_exit(&probe);
		floor_med[IPC_WAIT_URING] = floor_run(FLOOR_URING, word, n_sys / 10, n_sys, t);
	} else {
		fprintf(stderr, "bench/ring_pingpong: io_uring has no FUTEX_WAIT here; "
				"floor mode=uring skipped\n");
	}
	floor_run(FLOOR_PIPE, word, n_sys / 10, n_sys, t);

	for (int m = IPC_WAIT_URING; m <= IPC_WAIT_SPIN; m++)
		ring_rtt((enum ipc_wait_mode)m, floor_med[m], n_ring / 10, n_ring, t);

	/* Streams in the default mode; the receiver's checksum pass reads every
	 * byte. Then the same without payload checksums (shmrun
	 * --no-payload-checksum; headers are always checked). */
	for (int csum_off = 0; csum_off <= 1; csum_off++) {
		job_start(&j, IPC_WAIT_URING, csum_off ? SHM_F_NO_PAYLOAD_CSUM : 0);
		ring_stream(&j, 64, quick ? 200000 : 5000000);
		ring_stream(&j, 64u << 10, quick ? 2000 : 40000);
		job_stop(&j);
	}

	munmap(word, 4096);
	free(t);
	return 0;
}
