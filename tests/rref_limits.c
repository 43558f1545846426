/*
 * RRef limits and edge cases, in a job of 2 workers with room for 8 RRefs
 * (shmrun --max-rrefs 8). Rank 0 drives, rank 1 serves:
 *  - the table full: the 9th remote() fails with -ENOSPC and a text naming
 *    --max-rrefs, whoever the owner; once one RRef is freed a remote()
 *    works again (at once for an RRef we own, after the owner's delete for
 *    one of rank 1's);
 *  - a delete while a fork is in flight: rank 0 sends an RRef to rank 1 and
 *    frees its own handle before rank 1's call reads it (the call waits at
 *    a gate): the table still holds it, with rank 1's reference, and rank 1
 *    reads the value; for values ready or still pending, owned by either;
 *  - the same RRef twice in one call (two forks to one receiver);
 *  - a retained copy and the original freed in either order: the value stays
 *    readable until the last one goes, then the entry goes;
 *  - local_value() on a user fails naming the owner, on the owner works;
 *  - to_here() with a timeout on a value not ready: -ETIMEDOUT, "was not
 *    ready within"; without one it then gets the value;
 *  - a nil value (its owner keeps nothing of it) leaves the table with its
 *    last handle's free, before anything runs on the owner.
 * At the end the table and the pool are empty while both workers run.
 */
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "worker/link.h"
#include "worker/rref.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define MAX_RREFS 8
#define GONE_WAIT_NS (5ull * 1000000000ull) /* an owner's delete message on a loaded machine */

/* "make"(seed, ms): [seed, seed*7+1] after ms. */
static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value *items = shmrpc_call_alloc(c, 2 * sizeof(*items));

	(void)n, (void)u;
	if (!items)
		return -ENOMEM;
	usleep((useconds_t)a[1].u.i * 1000);
	items[0] = a[0];
	items[1] = shmrpc_int(a[0].u.i * 7 + 1);
	*r = shmrpc_list(items, 2);
	return 0;
}

static void check_value(const shmrpc_value *v, int64_t seed)
{
	CHECK(v->type == SHMRPC_LIST && v->len == 2 && v->u.items[0].u.i == seed &&
	      v->u.items[1].u.i == seed * 7 + 1, "not the value of seed %lld", (long long)seed);
}

static void check_rref(shmrpc_rref *r, int64_t seed)
{
	shmrpc_future *f;

	CHECK_OK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f));
	check_value(shmrpc_future_value(f), seed);
	shmrpc_future_free(f);
}

/* Rank 1's "read" calls wait here while rank 0 keeps it shut. */
static atomic_int gate_open = 1;

/* "gate"(open) */
static int fn_gate(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	atomic_store(&gate_open, a[0].u.b);
	*r = shmrpc_nil();
	return 0;
}

static void gate(bool open)
{
	shmrpc_value v = shmrpc_bool(open);
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_sync(1, "gate", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
}

/* "read"(seed, rrefs...): waits at the gate, then reads each; returns seed. */
static int fn_read(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)u;
	while (!atomic_load(&gate_open))
		usleep(1000);
	for (uint32_t i = 1; i < n; i++) {
		CHECK(a[i].type == SHMRPC_RREF, "argument %u is a %s", i, shmrpc_type_name(a[i].type));
		check_rref(a[i].u.r, a[0].u.i);
	}
	*r = a[0];
	return 0;
}

static shmrpc_rref *make(int owner, int64_t seed, int64_t ms)
{
	shmrpc_value args[2] = { shmrpc_int(seed), shmrpc_int(ms) };
	shmrpc_rref *r;

	CHECK_OK(shmrpc_remote(owner, "make", args, 2, SHMRPC_TIMEOUT_DEFAULT, &r));
	return r;
}

/* Waits until id leaves the table (an owner of 1 frees it on our delete message). */
static void wait_gone(uint64_t id)
{
	uint64_t t0 = shmrpc_now_ns();
	uint32_t slot;

	while (rref_find(&worker_agent->rrefs, id, &slot) == 0) {
		CHECK(shmrpc_now_ns() - t0 < GONE_WAIT_NS, "RRef %llx is still in the table",
		      (unsigned long long)id);
		usleep(1000);
	}
}

