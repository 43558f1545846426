/*
 * RRef forks by message (SHMRPC_RREF_FORK=message, docs/RREF.md): a user
 * that passes on an RRef it does not own keeps a pending-child reference;
 * the child asks the owner (RREF_FORK_REQUEST), then tells the parent
 * (RREF_CHILD_ACCEPT). 4 workers:
 *
 *  - chains: each worker makes RRefs on every owner and sends them along a
 *    chain of hops (rank + 1 each time, so through the owner too: a fork
 *    to the owner, and forks from it); every hop reads the value, the last
 *    returns the RRef (a fork back, in a reply) and the caller reads it;
 *  - a fork in flight, made to stay so: the owner (rank 2, one executor
 *    thread) is parked, and says so, before the parent sends the RRef on,
 *    so the child's RREF_FORK_REQUEST waits (frames from two peers have no
 *    order: had the park's frame still been in the owner's ring, the
 *    request could be taken first). Meanwhile
 *    the child's handle is not confirmed, the parent's count holds its
 *    pending-child reference and not the child's, the parent deletes its
 *    handle and the child still reads the value; once the owner runs, the
 *    counts move to the child, and the parent's goes to 0; the value,
 *    inline, is never marked alone where forks go by message (its last
 *    drop hands it to the owner, which frees the fork id too);
 *  - the child repeats its RREF_FORK_REQUEST and its RREF_CHILD_ACCEPT by
 *    hand (rref_send_fork_request / rref_send_child_accept, the protocol's
 *    own senders): both are acknowledged and no count moves;
 *  - at the end every worker sees the table empty and the pool unused
 *    while all owners still run (the owners freed every value), and the
 *    launcher finds nothing left.
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
#include "worker/rref.h"
#include "tests/lib/barrier.h"
#include "tests/lib/job.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define NWORKERS 4
#define PARENT 0
#define CHILD 1
#define OWNER 2
#define HOPS 5
#define SETTLE_NS (10ull * 1000000000ull) /* messages still in flight */

static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value *items = shmrpc_call_alloc(c, 2 * sizeof(*items));

	(void)n, (void)u;
	if (!items)
		return -ENOMEM;
	items[0] = shmrpc_int(a[0].u.i);
	items[1] = shmrpc_int(a[0].u.i * 7 + 1);
	*r = shmrpc_list(items, 2);
	return 0;
}

static void check_value(shmrpc_rref *r, int64_t seed)
{
	const shmrpc_value *v;
	shmrpc_future *f;

	CHECK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
	      "worker %d: to_here (seed %lld): %s", shmrpc_rank(), (long long)seed, shmrpc_errmsg());
	v = shmrpc_future_value(f);
	CHECK(v->type == SHMRPC_LIST && v->len == 2 && v->u.items[0].u.i == seed &&
	      v->u.items[1].u.i == seed * 7 + 1, "worker %d: not the value of seed %lld",
	      shmrpc_rank(), (long long)seed);
	shmrpc_future_free(f);
}

/* ---- chains ---- */

/* "hop"(rref, hops, seed): read it, pass it on, return it at the end. */
static int fn_hop(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *res, void *u)
{
	shmrpc_value args[3] = { a[0], shmrpc_int(a[1].u.i - 1), a[2] };
	shmrpc_future *f;

	(void)n, (void)u;
	check_value(a[0].u.r, a[2].u.i);
	if (a[1].u.i == 0) {
		*res = a[0]; /* back to the caller: a fork in a reply */
		return 0;
	}
	if (shmrpc_rpc_sync((shmrpc_rank() + 1) % NWORKERS, "hop", args, 3, SHMRPC_TIMEOUT_DEFAULT,
			    &f))
		return shmrpc_call_error(c, "RuntimeError", "hop: %s", shmrpc_errmsg());
	check_value(shmrpc_future_value(f)->u.r, a[2].u.i);
	shmrpc_future_free(f);
	*res = a[0];
	return 0;
}

