/*
 * The pool serves its whole size again after any order of allocations and
 * frees (issue 20): blocks of random sizes (1 B .. 8 MiB, log-uniform),
 * allocated, referenced by a second rank and freed in random orders, each
 * stamped and checked before its last reference goes (no overlap); after
 * each round every block is freed, in random order, and the whole pool is
 * one block again: a block of the pool's full size is handed out and
 * written end to end. Then the same from four processes at once. Then a
 * death under the pool's lock with its lists half changed (a child that
 * takes the lock, empties the lists and exits): the next taker rebuilds
 * them, and the full-size block comes back. Then corrupt list heads and
 * chunk entries: each allocation fails with a sentence, never a crash.
 */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "tests/lib/testlib.h"

#define MiB (1ull << 20)
#define POOL_BYTES (64 * MiB)
#define NLIVE 256
#define NPROC 4

struct blk {
	uint64_t off, size, mark;
	bool shared; /* rank 1 holds a reference too */
};

static uint64_t rnd(uint64_t *x)
{
	*x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
	return *x;
}

/* 1 B .. 8 MiB, log-uniform: as many tiny blocks as large ones. */
static uint64_t rnd_size(uint64_t *x)
{
	uint32_t bits = (uint32_t)(rnd(x) % 24);

	return 1 + rnd(x) % (1ull << bits);
}

static void stamp(struct shm_pool *p, struct blk *b, uint64_t mark)
{
	uint8_t *q = pool_at(p, b->off, b->size);

	CHECK(q, "block %llu of %llu bytes is outside the pool", (unsigned long long)b->off,
	      (unsigned long long)b->size);
	b->mark = mark;
	memcpy(q, &mark, b->size < 8 ? b->size : 8);
	if (b->size >= 16)
		memcpy(q + b->size - 8, &mark, 8);
	if (b->size >= 24)
		q[b->size / 2] = (uint8_t)mark;
}

static void verify(struct shm_pool *p, const struct blk *b)
{
	const uint8_t *q = pool_at(p, b->off, b->size);
	uint64_t m = b->mark;

	CHECK(memcmp(q, &m, b->size < 8 ? b->size : 8) == 0 &&
	      (b->size < 16 || memcmp(q + b->size - 8, &m, 8) == 0) &&
	      (b->size < 24 || q[b->size / 2] == (uint8_t)m),
	      "block %llu (%llu bytes) was overwritten: handed out twice",
	      (unsigned long long)b->off, (unsigned long long)b->size);
}

static void drop(struct shm_pool *p, uint32_t rank, struct blk *b)
{
	verify(p, b);
	if (b->shared)
		CHECK_OK(pool_unref(p, 1, b->off));
	CHECK_OK(pool_unref(p, rank, b->off));
	b->off = 0;
}

/* The pool is one free block again: the full size is handed out. */
static void whole_again(struct shm_pool *p, uint32_t rank, const char *when)
{
	struct pool_stats st;
	uint64_t off;

	pool_stats(p, &st);
	CHECK(st.used == 0 && st.blocks_live == 0, "%s: %llu bytes in %llu blocks still used", when,
	      (unsigned long long)st.used, (unsigned long long)st.blocks_live);
	CHECK(pool_alloc(p, rank, p->data_size, &off) == 0,
	      "%s: the whole pool (%llu bytes) cannot be served again: %s", when,
	      (unsigned long long)p->data_size, shmrpc_errmsg());
	memset(pool_at(p, off, p->data_size), 0x3c, p->data_size);
	CHECK_OK(pool_unref(p, rank, off));
}

/* Random allocations and frees; returns with every block freed. */
static void churn(struct shm_pool *p, uint32_t rank, uint64_t seed, uint32_t steps, bool share)
{
	static struct blk b[NLIVE];
	uint64_t x = seed;

	memset(b, 0, sizeof(b));
	for (uint32_t s = 0; s < steps; s++) {
		struct blk *t = &b[rnd(&x) % NLIVE];
		int rc;

		if (t->off) {
			drop(p, rank, t);
			continue;
		}
		t->size = rnd_size(&x);
		rc = pool_alloc(p, rank, t->size, &t->off);
		if (rc == -ENOMEM) { /* full: free something instead */
			t->off = 0;
			for (uint32_t i = 0; i < NLIVE; i++)
				if (b[(s + i) % NLIVE].off) {
					drop(p, rank, &b[(s + i) % NLIVE]);
					break;
				}
			continue;
		}
		CHECK(rc == 0, "pool_alloc(%llu): %s", (unsigned long long)t->size, shmrpc_errmsg());
		CHECK(pool_block_size(p, t->off) >= (int64_t)t->size, "short block");
		stamp(p, t, rnd(&x) | 1);
		t->shared = share && rnd(&x) % 4 == 0;
		if (t->shared)
			CHECK_OK(pool_ref(p, 1, t->off));
	}
	/* Free the rest in random order. */
	for (uint32_t left = NLIVE; left;) {
		struct blk *t = &b[rnd(&x) % NLIVE];

		if (t->off)
			drop(p, rank, t);
		left = 0;
		for (uint32_t i = 0; i < NLIVE; i++)
			left += b[i].off != 0;
	}
}

