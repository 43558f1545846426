/*
 * Deaths around CUDA device tensors, on the fake driver (tests/fake_cuda).
 *  - A receiver is killed with SIGKILL while it holds rank 0's tensor: the
 *    launcher's sweep drops its count on the tensor's token, and rank 0,
 *    which let go too, releases the tensor (its deleter runs once).
 *  - A producer is killed while rank 0 holds its tensor: rank 0's handle
 *    fails from then on (no bytes, no DLTensor, no sending it on) with the
 *    producer's death in the message, its mapping is closed, and freeing
 *    it leaves the pool empty.
 */
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "worker/agent.h"
#include "worker/cuda.h"
#include "tests/lib/fakecuda.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define LEN 4096

static shmrpc_tensor *_Atomic kept;

static int fn_keep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_tensor *t;

	(void)n, (void)u;
	if (shmrpc_tensor_retain(a[0].u.t, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	atomic_store(&kept, t);
	*r = shmrpc_nil();
	return 0;
}

static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_tensor_value(tl_fake_cuda_tensor(LEN, 0x42));
	return 0;
}

static int fn_die(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	raise(SIGKILL);
	return 0;
}

static uint64_t pool_used(void)
{
	struct pool_stats st;

	pool_stats(&worker_agent->pool, &st);
	return st.used;
}

static void kill_rank(int rank)
{
	shmrpc_future *f;

	CHECK(shmrpc_rpc_sync(rank, "die", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f) == -SHMRPC_EPEERDEAD,
	      "rank %d did not die: %s", rank, shmrpc_errmsg());
}

static void rank0(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor(LEN, 0x11), *theirs;
	shmrpc_value v = shmrpc_tensor_value(t);
	struct cuda_stats st;
	shmrpc_future *f;

	/* The receiver dies holding our tensor. */
	CHECK_OK(shmrpc_rpc_sync(2, "keep", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
	kill_rank(2);
	shmrpc_tensor_free(t);
	for (int i = 0; i < 500 && !tl_fake_cuda_deleted(); i++)
		usleep(10000);
	CHECK(tl_fake_cuda_deleted() == 1 && tl_fake_cuda_allocs() == 0,
	      "%d deleters ran, %d allocations left", tl_fake_cuda_deleted(), tl_fake_cuda_allocs());
	CHECK(pool_used() == 0, "the pool holds %llu bytes", (unsigned long long)pool_used());

	/* The producer dies while we hold its tensor. */
	CHECK_OK(shmrpc_rpc_sync(1, "make", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK_OK(shmrpc_tensor_retain(shmrpc_future_value(f)->u.t, &theirs));
	shmrpc_future_free(f);
	CHECK(((uint8_t *)shmrpc_tensor_data(theirs))[LEN - 1] == 0x42, "rank 1's bytes");
	kill_rank(1);
	CHECK(shmrpc_tensor_data(theirs) == NULL && strstr(shmrpc_errmsg(), "killed by signal 9"),
	      "a dead producer's tensor: %s", shmrpc_errmsg());
	CHECK(shmrpc_tensor_dl(theirs) == NULL, "a dead producer's DLTensor");
	v = shmrpc_tensor_value(theirs);
	CHECK(shmrpc_rpc_sync(0, "keep", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == -SHMRPC_EPEERDEAD &&
	      strstr(shmrpc_errmsg(), "died"), "sending a dead producer's tensor: %s",
	      shmrpc_errmsg());
	for (int i = 0; i < 500; i++) {
		cuda_stats_get(&st);
		if (!st.maps_open)
			break;
		usleep(10000);
	}
	CHECK(st.maps_open == 0, "%u mappings open after the producer died", st.maps_open);
	shmrpc_tensor_free(theirs);
	CHECK(pool_used() == 0, "the pool holds %llu bytes", (unsigned long long)pool_used());
	fprintf(stderr, "rank 0: both deaths handled\n");
}

static int worker(void)
{
	CHECK_OK(shmrpc_register("keep", "t", fn_keep, NULL));
	CHECK_OK(shmrpc_register("make", "", fn_make, NULL));
	CHECK_OK(shmrpc_register("die", "", fn_die, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0)
		rank0();
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	static const char *const texts[] = {
		"rank 0: both deaths handled",
		"shmrun: worker 2 (worker2) died: killed by signal 9 (SIGKILL)",
		"shmrun: worker 1 (worker1) died: killed by signal 9 (SIGKILL)", NULL
	};

	if (!tl_is_worker() && !tl_fake_cuda_use())
		return TL_SKIP;
	return tl_job_expect(worker, 1, texts, "-n", "3", "--on-failure=continue", NULL);
}
