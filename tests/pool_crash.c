/* A holder killed with SIGKILL at random moments while two of its threads
 * allocate, stamp, reference (its own blocks and the survivor's) and drop
 * blocks as fast as they can. After each death the survivor (and, every
 * fourth round, two more sweepers at once) sweeps the dead rank: together
 * they drop exactly the references its table recorded, a second sweep drops
 * nothing, the survivor's blocks stay live and intact, fresh blocks never
 * overlap them, no block is on a free list twice (free-listed + used <=
 * carved), and the rank joins again as the next generation. The design
 * allows a reference to leak when a death falls between the two steps of a
 * reference change (pool.c): those are counted and printed, and each leaked
 * live block must carry an unrecorded reference. At the end the survivor
 * lets go and the pool holds only what leaked. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "tests/lib/testlib.h"

#define ROUNDS 300
#define MAX_DELAY_US 3000
#define NPARENT 32 /* blocks the survivor holds throughout */
#define NHELD 32   /* per victim thread */
#define NFRESH 16
#define VICTIM 1

struct shared {
	uint64_t parent_off[NPARENT];
	_Atomic uint32_t ready;
	_Atomic int64_t swept[3];
};

struct victim {
	struct shm_pool *pool;
	struct shared *sh;
	uint64_t rng;
};

static uint64_t rnd(uint64_t *x)
{
	*x ^= *x << 13, *x ^= *x >> 7, *x ^= *x << 17;
	return *x;
}

static uint8_t parent_byte(uint32_t i)
{
	return (uint8_t)(0x11 * (i + 1));
}

static bool parent_intact(struct shm_pool *p, const struct shared *sh, uint32_t i)
{
	int64_t size = pool_block_size(p, sh->parent_off[i]);
	const uint8_t *q = pool_at(p, sh->parent_off[i], size > 0 ? (uint64_t)size : 1);

	if (size <= 0 || !q)
		return false;
	for (int64_t j = 0; j < size; j += 61)
		if (q[j] != parent_byte(i))
			return false;
	return q[size - 1] == parent_byte(i);
}

/* Runs until killed. Own blocks carry a random mark at both ends, checked
 * before each drop; the survivor's blocks are checked as they are. */
static void *victim_loop(void *arg)
{
	struct victim *v = arg;
	struct shm_pool *p = v->pool;
	uint64_t off[NHELD] = { 0 }, mark[NHELD] = { 0 };

	for (;;) {
		uint32_t h = (uint32_t)(rnd(&v->rng) % NHELD);
		uint64_t r = rnd(&v->rng);

		if (off[h]) {
			uint64_t *q = pool_at(p, off[h], 16);
			int64_t size = pool_block_size(p, off[h]);

			CHECK(size > 0, "held block %llu is not live: %s", (unsigned long long)off[h],
			      shmrpc_errmsg());
			if (mark[h])
				CHECK(q[0] == mark[h] && q[size / 8 - 1] == ~mark[h],
				      "own block %llu overwritten: handed out twice",
				      (unsigned long long)off[h]);
			CHECK_OK(pool_unref(p, VICTIM, off[h]));
			off[h] = 0;
		}
		if (r % 3 == 0) {
			uint32_t i = (uint32_t)(r >> 8) % NPARENT;

			CHECK_OK(pool_ref(p, VICTIM, v->sh->parent_off[i]));
			off[h] = v->sh->parent_off[i];
			mark[h] = 0;
			CHECK(parent_intact(p, v->sh, i), "survivor's block %u changed", i);
		} else {
			uint64_t *q;
			int64_t size;

			CHECK_OK(pool_alloc(p, VICTIM, 1 + (r >> 8) % (128 * 1024), &off[h]));
			size = pool_block_size(p, off[h]);
			q = pool_at(p, off[h], (uint64_t)size);
			mark[h] = (uint64_t)v->rng << 1 | 1;
			q[0] = mark[h];
			q[size / 8 - 1] = ~mark[h];
			if (r % 5 == 0) { /* a second reference of our own */
				CHECK_OK(pool_ref(p, VICTIM, off[h]));
				CHECK_OK(pool_unref(p, VICTIM, off[h]));
			}
		}
	}
	return NULL;
}