static void chains(int me)
{
	for (int owner = 0; owner < NWORKERS; owner++) {
		int64_t seed = me * 100 + owner;
		shmrpc_value make = shmrpc_int(seed), args[3];
		const shmrpc_value *v;
		shmrpc_future *f;
		shmrpc_rref *r;

		CHECK_OK(shmrpc_remote(owner, "make", &make, 1, SHMRPC_TIMEOUT_DEFAULT, &r));
		args[0] = shmrpc_rref_value(r);
		args[1] = shmrpc_int(HOPS);
		args[2] = shmrpc_int(seed);
		CHECK_OK(shmrpc_rpc_sync((me + 1) % NWORKERS, "hop", args, 3, SHMRPC_TIMEOUT_DEFAULT,
					 &f));
		v = shmrpc_future_value(f);
		CHECK(v->type == SHMRPC_RREF && shmrpc_rref_owner(v->u.r) == owner,
		      "the chain gave back a %s", shmrpc_type_name(v->type));
		check_value(v->u.r, seed);
		shmrpc_future_free(f);
		check_value(r, seed);
		shmrpc_rref_free(r);
	}
}

/* ---- a fork in flight ---- */

/* The owner's only executor thread waits in "park" until its main thread,
 * back from the parent's "wait_go", lets it go; it tells the parent it is
 * parked first ("owner_parked"). */
static struct {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool parked, go, owner_parked;
} gate = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, false };

static void gate_wait(bool *what)
{
	pthread_mutex_lock(&gate.lock);
	while (!*what)
		pthread_cond_wait(&gate.cond, &gate.lock);
	pthread_mutex_unlock(&gate.lock);
}

static void gate_open(bool *what)
{
	pthread_mutex_lock(&gate.lock);
	*what = true;
	pthread_cond_broadcast(&gate.cond);
	pthread_mutex_unlock(&gate.lock);
}

static int fn_park(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_future *f;
	int rc;

	(void)a, (void)n, (void)u;
	/* Not waited for until let go: a thread waiting for a call is counted
	 * out of the pool, which then runs queued jobs (the child's request
	 * among them) on another (worker/executor.h). */
	if (shmrpc_rpc_async(PARENT, "owner_parked", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f))
		return shmrpc_call_error(c, "RuntimeError", "park: %s", shmrpc_errmsg());
	gate_wait(&gate.parked); /* on the owner, "parked" means "let go" */
	rc = shmrpc_future_wait(f, -1);
	shmrpc_future_free(f);
	if (rc)
		return shmrpc_call_error(c, "RuntimeError", "park: %s", shmrpc_strerror(rc));
	*r = shmrpc_nil();
	return 0;
}

/* On the parent, from the owner's "park" (the parent's second thread:
 * the first may be in "wait_go"). */
static int fn_owner_parked(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			   void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	gate_open(&gate.owner_parked);
	*r = shmrpc_nil();
	return 0;
}

/* On the parent: returns once its main thread says so. */
static int fn_wait_go(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	gate_wait(&gate.go);
	*r = shmrpc_nil();
	return 0;
}

/* The child's copy of the fork, its seed and the fork's id (the copy has
 * its own), under a lock: "keep" and the later calls may run on different
 * executor threads, ordered only through other processes, which a thread
 * sanitizer does not see. */
static struct {
	pthread_mutex_t lock;
	shmrpc_rref *r;
	int64_t seed;
	uint64_t fork_id;
} kept = { .lock = PTHREAD_MUTEX_INITIALIZER };

static shmrpc_rref *kept_get(int64_t *seed, uint64_t *fork_id)
{
	shmrpc_rref *r;

	pthread_mutex_lock(&kept.lock);
	r = kept.r;
	*seed = kept.seed;
	*fork_id = kept.fork_id;
	pthread_mutex_unlock(&kept.lock);
	return r;
}

/* "keep"(rref, seed) -> confirmed_by_owner of the fork that came in. */
static int fn_keep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	int rc;

	(void)c, (void)n, (void)u;
	check_value(a[0].u.r, a[1].u.i);
	*r = shmrpc_bool(shmrpc_rref_confirmed_by_owner(a[0].u.r));
	pthread_mutex_lock(&kept.lock);
	kept.seed = a[1].u.i;
	kept.fork_id = a[0].u.r->fork_id;
	rc = shmrpc_rref_retain(a[0].u.r, &kept.r);
	pthread_mutex_unlock(&kept.lock);
	return rc;
}

/* "read_kept"() -> confirmed_by_owner, after reading the value. */
static int fn_read_kept(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uint64_t fork_id;
	int64_t seed;
	shmrpc_rref *k = kept_get(&seed, &fork_id);

	(void)c, (void)a, (void)n, (void)u;
	check_value(k, seed);
	*r = shmrpc_bool(shmrpc_rref_confirmed_by_owner(k));
	return 0;
}

