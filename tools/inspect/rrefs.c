/*
 * The RRef table's subject: the live RRefs by state, the oldest with their
 * owner and holders, and --check's three anomalies (an unswept RRef of a
 * DEAD owner, one counted below its holders' references, one leaked).
 */
#include <time.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tools/inspect/inspect.h"
#include "common/clock.h"
#include "common/error.h"

#define RR_READS 8                 /* tries at a settled read of a busy entry */
#define RR_RECHECK_NS 100000000u   /* pause before an RRef anomaly is read again */

/* One live RRef as read once. settled: its key and total were the same
 * before and after its counts were read, so the counts belong to that
 * total (a holder raises total before its count and lowers it after). */
struct rsnap {
	struct rref_info info;
	uint64_t sum; /* of the counts */
	bool settled;
};



/* The job's RRef table, as map_pool; one that is not for the job's world
 * cannot be read: its ranks would not be the job's. */
static int map_rrefs(struct view *v, int fd)
{
	int rc = rref_table_attach_fd(&v->rrefs, fd, true);

	if (rc || v->rrefs.world == v->seg.world)
		return rc;
	v->rrefs.fd = -1; /* fd stays the caller's, as on any failure */
	rref_table_detach(&v->rrefs);
	return shmrpc__fail(-EINVAL, "it is for %u workers, the job has %u", v->rrefs.world,
			    v->seg.world);
}

/* The entry at slot, its counts into counts (world of them); false when
 * the slot holds no RRef. An entry that keeps moving is read RR_READS
 * times at most, and then left unsettled. */
static bool snap_rref(const struct rref_table *t, uint32_t slot, uint32_t *counts, struct rsnap *s)
{
	const struct rref_entry *e = rref_entry_at(t, slot);

	for (int i = 0; i < RR_READS; i++) {
		if (!rref_info_at(t, slot, &s->info))
			return false;
		/* Acquire fences: total, then the counts, then total again. */
		atomic_thread_fence(memory_order_acquire);
		s->sum = 0;
		for (uint32_t r = 0; r < t->world; r++)
			s->sum += counts[r] = rref_count_of(t, slot, r);
		atomic_thread_fence(memory_order_acquire);
		s->settled = atomic_load_explicit(&e->key, memory_order_relaxed) == s->info.id &&
			     atomic_load_explicit(&e->total, memory_order_relaxed) == s->info.total;
		if (s->settled)
			break;
	}
	return true;
}

/* "CREATED_ON:LOCAL_ID", PyTorch's GloballyUniqueId. */
static const char *fmt_rref_id(uint64_t id, char *buf, size_t len)
{
	snprintf(buf, len, "%u:%llu", RREF_ID_RANK(id), (unsigned long long)RREF_ID_LOCAL(id));
	return buf;
}

static bool younger(const struct pick *a, const struct pick *b)
{
	return a->created_ns > b->created_ns;
}

static void pick_oldest(struct rscan *sc, struct pick p)
{
	uint32_t i, c;

	if (sc->n < sc->k) {
		for (i = sc->n++; i && younger(&p, &sc->pick[(i - 1) / 2]); i = (i - 1) / 2)
			sc->pick[i] = sc->pick[(i - 1) / 2];
		sc->pick[i] = p;
		return;
	}
	if (!younger(&sc->pick[0], &p))
		return;
	for (i = 0; (c = 2 * i + 1) < sc->n; i = c) {
		if (c + 1 < sc->n && younger(&sc->pick[c + 1], &sc->pick[c]))
			c++;
		if (!younger(&sc->pick[c], &p))
			break;
		sc->pick[i] = sc->pick[c];
	}
	sc->pick[i] = p;
}

static int by_age(const void *a, const void *b)
{
	const struct pick *x = a, *y = b;

	return (x->created_ns > y->created_ns) - (x->created_ns < y->created_ns);
}

/* Walks the table, picking the k (> 0) oldest RRefs, oldest first; false
 * when out of memory. */
