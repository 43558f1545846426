/*
 * A producer that leaves while another worker holds its CUDA tensor, on
 * the fake driver (tests/fake_cuda). Rank 0 sends a device tensor to rank
 * 1, which keeps it; rank 0 shuts down and exits. Its shutdown says who
 * still holds how many of its tensors; rank 1's handle then fails (no
 * bytes, with the producer's leaving in the message) instead of giving
 * memory that went with it, and freeing it leaves the pool empty.
 */
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "worker/link.h"
#include "tests/lib/fakecuda.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define LEN 4096

static shmrpc_tensor *_Atomic kept;

static int fn_keep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_tensor *t;

	(void)n, (void)u;
	CHECK(((uint8_t *)shmrpc_tensor_data(a[0].u.t))[0] == 0x11, "rank 0's bytes");
	if (shmrpc_tensor_retain(a[0].u.t, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	atomic_store(&kept, t);
	*r = shmrpc_nil();
	return 0;
}

static void rank1(void)
{
	struct shm_worker *w = shm_worker(&worker_agent->seg, 0);
	struct pool_stats st;
	shmrpc_tensor *t;
	int i;

	for (i = 0; i < 3000 && !atomic_load(&kept); i++)
		usleep(10000);
	t = atomic_exchange(&kept, NULL);
	CHECK(t, "rank 0 sent nothing");
	for (i = 0; i < 3000 && atomic_load(&w->state) == SHM_WORKER_RUNNING; i++)
		usleep(10000);
	CHECK(atomic_load(&w->state) == SHM_WORKER_EXITED, "rank 0 did not exit");
	CHECK(shmrpc_tensor_data(t) == NULL && strstr(shmrpc_errmsg(), "has left the job"),
	      "the tensor of a producer that left: %s", shmrpc_errmsg());
	shmrpc_tensor_free(t);
	pool_stats(&worker_agent->pool, &st);
	CHECK(st.used == 0, "the pool holds %llu bytes", (unsigned long long)st.used);
	fprintf(stderr, "rank 1: the tensor of a producer that left fails\n");
}

static int worker(void)
{
	CHECK_OK(shmrpc_register("keep", "t", fn_keep, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		shmrpc_tensor *t = tl_fake_cuda_tensor(LEN, 0x11);
		shmrpc_value v = shmrpc_tensor_value(t);
		shmrpc_future *f;

		CHECK_OK(shmrpc_rpc_sync(1, "keep", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		shmrpc_future_free(f);
		shmrpc_tensor_free(t);
		CHECK_OK(shmrpc_shutdown(0, 0));
		CHECK(tl_fake_cuda_deleted() == 0, "the deleter ran while rank 1 holds the tensor");
		return 0;
	}
	rank1();
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	static const char *const texts[] = {
		"shmrpc: worker 0: shutting down with 1 CUDA tensor(s) still held by other workers "
		"(worker 1 (worker1) holds 1)",
		"rank 1: the tensor of a producer that left fails", NULL
	};

	if (!tl_is_worker() && !tl_fake_cuda_use())
		return tl_skip("the stand-in CUDA driver (tests/fake_cuda) is not built");
	return tl_job_expect(worker, 0, texts, "-n", "2", NULL);
}