static void acked(shmrpc_future *f)
{
	CHECK(shmrpc_future_wait(f, -1) == 0, "a repeated fork message failed: %s", shmrpc_errmsg());
	shmrpc_future_free(f);
}

/* "repeat"(): the fork's messages once more, each acknowledged. */
static int fn_repeat(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uint64_t fork_id;
	int64_t seed;
	shmrpc_rref *k = kept_get(&seed, &fork_id);
	shmrpc_future *f;

	(void)c, (void)a, (void)n, (void)u;
	for (int i = 0; i < 2; i++) {
		CHECK_OK(rref_send_fork_request(worker_agent, k->id, k->slot, k->owner, fork_id, &f));
		acked(f);
		CHECK_OK(rref_send_child_accept(worker_agent, PARENT, fork_id, &f));
		acked(f);
	}
	*r = shmrpc_nil();
	return 0;
}

static int fn_drop_kept(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uint64_t fork_id;
	int64_t seed;
	shmrpc_rref *k = kept_get(&seed, &fork_id);

	(void)c, (void)a, (void)n, (void)u;
	check_value(k, seed);
	pthread_mutex_lock(&kept.lock);
	kept.r = NULL;
	pthread_mutex_unlock(&kept.lock);
	shmrpc_rref_free(k);
	*r = shmrpc_nil();
	return 0;
}

static uint32_t count_of(uint32_t slot, uint32_t rank)
{
	return rref_count_of(&worker_agent->rrefs, slot, rank);
}

static uint32_t total_of(uint32_t slot, uint64_t id)
{
	struct rref_info info;

	return rref_info_at(&worker_agent->rrefs, slot, &info) && info.id == id ? info.total : 0;
}

/* id's value is marked RREF_VALUE_ALONE: its last live drop would remove
 * it without a word to the owner. */
static bool alone(uint32_t slot, uint64_t id)
{
	struct rref_info info;

	return rref_info_at(&worker_agent->rrefs, slot, &info) && info.id == id &&
	       (info.value_len & RREF_VALUE_ALONE);
}

static bool call_bool(int dst, const char *fn, const shmrpc_value *args, uint32_t nargs)
{
	shmrpc_future *f;
	bool b;

	CHECK_OK(shmrpc_rpc_sync(dst, fn, args, nargs, SHMRPC_TIMEOUT_DEFAULT, &f));
	b = shmrpc_future_value(f)->u.b;
	shmrpc_future_free(f);
	return b;
}

/* Waits (a bound, not a timing) until the counts of (slot, id) are these. */
static void wait_counts(uint32_t slot, uint64_t id, uint32_t parent, uint32_t child,
			uint32_t total)
{
	uint64_t t0 = shmrpc_now_ns();

	while (count_of(slot, PARENT) != parent || count_of(slot, CHILD) != child ||
	       total_of(slot, id) != total) {
		CHECK(shmrpc_now_ns() - t0 < SETTLE_NS, "counts parent %u child %u total %u, want "
		      "%u %u %u", count_of(slot, PARENT), count_of(slot, CHILD), total_of(slot, id),
		      parent, child, total);
		usleep(1000);
	}
}