static void victim(struct shm_pool *p, struct shared *sh, uint32_t gen)
{
	struct victim v[2] = { { p, sh, 0x2545f4914f6cdd1dull * gen },
			       { p, sh, 0x9e3779b97f4a7c15ull * gen } };
	pthread_t t;

	CHECK_OK(pool_join(p, VICTIM, gen));
	CHECK(pthread_create(&t, NULL, victim_loop, &v[1]) == 0, "pthread_create");
	atomic_store(&sh->ready, 1);
	victim_loop(&v[0]);
}

static bool overlaps(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen)
{
	return a < b + blen && b < a + alen;
}

/* Fresh blocks after a sweep never overlap the survivor's live blocks. */
static void check_fresh(struct shm_pool *p, struct shared *sh, uint64_t *x)
{
	uint64_t off[NFRESH], len[NFRESH];

	for (uint32_t i = 0; i < NFRESH; i++) {
		CHECK_OK(pool_alloc(p, 0, 1 + rnd(x) % (256 * 1024), &off[i]));
		len[i] = (uint64_t)pool_block_size(p, off[i]);
		memset(pool_at(p, off[i], len[i]), 0xee, len[i]);
		for (uint32_t j = 0; j < NPARENT; j++)
			CHECK(!overlaps(off[i], len[i], sh->parent_off[j],
					(uint64_t)pool_block_size(p, sh->parent_off[j])),
			      "fresh block %llu overlaps the survivor's block %u",
			      (unsigned long long)off[i], j);
		for (uint32_t j = 0; j < i; j++)
			CHECK(!overlaps(off[i], len[i], off[j], len[j]), "fresh blocks overlap");
	}
	for (uint32_t j = 0; j < NPARENT; j++)
		CHECK(parent_intact(p, sh, j), "survivor's block %u damaged", j);
	for (uint32_t i = 0; i < NFRESH; i++)
		CHECK_OK(pool_unref(p, 0, off[i]));
}

/* Sweeps the dead generation, with two more sweepers every fourth round;
 * returns the references dropped by all. */
static int64_t sweep_all(struct shm_pool *p, struct shared *sh, uint32_t gen, bool crowd)
{
	int64_t total = 0;

	for (int i = 0; i < 3; i++)
		atomic_store(&sh->swept[i], 0);
	for (int i = 1; crowd && i < 3; i++) {
		pid_t pid = fork();

		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			int n = pool_sweep(p, VICTIM, gen);

			atomic_store(&sh->swept[i], n);
			_exit(n < 0);
		}
	}
	atomic_store(&sh->swept[0], pool_sweep(p, VICTIM, gen));
	CHECK(tl_wait_children(), "a sweeper failed");
	for (int i = 0; i < 3; i++) {
		CHECK(sh->swept[i] >= 0, "sweep %d: %lld", i, (long long)sh->swept[i]);
		total += sh->swept[i];
	}
	CHECK(pool_sweep(p, VICTIM, gen) == 0, "a second sweep dropped references");
	return total;
}

