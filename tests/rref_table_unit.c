/* The RRef table in one process: attach refuses what is not a table of our
 * format, each case with its own code and words, and a second mapping sees
 * the same entries; references count (creator, owner's pending run, forks),
 * a store drops the run's reference, the last release hands the entry to
 * its owner, who removes it; refused calls change nothing; a full table is
 * a clear error naming --max-rrefs and frees up again; tombstones are
 * reused under churn; waiters wake on a store and on the owner's death;
 * unreferenced RRefs go on their owner's collect list, taken once, but
 * for a value the owner keeps nothing of, whose last live release removes
 * it; the
 * sweep of a dead rank marks its RRefs and drops exactly its references,
 * once. The table is
 * empty at the end. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "shm/rref_table.h"
#include "tests/lib/testlib.h"

#define WORLD 4
#define MAX_RREFS 64

/* The value an RRef's owner stores, recognisable from the id alone. */
static uint64_t value_of(uint64_t id)
{
	return id * 0x9e3779b97f4a7c15ull | 1;
}

static void refused(int rc, int err, const char *text, const char *what)
{
	CHECK(rc == err, "%s: returned %d (%s), expected %d", what, rc, shmrpc_strerror(rc), err);
	CHECK(strstr(shmrpc_errmsg(), text), "%s: errmsg \"%s\" lacks \"%s\"", what, shmrpc_errmsg(),
	      text);
}

static struct rref_info info(const struct rref_table *t, uint32_t slot)
{
	struct rref_info in;

	CHECK(rref_info_at(t, slot, &in), "slot %u is not in use", slot);
	return in;
}

/* The entry at slot: its state, its total and every rank's count. */
static void expect(const struct rref_table *t, uint32_t slot, uint64_t id, uint32_t state,
		   const uint32_t counts[WORLD])
{
	struct rref_info in = info(t, slot);
	uint32_t sum = 0;

	CHECK(in.id == id, "slot %u holds %llx, not %llx", slot, (unsigned long long)in.id,
	      (unsigned long long)id);
	CHECK(in.state == state, "RRef %llx is %s, expected %s", (unsigned long long)id,
	      rref_state_name(in.state), rref_state_name(state));
	for (uint32_t r = 0; r < WORLD; r++) {
		CHECK(rref_count_of(t, slot, r) == counts[r], "RRef %llx: rank %u holds %u, expected %u",
		      (unsigned long long)id, r, rref_count_of(t, slot, r), counts[r]);
		sum += counts[r];
	}
	CHECK(in.total == sum, "RRef %llx: total %u, counts sum to %u", (unsigned long long)id,
	      in.total, sum);
}

static uint32_t insert(struct rref_table *t, uint64_t id, uint32_t owner, uint32_t creator)
{
	uint32_t slot, found;

	CHECK_OK(rref_insert(t, id, owner, creator, 0, &slot));
	CHECK(slot < t->capacity, "slot %u of %u", slot, t->capacity);
	CHECK_OK(rref_find(t, id, &found));
	CHECK(found == slot, "inserted at %u, found at %u", slot, found);
	return slot;
}

static void store(struct rref_table *t, uint32_t slot, uint64_t id, int expected)
{
	int rc = rref_store(t, slot, id, RREF_READY, value_of(id), id & 0xffff);

	CHECK(rc == expected, "store of %llx returned %d, expected %d (%s)",
	      (unsigned long long)id, rc, expected, shmrpc_errmsg());
}

/* The owner removes an entry whose last release returned 1. */
static void remove_unreferenced(struct rref_table *t, uint32_t slot, uint64_t id)
{
	uint32_t found;

	CHECK(info(t, slot).state == RREF_UNREFERENCED, "not unreferenced");
	CHECK_OK(rref_remove(t, slot, id));
	CHECK(rref_find(t, id, &found) == -ENOENT, "%llx still found after its removal",
	      (unsigned long long)id);
	CHECK(!rref_info_at(t, slot, &(struct rref_info){ 0 }), "slot %u in use after removal", slot);
}

