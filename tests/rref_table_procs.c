/* Six forked ranks share one RRef table and run the RRef protocol at
 * random: each creates RRefs it owns (sometimes forking one before its
 * value is stored: the receiver waits for it across processes), forks held
 * references to other ranks (charging the receiver, then passing the id
 * through a per-pair queue), and drops references; the releaser that makes
 * an RRef unreferenced tells its owner, which removes it. Whenever a rank
 * holds a reference the entry must still carry its id and the value its
 * owner stored: a value freed while reachable is the bug this catches.
 * The table is empty at the end.
 *
 * Then rounds in which one rank (another each time) is killed with SIGKILL
 * at a random step; the parent sweeps it as the launcher does (sweep, mark
 * dead, sweep again) while the survivors go on, stop sending to it, and
 * poll their own RRefs (a sweep that drops the last reference tells no
 * one). At the end the table holds only RRefs the victim was changing when
 * it died, each left in a way the protocol explains (see leftovers()). */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "shm/rref_table.h"
#include "tests/lib/testlib.h"

#define WORLD 6
#define OPS 20000
#define OWN_MAX 128   /* RRefs a rank owns at once */
#define HOLD_KEEP 48  /* references a rank keeps; it drops down to this */
#define HOLD_CAP 1024
#define QCAP 256      /* messages per ordered pair */
#define DRAIN_MAX 64  /* messages taken per step */
#define OUTBOX_CAP (WORLD * OWN_MAX)
#define BUSY_MAX 2    /* a fork inside create, a removal inside release */
#define NO_VICTIM UINT32_MAX

enum { MSG_FORK = 1, MSG_FREE = 2 };

struct msg {
	uint64_t id;
	uint32_t slot, kind;
};

/* Single producer (src), single consumer (dst). */
struct queue {
	_Atomic uint32_t head, tail;
	struct msg m[QCAP];
};

struct shared {
	struct queue q[WORLD][WORLD]; /* [src][dst] */
	uint32_t victim;
	_Atomic uint32_t ready, failed;
	_Atomic uint32_t dead[WORLD];     /* set by the parent between the sweeps */
	_Atomic uint32_t finished[WORLD]; /* forks no more */
	_Atomic uint32_t dropped[WORLD];  /* holds nothing, sends nothing more */
	_Atomic uint64_t progress[WORLD];
	/* The RRefs a rank is changing (nested: a rank waiting to send takes
	 * its messages), and the receiver of its fork: what a death may leave. */
	_Atomic uint64_t busy[WORLD][BUSY_MAX];
	_Atomic uint32_t busy_depth[WORLD], fork_dst[WORLD];
	_Atomic uint64_t forks, frees, removed_by_release, polled;
};

struct ref {
	uint64_t id;
	uint32_t slot;
};

struct rank {
	struct rref_table *t;
	struct shared *sh;
	uint32_t self;
	uint64_t rng, next_local;
	struct ref held[HOLD_CAP], owned[OWN_MAX];
	/* Notes waiting for room in their queue: no rank ever blocks. */
	struct {
		uint32_t dst;
		struct msg m;
	} outbox[OUTBOX_CAP];
	uint32_t nheld, nowned, nout;
};

static uint64_t rnd(struct rank *r)
{
	r->rng ^= r->rng << 13, r->rng ^= r->rng >> 7, r->rng ^= r->rng << 17;
	return r->rng;
}

static uint64_t value_of(uint64_t id)
{
	return id * 0x9e3779b97f4a7c15ull | 1;
}

/* A rank that fails a CHECK exits: the others (waiting on it) follow. */
static struct shared *failing_sh;

static void note_failure(void)
{
	atomic_store(&failing_sh->failed, 1);
}

static void bail_if_failed(const struct shared *sh)
{
	if (atomic_load(&sh->failed))
		_exit(1);
}

static bool is_dead(const struct shared *sh, uint32_t rank)
{
	return atomic_load(&sh->dead[rank]);
}

