/* 8 forked processes x 2 threads share one tensor pool: each thread
 * allocates blocks (64 B .. 512 KiB), stamps them with a unique canary and
 * publishes their offsets on a shared board; every thread takes references
 * to blocks published by other processes, checks their stamps, holds them a
 * while and drops them, while owners retire and replace theirs. A block
 * handed out twice while still referenced, or freed twice, would be stamped
 * by two owners: every holder re-checks the stamp before it drops its
 * reference. At the end the pool is empty, every carved block is on a free
 * list exactly once (free-listed bytes == carved bytes, nothing lost). */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "tests/lib/testlib.h"

#define NPROC 8
#define NTHREAD 2
#define SLOTS 8 /* published blocks per thread */
#define HOLD 16 /* references a thread holds on others' blocks */
#define ITERS 200000

struct board {
	_Atomic uint64_t slot[NPROC][NTHREAD][SLOTS];
	_Atomic uint32_t ready;
	_Atomic uint64_t refs_taken, stale; /* references taken; offsets found retired */
};

struct worker {
	struct shm_pool *pool;
	struct board *board;
	uint32_t rank, thread;
	uint64_t rng;
	uint64_t seq;
	uint64_t held[HOLD], held_stamp[HOLD];
	uint64_t own_stamp[SLOTS];
	uint64_t refs_taken, stale;
};

static uint64_t rnd(struct worker *w)
{
	w->rng ^= w->rng << 13, w->rng ^= w->rng >> 7, w->rng ^= w->rng << 17;
	return w->rng;
}

/* A stamp: the owner, a sequence number, and the block's size, written at
 * both ends of the block. Its words are written and read as relaxed
 * atomics: a block's bytes pass between processes, ordered by the pool's
 * own atomics, which TSan sees only in the process that made them; a
 * block this process wrote, freed, and another process reused and
 * stamped, would read as a race with that earlier write (the check is
 * the stamps' values, not their order). */
static void stamp(struct shm_pool *p, uint64_t off, uint64_t s)
{
	int64_t size = pool_block_size(p, off);
	uint64_t *q;

	CHECK(size > 0, "fresh block %llu: %s", (unsigned long long)off, shmrpc_errmsg());
	q = pool_at(p, off, (uint64_t)size);
	__atomic_store_n(&q[0], s, __ATOMIC_RELAXED);
	__atomic_store_n(&q[1], (uint64_t)size, __ATOMIC_RELAXED);
	__atomic_store_n(&q[size / 8 - 1], ~s, __ATOMIC_RELAXED);
}

/* The stamp read at off: 0 when torn (two owners wrote the block). */
static uint64_t stamp_of(struct shm_pool *p, uint64_t off)
{
	uint64_t *q = pool_at(p, off, 16);
	uint64_t s = __atomic_load_n(&q[0], __ATOMIC_RELAXED);
	uint64_t size = __atomic_load_n(&q[1], __ATOMIC_RELAXED);
	uint64_t *end = pool_at(p, off, size);

	return size >= 64 && end && __atomic_load_n(&end[size / 8 - 1], __ATOMIC_RELAXED) == ~s
	       ? s : 0;
}

static uint64_t block_bytes(struct worker *w)
{
	uint64_t r = rnd(w);

	if (r % 16 == 0)
		return 65537 + r % (512 * 1024 - 65537);
	return 1 + r % 65536;
}

/* Retires slot i of this thread (if occupied) and publishes a fresh block. */
static void replace(struct worker *w, uint32_t i)
{
	_Atomic uint64_t *slot = &w->board->slot[w->rank][w->thread][i];
	uint64_t old = atomic_exchange(slot, 0), off;

	if (old) {
		CHECK(stamp_of(w->pool, old) == w->own_stamp[i],
		      "rank %u: own block %llu restamped by someone else", w->rank,
		      (unsigned long long)old);
		CHECK_OK(pool_unref(w->pool, w->rank, old));
	}
	CHECK_OK(pool_alloc(w->pool, w->rank, block_bytes(w), &off));
	w->own_stamp[i] = (uint64_t)w->rank << 56 | (uint64_t)w->thread << 48 | ++w->seq;
	stamp(w->pool, off, w->own_stamp[i]);
	atomic_store(slot, off);
}

/* Takes a reference to a block another process published, into held[h]. */
static void take(struct worker *w, uint32_t h)
{
	uint32_t r = (w->rank + 1 + (uint32_t)(rnd(w) % (NPROC - 1))) % NPROC;
	_Atomic uint64_t *slot = &w->board->slot[r][rnd(w) % NTHREAD][rnd(w) % SLOTS];
	uint64_t off = atomic_load(slot), s;
	int rc;

	if (!off)
		return;
	rc = pool_ref(w->pool, w->rank, off);
	if (rc == -EINVAL) { /* retired and freed meanwhile */
		w->stale++;
		return;
	}
	CHECK_OK(rc);
	/* Still published after our reference: it is the block we meant, and
	 * it cannot be freed before we drop it. */
	if (atomic_load(slot) != off) {
		CHECK_OK(pool_unref(w->pool, w->rank, off));
		return;
	}
	s = stamp_of(w->pool, off);
	CHECK(s >> 56 == r, "block %llu published by rank %u carries stamp %llx",
	      (unsigned long long)off, r, (unsigned long long)s);
	w->held[h] = off;
	w->held_stamp[h] = s;
	w->refs_taken++;
}