static int memfd_with(const void *bytes, size_t len, size_t size)
{
	int fd = memfd_create("not-an-rref-table", MFD_CLOEXEC);

	CHECK(fd >= 0, "memfd_create");
	CHECK(ftruncate(fd, (off_t)size) == 0, "ftruncate");
	CHECK(pwrite(fd, bytes, len, 0) == (ssize_t)len, "pwrite");
	return fd;
}

static void attach_refused(int fd, int err, const char *text, const char *what)
{
	struct rref_table t;

	refused(rref_table_attach_fd(&t, fd, false), err, text, what);
	CHECK(t.base == NULL && t.fd == -1, "%s: mapped anyway", what);
	close(fd);
}

static void test_attach(struct rref_table *good)
{
	struct rref_table_header h = *good->hdr;
	struct rref_table other;
	uint64_t id = RREF_ID(1, 1);
	uint32_t slot, found;
	int fd;

	attach_refused(memfd_with(&h, 0, 0), -SHMRPC_EBADSEG, "bad magic", "empty file");
	h.magic ^= 1;
	attach_refused(memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG,
		       "not a shmrpc RRef table (bad magic)", "wrong magic");
	h = *good->hdr;
	h.format_version = RREF_TABLE_FORMAT_VERSION + 1;
	attach_refused(memfd_with(&h, sizeof(h), good->size), -SHMRPC_EVERSION,
		       "RRef table format 3, this library reads format 2", "newer format");
	h = *good->hdr;
	attach_refused(memfd_with(&h, sizeof(h), good->size - 4096), -SHMRPC_ETRUNC,
		       "RRef table truncated", "short file");
	attach_refused(memfd_with(&h, 64, 64), -SHMRPC_ETRUNC, "truncated: 64 bytes", "header cut");
	h.capacity *= 2;
	attach_refused(memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG,
		       "header layout is inconsistent (64 RRefs, 4 workers)", "wrong capacity");

	/* A second mapping (what a worker does with the inherited fd) sees
	 * the same entries, both ways. */
	fd = dup(good->fd);
	CHECK(fd >= 0, "dup");
	CHECK_OK(rref_table_attach_fd(&other, fd, false));
	CHECK(other.capacity == good->capacity && other.world == WORLD &&
	      other.max_rrefs == MAX_RREFS && other.entry_size == good->entry_size,
	      "second mapping sees another layout");
	slot = insert(good, id, 1, 1);
	CHECK_OK(rref_find(&other, id, &found));
	CHECK(found == slot, "second mapping finds %llx at %u, not %u", (unsigned long long)id,
	      found, slot);
	store(&other, slot, id, 0);
	CHECK(info(good, slot).state == RREF_READY && info(good, slot).value_off == value_of(id),
	      "store through the second mapping not seen");
	CHECK(rref_release(&other, slot, id, 1, 1) == 1, "last release through the second mapping");
	remove_unreferenced(good, slot, id);
	rref_table_detach(&other);
	CHECK(other.base == NULL && other.fd == -1, "detach left state");
}

