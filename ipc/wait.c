/* Doorbell waits in the three modes; see wait.h and doorbell.h. */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "ipc/doorbell.h"
#include "ipc/wait.h"

/* io_uring's futex ops (kernel >= 6.7); Debian 12's liburing 2.3 predates them. */
#define OP_FUTEX_WAIT 51
#define FUTEX2_SIZE_U32 0x02

#define TAG_FUTEX 1ull
#define TAG_PROBE 2ull
#define TAG_PID (1ull << 32) /* | id */

/* A spin-mode waiter's nap when the job has more processes than this one
 * may run on: long enough to give the core away, short beside a call. */
#define CROWDED_NAP_NS 20000

/* True when world processes outnumber the CPUs this process may run on. */
static bool crowded(uint32_t world)
{
	cpu_set_t set;

	return sched_getaffinity(0, sizeof(set), &set) == 0 && world > (uint32_t)CPU_COUNT(&set);
}

static int warned_fallback;

const char *ipc_wait_mode_name(enum ipc_wait_mode m)
{
	switch (m) {
	case IPC_WAIT_URING:
		return "uring";
	case IPC_WAIT_FUTEX:
		return "futex";
	case IPC_WAIT_SPIN:
		return "spin";
	default:
		return "auto";
	}
}

int ipc_wait_mode_parse(const char *s)
{
	if (!s || !*s)
		return IPC_WAIT_AUTO;
	if (!strcmp(s, "uring"))
		return IPC_WAIT_URING;
	if (!strcmp(s, "futex"))
		return IPC_WAIT_FUTEX;
	if (!strcmp(s, "spin"))
		return IPC_WAIT_SPIN;
	return shmrpc__fail(-EINVAL, "SHMRPC_WAIT=%s: expected uring, futex or spin", s);
}

/* An SQE, flushing the queue first if it is full; NULL only if the kernel
 * refuses to take the queued ones. */
static struct io_uring_sqe *get_sqe(struct io_uring *ring)
{
	struct io_uring_sqe *sqe = io_uring_get_sqe(ring);

	if (!sqe && io_uring_submit(ring) >= 0)
		sqe = io_uring_get_sqe(ring);
	return sqe;
}

static void prep_futex_wait(struct io_uring_sqe *sqe, _Atomic uint32_t *word, uint32_t seq,
			    uint64_t tag)
{
	memset(sqe, 0, sizeof(*sqe));
	sqe->opcode = OP_FUTEX_WAIT;
	sqe->fd = FUTEX2_SIZE_U32; /* not FUTEX2_PRIVATE: the waker is another process */
	sqe->addr = (uint64_t)(uintptr_t)word;
	sqe->addr2 = seq;
	sqe->addr3 = 0xffffffffu;
	sqe->user_data = tag;
}

/* Sets up the ring and checks that it knows FUTEX_WAIT: a wait on a word
 * that does not hold the expected value answers -EAGAIN where the op
 * exists and -EINVAL where it does not. */
static int uring_setup(struct ipc_waiter *w)
{
	_Atomic uint32_t word = 0;
	struct io_uring_sqe *sqe;
	struct io_uring_cqe *cqe;
	unsigned entries = 8;
	int err, res;

	while (entries < w->max_ids + 4)
		entries <<= 1;
	err = io_uring_queue_init(entries, &w->ring, 0);
	if (err)
		return shmrpc__fail(err, "io_uring is unavailable (%s)", strerror(-err));
	sqe = io_uring_get_sqe(&w->ring);
	if (!sqe) {
		io_uring_queue_exit(&w->ring);
		return shmrpc__fail(-EIO, "io_uring has no free SQE");
	}
	prep_futex_wait(sqe, &word, 1, TAG_PROBE);
	err = io_uring_submit_and_wait(&w->ring, 1);
	if (err < 0 || io_uring_peek_cqe(&w->ring, &cqe)) {
		io_uring_queue_exit(&w->ring);
		return shmrpc__fail(err < 0 ? err : -EIO, "io_uring probe failed");
	}
	res = cqe->res;
	io_uring_cqe_seen(&w->ring, cqe);
	if (res != -EAGAIN) {
		io_uring_queue_exit(&w->ring);
		return shmrpc__fail(-EOPNOTSUPP,
				    "io_uring has no FUTEX_WAIT (probe answered %d: kernel older than "
				    "6.7?)", res);
	}
	w->ring_ok = true;
	return 0;
}

