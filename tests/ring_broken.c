/*
 * A ring whose shared state is made impossible (its tail pushed past what
 * the ring can hold, as a stray write into the job's memory would), or
 * which holds a frame that fails its checks (a record of garbage), is no
 * longer read, and that does not leave anyone waiting: rank 0's call to
 * rank 1, whose reply would come on that ring, fails naming the ring and
 * the worker; a new call to rank 1 fails at once with the same words;
 * rank 1, told through the ring's abandoned mark, fails its calls to rank
 * 0 at once too, naming the link: the two are cut off from each other,
 * and only they: rank 2 calls both all along (a load running through the
 * corruption, every call answered right). The launcher names the worker
 * that received the corrupt frame and the job exits 1, not 0.
 */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "ipc/doorbell.h"
#include "ipc/ring.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define BROKEN_TEXT "the ring from worker 1 (worker1) is corrupt and is no longer read"
#define ABANDONED_TEXT "worker 0 (worker0) found the ring from this worker corrupt"

static atomic_bool stop_load;

static int fn_stop(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	/* Relaxed: the flag alone; rank 2's loop reads it. */
	atomic_store_explicit(&stop_load, true, memory_order_relaxed);
	*r = shmrpc_int(1);
	return 0;
}

/* Rank 2's load: calls to both workers of the link until told to stop. */
static void load(void)
{
	long calls = 0;

	while (!atomic_load_explicit(&stop_load, memory_order_relaxed)) {
		for (int dst = 0; dst < 2; dst++) {
			shmrpc_future *f;
			int rc = shmrpc_rpc_sync(dst, "ping", NULL, 0, 20000, &f);

			CHECK(rc == 0 && shmrpc_future_value(f)->u.i == dst,
			      "rank 2's load call %ld to rank %d: %d %s", calls, dst, rc,
			      shmrpc_errmsg());
			shmrpc_future_free(f);
			calls++;
		}
	}
	fprintf(stderr, "rank 2's load: %ld calls, all answered\n", calls);
}

static int fn_ping(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(shmrpc_rank());
	return 0;
}

/* On rank 2, after the break: both workers of the cut link answer it. */
static int fn_others(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	for (int dst = 0; dst < 2; dst++) {
		shmrpc_future *f;
		int rc = shmrpc_rpc_sync(dst, "ping", NULL, 0, 20000, &f);

		CHECK(rc == 0 && shmrpc_future_value(f)->u.i == dst,
		      "rank 2's call to rank %d after the break: %d %s", dst, rc, shmrpc_errmsg());
		shmrpc_future_free(f);
	}
	fprintf(stderr, "rank 2 reached both\n");
	*r = shmrpc_int(1);
	return 0;
}

/* The tail pushed past what the ring can hold: its control words are
 * impossible. Release, as a producer publishes: the consumer must see it. */
static void break_control(const struct shm_seg *seg)
{
	struct shm_ring_ctl *ctl = shm_ring(seg, 1, 0);

	atomic_store_explicit(&ctl->tail,
			      atomic_load_explicit(&ctl->head, memory_order_relaxed) +
				      4ull * seg->ring_size,
			      memory_order_release);
}

/* A record of garbage committed as a producer would: the ring is sound,
 * the frame in it fails its checks. */
static void break_data(const struct shm_seg *seg)
{
	struct ipc_ring r;
	uint8_t *rec;

	ipc_ring_open(&r, seg, 1, 0, true);
	rec = ipc_ring_reserve(&r, 96);
	CHECK(rec, "no room in the ring from rank 1 to rank 0");
	memset(rec, 0xa5, 96);
	ipc_ring_commit(&r);
}

/* On rank 1: breaks its own ring to rank 0 through a mapping of its own
 * (RING_BROKEN_HOW: control or data), then answers after a while (the
 * reply is lost). */