static void test_refs(struct rref_table *t)
{
	uint64_t a = RREF_ID(0, 1), b = RREF_ID(2, 1);
	uint32_t sa, sb;
	struct rref_info before;

	/* Creator 0, owner 1: one reference each. */
	sa = insert(t, a, 1, 0);
	expect(t, sa, a, RREF_PENDING, (uint32_t[WORLD]){ 1, 1, 0, 0 });
	CHECK(info(t, sa).owner == 1 && info(t, sa).creator == 0, "owner/creator");
	/* Creator == owner: two references for the same rank. */
	sb = insert(t, b, 2, 2);
	expect(t, sb, b, RREF_PENDING, (uint32_t[WORLD]){ 0, 0, 2, 0 });

	/* A fork to rank 3 is charged to it by the holder. */
	CHECK_OK(rref_hold(t, sa, a, 3, 1));
	expect(t, sa, a, RREF_PENDING, (uint32_t[WORLD]){ 1, 1, 0, 1 });

	/* Refusals change nothing. */
	before = info(t, sa);
	refused(rref_release(t, sa, a, 3, 2), -EINVAL, "rank 3 drops 2 references", "over-release");
	refused(rref_release(t, sa, a, 2, 1), -EINVAL, "holds 0", "release not held");
	refused(rref_hold(t, sa, b, 3, 1), -ENOENT, "not in the RRef table", "hold with another id");
	CHECK(rref_store(t, sa, a, RREF_PENDING, 1, 1) == -EINVAL, "store of state pending");
	CHECK(rref_hold(t, sa, a, WORLD, 1) == -EINVAL, "hold for rank %u accepted", WORLD);
	CHECK(rref_release(t, t->capacity, a, 0, 1) == -ENOENT, "release of a slot out of range");
	CHECK(info(t, sa).value_off == before.value_off && info(t, sa).value_len == before.value_len,
	      "a refused call changed the value");
	expect(t, sa, a, RREF_PENDING, (uint32_t[WORLD]){ 1, 1, 0, 1 });

	/* The store publishes the value and drops the owner's run reference. */
	store(t, sa, a, 0);
	expect(t, sa, a, RREF_READY, (uint32_t[WORLD]){ 1, 0, 0, 1 });
	CHECK(info(t, sa).value_off == value_of(a) && info(t, sa).value_len == (a & 0xffff),
	      "stored value not read back");
	/* A second store fails and leaves the value as it was. */
	refused(rref_store(t, sa, a, RREF_ERROR, 7, 7), -EINVAL, "is ready, not pending",
		"second store");
	CHECK(info(t, sa).value_off == value_of(a) && info(t, sa).value_len == (a & 0xffff),
	      "a refused store changed the value to %llu", (unsigned long long)info(t, sa).value_off);
	expect(t, sa, a, RREF_READY, (uint32_t[WORLD]){ 1, 0, 0, 1 });

	CHECK(rref_release(t, sa, a, 3, 1) == 0, "rank 3's release is not the last");
	refused(rref_remove(t, sa, a), -EBUSY, "still has references", "remove while referenced");
	CHECK(rref_release(t, sa, a, 0, 1) == 1, "the creator's last release");
	expect(t, sa, a, RREF_UNREFERENCED, (uint32_t[WORLD]){ 0, 0, 0, 0 });
	refused(rref_release(t, sa, a, 0, 1), -EINVAL, "holds 0", "release after the last");
	remove_unreferenced(t, sa, a);
	refused(rref_remove(t, sa, a), -ENOENT, "it was deleted", "second remove");
	refused(rref_release(t, sa, a, 0, 1), -ENOENT, "it was deleted", "release after remove");

	/* An error is stored like a value; creator == owner drops both. */
	CHECK_OK(rref_store(t, sb, b, RREF_ERROR, 99, 3));
	expect(t, sb, b, RREF_ERROR, (uint32_t[WORLD]){ 0, 0, 1, 0 });
	CHECK(rref_release(t, sb, b, 2, 1) == 1, "owner-creator's last release");
	remove_unreferenced(t, sb, b);
	CHECK(t->hdr->live == 0, "%u live", t->hdr->live);
}

/* Full at max_rrefs with words naming the option; one removal makes room. */
static void test_full(struct rref_table *t)
{
	uint32_t slots[MAX_RREFS + 1];

	for (uint32_t i = 0; i < MAX_RREFS; i++)
		slots[i] = insert(t, RREF_ID(3, 100 + i), 3, 3);
	CHECK(t->hdr->live == MAX_RREFS, "%u live", t->hdr->live);
	refused(rref_insert(t, RREF_ID(3, 100 + MAX_RREFS), 3, 3, 0, &slots[MAX_RREFS]), -ENOSPC,
		"--max-rrefs", "65th insert");
	CHECK(t->hdr->live == MAX_RREFS, "a refused insert changed live to %u", t->hdr->live);
	CHECK(rref_release(t, slots[7], RREF_ID(3, 107), 3, 2) == 1, "release of both references");
	remove_unreferenced(t, slots[7], RREF_ID(3, 107));
	slots[7] = insert(t, RREF_ID(3, 100 + MAX_RREFS), 3, 3);
	for (uint32_t i = 0; i < MAX_RREFS; i++) {
		uint64_t id = RREF_ID(3, 100 + (i == 7 ? MAX_RREFS : i));

		CHECK(rref_release(t, slots[i], id, 3, 2) == 1, "release %u", i);
		remove_unreferenced(t, slots[i], id);
	}
	CHECK(t->hdr->live == 0, "%u live", t->hdr->live);
}

