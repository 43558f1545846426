/*
 * A plain 1 GiB tensor through a job with the default pool (issue 20: the
 * pool needs no sizing for ordinary work). Rank 0 makes a 1 GiB tensor with
 * shmrpc_tensor_alloc, writes one byte per page, and sends it to rank 1,
 * which checks every page's byte and writes its own mark: rank 0 sees it.
 * The pool's memory is committed as the block is handed out (the memfd
 * holds at least 1 GiB while the tensor lives) and given back when it is
 * freed (hole punching: the memfd holds far less afterwards). Then again,
 * twice: the space of a freed 1 GiB block serves the next one.
 */
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define GiB (1ull << 30)
#define PAGE 4096u
#define SETTLE_NS 30000000000ull

static const DLDataType u8 = { kDLUInt, 8, 1 };

static uint8_t page_byte(uint64_t i)
{
	return (uint8_t)(i * 131 + 7);
}

/* Checks one byte per page, then marks the last byte; returns the pages. */
static int fn_check(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uint8_t *d = shmrpc_tensor_data(a[0].u.t);
	uint64_t len = shmrpc_tensor_nbytes(a[0].u.t);

	(void)n, (void)u;
	if (len != GiB)
		return shmrpc_call_error(c, "ValueError", "%llu bytes arrived",
					 (unsigned long long)len);
	for (uint64_t i = 0; i < len / PAGE; i++)
		if (d[i * PAGE] != page_byte(i))
			return shmrpc_call_error(c, "ValueError", "page %llu differs",
						 (unsigned long long)i);
	d[len - 1] = 0xee;
	*r = shmrpc_int((int64_t)(len / PAGE));
	return 0;
}

/* Bytes the pool's memfd holds committed now. */
static uint64_t pool_committed(void)
{
	const char *fd = getenv(SHMRPC_ENV_POOL_FD);
	struct stat st;

	CHECK(fd && fstat(atoi(fd), &st) == 0, "no pool fd (%s)", fd ? fd : "unset");
	return (uint64_t)st.st_blocks * 512;
}

/* Committed before the first tensor: the pool's records and tables. */
static uint64_t base;

static void one(int round)
{
	int64_t shape[1] = { (int64_t)GiB };
	uint64_t before = pool_committed(), during, after;
	shmrpc_tensor *t;
	shmrpc_future *f;
	shmrpc_value v;
	uint8_t *d;

	CHECK(shmrpc_tensor_alloc(u8, 1, shape, &t) == 0, "a 1 GiB tensor on a default job: %s",
	      shmrpc_errmsg());
	d = shmrpc_tensor_data(t);
	for (uint64_t i = 0; i < GiB / PAGE; i++)
		d[i * PAGE] = page_byte(i);
	during = pool_committed();
	CHECK(during >= base + GiB - PAGE, "round %d: %llu bytes committed with the tensor, %llu "
	      "at the start", round, (unsigned long long)during, (unsigned long long)base);
	v = shmrpc_tensor_value(t);
	CHECK_OK(shmrpc_rpc_sync(1, "check", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->u.i == (int64_t)(GiB / PAGE), "pages checked");
	shmrpc_future_free(f);
	CHECK(d[GiB - 1] == 0xee, "rank 1's write not seen: a copy was sent");
	shmrpc_tensor_free(t);
	/* Rank 1's reference goes with its ack: wait for the pool to empty. */
	CHECK(tl_wait_empty(SETTLE_NS), "the pool did not empty: %llu bytes used",
	      (unsigned long long)tl_pool_used());
	/* The pages go back just after the last reference (its dropper
	 * punches them out before it lists the block; 64 MiB of slack for
	 * what else the job keeps committed). */
	for (int i = 0; i < 5000 && (after = pool_committed()) > base + (64u << 20); i++)
		usleep(1000);
	CHECK(after <= base + (64u << 20), "round %d: %llu bytes still committed after the free "
	      "(%llu with the tensor): not given back", round, (unsigned long long)after,
	      (unsigned long long)during);
	printf("round %d: committed %llu MiB before, %llu MiB with the tensor, %llu MiB after\n",
	       round, (unsigned long long)(before >> 20), (unsigned long long)(during >> 20),
	       (unsigned long long)(after >> 20));
}

static int worker(void)
{
	CHECK_OK(shmrpc_register("check", "t", fn_check, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		base = pool_committed();
		for (int round = 0; round < 2; round++)
			one(round);
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	if (!tl_is_worker() && pool_default_bytes() < 2 * GiB)
		return tl_skip("this machine has less than 4 GiB of memory for a 1 GiB tensor");
	return tl_job_test(worker, "-n", "2", NULL);
}