static void drop(struct worker *w, uint32_t h)
{
	if (!w->held[h])
		return;
	CHECK(stamp_of(w->pool, w->held[h]) == w->held_stamp[h],
	      "rank %u: block %llu changed while referenced (stamp %llx, was %llx): handed out "
	      "twice", w->rank, (unsigned long long)w->held[h],
	      (unsigned long long)stamp_of(w->pool, w->held[h]), (unsigned long long)w->held_stamp[h]);
	CHECK_OK(pool_unref(w->pool, w->rank, w->held[h]));
	w->held[h] = 0;
}

static void *thread_main(void *arg)
{
	struct worker *w = arg;
	long iters = (long)(ITERS * tl_scale());

	for (uint32_t i = 0; i < SLOTS; i++)
		replace(w, i);
	for (long n = 0; n < iters; n++) {
		uint32_t h = (uint32_t)(rnd(w) % HOLD);

		if (n % 4 == 0)
			replace(w, (uint32_t)(rnd(w) % SLOTS));
		drop(w, h);
		take(w, h);
	}
	for (uint32_t h = 0; h < HOLD; h++)
		drop(w, h);
	return NULL;
}

static int child(struct shm_pool *pool, struct board *board, uint32_t rank)
{
	struct worker w[NTHREAD];
	pthread_t t[NTHREAD];
	uint64_t taken = 0, stale = 0;

	CHECK_OK(pool_join(pool, rank, 1));
	/* Start together, so that the processes overlap; only for that, so a
	 * sibling that never comes does not hold us for more than a second. */
	atomic_fetch_add(&board->ready, 1);
	for (int i = 0; i < 10000 && atomic_load(&board->ready) < NPROC; i++)
		usleep(100);
	for (uint32_t i = 0; i < NTHREAD; i++) {
		w[i] = (struct worker){ .pool = pool, .board = board, .rank = rank, .thread = i,
					.rng = 0x9e3779b97f4a7c15ull * (rank * NTHREAD + i + 1) };
		CHECK(pthread_create(&t[i], NULL, thread_main, &w[i]) == 0, "pthread_create");
	}
	for (uint32_t i = 0; i < NTHREAD; i++) {
		pthread_join(t[i], NULL);
		taken += w[i].refs_taken;
		stale += w[i].stale;
	}
	atomic_fetch_add(&board->refs_taken, taken);
	atomic_fetch_add(&board->stale, stale);
	/* Retire what we published, as in the loop: others may still be
	 * taking references to it. */
	for (uint32_t i = 0; i < NTHREAD; i++)
		for (uint32_t s = 0; s < SLOTS; s++)
			CHECK_OK(pool_unref(pool, rank,
					    atomic_exchange(&board->slot[rank][i][s], 0)));
	CHECK(pool_leave(pool, rank) == 0, "rank %u still held references at the end", rank);
	return 0;
}

int main(void)
{
	struct pool_params pp = { .bytes = 128ull << 20, .world = NPROC, .holder_cap = 1024 };
	struct board *board = mmap(NULL, sizeof(*board), PROT_READ | PROT_WRITE,
				   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	struct shm_pool pool;
	struct pool_stats st;

	CHECK(board != MAP_FAILED, "mmap");
	CHECK_OK(pool_create(&pool, &pp));
	for (uint32_t r = 0; r < NPROC; r++) {
		pid_t pid = fork();

		CHECK(pid >= 0, "fork");
		if (pid == 0)
			_exit(child(&pool, board, r));
	}
	CHECK(tl_wait_children(), "a worker failed");
	CHECK(board->refs_taken > 0, "no process ever got a reference to another's block");
	pool_stats(&pool, &st);
	CHECK(st.used == 0 && st.refs_live == 0 && st.refs_held == 0,
	      "pool not empty: %llu bytes in %llu blocks, %llu references",
	      (unsigned long long)st.used, (unsigned long long)st.blocks_live,
	      (unsigned long long)st.refs_live);
	CHECK(st.free_listed == st.carved && st.lost == 0,
	      "%llu bytes on the free lists, %llu carved: a block freed twice or lost",
	      (unsigned long long)st.free_listed, (unsigned long long)st.carved);
	printf("pool_procs: %u processes x %u threads, %llu references taken across processes "
	       "(%llu offsets found freed), %llu MiB carved, %u block records\n",
	       NPROC, NTHREAD, (unsigned long long)board->refs_taken,
	       (unsigned long long)board->stale, (unsigned long long)(st.carved >> 20),
	       st.block_records_used);
	pool_detach(&pool);
	munmap(board, sizeof(*board));
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