/* Random inserts and removals on a small table: slots are freed to
 * tombstones and taken again, and every live id is still found where it
 * was put (a lookup probes past tombstones). */
static void test_churn(void)
{
	enum { CHURN_MAX = 12, KEEP = 10 };
	struct rref_table_params tp = { .max_rrefs = CHURN_MAX, .world = 2 };
	struct rref_table t;
	uint64_t live[KEEP] = { 0 }, x = 0x2545f4914f6cdd1dull, n = 0;
	uint32_t slot[KEEP], found, in_use = 0;
	long cycles = (long)(100000 * tl_scale());

	CHECK_OK(rref_table_create(&t, &tp));
	for (long c = 0; c < cycles; c++) {
		uint32_t k;

		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		k = (uint32_t)(x % KEEP);
		if (live[k]) {
			CHECK(rref_release(&t, slot[k], live[k], 1, 2) == 1, "churn release");
			CHECK_OK(rref_remove(&t, slot[k], live[k]));
			CHECK(rref_find(&t, live[k], &found) == -ENOENT, "removed id found");
			live[k] = 0;
			in_use--;
		} else {
			/* Unique, scattered ids: a counter times an odd constant. */
			live[k] = RREF_ID(1, ++n * 0x9e3779b97f4aull);
			slot[k] = insert(&t, live[k], 1, 1);
			in_use++;
		}
		for (uint32_t i = 0; i < KEEP; i++) {
			if (!live[i])
				continue;
			CHECK_OK(rref_find(&t, live[i], &found));
			CHECK(found == slot[i], "id %llx moved from slot %u to %u",
			      (unsigned long long)live[i], slot[i], found);
		}
		CHECK(t.hdr->live == in_use, "live %u, %u in use", t.hdr->live, in_use);
	}
	for (uint32_t i = 0; i < KEEP; i++)
		if (live[i]) {
			CHECK(rref_release(&t, slot[i], live[i], 1, 2) == 1, "final release");
			CHECK_OK(rref_remove(&t, slot[i], live[i]));
		}
	CHECK(t.hdr->live == 0, "%u live after churn", t.hdr->live);
	rref_table_detach(&t);
}

struct waiter {
	struct rref_table *t;
	uint32_t slot;
	uint64_t id;
	int rc;
};

static void *wait_thread(void *arg)
{
	struct waiter *w = arg;

	w->rc = rref_wait(w->t, w->slot, w->id, 0);
	return NULL;
}

/* Starts a thread waiting (no deadline) on the entry and returns once it
 * has announced itself: what follows must wake it. */
static void start_waiter(struct waiter *w, pthread_t *th)
{
	struct rref_entry *e = rref_entry_at(w->t, w->slot);

	w->rc = -1;
	CHECK(pthread_create(th, NULL, wait_thread, w) == 0, "pthread_create");
	while (!atomic_load(&e->waiters))
		sched_yield();
}

static void test_wait(struct rref_table *t)
{
	uint64_t id = RREF_ID(0, 500);
	uint32_t slot = insert(t, id, 0, 1);
	uint64_t t0 = shmrpc_now_ns();
	struct waiter w = { t, slot, id, 0 };
	pthread_t th;

	CHECK(rref_wait(t, slot, id, t0 + 20000000) == -ETIMEDOUT, "pending entry did not time out");
	CHECK(shmrpc_now_ns() >= t0 + 20000000, "timed out before its deadline");
	refused(rref_wait(t, slot, RREF_ID(0, 501), 0), -ENOENT, "it was deleted", "wait on no id");

	start_waiter(&w, &th);
	store(t, slot, id, 0);
	pthread_join(th, NULL);
	CHECK(w.rc == RREF_READY, "woken waiter saw %d", w.rc);
	CHECK(rref_wait(t, slot, id, 0) == RREF_READY, "ready entry");
	CHECK(rref_wait(t, slot, id, 1) == RREF_READY, "ready entry, deadline passed");
	CHECK(rref_release(t, slot, id, 1, 1) == 1, "creator's release");
	remove_unreferenced(t, slot, id);
}

