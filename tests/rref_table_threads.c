/* The RRef table from several threads of one process, as a worker's
 * executor threads use it: an insert tries the slot its process emptied
 * last (freed_hint), so a slot is taken again at once, by whichever thread
 * inserts next. A message that names an entry by slot is checked against
 * the id: every call made with an id whose slot was reused refuses, and
 * leaves the new RRef as it was. Then threads create, hold, store, drop
 * and remove RRefs at once on a small table, each checking that the
 * entries it holds keep their ids, while another reads every slot as
 * inspectors and debug counts do. Run under TSan (make SAN=thread). */
#include <errno.h>
#include <pthread.h>
#include <string.h>

#include "shmrpc.h"
#include "shm/rref_table.h"
#include "tests/lib/testlib.h"

#define WORLD 4
#define THREADS 4
#define KEEP 3 /* entries each thread keeps alive across its steps */

static void refused(int rc, const char *what)
{
	CHECK(rc == -ENOENT && strstr(shmrpc_errmsg(), "it was deleted"),
	      "%s with a reused slot's old id: returned %d (%s)", what, rc, shmrpc_errmsg());
}

/* A reaches its last release and goes; B takes A's slot at once; every
 * call naming A by that slot refuses, and B's entry stays as made. */
static void test_reused_slot(struct rref_table *t)
{
	const uint64_t a = RREF_ID(0, 1), b = RREF_ID(0, 2);
	const uint64_t alone = RREF_VALUE_ALONE | RREF_VALUE_INLINE | 1;
	uint32_t sa, sb;
	struct rref_info in;

	CHECK_OK(rref_insert(t, a, 1, 0, 0, &sa));
	CHECK_OK(rref_store(t, sa, a, RREF_READY, 7, alone));
	CHECK(rref_release(t, sa, a, 0, 1) == 2, "A's last release removes it");
	CHECK_OK(rref_insert(t, b, 2, 3, 0, &sb));
	CHECK(sb == sa, "B went to slot %u, not to A's slot %u just emptied", sb, sa);

	refused(rref_hold(t, sa, a, 1, 1), "hold");
	refused(rref_release(t, sa, a, 3, 1), "release");
	refused(rref_store(t, sa, a, RREF_READY, 7, alone), "store");
	refused(rref_wait(t, sa, a, 0), "wait");
	refused(rref_remove(t, sa, a), "remove");
	CHECK(rref_sweep_entry(t, sa, a, 3) == 0, "sweep of the old id");
	CHECK(rref_mark_owner_dead(t, sa, a) == 0, "owner's death for the old id");

	CHECK(rref_info_at(t, sb, &in) && in.id == b && in.state == RREF_PENDING && in.owner == 2 &&
		      in.creator == 3 && in.total == 2 && rref_count_of(t, sb, 2) == 1 &&
		      rref_count_of(t, sb, 3) == 1 && rref_count_of(t, sb, 1) == 0,
	      "B changed by calls made for A: %s, owner %u, creator %u, total %u",
	      rref_state_name(in.state), in.owner, in.creator, in.total);
	CHECK_OK(rref_store(t, sb, b, RREF_READY, 7, alone));
	CHECK(rref_release(t, sb, b, 3, 1) == 2, "B's last release removes it");
}

struct churn {
	struct rref_table *t;
	uint32_t self;
	long steps;
	_Atomic int *stop;
};

static void check_held(struct rref_table *t, uint32_t slot, uint64_t id, uint32_t owner)
{
	struct rref_info in;

	CHECK(rref_info_at(t, slot, &in) && in.id == id && in.owner == owner,
	      "RRef %llx, held, is no longer at slot %u", (unsigned long long)id, slot);
}

/* One thread: RRefs of its own (owner self, creator self + 1), each
 * created, sometimes forked to a third rank, stored and dropped; KEEP of
 * them live at a time, so that slots are freed and taken among threads. */
