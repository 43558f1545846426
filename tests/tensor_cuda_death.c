/*
 * Deaths around CUDA device tensors, on the fake driver (tests/fake_cuda).
 *  - A receiver is killed with SIGKILL while it holds rank 0's tensor and
 *    has another of rank 0's in its idle cache (no handle, the mapping
 *    kept): the launcher's sweep drops its counts on both tokens, and rank
 *    0, which let go too, releases both tensors (each deleter runs once).
 *  - A producer is killed while rank 0 holds its tensor and has another of
 *    its tensors in the idle cache: rank 0's handle fails from then on (no
 *    bytes, no DLTensor, no sending it on) with the producer's death in the
 *    message, both mappings are closed, and freeing the handle leaves the
 *    pool empty (the cache let go of its token).
 */
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "worker/cuda.h"
#include "worker/tensor.h"
#include "tests/lib/fakecuda.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define LEN 4096

/* Reads the tensor, keeps no handle: it stays in the idle cache. */
static int fn_look(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	CHECK(((uint8_t *)shmrpc_tensor_data(a[0].u.t))[0] == 0x22, "rank 0's bytes");
	*r = shmrpc_nil();
	return 0;
}

/* This process's CUDA mappings open. */
static int fn_maps(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	struct cuda_stats st;

	(void)c, (void)a, (void)n, (void)u;
	cuda_stats_get(&st);
	*r = shmrpc_int(st.maps_open);
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

static void kill_rank(int rank)
{
	shmrpc_future *f;

	CHECK(shmrpc_rpc_sync(rank, "die", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f) == -SHMRPC_EPEERDEAD,
	      "rank %d did not die: %s", rank, shmrpc_errmsg());
}

static int64_t maps_of(int rank)
{
	shmrpc_future *f;
	int64_t n;

	CHECK_OK(shmrpc_rpc_sync(rank, "maps", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	n = shmrpc_future_value(f)->u.i;
	shmrpc_future_free(f);
	return n;
}

static void rank0(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor(LEN, 0x11), *idle = tl_fake_cuda_tensor(LEN, 0x22);
	shmrpc_tensor *theirs;
	shmrpc_value v = shmrpc_tensor_value(t);
	struct cuda_stats st;
	shmrpc_future *f;
	int64_t maps = 0;

	/* The receiver dies holding our tensor, and another in its cache. */
	CHECK_OK(shmrpc_rpc_sync(2, "keep", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
	v = shmrpc_tensor_value(idle);
	CHECK_OK(shmrpc_rpc_sync(2, "look", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
	/* Its handle goes once the reply is out: then both are mapped there. */
	for (int i = 0; i < 500 && (maps = maps_of(2)) != 2; i++)
		usleep(10000);
	CHECK(maps == 2, "rank 2 has %lld mappings open", (long long)maps);
	shmrpc_tensor_free(idle);
	usleep(5 * TENSOR_REAP_NS / 1000);
	CHECK(tl_fake_cuda_deleted() == 0, "a deleter ran while rank 2 caches the tensor");
	kill_rank(2);
	shmrpc_tensor_free(t);
	for (int i = 0; i < 500 && tl_fake_cuda_deleted() < 2; i++)
		usleep(10000);
	CHECK(tl_fake_cuda_deleted() == 2 && tl_fake_cuda_allocs() == 0,
	      "%d deleters ran, %d allocations left", tl_fake_cuda_deleted(), tl_fake_cuda_allocs());
	CHECK(tl_pool_used() == 0, "the pool holds %llu bytes", (unsigned long long)tl_pool_used());

	/* The producer dies while we hold its tensor, and another in our
	 * cache. */
	CHECK_OK(shmrpc_rpc_sync(1, "make", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
	CHECK_OK(shmrpc_rpc_sync(1, "make", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK_OK(shmrpc_tensor_retain(shmrpc_future_value(f)->u.t, &theirs));
	shmrpc_future_free(f);
	CHECK(((uint8_t *)shmrpc_tensor_data(theirs))[LEN - 1] == 0x42, "rank 1's bytes");
	cuda_stats_get(&st);
	CHECK(st.maps_open == 2, "%u mappings open before the producer dies", st.maps_open);
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
	/* The cache lets go of its token just after the mappings close. */
	for (int i = 0; i < 500 && tl_pool_used(); i++)
		usleep(10000);
	CHECK(tl_pool_used() == 0, "the pool holds %llu bytes", (unsigned long long)tl_pool_used());
	fprintf(stderr, "rank 0: both deaths handled\n");
}

static int worker(void)
{
	tl_keep_register();
	CHECK_OK(shmrpc_register("make", "", fn_make, NULL));
	CHECK_OK(shmrpc_register("look", "t", fn_look, NULL));
	CHECK_OK(shmrpc_register("maps", "", fn_maps, NULL));
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
		return tl_skip("the stand-in CUDA driver (tests/fake_cuda) is not built");
	return tl_job_expect(worker, 1, texts, "-n", "3", "--on-failure=continue", NULL);
}