static void test_owner_death(struct rref_table *t)
{
	enum { DEAD = 2 };
	uint64_t p = RREF_ID(0, 600), r = RREF_ID(1, 601), u = RREF_ID(2, 602);
	uint32_t sp = insert(t, p, DEAD, 0), sr = insert(t, r, DEAD, 1), su = insert(t, u, DEAD, 2);
	uint64_t other = RREF_ID(3, 603);
	uint32_t so = insert(t, other, 0, 3);
	struct waiter w = { t, sp, p, 0 };
	pthread_t th;

	/* p stays pending, with a fork to rank 3; r is ready and held by 1 and
	 * 3; u is unreferenced, not yet removed by its owner. */
	CHECK_OK(rref_hold(t, sp, p, 3, 1));
	store(t, sr, r, 0);
	CHECK_OK(rref_hold(t, sr, r, 3, 1));
	store(t, su, u, 0);
	CHECK(rref_release(t, su, u, DEAD, 1) == 1, "u's last release");

	/* The sweep marks the dead owner's RRefs (waking their waiters),
	 * removes the unreferenced one, and drops exactly its references. */
	start_waiter(&w, &th);
	CHECK(rref_sweep_rank(t, DEAD) == 1, "the sweep drops p's pending run only");
	pthread_join(th, NULL);
	CHECK(w.rc == RREF_OWNER_DEAD, "waiter on the dead owner's RRef saw %d", w.rc);
	CHECK(rref_find(t, u, &(uint32_t){ 0 }) == -ENOENT, "unreferenced entry not removed");
	expect(t, sp, p, RREF_OWNER_DEAD, (uint32_t[WORLD]){ 1, 0, 0, 1 });
	expect(t, sr, r, RREF_OWNER_DEAD, (uint32_t[WORLD]){ 0, 1, 0, 1 });
	expect(t, so, other, RREF_PENDING, (uint32_t[WORLD]){ 1, 0, 0, 1 });
	CHECK(rref_sweep_rank(t, DEAD) == 0, "a second sweep dropped something");
	expect(t, sp, p, RREF_OWNER_DEAD, (uint32_t[WORLD]){ 1, 0, 0, 1 });
	refused(rref_store(t, sp, p, RREF_READY, 1, 1), -EINVAL, "is owner-dead, not pending",
		"store after the owner's death");
	CHECK(info(t, sp).value_off == 0, "a refused store wrote the value");

	/* A holder that owns nothing: only its counts go, once. */
	CHECK(rref_sweep_rank(t, 3) == 3, "rank 3 held three references");
	CHECK(rref_sweep_rank(t, 3) == 0, "second sweep of rank 3");
	expect(t, sp, p, RREF_OWNER_DEAD, (uint32_t[WORLD]){ 1, 0, 0, 0 });
	expect(t, sr, r, RREF_OWNER_DEAD, (uint32_t[WORLD]){ 0, 1, 0, 0 });
	expect(t, so, other, RREF_PENDING, (uint32_t[WORLD]){ 1, 0, 0, 0 });
	CHECK(rref_sweep_rank(t, WORLD) == -EINVAL, "sweep of rank %u", WORLD);

	/* The last user reference of a dead owner's RRef removes it. */
	CHECK(rref_release(t, sp, p, 0, 1) == 2, "last release of p");
	CHECK(rref_find(t, p, &(uint32_t){ 0 }) == -ENOENT, "p not removed");
	/* rref_sweep_entry drops one rank's references on one entry. */
	CHECK(rref_sweep_entry(t, sr, r, 0) == 0 && rref_sweep_entry(t, sr, r, WORLD) == 0,
	      "sweep of a rank holding nothing");
	CHECK(rref_sweep_entry(t, sr, r, 1) == 2, "sweep of r's last holder");
	CHECK(rref_find(t, r, &(uint32_t){ 0 }) == -ENOENT, "r not removed");
	CHECK(rref_sweep_entry(t, sr, r, 1) == 0, "sweep of a removed entry");

	/* A creator that inserted after the owner's sweep marks its entry. */
	p = RREF_ID(1, 610);
	sp = insert(t, p, DEAD, 1);
	CHECK(rref_mark_owner_dead(t, sp, p) == 1, "mark of a pending entry");
	CHECK(rref_mark_owner_dead(t, sp, p) == 0, "second mark");
	CHECK(rref_mark_owner_dead(t, sp, RREF_ID(1, 611)) == 0, "mark of another id");
	expect(t, sp, p, RREF_OWNER_DEAD, (uint32_t[WORLD]){ 0, 1, 1, 0 });
	CHECK(rref_sweep_entry(t, sp, p, DEAD) == 0, "the run's reference is not the last");
	CHECK(rref_release(t, sp, p, 1, 1) == 2, "creator's last release");
	CHECK(rref_find(t, p, &(uint32_t){ 0 }) == -ENOENT, "marked entry not removed");
	/* An entry with no reference left goes at the mark. */
	p = RREF_ID(1, 612);
	sp = insert(t, p, DEAD, 1);
	CHECK(rref_sweep_entry(t, sp, p, DEAD) == 0 && rref_release(t, sp, p, 1, 1) == 1,
	      "releases before the mark");
	CHECK(rref_mark_owner_dead(t, sp, p) == 0, "mark of an unreferenced entry");
	CHECK(rref_find(t, p, &(uint32_t){ 0 }) == -ENOENT, "unreferenced entry not removed at mark");

	/* The live owner's RRef lost its creator's reference to the sweep;
	 * the store drops the last one. */
	store(t, so, other, 1);
	remove_unreferenced(t, so, other);
	CHECK(rref_sweep_rank(t, 0) == 0, "sweep of an empty table");
}

