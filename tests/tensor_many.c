/*
 * 100,000 tensors through one job under `ulimit -n 1024`: a tensor is a
 * pool offset, never a file descriptor or a mapping of its own. Rank 0
 * sends each a new tensor (with rpc_async, 1000 in flight), rank 1 checks
 * its bytes and answers with a new tensor of its own; at the end the pool
 * is empty.
 */
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "worker/link.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define WINDOW 1000

static const DLDataType i64 = { kDLInt, 64, 1 };

static shmrpc_tensor *scalar(int64_t x)
{
	int64_t shape[1] = { 1 };
	shmrpc_tensor *t;

	CHECK_OK(shmrpc_tensor_alloc(i64, 1, shape, &t));
	*(int64_t *)shmrpc_tensor_data(t) = x;
	return t;
}

static int fn_negate(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_tensor_value(scalar(-*(int64_t *)shmrpc_tensor_data(a[0].u.t)));
	return 0;
}

static void settle(shmrpc_future *f, int64_t x)
{
	CHECK_OK(shmrpc_future_wait(f, -1));
	CHECK(*(int64_t *)shmrpc_tensor_data(shmrpc_future_value(f)->u.t) == -x, "reply to %lld",
	      (long long)x);
	shmrpc_future_free(f);
}

static int worker(void)
{
	int n = (int)(100000 * tl_scale());
	static shmrpc_future *f[WINDOW];
	struct pool_stats st;

	CHECK_OK(shmrpc_register("negate", "t", fn_negate, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		for (int i = 0; i < n; i++) {
			shmrpc_tensor *t = scalar(i);
			shmrpc_value v = shmrpc_tensor_value(t);

			if (i >= WINDOW)
				settle(f[i % WINDOW], i - WINDOW);
			CHECK_OK(shmrpc_rpc_async(1, "negate", &v, 1, SHMRPC_TIMEOUT_NONE, &f[i % WINDOW]));
			shmrpc_tensor_free(t); /* pinned until rank 1 holds it */
		}
		for (int i = n > WINDOW ? n - WINDOW : 0; i < n; i++)
			settle(f[i % WINDOW], i);
		for (int i = 0; i < 5000; i++) {
			/* Quiescent: a block whose last reference just went is
			 * neither used nor listed until its freer has the lock. */
			pool_stats(&worker_agent->pool, &st);
			if (!st.used && !st.lost)
				break;
			usleep(1000);
		}
		CHECK(st.used == 0 && st.lost == 0, "pool: %llu bytes used, %llu lost",
		      (unsigned long long)st.used, (unsigned long long)st.lost);
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	struct rlimit rl = { 1024, 1024 };

	/* Inherited by shmrun and the workers. */
	CHECK(tl_is_worker() || setrlimit(RLIMIT_NOFILE, &rl) == 0, "ulimit -n 1024");
	return tl_job_test(worker, "-n", "2", NULL);
}
