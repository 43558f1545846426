/* The job's shared state as a test's worker sees it; see settle.h. */
#include <stdatomic.h>
#include <unistd.h>

#include "common/clock.h"
#include "shm/pool.h"
#include "tests/lib/settle.h"
#include "worker/link.h"

uint32_t tl_rrefs_live(void)
{
	/* Relaxed: a gauge; the wait below polls it. */
	return atomic_load_explicit(&worker_agent->rrefs.hdr->live, memory_order_relaxed);
}

uint64_t tl_pool_used(void)
{
	struct pool_stats st;

	pool_stats(&worker_agent->pool, &st);
	return st.used;
}

bool tl_wait_empty(uint64_t timeout_ns)
{
	uint64_t t0 = shmrpc_now_ns();

	while (tl_rrefs_live() || tl_pool_used()) {
		if (shmrpc_now_ns() - t0 > timeout_ns)
			return false;
		usleep(2000);
	}
	return true;
}