/* Records a death and wakes every thread of ours sleeping on the doorbell. */
static void note_death(struct ipc_waiter *w, uint32_t id)
{
	/* Release pairs with the acquire in ipc_waiter_take_dead. */
	atomic_fetch_or_explicit(&w->dead_bits[id / 64], 1ull << (id % 64), memory_order_release);
	ipc_doorbell_ring(w->self, NULL);
}

static void *watcher_main(void *arg)
{
	struct ipc_waiter *w = arg;
	struct pollfd *pfd = calloc(w->max_ids + 1, sizeof(*pfd));
	uint32_t *ids = calloc(w->max_ids + 1, sizeof(*ids));

	if (!pfd || !ids)
		abort(); /* a process that cannot learn of deaths must not go on */
	for (;;) {
		nfds_t n = 1;
		uint64_t v;

		pfd[0] = (struct pollfd){ .fd = w->watcher_efd, .events = POLLIN };
		pthread_mutex_lock(&w->lock);
		for (uint32_t id = 0; id < w->max_ids; id++) {
			if (w->pidfds[id] < 0)
				continue;
			pfd[n] = (struct pollfd){ .fd = w->pidfds[id], .events = POLLIN };
			ids[n++] = id;
		}
		pthread_mutex_unlock(&w->lock);
		if (poll(pfd, n, -1) < 0)
			continue;
		if (pfd[0].revents) {
			if (read(w->watcher_efd, &v, sizeof(v)) == sizeof(v) && v >= (1ull << 32))
				break; /* told to stop */
		}
		pthread_mutex_lock(&w->lock);
		for (nfds_t i = 1; i < n; i++) {
			if (!pfd[i].revents || w->pidfds[ids[i]] < 0)
				continue;
			close(w->pidfds[ids[i]]);
			w->pidfds[ids[i]] = -1;
			note_death(w, ids[i]);
		}
		pthread_mutex_unlock(&w->lock);
	}
	free(pfd);
	free(ids);
	return NULL;
}

static int watcher_start(struct ipc_waiter *w)
{
	int err;

	w->watcher_efd = eventfd(0, EFD_CLOEXEC);
	if (w->watcher_efd < 0)
		return shmrpc__fail(-errno, "eventfd: %s", strerror(errno));
	err = pthread_create(&w->watcher, NULL, watcher_main, w);
	if (err) {
		close(w->watcher_efd);
		return shmrpc__fail(-err, "cannot start the pidfd watcher thread: %s", strerror(err));
	}
	w->watcher_running = true;
	return 0;
}

int ipc_waiter_init(struct ipc_waiter *w, struct shm_worker *self, uint32_t max_ids,
		    enum ipc_wait_mode mode)
{
	const char *spin = getenv("SHMRPC_SPIN_NS");
	uint32_t words = (max_ids + 63) / 64;
	int err;

	memset(w, 0, sizeof(*w));
	w->self = self;
	w->max_ids = max_ids;
	w->watcher_efd = -1;
	w->fixed_spin_ns = spin && *spin ? atoi(spin) : -1;
	w->crowded = crowded(max_ids);
	w->pidfds = malloc(max_ids * sizeof(*w->pidfds));
	w->dead_bits = calloc(words, sizeof(*w->dead_bits));
	w->reported_bits = calloc(words, sizeof(*w->reported_bits));
	if (!w->pidfds || !w->dead_bits || !w->reported_bits) {
		err = -ENOMEM;
		goto fail;
	}
	for (uint32_t i = 0; i < max_ids; i++)
		w->pidfds[i] = -1;
	pthread_mutex_init(&w->lock, NULL);

	if (mode == IPC_WAIT_AUTO) {
		err = ipc_wait_mode_parse(getenv("SHMRPC_WAIT"));
		if (err < 0)
			goto fail_lock;
		mode = (enum ipc_wait_mode)err;
	}
	if (mode == IPC_WAIT_AUTO || mode == IPC_WAIT_URING) {
		err = uring_setup(w);
		if (err == 0) {
			w->mode = IPC_WAIT_URING;
			return 0;
		}
		shmrpc__warn_once(&warned_fallback, "%s: waiting with futex(2) and a pidfd watcher thread",
				  shmrpc_errmsg());
		mode = IPC_WAIT_FUTEX;
	}
	w->mode = mode;
	err = watcher_start(w);
	if (err == 0)
		return 0;
fail_lock:
	pthread_mutex_destroy(&w->lock);
fail:
	free(w->pidfds);
	free(w->dead_bits);
	free(w->reported_bits);
	return err == -ENOMEM ? shmrpc__fail(err, "out of memory setting up a waiter") : err;
}

