/*
 * A worker that holds tensors is killed with SIGKILL: the launcher sweeps
 * its references, so the blocks only it held go back to the pool, and a
 * block it shared stays alive for the others. Rank 2 allocates tensors,
 * gives one to rank 0, keeps one of rank 0's, and dies; rank 0 then finds
 * the pool holding exactly its own blocks, and nothing once it lets go.
 */
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "worker/link.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define BLOCK (1 << 20)

static const DLDataType u8 = { kDLUInt, 8, 1 };
static shmrpc_tensor *held[16];

static shmrpc_tensor *alloc_block(uint8_t fill)
{
	int64_t shape[1] = { BLOCK };
	shmrpc_tensor *t;

	CHECK_OK(shmrpc_tensor_alloc(u8, 1, shape, &t));
	memset(shmrpc_tensor_data(t), fill, BLOCK);
	return t;
}

/* Rank 2: keeps the argument and ten blocks of its own, returns one of them. */
static int fn_hoard(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	CHECK_OK(shmrpc_tensor_retain(a[0].u.t, &held[0]));
	for (int i = 1; i < 11; i++)
		held[i] = alloc_block((uint8_t)i);
	*r = shmrpc_tensor_value(held[1]); /* held[1] stays ours: the reply pins its own */
	return 0;
}

static int fn_die(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	raise(SIGKILL);
	return 0;
}

static int worker(void)
{
	CHECK_OK(shmrpc_register("hoard", "t", fn_hoard, NULL));
	CHECK_OK(shmrpc_register("die", "", fn_die, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		shmrpc_tensor *mine = alloc_block(0xee), *theirs;
		shmrpc_value v = shmrpc_tensor_value(mine);
		shmrpc_future *f;
		uint64_t expect;

		CHECK_OK(shmrpc_rpc_sync(2, "hoard", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK_OK(shmrpc_tensor_retain(shmrpc_future_value(f)->u.t, &theirs));
		shmrpc_future_free(f);
		CHECK(((uint8_t *)shmrpc_tensor_data(theirs))[BLOCK - 1] == 1, "rank 2's bytes");
		CHECK(shmrpc_rpc_sync(2, "die", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f) == -SHMRPC_EPEERDEAD,
		      "rank 2 did not die: %s", shmrpc_errmsg());
		CHECK(strstr(shmrpc_errmsg(), "killed by signal 9"), "%s", shmrpc_errmsg());
		/* The launcher swept rank 2 before it marked it dead: what is left is ours. */
		expect = (uint64_t)pool_block_size(&worker_agent->pool, shmrpc_tensor_pool_offset(mine)) +
			 (uint64_t)pool_block_size(&worker_agent->pool, shmrpc_tensor_pool_offset(theirs));
		CHECK(tl_pool_used() == expect, "pool holds %llu bytes, we hold %llu",
		      (unsigned long long)tl_pool_used(), (unsigned long long)expect);
		CHECK(((uint8_t *)shmrpc_tensor_data(theirs))[0] == 1, "a block we share was freed");
		shmrpc_tensor_free(mine);
		shmrpc_tensor_free(theirs);
		CHECK(tl_pool_used() == 0, "pool holds %llu bytes", (unsigned long long)tl_pool_used());
		fprintf(stderr, "rank 0: the pool is empty\n");
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	static const char *const texts[] = {
		"rank 0: the pool is empty",
		"shmrun: worker 2 (worker2) died: killed by signal 9 (SIGKILL)", NULL
	};

	return tl_job_expect(worker, 1, texts, "-n", "3", "--on-failure=continue", NULL);
}