static int fn_break(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const char *fd = getenv(SHMRPC_ENV_JOB_FD), *how = getenv("RING_BROKEN_HOW");
	struct shm_seg seg;
	shmrpc_future *f;
	int dup_fd, rc;

	(void)c, (void)a, (void)n, (void)u;
	CHECK(fd, "no %s", SHMRPC_ENV_JOB_FD);
	dup_fd = fcntl(atoi(fd), F_DUPFD_CLOEXEC, 0);
	CHECK(dup_fd >= 0, "dup(%s)", fd);
	CHECK_OK(shm_seg_attach_fd(&seg, dup_fd, false));
	if (how && !strcmp(how, "data"))
		break_data(&seg);
	else
		break_control(&seg);
	ipc_doorbell_ring(shm_worker(&seg, 0), shm_worker(&seg, 1));
	shm_seg_detach(&seg);
	usleep(300000);
	/* Rank 0 found the ring corrupt by now: our calls to it fail at once. */
	rc = shmrpc_rpc_sync(0, "ping", NULL, 0, 20000, &f);
	CHECK(rc == -SHMRPC_EPEERDEAD && strstr(shmrpc_errmsg(), ABANDONED_TEXT),
	      "rank 1's call to rank 0 after the break: %d %s", rc, shmrpc_errmsg());
	fprintf(stderr, "rank 1's call to rank 0 failed at once\n");
	*r = shmrpc_int(1);
	return 0;
}

static int worker(void)
{
	shmrpc_future *f;
	int rc;

	CHECK_OK(shmrpc_register("break", "", fn_break, NULL));
	CHECK_OK(shmrpc_register("ping", "", fn_ping, NULL));
	CHECK_OK(shmrpc_register("others", "", fn_others, NULL));
	CHECK_OK(shmrpc_register("stop", "", fn_stop, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 2)
		load();
	if (shmrpc_rank() == 0) {
		uint64_t t0 = shmrpc_now_ns();

		rc = shmrpc_rpc_sync(1, "break", NULL, 0, 20000, &f);
		CHECK(rc == -SHMRPC_EPEERDEAD && strstr(shmrpc_errmsg(), BROKEN_TEXT),
		      "the call whose reply is lost: %d %s", rc, shmrpc_errmsg());
		fprintf(stderr, "the call failed after %.1f ms\n",
			(double)(shmrpc_now_ns() - t0) / 1e6);
		rc = shmrpc_rpc_sync(1, "break", NULL, 0, 20000, &f);
		CHECK(rc == -SHMRPC_EPEERDEAD && strstr(shmrpc_errmsg(), BROKEN_TEXT),
		      "a new call: %d %s", rc, shmrpc_errmsg());
		/* After rank 1's own check (its handler sleeps 300 ms first). */
		usleep(600000);
		rc = shmrpc_rpc_sync(2, "others", NULL, 0, 20000, &f);
		CHECK(rc == 0, "rank 2's calls: %d %s", rc, shmrpc_errmsg());
		shmrpc_future_free(f);
		CHECK_OK(shmrpc_rpc_sync(2, "stop", NULL, 0, 20000, &f));
		shmrpc_future_free(f);
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	/* Each worker's success says so: a CHECK failing also ends the job 1. */
	static const char *const texts[] = { "the call failed after",
					     "rank 1's call to rank 0 failed at once",
					     "rank 2 reached both",
					     "all answered",
					     "shmrun: worker 0 (worker0) received 1 corrupt frame",
					     NULL };
	static const char *const hows[] = { "control", "data" };

	if (tl_is_worker())
		return worker();
	for (int i = 0; i < 2; i++) {
		int rc;

		setenv("RING_BROKEN_HOW", hows[i], 1);
		rc = tl_job_expect(worker, 1, texts, "-n", "3", NULL);
		if (rc)
			return rc;
		fprintf(stderr, "ring_broken: %s: ok\n", hows[i]);
	}
	return 0;
}