static uint32_t count_of(uint64_t id, uint32_t rank)
{
	uint32_t slot;

	CHECK(rref_find(&worker_agent->rrefs, id, &slot) == 0, "RRef %llx is not in the table",
	      (unsigned long long)id);
	return rref_count_of(&worker_agent->rrefs, slot, rank);
}

/* rank 0 holds want references to id: handles; as the owner it may also
 * hold its run's, which goes just after the value is stored. */
static void expect_ours(uint64_t id, int owner, uint32_t want)
{
	uint32_t c = count_of(id, 0);

	CHECK(c == want || (owner == 0 && c == want + 1), "rank 0 holds %u references to an RRef "
	      "of worker %d, want %u", c, owner, want);
}

static void table_full(void)
{
	shmrpc_rref *r[MAX_RREFS], *extra;
	uint64_t t0, id;
	int tries = 0, rc;

	for (int i = 0; i < MAX_RREFS; i++) {
		r[i] = make(i % 2, i, 0);
		check_rref(r[i], i);
	}
	for (int owner = 0; owner < 2; owner++) {
		shmrpc_value args[2] = { shmrpc_int(99), shmrpc_int(0) };

		rc = shmrpc_remote(owner, "make", args, 2, SHMRPC_TIMEOUT_DEFAULT, &extra);
		CHECK(rc == -ENOSPC && !extra, "remote() on a full table: %d (%s)", rc, shmrpc_errmsg());
		CHECK(strstr(shmrpc_errmsg(), "--max-rrefs"), "\"%s\" does not say what to raise",
		      shmrpc_errmsg());
	}
	/* Ours goes at once. */
	shmrpc_rref_free(r[0]);
	r[0] = make(1, 100, 0);
	check_rref(r[0], 100);
	/* Rank 1's goes when rank 1 has our delete. */
	id = r[1]->id;
	shmrpc_rref_free(r[1]);
	t0 = shmrpc_now_ns();
	for (;;) {
		shmrpc_value args[2] = { shmrpc_int(101), shmrpc_int(0) };

		tries++;
		rc = shmrpc_remote(1, "make", args, 2, SHMRPC_TIMEOUT_DEFAULT, &r[1]);
		if (rc == 0)
			break;
		CHECK(rc == -ENOSPC && shmrpc_now_ns() - t0 < GONE_WAIT_NS, "remote(): %d (%s)", rc,
		      shmrpc_errmsg());
		usleep(1000);
	}
	check_rref(r[1], 101);
	CHECK(rref_find(&worker_agent->rrefs, id, &(uint32_t){ 0 }) == -ENOENT, "the freed one stays");
	fprintf(stderr, "rank 0: table full: -ENOSPC naming --max-rrefs; after a free, remote() "
		"works again (at once for ours, try %d for rank 1's)\n", tries);
	for (int i = 0; i < MAX_RREFS; i++) {
		id = r[i]->id;
		shmrpc_rref_free(r[i]);
		wait_gone(id);
	}
}