int main(void)
{
	struct pool_params pp = { .bytes = 64ull << 20, .world = 2, .holder_cap = 4096 };
	struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
				 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	uint32_t rounds = (uint32_t)(ROUNDS * tl_scale());
	uint64_t x = 0x853c49e6748fea9bull, parent_bytes = 0, swept = 0;
	struct pool_holder_stats hs;
	struct shm_pool pool;
	struct pool_stats st;

	CHECK(sh != MAP_FAILED, "mmap");
	CHECK_OK(pool_create(&pool, &pp));
	CHECK_OK(pool_join(&pool, 0, 1));
	for (uint32_t i = 0; i < NPARENT; i++) {
		int64_t size;

		CHECK_OK(pool_alloc(&pool, 0, 1 + rnd(&x) % (200 * 1024), &sh->parent_off[i]));
		size = pool_block_size(&pool, sh->parent_off[i]);
		memset(pool_at(&pool, sh->parent_off[i], (uint64_t)size), parent_byte(i), (size_t)size);
		parent_bytes += (uint64_t)size;
	}

	for (uint32_t round = 0; round < rounds; round++) {
		uint32_t gen = round + 1;
		int status;
		pid_t pid;
		int64_t n;

		atomic_store(&sh->ready, 0);
		pid = fork();
		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			victim(&pool, sh, gen);
			_exit(1);
		}
		while (!atomic_load(&sh->ready))
			usleep(50);
		usleep((useconds_t)(rnd(&x) % MAX_DELAY_US));
		CHECK(kill(pid, SIGKILL) == 0, "kill");
		CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
		CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
		      "round %u: the victim failed before it was killed (status %#x)", round, status);

		CHECK_OK(pool_holder_stats(&pool, VICTIM, &hs));
		CHECK(hs.generation == gen && hs.state == POOL_HOLDER_LIVE, "victim record");
		n = sweep_all(&pool, sh, gen, round % 4 == 0);
		CHECK(n == (int64_t)hs.refs, "round %u: sweepers dropped %lld references, the table "
		      "recorded %llu", round, (long long)n, (unsigned long long)hs.refs);
		swept += (uint64_t)n;
		CHECK_OK(pool_holder_stats(&pool, VICTIM, &hs));
		CHECK(hs.state == POOL_HOLDER_SWEPT && hs.refs == 0, "victim not swept");

		pool_stats(&pool, &st);
		CHECK(st.refs_held == NPARENT, "round %u: %llu references recorded, the survivor "
		      "holds %u", round, (unsigned long long)st.refs_held, NPARENT);
		CHECK(st.free_listed + st.used <= st.carved, "round %u: %llu bytes free-listed + %llu "
		      "used > %llu carved: a block freed twice", round,
		      (unsigned long long)st.free_listed, (unsigned long long)st.used,
		      (unsigned long long)st.carved);
		CHECK(st.blocks_live - NPARENT <= st.refs_unrecorded,
		      "round %u: %llu blocks live beyond the survivor's, only %llu leaked references",
		      round, (unsigned long long)(st.blocks_live - NPARENT),
		      (unsigned long long)st.refs_unrecorded);
		check_fresh(&pool, sh, &x);
	}

	for (uint32_t i = 0; i < NPARENT; i++) {
		CHECK(parent_intact(&pool, sh, i), "survivor's block %u damaged", i);
		CHECK_OK(pool_unref(&pool, 0, sh->parent_off[i]));
	}
	CHECK(pool_leave(&pool, 0) == 0, "the survivor held more than its blocks");
	pool_stats(&pool, &st);
	CHECK(st.refs_held == 0, "references still recorded");
	CHECK(st.blocks_live <= st.refs_unrecorded, "%llu blocks live, %llu leaked references",
	      (unsigned long long)st.blocks_live, (unsigned long long)st.refs_unrecorded);
	CHECK(st.free_listed + st.used <= st.carved, "a block freed twice");
	printf("pool_crash: %u kills, %llu references swept; leaked by deaths mid-change: %llu "
	       "references (%llu bytes in %llu blocks still live), %llu bytes lost; used %llu bytes "
	       "(%llu by the survivor before it let go); %llu free-list rebuilds after a death "
	       "under the pool's lock\n",
	       rounds, (unsigned long long)swept, (unsigned long long)st.refs_unrecorded,
	       (unsigned long long)st.used, (unsigned long long)st.blocks_live,
	       (unsigned long long)st.lost, (unsigned long long)st.used,
	       (unsigned long long)parent_bytes,
	       (unsigned long long)atomic_load(&pool.hdr->rebuilds));
	pool_detach(&pool);
	munmap(sh, sizeof(*sh));
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
