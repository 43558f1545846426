/*
 * Fork fuzz: 8 workers pass 10 k RRefs around at random and drop them.
 *
 * Every worker makes its share of RRefs with remote() on random owners
 * (itself included); a value is [seed, seed*7+1], sometimes with a small
 * tensor filled from the seed, so whoever reads it can tell it is the
 * value of that RRef. The creator sends each RRef to a few random workers
 * at once ("take", fan-out), and often drops its own handle before those
 * calls have run. A taker reads the value, then forwards it along a chain
 * of further takes, returns it (a fork back to its caller), or keeps a
 * copy that it reads and drops later at random. Every read must find the
 * value: no value is freed while a reference reaches it. At the end
 * everyone drops what it kept, and every worker waits until the RRef table
 * is empty and the tensor pool holds nothing while all owners still run,
 * so the owners freed every value themselves; the launcher then finds the
 * table empty too. Run twice: with forks charged in the table, and with
 * SHMRPC_RREF_FORK=message (torch's fork messages, docs/RREF.md);
 * RREF_FORK_FUZZ_MODE=table or message runs one of the two.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "shm/pool.h"
#include "worker/link.h"
#include "tests/lib/barrier.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define WORKERS "8"
#define TOTAL_RREFS 10000
#define TENSOR_BYTES 64
#define MAX_FANOUT 3
#define MAX_HOPS 3
#define KEPT_MAX 64   /* copies a worker's takes keep */
#define WINDOW 32     /* handles a driver keeps a while before dropping */
#define EMPTY_WAIT_NS (10ull * 1000000000ull) /* deletes still in flight at the end */

static const DLDataType u8 = { kDLUInt, 8, 1 };

/* xorshift64*, one state per thread, seeded from the rank and the thread. */
static __thread uint64_t rng;
static atomic_uint rng_seeds;

static uint64_t rnd(void)
{
	if (!rng)
		rng = ((uint64_t)shmrpc_rank() + 1) * 0x9e3779b97f4a7c15ull ^
		      (atomic_fetch_add(&rng_seeds, 1) + 1) * 0xbf58476d1ce4e5b9ull;
	rng ^= rng >> 12;
	rng ^= rng << 25;
	rng ^= rng >> 27;
	return rng * 0x2545f4914f6cdd1dull;
}

static atomic_long n_reads, n_forwards, n_returns, n_kept;

/* "make"(seed, with_tensor): [seed, seed*7+1] or [seed, seed*7+1, tensor]. */
static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value *items = shmrpc_call_alloc(c, 3 * sizeof(*items));
	int64_t seed = a[0].u.i, shape[1] = { TENSOR_BYTES };
	shmrpc_tensor *t;

	(void)n, (void)u;
	if (!items)
		return -ENOMEM;
	items[0] = shmrpc_int(seed);
	items[1] = shmrpc_int(seed * 7 + 1);
	if (!a[1].u.b) {
		*r = shmrpc_list(items, 2);
		return 0;
	}
	CHECK_OK(shmrpc_tensor_alloc(u8, 1, shape, &t));
	for (int i = 0; i < TENSOR_BYTES; i++)
		((uint8_t *)shmrpc_tensor_data(t))[i] = (uint8_t)(seed + i);
	items[2] = shmrpc_tensor_value(t); /* the call frees our handle; the RRef holds its own */
	*r = shmrpc_list(items, 3);
	return 0;
}

/* Reads r and checks that it holds the value made from seed. */
static void check_rref(shmrpc_rref *r, int64_t seed)
{
	const shmrpc_value *v, *it;
	shmrpc_future *f;
	char rs[256];

	shmrpc_rref_str(r, rs, sizeof(rs));
	CHECK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
	      "worker %d: to_here of %s (seed %lld): %s", shmrpc_rank(), rs, (long long)seed,
	      shmrpc_errmsg());
	v = shmrpc_future_value(f);
	it = v->u.items;
	CHECK(v->type == SHMRPC_LIST && (v->len == 2 || v->len == 3) && it[0].type == SHMRPC_INT &&
	      it[1].type == SHMRPC_INT, "%s: a value of the wrong shape", rs);
	CHECK(it[0].u.i == seed && it[1].u.i == seed * 7 + 1, "%s holds [%lld, %lld], want seed %lld",
	      rs, (long long)it[0].u.i, (long long)it[1].u.i, (long long)seed);
	if (v->len == 3) {
		const uint8_t *b;

		CHECK(it[2].type == SHMRPC_TENSOR && shmrpc_tensor_nbytes(it[2].u.t) == TENSOR_BYTES,
		      "%s: not the tensor made", rs);
		b = shmrpc_tensor_data(it[2].u.t);
		for (int i = 0; i < TENSOR_BYTES; i++)
			CHECK(b[i] == (uint8_t)(seed + i), "%s: tensor byte %d is %u, want %u", rs, i,
			      b[i], (uint8_t)(seed + i));
	}
	shmrpc_future_free(f);
	atomic_fetch_add(&n_reads, 1);
}