/* Collect lists: the last releases of three RRefs of rank 1 push them on
 * its list (the first push says the list was empty); the owner takes the
 * list once, newest first, and the links end it; a sweep that leaves an
 * RRef of a live owner unreferenced lists it too. Rank 2 then has nothing. */
static void test_collect(struct rref_table *t)
{
	uint64_t id[3] = { RREF_ID(0, 700), RREF_ID(0, 701), RREF_ID(0, 702) };
	uint64_t swept = RREF_ID(3, 703);
	uint32_t slot[3], ss, at;

	CHECK(!rref_collect_pending(t, 1) && rref_collect_take(t, 1) == 0, "a list to start with");
	for (int i = 0; i < 3; i++) {
		slot[i] = insert(t, id[i], 1, 0);
		store(t, slot[i], id[i], 0);
		CHECK(rref_release(t, slot[i], id[i], 0, 1) == 1, "last release of %d", i);
		CHECK(rref_collect_push(t, slot[i]) == (i == 0), "push %d: was the list empty?", i);
		CHECK(rref_collect_pending(t, 1), "nothing pending after push %d", i);
	}
	CHECK(!rref_collect_pending(t, 2), "rank 2 has a list");
	at = rref_collect_take(t, 1);
	CHECK(!rref_collect_pending(t, 1) && rref_collect_take(t, 1) == 0, "taken twice");
	for (int i = 2; i >= 0; i--) {
		CHECK(at == slot[i] + 1, "list item %d: slot+1 %u, expected %u", i, at, slot[i] + 1);
		at = rref_collect_next(t, slot[i]);
		remove_unreferenced(t, slot[i], id[i]);
	}
	CHECK(at == 0, "the list goes on after its last item: %u", at);
	CHECK(rref_collect_next(t, t->capacity) == 0, "a slot out of the table has a link");

	ss = insert(t, swept, 1, 3); /* rank 3 makes it; it dies before the store */
	store(t, ss, swept, 0);
	CHECK(rref_sweep_rank(t, 3) == 1, "the sweep drops the creator's reference");
	CHECK(rref_collect_take(t, 1) == ss + 1, "the swept RRef is not on its owner's list");
	CHECK(rref_collect_next(t, ss) == 0, "a list of one goes on");
	remove_unreferenced(t, ss, swept);
}