static bool scan_rrefs(const struct rref_table *t, uint32_t k, struct rscan *sc)
{
	struct rref_info info;

	memset(sc, 0, sizeof(*sc));
	sc->k = k;
	sc->pick = calloc(k, sizeof(*sc->pick));
	if (!sc->pick)
		return false;
	for (uint32_t s = 0; s < t->capacity; s++) {
		if (!rref_info_at(t, s, &info))
			continue;
		sc->live++;
		if (info.state < RR_NSTATES)
			sc->by_state[info.state]++;
		pick_oldest(sc, (struct pick){ info.created_ns, info.id, s });
	}
	qsort(sc->pick, sc->n, sizeof(*sc->pick), by_age);
	return true;
}

/* The RRefs' counts by state, and the oldest (for the text or the JSON;
 * --check walks the table itself). */
static bool snap_rrefs(struct view *v)
{
	if (!(v->counts = calloc(v->rrefs.world, sizeof(*v->counts))))
		return false;
	return v->check || scan_rrefs(&v->rrefs, v->json ? RR_LISTED : RR_SHOWN, &v->sc);
}

static void detach_rrefs(struct view *v)
{
	free(v->sc.pick);
	free(v->counts);
	rref_table_detach(&v->rrefs);
}

static void print_rrefs_text(struct view *v)
{
	const struct rref_table *t = &v->rrefs;
	const struct rscan *sc = &v->sc;
	uint32_t *counts = v->counts;
	uint64_t now = shmrpc_now_ns();
	char id[48], dur[32];
	struct rsnap s;

	printf("\nrref table     %u live of %u (capacity %u slots)\n              ", sc->live,
	       t->max_rrefs, t->capacity);
	for (uint32_t st = RREF_PENDING; st < RR_NSTATES; st++)
		printf("%s %u %s", st == RREF_PENDING ? "" : ",", sc->by_state[st], rref_state_name(st));
	printf("\n");
	if (!sc->n)
		return;
	printf("%-18s %5s %-12s %5s %7s  %s\n", "ID", "OWNER", "STATE", "TOTAL", "AGE", "COUNTS");
	for (uint32_t i = 0; i < sc->n; i++) {
		/* Read again: it may have gone since the walk. */
		if (!snap_rref(t, sc->pick[i].slot, counts, &s) || s.info.id != sc->pick[i].id)
			continue;
		printf("%-18s %5u %-12s %5u %7s ", fmt_rref_id(s.info.id, id, sizeof(id)), s.info.owner,
		       rref_state_name(s.info.state), s.info.total,
		       fmt_dur(now > s.info.created_ns ? now - s.info.created_ns : 0, dur, sizeof(dur)));
		for (uint32_t r = 0; r < t->world; r++)
			if (counts[r])
				printf(" %u:%u", r, counts[r]);
		printf("\n");
	}
	if (sc->live > sc->n)
		printf("... and %u more\n", sc->live - sc->n);
}

/* Ends with the entries' ']}': the object's last field. */
static void print_rrefs_json(struct view *v)
{
	const struct rref_table *t = &v->rrefs;
	const struct rscan *sc = &v->sc;
	uint32_t *counts = v->counts;
	uint64_t now = shmrpc_now_ns();
	bool first = true;
	struct rsnap s;
	char id[48];

	printf(",\"rrefs\":{\"live\":%u,\"max\":%u,\"capacity\":%u,\"by_state\":{", sc->live,
	       t->max_rrefs, t->capacity);
	for (uint32_t st = RREF_PENDING; st < RR_NSTATES; st++)
		printf("%s\"%s\":%u", st == RREF_PENDING ? "" : ",", rref_state_name(st),
		       sc->by_state[st]);
	printf("},\"entries\":[");
	for (uint32_t i = 0; i < sc->n; i++) {
		bool none = true;

		if (!snap_rref(t, sc->pick[i].slot, counts, &s) || s.info.id != sc->pick[i].id)
			continue;
		printf("%s{\"id\":\"%s\",\"owner\":%u,\"creator\":%u,\"state\":\"%s\",\"total\":%u,"
		       "\"age_s\":%.3f,\"counts\":{", first ? "" : ",",
		       fmt_rref_id(s.info.id, id, sizeof(id)), s.info.owner, s.info.creator,
		       rref_state_name(s.info.state), s.info.total,
		       (double)(now > s.info.created_ns ? now - s.info.created_ns : 0) / 1e9);
		for (uint32_t r = 0; r < t->world; r++) {
			if (counts[r]) {
				printf("%s\"%u\":%u", none ? "" : ",", r, counts[r]);
				none = false;
			}
		}
		printf("}}");
		first = false;
	}
	printf("]}");
}