/* A set of held handles with their seeds; a handle pushed out is read
 * once more, then dropped. */
struct held {
	shmrpc_rref *r;
	int64_t seed;
};

/* Puts (r, seed) in one of the cap slots of set; *out: what it pushed out
 * (r NULL if none); putting r NULL takes a random one out. */
static void swap_random(struct held *set, int cap, struct held in, struct held *out)
{
	int i = (int)(rnd() % (uint64_t)cap);

	*out = set[i];
	set[i] = in;
}

static void drop(struct held h)
{
	if (!h.r)
		return;
	check_rref(h.r, h.seed);
	shmrpc_rref_free(h.r);
}

/* Copies kept by this worker's takes, dropped at random by later takes. */
static struct {
	pthread_mutex_t lock;
	struct held set[KEPT_MAX];
} kept = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* Reading and freeing happen outside the lock: a read on an executor
 * thread may run other takes meanwhile. */
static void kept_swap(struct held in)
{
	struct held out;

	pthread_mutex_lock(&kept.lock);
	swap_random(kept.set, KEPT_MAX, in, &out);
	pthread_mutex_unlock(&kept.lock);
	drop(out);
}

/*
 * Sends r to 1..MAX_FANOUT random workers at once, each to take it with
 * hops-1 hops left. *res: the first RRef one of them returned (ours to
 * give: the call frees it after the reply), or nil.
 */
static int forward(shmrpc_call *c, shmrpc_rref *r, int64_t hops, int64_t seed, shmrpc_value *res)
{
	shmrpc_future *f[MAX_FANOUT];
	shmrpc_value args[3] = { shmrpc_rref_value(r), shmrpc_int(hops - 1), shmrpc_int(seed) };
	int nf = 1 + (int)(rnd() % MAX_FANOUT), rc = 0;

	atomic_fetch_add(&n_forwards, 1);
	for (int i = 0; i < nf; i++)
		CHECK_OK(shmrpc_rpc_async((int)(rnd() % (uint64_t)shmrpc_world_size()), "take", args, 3,
					  SHMRPC_TIMEOUT_DEFAULT, &f[i]));
	*res = shmrpc_nil();
	for (int i = 0; i < nf; i++) {
		const shmrpc_value *v;
		shmrpc_rref *back;

		CHECK(shmrpc_future_wait(f[i], -1) == 0, "worker %d: a forwarded take failed: %s",
		      shmrpc_rank(), shmrpc_errmsg());
		v = shmrpc_future_value(f[i]);
		if (v->type == SHMRPC_RREF && res->type == SHMRPC_NIL) {
			check_rref(v->u.r, seed);
			rc = shmrpc_rref_retain(v->u.r, &back);
			if (rc == 0)
				*res = shmrpc_rref_value(back);
		}
		shmrpc_future_free(f[i]);
	}
	return rc ? shmrpc_call_error(c, "RuntimeError", "retain: %s", shmrpc_errmsg()) : 0;
}

/* "take"(rref, hops, seed): read it, then forward, return, keep or let go. */
static int fn_take(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *res, void *u)
{
	shmrpc_rref *r = a[0].u.r;
	int64_t hops = a[1].u.i, seed = a[2].u.i;
	uint64_t p = rnd() % 100;

	(void)n, (void)u;
	check_rref(r, seed);
	*res = shmrpc_nil();
	if (hops > 0 && p < 35)
		return forward(c, r, hops, seed, res);
	if (p < 65) {
		atomic_fetch_add(&n_returns, 1);
		*res = a[0]; /* the argument itself: a fork back to the caller */
		return 0;
	}
	if (p < 90) {
		struct held h = { NULL, seed };

		CHECK_OK(shmrpc_rref_retain(r, &h.r));
		atomic_fetch_add(&n_kept, 1);
		kept_swap(h);
	} else {
		kept_swap((struct held){ NULL, 0 });
	}
	return 0;
}

/* ---- the end: the owners freed everything ---- */

static void dump_table(void)
{
	struct rref_table *t = &worker_agent->rrefs;

	for (uint32_t s = 0; s < t->capacity; s++) {
		struct rref_info info;

		if (!rref_info_at(t, s, &info))
			continue;
		fprintf(stderr, "worker %d: left: id %u:%llu owner %u creator %u %s total %u, counts",
			shmrpc_rank(), RREF_ID_RANK(info.id),
			(unsigned long long)RREF_ID_LOCAL(info.id), info.owner, info.creator,
			rref_state_name(info.state), info.total);
		for (uint32_t k = 0; k < t->world; k++)
			fprintf(stderr, " %u", rref_count_of(t, s, k));
		fputc('\n', stderr);
	}
}

