/*
 * A ring whose shared state is made impossible (its tail pushed past what
 * the ring can hold, as a stray write into the job's memory would) is no
 * longer read, and that does not leave anyone waiting: rank 0's call to
 * rank 1, whose reply would come on that ring, fails naming the ring and
 * the worker; a new call to rank 1 fails at once with the same words; the
 * launcher names the worker that received the corrupt frame and the job
 * exits 1, not 0.
 */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "ipc/doorbell.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define BROKEN_TEXT "the ring from worker 1 (worker1) is corrupt and is no longer read"

/* On rank 1: breaks its own ring to rank 0 through a mapping of its own,
 * then answers after a while (the reply is lost). */
static int fn_break(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const char *fd = getenv(SHMRPC_ENV_JOB_FD);
	struct shm_ring_ctl *ctl;
	struct shm_seg seg;
	int dup_fd;

	(void)c, (void)a, (void)n, (void)u;
	CHECK(fd, "no %s", SHMRPC_ENV_JOB_FD);
	dup_fd = fcntl(atoi(fd), F_DUPFD_CLOEXEC, 0);
	CHECK(dup_fd >= 0, "dup(%s)", fd);
	CHECK_OK(shm_seg_attach_fd(&seg, dup_fd, false));
	ctl = shm_ring(&seg, 1, 0);
	/* Release, as a producer publishes: the consumer must see it. */
	atomic_store_explicit(&ctl->tail,
			      atomic_load_explicit(&ctl->head, memory_order_relaxed) +
				      4ull * seg.ring_size,
			      memory_order_release);
	ipc_doorbell_ring(shm_worker(&seg, 0), shm_worker(&seg, 1));
	shm_seg_detach(&seg);
	usleep(300000);
	*r = shmrpc_int(1);
	return 0;
}

static int worker(void)
{
	shmrpc_future *f;
	int rc;

	CHECK_OK(shmrpc_register("break", "", fn_break, NULL));
	CHECK_OK(shmrpc_init(NULL));
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
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	static const char *const texts[] = { "the call failed after",
					     "shmrun: worker 0 (worker0) received 1 corrupt frame",
					     NULL };

	return tl_job_expect(worker, 1, texts, "-n", "2", NULL);
}