static void test_one_process(void)
{
	struct pool_params pp = { .bytes = POOL_BYTES, .world = 2, .holder_cap = 1u << 12 };
	uint32_t rounds = (uint32_t)(4 * tl_scale()) + 1;
	struct shm_pool p;

	CHECK_OK(pool_create(&p, &pp));
	CHECK_OK(pool_join(&p, 0, 1));
	CHECK_OK(pool_join(&p, 1, 1));
	whole_again(&p, 0, "a new pool");
	for (uint32_t r = 0; r < rounds; r++) {
		char when[32];

		churn(&p, 0, 0x9e3779b97f4a7c15ull * (r + 1), 10000, true);
		snprintf(when, sizeof(when), "after round %u", r);
		whole_again(&p, 0, when);
	}
	pool_detach(&p);
}

static void test_processes(void)
{
	struct pool_params pp = { .bytes = POOL_BYTES, .world = NPROC, .holder_cap = 1u << 12 };
	struct shm_pool p;

	CHECK_OK(pool_create(&p, &pp));
	for (uint32_t i = 0; i < NPROC; i++) {
		pid_t pid = fork();

		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			CHECK_OK(pool_join(&p, i, 1));
			churn(&p, i, 0x2545f4914f6cdd1dull * (i + 1),
			      (uint32_t)(10000 * tl_scale()) + 1000, false);
			CHECK(pool_leave(&p, i) == 0, "rank %u still held blocks", i);
			_exit(0);
		}
	}
	CHECK(tl_wait_children(), "a process failed");
	CHECK_OK(pool_join(&p, 0, 2));
	whole_again(&p, 0, "after four processes");
	pool_detach(&p);
}

/* A death under the lock, the lists emptied: the next taker rebuilds. */
static void test_rebuild(void)
{
	struct pool_params pp = { .bytes = POOL_BYTES, .world = 1, .holder_cap = 1u << 12 };
	struct blk keep[3] = { { .size = 100 }, { .size = 300000 }, { .size = 5 * MiB } };
	struct shm_pool p;
	uint64_t off;
	pid_t pid;
	int status;

	CHECK_OK(pool_create(&p, &pp));
	CHECK_OK(pool_join(&p, 0, 1));
	for (int i = 0; i < 3; i++) {
		CHECK_OK(pool_alloc(&p, 0, keep[i].size, &keep[i].off));
		stamp(&p, &keep[i], 0x1234567ull * (i + 1) | 1);
	}
	pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		pthread_mutex_lock(&p.hdr->lock.m);
		for (int o = 0; o < 32; o++) {
			atomic_store(&p.hdr->chunk_free[o], 0);
			atomic_store(&p.hdr->rec_free[o], 0);
		}
		_exit(0); /* holding the lock */
	}
	CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status), "the child");
	/* The lists are empty: only a rebuild finds room. */
	CHECK(pool_alloc(&p, 0, MiB, &off) == 0, "after a death under the lock: %s",
	      shmrpc_errmsg());
	CHECK(atomic_load(&p.hdr->rebuilds) == 1, "%llu rebuilds",
	      (unsigned long long)atomic_load(&p.hdr->rebuilds));
	for (int i = 0; i < 3; i++) {
		CHECK(!(off < keep[i].off + keep[i].size && keep[i].off < off + MiB),
		      "the rebuild handed out a live block");
		verify(&p, &keep[i]);
		CHECK_OK(pool_unref(&p, 0, keep[i].off));
	}
	CHECK_OK(pool_unref(&p, 0, off));
	whole_again(&p, 0, "after the rebuild");
	pool_detach(&p);
}

/* Corrupt shared words: a sentence naming the structure, never a crash,
 * a wild index nor a block handed out twice; and once a structure is found
 * corrupt, the pool hands out nothing more. Each case on a fresh pool. */