static void wait_empty(void)
{
	uint64_t t0 = shmrpc_now_ns();

	if (!tl_wait_empty(EMPTY_WAIT_NS) && tl_rrefs_live())
		dump_table();
	CHECK(tl_rrefs_live() == 0 && tl_pool_used() == 0, "worker %d: %u RRefs live and %llu pool "
	      "bytes used %.1f s after everyone dropped everything", shmrpc_rank(), tl_rrefs_live(),
	      (unsigned long long)tl_pool_used(), (double)(shmrpc_now_ns() - t0) / 1e9);
}

/* ---- the driver ---- */

static void drive(int count)
{
	static struct held window[WINDOW];
	int world = shmrpc_world_size(), me = shmrpc_rank();

	for (int i = 0; i < count; i++) {
		int64_t seed = ((int64_t)(me + 1) << 32) | i;
		shmrpc_value make[2] = { shmrpc_int(seed), shmrpc_bool(rnd() % 8 == 0) };
		shmrpc_future *f[MAX_FANOUT];
		int nf = (int)(rnd() % (MAX_FANOUT + 1));
		struct held out;
		shmrpc_rref *r;

		CHECK_OK(shmrpc_remote((int)(rnd() % (uint64_t)world), "make", make, 2,
				       SHMRPC_TIMEOUT_DEFAULT, &r));
		if (rnd() % 4 == 0)
			check_rref(r, seed); /* often before the owner has run make */
		for (int j = 0; j < nf; j++) {
			shmrpc_value take[3] = { shmrpc_rref_value(r),
						 shmrpc_int((int64_t)(rnd() % (MAX_HOPS + 1))),
						 shmrpc_int(seed) };

			CHECK_OK(shmrpc_rpc_async((int)(rnd() % (uint64_t)world), "take", take, 3,
						  SHMRPC_TIMEOUT_DEFAULT, &f[j]));
		}
		/* Our handle goes now (forks in flight), later, or after the takes. */
		switch (rnd() % 3) {
		case 0:
			shmrpc_rref_free(r);
			r = NULL;
			break;
		case 1:
			swap_random(window, WINDOW, (struct held){ r, seed }, &out);
			drop(out);
			r = NULL;
			break;
		}
		for (int j = 0; j < nf; j++) {
			const shmrpc_value *v;

			CHECK(shmrpc_future_wait(f[j], -1) == 0, "worker %d: take of seed %lld: %s", me,
			      (long long)seed, shmrpc_errmsg());
			v = shmrpc_future_value(f[j]);
			if (v->type == SHMRPC_RREF) {
				struct held back = { NULL, seed };

				check_rref(v->u.r, seed);
				if (rnd() % 2) {
					CHECK_OK(shmrpc_rref_retain(v->u.r, &back.r));
					swap_random(window, WINDOW, back, &out);
					drop(out);
				}
			}
			shmrpc_future_free(f[j]);
		}
		if (r)
			drop((struct held){ r, seed });
	}
	for (int i = 0; i < WINDOW; i++) {
		drop(window[i]);
		window[i].r = NULL;
	}
}

static int worker(void)
{
	int count;
	uint64_t t0;

	CHECK_OK(shmrpc_register("make", "ib", fn_make, NULL));
	CHECK_OK(shmrpc_register("take", "rii", fn_take, NULL));
	CHECK_OK(tl_barrier_register());
	CHECK_OK(shmrpc_init(NULL));
	count = (int)(TOTAL_RREFS * tl_scale()) / shmrpc_world_size();
	if (count < 8)
		count = 8;
	t0 = shmrpc_now_ns();
	drive(count);
	tl_barrier(0, shmrpc_world_size()); /* no take runs any more */
	for (int i = 0; i < KEPT_MAX; i++) {
		struct held h;

		pthread_mutex_lock(&kept.lock);
		h = kept.set[i];
		kept.set[i].r = NULL;
		pthread_mutex_unlock(&kept.lock);
		drop(h);
	}
	tl_barrier(1, shmrpc_world_size()); /* every handle of the job is gone */
	wait_empty();
	fprintf(stderr, "worker %d: %d RRefs made, %ld reads, %ld forwards, %ld returns, %ld kept: "
		"all freed (%.1f s)\n", shmrpc_rank(), count, atomic_load(&n_reads),
		atomic_load(&n_forwards), atomic_load(&n_returns), atomic_load(&n_kept),
		(double)(shmrpc_now_ns() - t0) / 1e9);
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

/* RREF_FORK_FUZZ_MODE=table or message runs that mode only (to repeat
 * one under load); unset, both run. */
int main(void)
{
	const char *only = getenv("RREF_FORK_FUZZ_MODE");
	int rc;

	if (tl_is_worker())
		return worker();
	CHECK(!only || !strcmp(only, "table") || !strcmp(only, "message"),
	      "RREF_FORK_FUZZ_MODE=%s: expected table or message", only);
	if (!only || !strcmp(only, "table")) {
		rc = tl_job_test(worker, "-n", WORKERS, NULL);
		if (rc || only)
			return rc;
	}
	setenv("SHMRPC_RREF_FORK", "message", 1);
	return tl_job_test(worker, "-n", WORKERS, NULL);
}