/* Sends each RRef to rank 1 (n times in one call) and frees ours before the call reads it. */
static void fork_in_flight(int owner, int64_t ms, int times)
{
	int64_t seed = 200 + owner * 10 + ms + times;
	shmrpc_rref *r = make(owner, seed, ms);
	shmrpc_value args[3] = { shmrpc_int(seed), shmrpc_rref_value(r), shmrpc_rref_value(r) };
	uint64_t id = r->id;
	shmrpc_future *f;

	if (!ms)
		check_rref(r, seed); /* ready before it travels */
	gate(false);
	CHECK_OK(shmrpc_rpc_async(1, "read", args, 1 + (uint32_t)times, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_rref_free(r);
	/* Rank 1's references were made before the call went; ours is gone. */
	expect_ours(id, owner, 0);
	CHECK(count_of(id, 1) >= (uint32_t)times, "rank 1 holds %u references", count_of(id, 1));
	gate(true);
	CHECK_OK(shmrpc_future_wait(f, -1));
	CHECK(shmrpc_future_value(f)->u.i == seed, "read returned %lld",
	      (long long)shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	wait_gone(id);
}

static void retain_and_free(int owner, bool original_first)
{
	int64_t seed = 300 + owner * 2 + original_first;
	shmrpc_rref *r = make(owner, seed, 0), *copy, *first, *last;
	uint64_t id = r->id;

	check_rref(r, seed);
	CHECK_OK(shmrpc_rref_retain(r, &copy));
	expect_ours(id, owner, 2);
	first = original_first ? r : copy;
	last = original_first ? copy : r;
	shmrpc_rref_free(first);
	expect_ours(id, owner, 1);
	check_rref(last, seed);
	shmrpc_rref_free(last);
	wait_gone(id);
}

static void local_value(void)
{
	shmrpc_rref *user = make(1, 400, 0), *mine = make(0, 401, 0);
	const shmrpc_value *v;
	int rc;

	rc = shmrpc_rref_local_value(user, &v);
	CHECK(rc == -EPERM, "local_value on a user: %d (%s)", rc, rc ? shmrpc_errmsg() : "it worked");
	CHECK(strstr(shmrpc_errmsg(), "can't call localValue() on user") &&
	      strstr(shmrpc_errmsg(), "owner worker 1 (worker1)"), "%s", shmrpc_errmsg());
	CHECK_OK(shmrpc_rref_local_value(mine, &v));
	check_value(v, 401);
	shmrpc_rref_free(user);
	shmrpc_rref_free(mine);
}

static void to_here_timeout(void)
{
	shmrpc_rref *r = make(1, 500, 500);
	shmrpc_future *f;
	int rc = shmrpc_rref_to_here(r, 50, &f);

	CHECK(rc == -ETIMEDOUT && !f, "to_here(50 ms) of a value 500 ms away: %d (%s)", rc,
	      rc ? shmrpc_errmsg() : "it came");
	CHECK(strstr(shmrpc_errmsg(), "was not ready within"), "%s", shmrpc_errmsg());
	check_rref(r, 500);
	shmrpc_rref_free(r);
}

/* A value its owner keeps nothing of (nil: inline in the entry) leaves the
 * table with the last handle's free, at once: the owner does nothing. */
static void alone_at_free(void)
{
	shmrpc_value open = shmrpc_bool(true);
	shmrpc_future *f;
	shmrpc_rref *r, *copy;
	uint64_t id;

	CHECK_OK(shmrpc_remote(1, "gate", &open, 1, SHMRPC_TIMEOUT_DEFAULT, &r));
	CHECK_OK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->type == SHMRPC_NIL, "gate() gave a %s",
	      shmrpc_type_name(shmrpc_future_value(f)->type));
	shmrpc_future_free(f);
	id = r->id;
	CHECK_OK(shmrpc_rref_retain(r, &copy));
	shmrpc_rref_free(r);
	expect_ours(id, 1, 1);
	shmrpc_rref_free(copy);
	CHECK(rref_find(&worker_agent->rrefs, id, &(uint32_t){ 0 }) == -ENOENT,
	      "a nil RRef stays in the table after its last free");
}

static void drive(void)
{
	table_full();
	alone_at_free();
	for (int owner = 0; owner < 2; owner++) {
		fork_in_flight(owner, 0, 1);   /* a ready value */
		fork_in_flight(owner, 100, 1); /* a value still being made */
		fork_in_flight(owner, 0, 2);   /* twice in one call */
		retain_and_free(owner, true);
		retain_and_free(owner, false);
	}
	local_value();
	to_here_timeout();
	/* The last deletes, and the owners' frees, settle after their calls. */
	CHECK(tl_wait_empty(GONE_WAIT_NS), "%u RRefs live, %llu pool bytes used at the end",
	      tl_rrefs_live(), (unsigned long long)tl_pool_used());
	fprintf(stderr, "rank 0: all RRef limit checks passed, the table is empty\n");
}

static int worker(void)
{
	CHECK_OK(shmrpc_register("make", "ii", fn_make, NULL));
	CHECK_OK(shmrpc_register("read", NULL, fn_read, NULL));
	CHECK_OK(shmrpc_register("gate", "b", fn_gate, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0)
		drive();
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	static const char *const texts[] = { "rank 0: table full: -ENOSPC naming --max-rrefs",
					     "rank 0: all RRef limit checks passed", NULL };

	return tl_job_expect(worker, 0, texts, "-n", "2", "--max-rrefs", "8", NULL);
}