static bool send(struct shared *sh, uint32_t src, uint32_t dst, struct msg m)
{
	struct queue *q = &sh->q[src][dst];
	uint32_t tail = atomic_load_explicit(&q->tail, memory_order_relaxed);

	if (tail - atomic_load_explicit(&q->head, memory_order_acquire) == QCAP)
		return false;
	q->m[tail % QCAP] = m;
	atomic_store_explicit(&q->tail, tail + 1, memory_order_release);
	return true;
}

static bool recv(struct shared *sh, uint32_t src, uint32_t dst, struct msg *m)
{
	struct queue *q = &sh->q[src][dst];
	uint32_t head = atomic_load_explicit(&q->head, memory_order_relaxed);

	if (head == atomic_load_explicit(&q->tail, memory_order_acquire))
		return false;
	*m = q->m[head % QCAP];
	atomic_store_explicit(&q->head, head + 1, memory_order_release);
	return true;
}

/* What a holder of id at slot must see: the id, the value its owner
 * stored, and READY (or OWNER_DEAD once the victim, its owner, died). */
static struct rref_info check_held(struct rank *r, const struct ref *h)
{
	struct rref_info in;

	CHECK(rref_info_at(r->t, h->slot, &in), "rank %u holds %llx but slot %u is free: freed "
	      "while referenced", r->self, (unsigned long long)h->id, h->slot);
	CHECK(in.id == h->id, "rank %u holds %llx but slot %u holds %llx: freed and reused while "
	      "referenced", r->self, (unsigned long long)h->id, h->slot, (unsigned long long)in.id);
	CHECK(in.state == RREF_READY ||
	      (in.state == RREF_OWNER_DEAD && in.owner == r->sh->victim),
	      "rank %u: RRef %llx (owner %u) is %s while held", r->self, (unsigned long long)h->id,
	      in.owner, rref_state_name(in.state));
	/* An owner killed before its store leaves no value. */
	CHECK((in.value_off == value_of(h->id) && in.value_len == (h->id & 0xffff)) ||
	      (in.state == RREF_OWNER_DEAD && !in.value_off && !in.value_len),
	      "rank %u: RRef %llx carries value %llx/%llu, not its own", r->self,
	      (unsigned long long)h->id, (unsigned long long)in.value_off,
	      (unsigned long long)in.value_len);
	CHECK(rref_count_of(r->t, h->slot, r->self) > 0, "rank %u holds %llx, its count is 0",
	      r->self, (unsigned long long)h->id);
	return in;
}

static void busy_push(struct rank *r, uint64_t id)
{
	uint32_t d = atomic_load(&r->sh->busy_depth[r->self]);

	CHECK(d < BUSY_MAX, "rank %u: busy %u deep", r->self, d);
	atomic_store(&r->sh->busy[r->self][d], id);
	atomic_store(&r->sh->busy_depth[r->self], d + 1);
}

static void busy_pop(struct rank *r)
{
	uint32_t d = atomic_load(&r->sh->busy_depth[r->self]) - 1;

	atomic_store(&r->sh->busy_depth[r->self], d);
	atomic_store(&r->sh->busy[r->self][d], 0);
}

static int find_owned(const struct rank *r, uint64_t id)
{
	for (uint32_t i = 0; i < r->nowned; i++)
		if (r->owned[i].id == id)
			return (int)i;
	return -1;
}

/* The owner removes an unreferenced RRef of its own. */
static void owner_remove(struct rank *r, uint32_t i)
{
	struct ref o = r->owned[i];
	struct rref_info in;

	CHECK(rref_info_at(r->t, o.slot, &in) && in.id == o.id && in.state == RREF_UNREFERENCED,
	      "rank %u: own RRef %llx to remove is not unreferenced", r->self,
	      (unsigned long long)o.id);
	busy_push(r, o.id);
	CHECK_OK(rref_remove(r->t, o.slot, o.id));
	busy_pop(r);
	r->owned[i] = r->owned[--r->nowned];
}