void ipc_waiter_destroy(struct ipc_waiter *w)
{
	if (w->watcher_running) {
		uint64_t stop = 1ull << 32;

		if (write(w->watcher_efd, &stop, sizeof(stop)) == sizeof(stop))
			pthread_join(w->watcher, NULL);
		close(w->watcher_efd);
	}
	if (w->ring_ok)
		io_uring_queue_exit(&w->ring);
	for (uint32_t i = 0; i < w->max_ids; i++)
		if (w->pidfds[i] >= 0)
			close(w->pidfds[i]);
	pthread_mutex_destroy(&w->lock);
	free(w->pidfds);
	free(w->dead_bits);
	free(w->reported_bits);
	memset(w, 0, sizeof(*w));
}

int ipc_waiter_watch(struct ipc_waiter *w, uint32_t id, pid_t pid)
{
	int fd;

	if (id >= w->max_ids)
		return shmrpc__fail(-EINVAL, "watch id %u out of range (%u)", id, w->max_ids);
	fd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (fd < 0) {
		if (errno == ESRCH) { /* already gone: a death all the same */
			note_death(w, id);
			return 0;
		}
		return shmrpc__fail(-errno, "pidfd_open(%d): %s", (int)pid, strerror(errno));
	}
	pthread_mutex_lock(&w->lock);
	if (w->pidfds[id] >= 0)
		close(w->pidfds[id]);
	w->pidfds[id] = fd;
	pthread_mutex_unlock(&w->lock);
	if (w->mode == IPC_WAIT_URING) {
		struct io_uring_sqe *sqe = get_sqe(&w->ring);

		if (!sqe)
			return shmrpc__fail(-EBUSY, "io_uring refused a pidfd poll");
		io_uring_prep_poll_add(sqe, fd, POLLIN);
		sqe->user_data = TAG_PID | id;
		io_uring_submit(&w->ring);
	} else {
		uint64_t one = 1;

		if (write(w->watcher_efd, &one, sizeof(one)) != sizeof(one))
			return shmrpc__fail(-errno, "cannot reach the watcher thread");
	}
	return 0;
}

bool ipc_waiter_is_dead(struct ipc_waiter *w, uint32_t id)
{
	/* Acquire pairs with note_death's release. */
	return id < w->max_ids &&
	       (atomic_load_explicit(&w->dead_bits[id / 64], memory_order_acquire) >> (id % 64)) & 1;
}

bool ipc_waiter_has_news(struct ipc_waiter *w)
{
	for (uint32_t i = 0; i < (w->max_ids + 63) / 64; i++)
		/* Acquire pairs with note_death's release. */
		if (atomic_load_explicit(&w->dead_bits[i], memory_order_acquire) & ~w->reported_bits[i])
			return true;
	return false;
}

bool ipc_waiter_take_dead(struct ipc_waiter *w, uint32_t *id)
{
	for (uint32_t i = 0; i < (w->max_ids + 63) / 64; i++) {
		/* Acquire pairs with note_death's release. */
		uint64_t fresh = atomic_load_explicit(&w->dead_bits[i], memory_order_acquire) &
				 ~w->reported_bits[i];

		if (fresh) {
			uint32_t bit = (uint32_t)__builtin_ctzll(fresh);

			w->reported_bits[i] |= 1ull << bit;
			*id = i * 64 + bit;
			return true;
		}
	}
	return false;
}

/* Spins until the doorbell moves, ready(arg), or budget_ns passes; true
 * unless the budget ran out. A yielding spin on a crowded machine naps
 * instead: sched_yield keeps a spinner runnable, so eight spinners on two
 * cores take most of the time their busy peers need to make progress. */