/* Values their owner keeps nothing of (RREF_VALUE_ALONE, with the inline
 * mark): the last live release removes the entry itself (2) and lists
 * nothing; a block value (no inline mark) or an inline one not marked
 * alone is handed over (1); so is one a sweep of a dead holder leaves
 * unreferenced, for its owner to remove. */
static void test_alone(struct rref_table *t)
{
	const uint64_t alone = RREF_VALUE_ALONE | RREF_VALUE_INLINE | 1;
	uint64_t id[4] = { RREF_ID(0, 800), RREF_ID(0, 801), RREF_ID(0, 802), RREF_ID(3, 803) };
	uint64_t len[4] = { alone, RREF_VALUE_ALONE | 1, RREF_VALUE_INLINE | 1, alone };
	uint32_t slot[4];

	for (int i = 0; i < 4; i++) {
		slot[i] = insert(t, id[i], 1, i == 3 ? 3 : 0);
		CHECK(rref_store(t, slot[i], id[i], RREF_READY, 0xc0, len[i]) == 0, "store %d", i);
	}
	CHECK(rref_release(t, slot[0], id[0], 0, 1) == 2, "last release of a value alone");
	CHECK(rref_find(t, id[0], &(uint32_t){ 0 }) == -ENOENT, "the value alone stays");
	CHECK(rref_release(t, slot[1], id[1], 0, 1) == 1, "last release of a block value");
	CHECK(rref_release(t, slot[2], id[2], 0, 1) == 1, "last release of an inline value not alone");
	CHECK(rref_sweep_rank(t, 3) == 1, "the sweep drops the dead creator's reference");
	CHECK(info(t, slot[3]).state == RREF_UNREFERENCED, "swept: %s",
	      rref_state_name(info(t, slot[3]).state));
	CHECK(rref_collect_take(t, 1) == slot[3] + 1 && rref_collect_next(t, slot[3]) == 0,
	      "the swept value alone is not listed for its owner alone");
	for (int i = 1; i < 4; i++)
		remove_unreferenced(t, slot[i], id[i]);
}

int main(void)
{
	struct rref_table_params tp = { .max_rrefs = MAX_RREFS, .world = WORLD };
	struct rref_table t;
	struct rref_info in;
	uint32_t used = 0;

	/* The header, the collect list heads, 128 entries of 128 bytes. */
	CHECK(rref_table_bytes(&tp) == 2 * RREF_TABLE_PAGE + 128 * 128, "%llu bytes",
	      (unsigned long long)rref_table_bytes(&tp));
	CHECK(rref_table_bytes(&(struct rref_table_params){ .max_rrefs = 1, .world = 0 }) == 0,
	      "world 0 accepted");
	refused(rref_table_create(&t, &(struct rref_table_params){ .world = RREF_MAX_WORLD + 1 }),
		-EINVAL, "workers 1..1024", "world too large");
	CHECK_OK(rref_table_create(&t, &tp));
	CHECK(t.capacity == 128 && t.entry_size == 128 && t.world == WORLD, "capacity %u, entry %u",
	      t.capacity, t.entry_size);
	test_attach(&t);
	test_refs(&t);
	test_full(&t);
	test_churn();
	test_wait(&t);
	test_collect(&t);
	test_alone(&t);
	test_owner_death(&t);
	for (uint32_t s = 0; s < t.capacity; s++)
		used += rref_info_at(&t, s, &in);
	CHECK(used == 0 && t.hdr->live == 0, "%u slots in use, live %u at the end", used,
	      t.hdr->live);
	rref_table_detach(&t);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