static void adopt(struct rank *r, const struct msg *m)
{
	struct ref h = { m->id, m->slot };
	int st = rref_wait(r->t, h.slot, h.id, shmrpc_now_ns() + 10000000000ull);

	/* A forked RRef may still be pending: its owner stores the value
	 * after the fork (10 s only guards against a hang). */
	CHECK(st == RREF_READY || (st == RREF_OWNER_DEAD && RREF_ID_RANK(h.id) == r->sh->victim),
	      "rank %u: wait on adopted RRef %llx gave %d (%s)", r->self, (unsigned long long)h.id,
	      st, shmrpc_errmsg());
	check_held(r, &h);
	CHECK(r->nheld < HOLD_CAP, "rank %u holds %u references", r->self, r->nheld);
	r->held[r->nheld++] = h;
}

/* Takes what the other ranks sent, the dead one's included. */
static bool drain(struct rank *r)
{
	uint32_t n = 0;
	struct msg m;

	for (uint32_t src = 0; src < WORLD; src++) {
		while (n < DRAIN_MAX && recv(r->sh, src, r->self, &m)) {
			int i;

			n++;
			if (m.kind == MSG_FORK) {
				adopt(r, &m);
				continue;
			}
			i = find_owned(r, m.id);
			/* After the death the owner also polls: a note may come late. */
			CHECK(i >= 0 || r->sh->victim != NO_VICTIM, "rank %u: note for %llx, which it "
			      "does not own", r->self, (unsigned long long)m.id);
			if (i >= 0)
				owner_remove(r, (uint32_t)i);
		}
	}
	return n > 0;
}

/* Sends the notes there is room for; those to a dead owner are dropped
 * (its RRefs are the sweeps'). True if the outbox changed. */
static bool flush(struct rank *r)
{
	uint32_t before = r->nout;

	for (uint32_t i = 0; i < r->nout;) {
		if (is_dead(r->sh, r->outbox[i].dst) ||
		    send(r->sh, r->self, r->outbox[i].dst, r->outbox[i].m))
			r->outbox[i] = r->outbox[--r->nout];
		else
			i++;
	}
	return r->nout != before;
}

static void release(struct rank *r, uint32_t h)
{
	struct ref ref = r->held[h];
	uint32_t owner = check_held(r, &ref).owner;
	int rc, i;

	r->held[h] = r->held[--r->nheld];
	busy_push(r, ref.id);
	rc = rref_release(r->t, ref.slot, ref.id, r->self, 1);
	CHECK(rc >= 0 && rc <= 2, "rank %u: release of %llx returned %d (%s)", r->self,
	      (unsigned long long)ref.id, rc, shmrpc_errmsg());
	if (rc == 2) {
		CHECK(owner == r->sh->victim, "rank %u: release of %llx (owner %u, alive) removed it",
		      r->self, (unsigned long long)ref.id, owner);
		atomic_fetch_add(&r->sh->removed_by_release, 1);
	} else if (rc == 1 && owner == r->self) {
		i = find_owned(r, ref.id);
		CHECK(i >= 0, "rank %u: own RRef %llx not in its list", r->self,
		      (unsigned long long)ref.id);
		owner_remove(r, (uint32_t)i);
	} else if (rc == 1) {
		CHECK(r->nout < OUTBOX_CAP, "rank %u: %u notes unsent", r->self, r->nout);
		r->outbox[r->nout].dst = owner;
		r->outbox[r->nout++].m = (struct msg){ ref.id, ref.slot, MSG_FREE };
		atomic_fetch_add(&r->sh->frees, 1);
	}
	busy_pop(r);
}

static uint32_t random_peer(struct rank *r)
{
	for (;;) {
		uint32_t dst = (uint32_t)(rnd(r) % WORLD);

		if (dst != r->self && !is_dead(r->sh, dst))
			return dst;
	}
}

/* Charges dst with one reference to ref, then sends it. A receiver found
 * dead after the charge (seq_cst against the parent's mark, then sweep)
 * has all its references here taken (the sweep may have taken this one);
 * a full queue has the charge dropped again. */