static bool spin_for(struct ipc_waiter *w, uint32_t seq, uint64_t budget_ns, bool yield,
		     bool (*ready)(void *), void *arg)
{
	static const struct timespec nap = { 0, CROWDED_NAP_NS };
	uint64_t start = shmrpc_now_ns();

	for (uint32_t i = 1;; i++) {
		if (ipc_doorbell_seq(w->self) != seq || ready(arg))
			return true;
		shmrpc_cpu_relax();
		if ((i & 63) == 0) {
			if (shmrpc_now_ns() - start >= budget_ns)
				return false;
			if (yield && w->crowded)
				nanosleep(&nap, NULL);
			else if (yield)
				sched_yield();
		}
	}
}

/* Handles every completion already in the queue; returns how many. */
static unsigned uring_reap(struct ipc_waiter *w)
{
	struct io_uring_cqe *cqe;
	unsigned head, seen = 0;

	io_uring_for_each_cqe(&w->ring, head, cqe) {
		seen++;
		if (cqe->user_data == TAG_FUTEX)
			w->futex_armed = false;
		else if (cqe->user_data & TAG_PID)
			note_death(w, (uint32_t)(cqe->user_data & 0xffffffffu));
	}
	io_uring_cq_advance(&w->ring, seen);
	return seen;
}

void ipc_waiter_poll(struct ipc_waiter *w)
{
	if (w->mode == IPC_WAIT_URING && io_uring_cq_ready(&w->ring))
		uring_reap(w);
}

static int uring_wait(struct ipc_waiter *w, uint32_t seq, uint64_t timeout_ns)
{
	struct __kernel_timespec ts;
	struct io_uring_cqe *cqe;
	int err;

	if (!w->futex_armed) {
		struct io_uring_sqe *sqe = get_sqe(&w->ring);

		if (!sqe) /* cannot arm: a plain futex wait does the job */
			return ipc_futex_wait(&w->self->doorbell, seq, timeout_ns);
		prep_futex_wait(sqe, &w->self->doorbell, seq, TAG_FUTEX);
		w->futex_armed = true;
	}
	ts.tv_sec = (long long)(timeout_ns / 1000000000u);
	ts.tv_nsec = (long long)(timeout_ns % 1000000000u);
	err = io_uring_submit_and_wait_timeout(&w->ring, &cqe, 1, timeout_ns ? &ts : NULL, NULL);
	if (uring_reap(w) == 0 && err == -ETIME)
		return -ETIMEDOUT;
	return 0;
}

int ipc_waiter_sleep(struct ipc_waiter *w, uint32_t seq, uint64_t timeout_ns,
		     bool (*ready)(void *arg), void *arg)
{
	uint64_t limit = timeout_ns ? timeout_ns : UINT64_MAX, budget;
	bool adaptive = w->fixed_spin_ns < 0, came;
	int err;

	if (w->mode == IPC_WAIT_SPIN)
		return spin_for(w, seq, limit, true, ready, arg) ? 0 : -ETIMEDOUT;

	budget = adaptive ? shmrpc_spin_budget_ns(&w->spin, limit)
			  : (uint64_t)w->fixed_spin_ns < limit ? (uint64_t)w->fixed_spin_ns : limit;
	came = budget && spin_for(w, seq, budget, false, ready, arg);
	if (adaptive)
		shmrpc_spin_budget_update(&w->spin, came);
	if (came)
		return 0;
	if (timeout_ns) {
		if (timeout_ns <= budget)
			return -ETIMEDOUT;
		timeout_ns -= budget;
	}

	/* seq_cst RMW, then a full fence before looking at the rings again:
	 * pairs with the waker's fence between publishing and reading
	 * `sleepers` (doorbell.h). Either it sees us and rings, or we see its
	 * frame. */
	atomic_fetch_add_explicit(&w->self->sleepers, 1, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
	/* Re-check after announcing ourselves: a futex wait armed in an earlier
	 * round compares against an older value, not against seq. */
	if (atomic_load_explicit(&w->self->doorbell, memory_order_seq_cst) != seq || ready(arg))
		err = 0;
	else if (w->mode == IPC_WAIT_URING)
		err = uring_wait(w, seq, timeout_ns);
	else
		err = ipc_futex_wait(&w->self->doorbell, seq, timeout_ns);
	atomic_fetch_sub_explicit(&w->self->sleepers, 1, memory_order_seq_cst);
	return err == -ETIMEDOUT ? err : 0;
}
