/* A barrier kept by rank 0; see barrier.h. */
#include <stdatomic.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "tests/lib/barrier.h"
#include "tests/lib/testlib.h"

#define PHASES 8
#define WAIT_NS (60ull * 1000000000ull)

static atomic_int arrived[PHASES];

static int fn_arrive(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(atomic_fetch_add(&arrived[a[0].u.i % PHASES], 1) + 1);
	return 0;
}

static int fn_arrived(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(atomic_load(&arrived[a[0].u.i % PHASES]));
	return 0;
}

int tl_barrier_register(void)
{
	return shmrpc_register("tl_arrive", "i", fn_arrive, NULL) ?:
	       shmrpc_register("tl_arrived", "i", fn_arrived, NULL);
}

void tl_barrier(int phase, int parties)
{
	shmrpc_value v = shmrpc_int(phase);
	const char *fn = "tl_arrive";
	uint64_t t0 = shmrpc_now_ns();
	shmrpc_future *f;
	int64_t n;

	for (;;) {
		CHECK_OK(shmrpc_rpc_sync(0, fn, &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		n = shmrpc_future_value(f)->u.i;
		shmrpc_future_free(f);
		if (n >= parties)
			return;
		CHECK(shmrpc_now_ns() - t0 < WAIT_NS, "worker %d: barrier %d: %lld of %d came",
		      shmrpc_rank(), phase, (long long)n, parties);
		fn = "tl_arrived";
		usleep(2000);
	}
}