static void fork_to(struct rank *r, const struct ref *ref, uint32_t dst)
{
	int rc;

	atomic_store(&r->sh->fork_dst[r->self], dst);
	busy_push(r, ref->id);
	CHECK_OK(rref_hold(r->t, ref->slot, ref->id, dst, 1));
	if (is_dead(r->sh, dst)) {
		CHECK(rref_sweep_entry(r->t, ref->slot, ref->id, dst) == 0,
		      "taking back a dead receiver's charge dropped the last reference");
	} else if (send(r->sh, r->self, dst, (struct msg){ ref->id, ref->slot, MSG_FORK })) {
		atomic_fetch_add(&r->sh->forks, 1);
	} else {
		rc = rref_release(r->t, ref->slot, ref->id, dst, 1);
		CHECK(rc == 0 || (rc == -EINVAL && is_dead(r->sh, dst)),
		      "taking back a charge returned %d (%s)", rc, shmrpc_errmsg());
	}
	busy_pop(r);
}

/* Creates an RRef of its own; half the time forks it before the value is
 * there, so that the receiver waits for it. */
static void create(struct rank *r)
{
	struct ref ref = { RREF_ID(r->self, ++r->next_local), 0 };
	bool early = rnd(r) % 2;
	int rc;

	busy_push(r, ref.id);
	CHECK_OK(rref_insert(r->t, ref.id, r->self, r->self, 0, &ref.slot));
	r->owned[r->nowned++] = ref;
	if (early)
		fork_to(r, &ref, random_peer(r));
	rc = rref_store(r->t, ref.slot, ref.id, RREF_READY, value_of(ref.id), ref.id & 0xffff);
	CHECK(rc == 0, "rank %u: store of %llx returned %d (%s)", r->self,
	      (unsigned long long)ref.id, rc, shmrpc_errmsg());
	busy_pop(r);
	r->held[r->nheld++] = ref;
	check_held(r, &ref);
}

/* One operation at random; false when there was none to do (it owns all
 * it may, others hold them, and it holds nothing). */
static bool step(struct rank *r)
{
	uint64_t x = rnd(r) % 8;
	bool got;

	bail_if_failed(r->sh);
	got = drain(r) | flush(r);

	while (r->nheld > HOLD_KEEP)
		release(r, (uint32_t)(rnd(r) % r->nheld));
	if (r->nowned < OWN_MAX && (x < 2 || !r->nheld))
		create(r);
	else if (x < 5 && r->nheld)
		fork_to(r, &r->held[rnd(r) % r->nheld], random_peer(r));
	else if (r->nheld)
		release(r, (uint32_t)(rnd(r) % r->nheld));
	else
		return got;
	if (r->nheld)
		check_held(r, &r->held[rnd(r) % r->nheld]);
	atomic_fetch_add_explicit(&r->sh->progress[r->self], 1, memory_order_relaxed);
	return true;
}

/* True when every rank has set flag[] or is dead. */
static bool all_set(struct shared *sh, _Atomic uint32_t *flag)
{
	bail_if_failed(sh);
	for (uint32_t i = 0; i < WORLD; i++)
		if (!atomic_load(&flag[i]) && !is_dead(sh, i))
			return false;
	return true;
}

/* Own RRefs that a sweep (or a rank that died before its note) left
 * unreferenced: no one tells the owner. */
static void poll_owned(struct rank *r)
{
	for (uint32_t i = 0; i < r->nowned;) {
		struct rref_info in;

		if (rref_info_at(r->t, r->owned[i].slot, &in) && in.id == r->owned[i].id &&
		    in.state == RREF_UNREFERENCED) {
			owner_remove(r, i);
			atomic_fetch_add(&r->sh->polled, 1);
		} else {
			i++;
		}
	}
}