static void corrupt_pool(struct shm_pool *p, uint32_t holder_cap)
{
	struct pool_params pp = { .bytes = 4 * MiB, .world = 1, .holder_cap = holder_cap };

	CHECK_OK(pool_create(p, &pp));
	CHECK_OK(pool_join(p, 0, 1));
}

static void expect_corrupt(int rc, const char *text, const char *what)
{
	CHECK(rc == -SHMRPC_ECORRUPT && strstr(shmrpc_errmsg(), text), "%s: %d %s", what, rc,
	      shmrpc_errmsg());
}

static void test_corrupt(void)
{
	struct shm_pool p;
	uint64_t off, a, b;
	uint32_t o = 6; /* the 4 MiB block's order (64 chunks) */

	corrupt_pool(&p, 64);
	CHECK(atomic_load(&p.hdr->chunk_free[o]) == 1, "a new 4 MiB pool is one free block");
	atomic_store(&p.hdr->chunk_free[o], 1000);
	expect_corrupt(pool_alloc(&p, 0, MiB, &off),
		       "free list of chunk blocks of order 6 is corrupt: it names 1000 of 64",
		       "a wild list head");
	atomic_store(&p.hdr->chunk_free[o], 1);
	expect_corrupt(pool_alloc(&p, 0, MiB, &off), "the tensor pool's free lists were found "
		       "corrupt earlier", "an allocation after the corruption");
	pool_detach(&p);

	/* A chunk entry that claims more chunks than the pool has. */
	corrupt_pool(&p, 64);
	CHECK_OK(pool_alloc(&p, 0, MiB, &off));
	atomic_store(&p.chunks[0].entry, atomic_load(&p.chunks[0].entry) | (40ull << 56));
	expect_corrupt(pool_unref(&p, 0, off), "the tensor pool's chunk table is corrupt",
		       "a wild chunk entry");
	pool_detach(&p);

	/* A slab list naming a chunk beyond the pool. */
	corrupt_pool(&p, 64);
	atomic_store(&p.hdr->partial[0], 99);
	expect_corrupt(pool_alloc(&p, 0, 64, &off), "99 of 64", "a wild slab list");
	pool_detach(&p);

	/* A slab's free list made to name a block in use: refused, never
	 * the same block twice. */
	corrupt_pool(&p, 64);
	CHECK_OK(pool_alloc(&p, 0, 64, &a));
	CHECK_OK(pool_alloc(&p, 0, 64, &b));
	p.chunks[(a - p.data_off) >> POOL_CHUNK_SHIFT].free_head = 1;
	expect_corrupt(pool_alloc(&p, 0, 64, &off), "is not a free block of it",
		       "a slab link to a block in use");
	pool_detach(&p);

	/* A free-list link whose neighbour does not name it back. */
	corrupt_pool(&p, 64);
	CHECK_OK(pool_alloc(&p, 0, POOL_CHUNK, &a)); /* splits: free blocks of each order */
	p.chunks[1].prev = 5;
	expect_corrupt(pool_alloc(&p, 0, POOL_CHUNK, &off), "free list of chunk blocks of order 0",
		       "a free-list link into another list");
	pool_detach(&p);

	/* A block record whose count is below what is dropped. */
	corrupt_pool(&p, 64);
	CHECK_OK(pool_alloc(&p, 0, 64, &a));
	CHECK_OK(pool_ref(&p, 0, a));
	{
		uint32_t c = (uint32_t)((a - p.data_off) >> POOL_CHUNK_SHIFT);

		atomic_store(&p.meta[(uint32_t)atomic_load(&p.chunks[c].entry)].refs, 1);
	}
	CHECK_OK(pool_unref(&p, 0, a)); /* the count's last: the block goes */
	expect_corrupt(pool_sweep(&p, 0, 1), "the tensor pool's block record",
		       "a count below the holder's records");
	pool_detach(&p);

	/* A holder table entry naming a record beyond the pool. */
	corrupt_pool(&p, 64);
	atomic_store(&p.tables[3], (uint64_t)1 << 48 | (uint64_t)1 << 32 | 0x7fffffffu);
	expect_corrupt(pool_sweep(&p, 0, 1), "the tensor pool's holder table of rank 0 is corrupt",
		       "a wild holder entry");
	pool_detach(&p);
}

int main(void)
{
	test_one_process();
	test_processes();
	test_rebuild();
	test_corrupt();
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