static void in_flight(void)
{
	int64_t seed = 4242;
	shmrpc_value make = shmrpc_int(seed), args[2];
	shmrpc_future *park;
	shmrpc_rref *r;
	uint32_t slot;
	uint64_t id;

	CHECK_OK(shmrpc_remote(OWNER, "make", &make, 1, SHMRPC_TIMEOUT_DEFAULT, &r));
	check_value(r, seed);
	slot = r->slot;
	id = r->id;
	wait_counts(slot, id, 1, 0, 1);
	CHECK(!alone(slot, id), "a value is marked alone where forks go by message");
	/* The owner's thread parks; the child's request queues behind it. */
	CHECK_OK(shmrpc_rpc_async(OWNER, "park", NULL, 0, SHMRPC_TIMEOUT_NONE, &park));
	gate_wait(&gate.owner_parked);
	args[0] = shmrpc_rref_value(r);
	args[1] = shmrpc_int(seed);
	CHECK(!call_bool(CHILD, "keep", args, 2), "the child's fork is confirmed while the owner "
	      "is parked");
	/* Our handle and our pending child; nothing of the child's yet. */
	CHECK(count_of(slot, PARENT) == 2 && count_of(slot, CHILD) == 0 &&
	      count_of(slot, OWNER) == 0 && total_of(slot, id) == 2,
	      "in flight: counts parent %u child %u owner %u total %u", count_of(slot, PARENT),
	      count_of(slot, CHILD), count_of(slot, OWNER), total_of(slot, id));
	/* Delete while the fork is in flight: the pending child keeps it. */
	shmrpc_rref_free(r);
	CHECK(count_of(slot, PARENT) == 1 && total_of(slot, id) == 1,
	      "after the parent's delete: count %u total %u", count_of(slot, PARENT),
	      total_of(slot, id));
	CHECK(!call_bool(CHILD, "read_kept", NULL, 0), "confirmed while the owner is parked");
	gate_open(&gate.go); /* the owner's main thread lets its executor go */
	CHECK_OK(shmrpc_future_wait(park, -1));
	shmrpc_future_free(park);
	/* The owner made the child's reference; the child's accept took ours. */
	wait_counts(slot, id, 0, 1, 1);
	CHECK(!alone(slot, id), "a value forked by message is marked alone");
	CHECK(call_bool(CHILD, "read_kept", NULL, 0), "not confirmed after the owner ran");
	/* Repeated requests and accepts change nothing. */
	CHECK_OK(shmrpc_rpc_sync(CHILD, "repeat", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &park));
	shmrpc_future_free(park);
	CHECK(count_of(slot, PARENT) == 0 && count_of(slot, CHILD) == 1 &&
	      count_of(slot, OWNER) == 0 && total_of(slot, id) == 1,
	      "after repeated messages: counts parent %u child %u owner %u total %u",
	      count_of(slot, PARENT), count_of(slot, CHILD), count_of(slot, OWNER),
	      total_of(slot, id));
	CHECK_OK(shmrpc_rpc_sync(CHILD, "drop_kept", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &park));
	shmrpc_future_free(park);
	wait_counts(slot, id, 0, 0, 0); /* the owner freed it: the slot no longer holds id */
}

/* ---- the end ---- */

static void wait_empty(void)
{
	tl_wait_empty(SETTLE_NS);
	CHECK(tl_rrefs_live() == 0 && tl_pool_used() == 0, "worker %d: %u RRefs live, %llu pool "
	      "bytes used", shmrpc_rank(), tl_rrefs_live(), (unsigned long long)tl_pool_used());
}

static int worker(void)
{
	struct shmrpc_options o = SHMRPC_OPTIONS(.num_threads = 2);
	shmrpc_future *f;
	int me;

	CHECK(getenv("SHMRPC_RREF_FORK") && !strcmp(getenv("SHMRPC_RREF_FORK"), "message"),
	      "SHMRPC_RREF_FORK is not message in the worker");
	CHECK_OK(shmrpc_register("make", "i", fn_make, NULL));
	CHECK_OK(shmrpc_register("hop", "rii", fn_hop, NULL));
	CHECK_OK(shmrpc_register("park", "", fn_park, NULL));
	CHECK_OK(shmrpc_register("wait_go", "", fn_wait_go, NULL));
	CHECK_OK(shmrpc_register("owner_parked", "", fn_owner_parked, NULL));
	CHECK_OK(shmrpc_register("keep", "ri", fn_keep, NULL));
	CHECK_OK(shmrpc_register("read_kept", "", fn_read_kept, NULL));
	CHECK_OK(shmrpc_register("repeat", "", fn_repeat, NULL));
	CHECK_OK(shmrpc_register("drop_kept", "", fn_drop_kept, NULL));
	CHECK_OK(tl_barrier_register());
	me = atoi(getenv("SHMRPC_RANK"));
	if (me == OWNER)
		o.num_threads = 1; /* parked by "park" in the second phase */
	CHECK_OK(shmrpc_init(&o));
	chains(me);
	tl_barrier(0, NWORKERS);
	if (me == PARENT) {
		in_flight();
	} else if (me == OWNER) {
		/* Back from the parent's wait_go, let the parked thread go. */
		CHECK_OK(shmrpc_rpc_sync(PARENT, "wait_go", NULL, 0, SHMRPC_TIMEOUT_NONE, &f));
		shmrpc_future_free(f);
		gate_open(&gate.parked);
	}
	tl_barrier(1, NWORKERS);
	wait_empty();
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	setenv("SHMRPC_RREF_FORK", "message", 1);
	return tl_job_test(worker, "-n", "4", NULL);
}