enum fault { FAULT_NONE, FAULT_UNSWEPT, FAULT_CORRUPT, FAULT_LEAKED };

static bool ended(uint32_t state)
{
	return state == SHM_WORKER_EXITED || state == SHM_WORKER_DEAD;
}

/* What is wrong with the RRef at slot (read into s and counts), if anything. */
static enum fault fault_of(const struct rref_table *t, const struct wsnap *ws, uint32_t slot,
			   uint32_t *counts, struct rsnap *s)
{
	if (!snap_rref(t, slot, counts, s))
		return FAULT_NONE;
	if (s->info.owner < t->world && ws[s->info.owner].state == SHM_WORKER_DEAD &&
	    s->info.state != RREF_OWNER_DEAD)
		return FAULT_UNSWEPT;
	if (!s->settled || s->info.total == s->sum)
		return FAULT_NONE;
	if (s->info.total < s->sum)
		return FAULT_CORRUPT;
	for (uint32_t r = 0; r < t->world; r++)
		if (counts[r] && !ended(ws[r].state))
			return FAULT_NONE;
	return FAULT_LEAKED;
}

/* Prints each RRef anomaly; the number found, or -1 when out of memory. */
static int check_rrefs(struct view *v)
{
	const struct rref_table *t = &v->rrefs;
	const struct wsnap *ws = v->ws;
	uint32_t *counts = v->counts;
	const struct timespec pause = { 0, RR_RECHECK_NS };
	struct pick *bad = NULL;
	uint32_t nbad = 0, cap = 0;
	struct rsnap s;
	char id[48];
	int found = 0;

	for (uint32_t slot = 0; slot < t->capacity; slot++) {
		if (fault_of(t, ws, slot, counts, &s) == FAULT_NONE)
			continue;
		if (nbad == cap) {
			struct pick *more = realloc(bad, (cap = cap ? 2 * cap : 16) * sizeof(*bad));

			if (!more) {
				free(bad);
				return -1;
			}
			bad = more;
		}
		bad[nbad++] = (struct pick){ s.info.created_ns, s.info.id, slot };
	}
	/* A count change in flight passes in an instant; a fault stays. */
	if (nbad)
		nanosleep(&pause, NULL);
	for (uint32_t i = 0; i < nbad; i++) {
		enum fault f = fault_of(t, ws, bad[i].slot, counts, &s);

		if (f == FAULT_NONE || s.info.id != bad[i].id)
			continue;
		fmt_rref_id(s.info.id, id, sizeof(id));
		if (f == FAULT_UNSWEPT)
			printf("RRef %s is %s, but its owner rank %u is DEAD: the sweep missed it\n", id,
			       rref_state_name(s.info.state), s.info.owner);
		else if (f == FAULT_CORRUPT)
			printf("RRef %s is corrupt: total %u is below the %llu references its holders "
			       "count\n", id, s.info.total, (unsigned long long)s.sum);
		else
			printf("RRef %s leaked: total %u is above the %llu references its holders count, "
			       "and no holder is alive\n", id, s.info.total, (unsigned long long)s.sum);
		found++;
	}
	free(bad);
	return found;
}

const struct subject rrefs_subject = { "rref table", "the RRef table", "rrefs", RREF_LINK,
				       map_rrefs, snap_rrefs, print_rrefs_text, print_rrefs_json,
				       check_rrefs, detach_rrefs };