static int child(struct rref_table *t, struct shared *sh, uint32_t self, long ops)
{
	static struct rank r;
	bool after_death = sh->victim != NO_VICTIM;

	failing_sh = sh;
	atexit(note_failure);
	r = (struct rank){ .t = t, .sh = sh, .self = self,
			   .rng = 0x9e3779b97f4a7c15ull * (self + 1) ^ (uint64_t)getpid() };
	/* Start together (for a second at most), so that the ranks overlap. */
	atomic_fetch_add(&sh->ready, 1);
	for (int i = 0; i < 10000 && atomic_load(&sh->ready) < WORLD; i++)
		usleep(100);
	/* The victim runs until it is killed. An idle rank lets the others
	 * run: on 2 cores one would otherwise spin out its time slice. */
	for (long n = 0; self == sh->victim || n < ops;) {
		if (step(&r)) {
			n++;
			continue;
		}
		if (after_death)
			poll_owned(&r);
		sched_yield();
	}
	atomic_store(&sh->finished[self], 1);
	/* No more forks from anyone once all have finished: what is queued
	 * is all there is; drop everything, telling owners. */
	for (;;) {
		bool all = all_set(sh, sh->finished), got = drain(&r);

		while (r.nheld)
			release(&r, r.nheld - 1);
		flush(&r);
		if (all && !got && !r.nout)
			break;
		if (!got)
			sched_yield();
	}
	atomic_store(&sh->dropped[self], 1);
	/* Notes still come until every rank has dropped everything. */
	for (;;) {
		bool all = all_set(sh, sh->dropped), got = drain(&r);

		if (after_death)
			poll_owned(&r);
		if (!r.nowned || (all && !got))
			break;
		if (!got)
			sched_yield();
	}
	CHECK(r.nheld == 0, "rank %u adopted a fork after all finished", self);
	/* Without a death every RRef is removed by its owner; after one, what
	 * is left has references that will never be dropped (the leaks the
	 * parent accounts for), none is unreferenced. */
	CHECK(after_death || r.nowned == 0, "rank %u still owns %u RRefs at the end", self,
	      r.nowned);
	for (uint32_t i = 0; i < r.nowned; i++) {
		struct rref_info in;

		CHECK(rref_info_at(t, r.owned[i].slot, &in) && in.id == r.owned[i].id &&
		      in.state == RREF_READY, "rank %u: own leftover %llx is not ready", self,
		      (unsigned long long)r.owned[i].id);
	}
	return 0;
}

/* Kills the victim once it has done `after` steps; then sweeps it as the
 * launcher does while the survivors go on. */
static void kill_and_sweep(struct rref_table *t, struct shared *sh, pid_t pid, long after)
{
	uint32_t v = sh->victim;
	int status;

	while ((long)atomic_load(&sh->progress[v]) < after) {
		CHECK(!atomic_load(&sh->failed), "a rank failed before the kill");
		usleep(1000);
	}
	CHECK(kill(pid, SIGKILL) == 0, "kill");
	CHECK(waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) &&
	      WTERMSIG(status) == SIGKILL, "victim %u did not die of SIGKILL (status %#x)", v,
	      status);
	rref_sweep_rank(t, v);
	atomic_store(&sh->dead[v], 1);
	rref_sweep_rank(t, v);
}

static bool victim_busy(const struct shared *sh, uint64_t id)
{
	for (uint32_t d = 0; d < BUSY_MAX; d++)
		if (id && atomic_load(&sh->busy[sh->victim][d]) == id)
			return true;
	return false;
}

/*
 * What is left in the table once all survivors have let go: only RRefs the
 * victim was changing when it died, each in a way the protocol explains:
 * half inserted or removed (its key without a filled entry, or the slot
 * still REMOVING, whose id is gone); total above
 * the counts (between the two steps of a count change); total 0 but never
 * handed to the owner (between the last drop and the state's CAS); charged
 * to a receiver but never sent. live counts each of them, and may count one
 * the victim was inserting (before its key) or removing (after it).
 * Returns live.
 */