static void *churn(void *arg)
{
	struct churn *c = arg;
	const uint64_t alone = RREF_VALUE_ALONE | RREF_VALUE_INLINE | 1;
	uint32_t owner = c->self, creator = (c->self + 1) % WORLD, other = (c->self + 2) % WORLD;
	uint64_t ids[KEEP] = { 0 }, n = 0;
	uint32_t slots[KEEP];
	bool forked[KEEP];

	for (long i = 0; i <= c->steps; i++) {
		uint32_t k = (uint32_t)(i % KEEP);

		if (ids[k]) {
			check_held(c->t, slots[k], ids[k], owner);
			if (forked[k])
				CHECK(rref_release(c->t, slots[k], ids[k], other, 1) == 0, "fork's drop");
			CHECK(rref_release(c->t, slots[k], ids[k], creator, 1) == 2,
			      "the last drop of a value alone removes it");
			ids[k] = 0;
		}
		if (i + KEEP > c->steps)
			continue; /* the last steps only drop */
		ids[k] = RREF_ID(c->self, ++n);
		forked[k] = i % 3 == 0;
		CHECK_OK(rref_insert(c->t, ids[k], owner, creator, 0, &slots[k]));
		check_held(c->t, slots[k], ids[k], owner);
		if (forked[k])
			CHECK_OK(rref_hold(c->t, slots[k], ids[k], other, 1));
		CHECK_OK(rref_store(c->t, slots[k], ids[k], RREF_READY, ids[k], alone));
	}
	return NULL;
}

/* Reads every slot until told to stop, as shmrpc-inspect and the debug
 * counts do while the job runs: a copy is one RRef's, never an id with
 * the fields of the next RRef in its slot (each thread's ids name its
 * rank, the owner of its RRefs, and a stored value is the id). */
static void *reader(void *arg)
{
	struct churn *c = arg;
	struct rref_info in;

	while (!atomic_load(c->stop))
		for (uint32_t s = 0; s < c->t->capacity; s++) {
			if (!rref_info_at(c->t, s, &in))
				continue;
			CHECK(in.owner == RREF_ID_RANK(in.id) && in.creator == (in.owner + 1) % WORLD,
			      "slot %u: RRef %llx with owner %u, creator %u", s,
			      (unsigned long long)in.id, in.owner, in.creator);
			CHECK(in.state != RREF_READY || in.value_off == in.id,
			      "slot %u: RRef %llx with the value %llx", s, (unsigned long long)in.id,
			      (unsigned long long)in.value_off);
		}
	return NULL;
}

static void test_threads(struct rref_table *t)
{
	struct churn c[THREADS + 1];
	pthread_t th[THREADS + 1];
	_Atomic int stop = 0;

	for (uint32_t i = 0; i <= THREADS; i++) {
		c[i] = (struct churn){ t, i, (long)(20000 * tl_scale()) + KEEP, &stop };
		CHECK(pthread_create(&th[i], NULL, i < THREADS ? churn : reader, &c[i]) == 0,
		      "pthread_create");
	}
	for (uint32_t i = 0; i < THREADS; i++)
		pthread_join(th[i], NULL);
	atomic_store(&stop, 1);
	pthread_join(th[THREADS], NULL);
}

int main(void)
{
	/* THREADS * KEEP live at most, in a table of 32 slots. */
	struct rref_table_params tp = { .max_rrefs = THREADS * KEEP + 4, .world = WORLD };
	struct rref_table t;
	struct rref_info in;
	uint32_t used = 0;

	CHECK_OK(rref_table_create(&t, &tp));
	test_reused_slot(&t);
	test_threads(&t);
	for (uint32_t s = 0; s < t.capacity; s++)
		used += rref_info_at(&t, s, &in);
	CHECK(used == 0 && t.hdr->live == 0, "%u slots in use, live %u at the end", used,
	      t.hdr->live);
	rref_table_detach(&t);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