static uint32_t leftovers(struct rref_table *t, struct shared *sh)
{
	uint32_t v = sh->victim, keys = 0, torn = 0, counted = 0, zero = 0, unsent = 0, live;
	uint32_t changing = 0;

	/* Nesting repeats an id only at the next level (a fork in create). */
	for (uint32_t d = 0; v != NO_VICTIM && d < BUSY_MAX; d++)
		changing += sh->busy[v][d] && (d == 0 || sh->busy[v][d] != sh->busy[v][d - 1]);
	for (uint32_t s = 0; s < t->capacity; s++) {
		uint64_t key = atomic_load(&rref_entry_at(t, s)->key);
		uint32_t sum = 0;
		struct rref_info in;

		if (!key || key == RREF_TOMB)
			continue;
		keys++;
		CHECK(v != NO_VICTIM, "slot %u holds %llx at the end, no rank died", s,
		      (unsigned long long)key);
		if (key == RREF_REMOVING) { /* killed between a removal's CAS and its TOMB */
			CHECK(changing > 0, "slot %u is being removed at the end, but the dead "
			      "rank %u was changing nothing", s, v);
			torn++;
			continue;
		}
		CHECK(victim_busy(sh, key), "slot %u holds %llx at the end: the dead rank %u was "
		      "not changing it", s, (unsigned long long)key, v);
		if (!rref_info_at(t, s, &in)) {
			torn++;
			continue;
		}
		for (uint32_t r = 0; r < WORLD; r++)
			sum += rref_count_of(t, s, r);
		CHECK(rref_count_of(t, s, v) == 0, "dead rank %u still counted on %llx", v,
		      (unsigned long long)key);
		if (in.total > sum) {
			counted++;
		} else if (in.total == 0 && in.state == RREF_READY) {
			zero++;
		} else {
			CHECK(in.total == sum && sum == rref_count_of(t, s, sh->fork_dst[v]),
			      "RRef %llx (%s, owner %u) left with total %u, counts %u: not a "
			      "documented leak", (unsigned long long)key, rref_state_name(in.state),
			      in.owner, in.total, sum);
			unsent++;
		}
	}
	live = atomic_load(&t->hdr->live);
	CHECK(keys <= live && live <= changing, "live %u, %u slots hold ids, the dead rank was "
	      "changing %u RRefs", live, keys, changing);
	if (v != NO_VICTIM)
		printf("rref_table_procs: after rank %u died: live %u; left: %u half inserted or "
		       "removed, %u total above the counts, %u total 0 not handed over, %u charged "
		       "but never sent\n", v, live, torn, counted, zero, unsent);
	return live;
}

/* One round on a fresh table; the victim (if any) is killed after `kill_at`
 * of its steps. */
static void run(struct shared *sh, uint32_t victim, long kill_at)
{
	struct rref_table_params tp = { .max_rrefs = WORLD * (OWN_MAX + 16), .world = WORLD };
	long ops = (long)(OPS * tl_scale());
	struct rref_table table, *t = &table;
	pid_t pids[WORLD];

	CHECK_OK(rref_table_create(t, &tp));
	memset(sh, 0, sizeof(*sh));
	sh->victim = victim;
	fflush(NULL); /* a child that fails exits: it must not print our buffer again */
	for (uint32_t r = 0; r < WORLD; r++) {
		pids[r] = fork();
		CHECK(pids[r] >= 0, "fork");
		if (pids[r] == 0)
			_exit(child(t, sh, r, ops));
	}
	if (victim != NO_VICTIM)
		kill_and_sweep(t, sh, pids[victim], kill_at);
	CHECK(tl_wait_children(), "a rank failed");
	CHECK(sh->forks > 0 && sh->frees > 0, "%llu forks, %llu notes: the protocol did not run",
	      (unsigned long long)sh->forks, (unsigned long long)sh->frees);
	printf("rref_table_procs: %s: %llu forks, %llu notes to owners, %llu removed by a release "
	       "(dead owner), %llu found unreferenced by their owner\n",
	       victim == NO_VICTIM ? "no death" : "rank killed", (unsigned long long)sh->forks,
	       (unsigned long long)sh->frees, (unsigned long long)sh->removed_by_release,
	       (unsigned long long)sh->polled);
	leftovers(t, sh);
	rref_table_detach(t);
}

int main(void)
{
	struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
				 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	long ops = (long)(OPS * tl_scale());
	int deaths = 2 + (int)(40 * tl_scale());
	uint64_t x = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull | 1;

	CHECK(sh != MAP_FAILED, "mmap");
	run(sh, NO_VICTIM, 0);
	/* Each death at another rank and another moment. */
	for (int d = 0; d < deaths; d++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		run(sh, (uint32_t)d % WORLD, ops / 10 + (long)(x % (uint64_t)(ops * 4 / 5 + 1)));
	}
	munmap(sh, sizeof(*sh));
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}

