/*
 * shmrun --trace FILE: once every worker is reaped, the flight recorders
 * of the whole job (worker/trace.h) as one Chrome trace-event JSON file,
 * for Perfetto or chrome://tracing.
 *
 * Each worker's records are paired by (peer, message id): sent with
 * completed makes a call, started with finished a handler run, received
 * with started a wait in the executors' queue (a request that one record
 * says received and started, run at once by the thread that took it,
 * makes a handler run from that record and no wait), pinned with unpinned (of
 * the same message: request or reply) a tensor handoff, blocked with
 * unblocked (of the same type) a send that waited for ring space. Each
 * becomes a complete event ("X") on a track of its own kind; since the
 * recorder says nothing of threads, overlapping events of one kind go to
 * further tracks (lanes), so that no track holds events that do not nest.
 * A call and the handler that served it (the callee's records with the
 * caller as peer and the same id) are joined by two flows: send to handler
 * start, handler end to reply. A handoff and the receiver's span that took
 * its tensors (the handler, for a request's; the call, for a reply's) are
 * joined by two more: "tensors" from the pin to where the receiver took
 * them (handler start, call end), "ack" from where it said so (its reply
 * at handler end; its TENSOR_ACK after the call's end) to the release. A
 * record left without its pair (its call went on past a death, or its
 * pair was overwritten in the ring) becomes an instant event.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "common/json.h"
#include "launcher/shmrun.h"
#include "shm/exit_info.h"
#include "worker/msg.h"
#include "worker/trace.h"

enum lane_kind { LANE_CALL, LANE_HANDLER, LANE_QUEUED, LANE_TENSORS, LANE_BLOCKED, LANE_KINDS };

static const char *const lane_names[LANE_KINDS] = { "calls", "handlers", "queued", "tensors",
						    "blocked" };

/* One complete event: a is its first record, b its last. */
struct span {
	const struct trace_entry *a, *b;
	uint32_t rank, kind, lane;
};

struct rank_recs {
	struct trace_entry *e; /* oldest first */
	bool *paired;          /* e[i] is part of a span */
	size_t n;
	uint64_t head, dropped;
	uint32_t lanes[LANE_KINDS];
};

struct trace_out {
	const struct job *j;
	FILE *f;
	struct rank_recs *r;
	struct span *spans;
	size_t nspans;
	/* LANE_HANDLER and LANE_CALL spans, each by rank, peer, id */
	const struct span **handlers, **calls;
	size_t nhandlers, ncalls;
	bool first; /* no event written yet: no comma before the next */
};

/* ns - start_ns in microseconds, to the nanosecond: a time since the
 * launcher started, or a duration. */
static void put_us(FILE *f, const char *key, uint64_t ns, uint64_t start_ns)
{
	uint64_t d = ns >= start_ns ? ns - start_ns : start_ns - ns;

	fprintf(f, ",\"%s\":%s%llu.%03llu", key, ns >= start_ns ? "" : "-",
		(unsigned long long)(d / 1000u), (unsigned long long)(d % 1000u));
}

static const char *type_name(uint32_t type, char *buf, size_t len)
{
	const char *name = worker_msg_name(type);

	if (name)
		return name;
	if (!type)
		return "-";
	snprintf(buf, len, "%u", type);
	return buf;
}

/* What e is about: its message type, or for a pin its tensors and the
 * message they went with. */
static const char *msg_name(const struct trace_entry *e, char *buf, size_t len)
{
	if (!trace_is_pin(e->kind))
		return type_name(e->type, buf, len);
	snprintf(buf, len, "%u tensor%s, %s", e->tensors, e->tensors == 1 ? "" : "s",
		 e->reply ? "reply" : "request");
	return buf;
}

/* Starts an event: its separator, name, category, phase, process, track. */
static void event(struct trace_out *t, const char *name, const char *cat, const char *ph,
		  uint32_t pid, uint32_t tid)
{
	fputs(t->first ? "\n" : ",\n", t->f);
	t->first = false;
	fputs("{\"name\":", t->f);
	json_put_str(t->f, name);
	fprintf(t->f, ",\"cat\":\"%s\",\"ph\":\"%s\",\"pid\":%u,\"tid\":%u", cat, ph, pid, tid);
}

/* Track 0 holds the unpaired records; lane l of kind k is track 1 + l*KINDS + k. */
static uint32_t lane_tid(uint32_t kind, uint32_t lane)
{
	return 1 + lane * LANE_KINDS + kind;
}

static void track_meta(struct trace_out *t, uint32_t rank, uint32_t tid, const char *name,
		       uint32_t sort)
{
	event(t, "thread_name", "__metadata", "M", rank, tid);
	fputs(",\"args\":{\"name\":", t->f);
	json_put_str(t->f, name);
	fputs("}}", t->f);
	event(t, "thread_sort_index", "__metadata", "M", rank, tid);
	fprintf(t->f, ",\"args\":{\"sort_index\":%u}}", sort);
}

static void rank_meta(struct trace_out *t, uint32_t rank)
{
	const struct rank_recs *r = &t->r[rank];
	char who[SHM_NAME_MAX + 32], name[32];

	report_worker(t->j, rank, who, sizeof(who));
	event(t, "process_name", "__metadata", "M", rank, 0);
	fputs(",\"args\":{\"name\":", t->f);
	json_put_str(t->f, who);
	fputs("}}", t->f);
	event(t, "process_sort_index", "__metadata", "M", rank, 0);
	fprintf(t->f, ",\"args\":{\"sort_index\":%u}}", rank);
	/* Calls first, the records without their pair last. */
	track_meta(t, rank, 0, "unpaired records", LANE_KINDS << 20);
	for (uint32_t k = 0; k < LANE_KINDS; k++) {
		for (uint32_t l = 0; l < r->lanes[k]; l++) {
			if (l)
				snprintf(name, sizeof(name), "%s %u", lane_names[k], l + 1);
			track_meta(t, rank, lane_tid(k, l), l ? name : lane_names[k],
				   k << 20 | l);
		}
	}
}

/* The arguments of an event made of record a, and b its end (NULL: none
 * shown); reply: b is the reply of a call, shown with its type and size.
 * The status is b's, or a's. A handler's start says whether the request
 * was run at once by the thread that took it off the ring (one record
 * for received and started), or queued. */
static void put_args(struct trace_out *t, const struct trace_entry *a,
		     const struct trace_entry *b, bool reply)
{
	char buf[16];

	if (trace_is_pin(a->kind)) {
		fprintf(t->f, ",\"args\":{\"with\":\"%s\",\"tensors\":%u",
			a->reply ? "reply" : "request", a->tensors);
	} else {
		fputs(",\"args\":{\"type\":", t->f);
		json_put_str(t->f, type_name(a->type, buf, sizeof(buf)));
	}
	fprintf(t->f, ",\"peer\":%u,\"msg_id\":%llu,\"bytes\":%llu", a->peer,
		(unsigned long long)a->msg_id, (unsigned long long)a->size);
	if (reply) {
		fputs(",\"reply\":", t->f);
		json_put_str(t->f, type_name(b->type, buf, sizeof(buf)));
		fprintf(t->f, ",\"reply_bytes\":%llu", (unsigned long long)b->size);
	}
	if (a->kind == SHM_TRACE_STARTED || a->kind == SHM_TRACE_RECEIVED_STARTED)
		fprintf(t->f, ",\"at_once\":%s",
			a->kind == SHM_TRACE_RECEIVED_STARTED ? "true" : "false");
	fprintf(t->f, ",\"status\":\"%s\"}}", trace_status_name((b ? b : a)->status));
}

static void put_span(struct trace_out *t, const struct span *s)
{
	static const char *const fmt[LANE_KINDS] = {
		[LANE_CALL] = "%s to %u",
		[LANE_HANDLER] = "%s from %u",
		[LANE_QUEUED] = "queued %s from %u",
		[LANE_TENSORS] = "%s to %u",
		[LANE_BLOCKED] = "%s blocked: ring to %u full",
	};
	const struct trace_entry *a = s->a, *b = s->b;
	char name[80], buf[32];

	snprintf(name, sizeof(name), fmt[s->kind], msg_name(a, buf, sizeof(buf)), a->peer);
	event(t, name, lane_names[s->kind], "X", s->rank, lane_tid(s->kind, s->lane));
	put_us(t->f, "ts", a->time_ns, t->j->start_ns);
	put_us(t->f, "dur", b->time_ns > a->time_ns ? b->time_ns : a->time_ns, a->time_ns);
	/* A wait in the queue ends where the handler starts: its status is the request's. */
	put_args(t, a, s->kind == LANE_QUEUED ? NULL : b,
		 s->kind == LANE_CALL || s->kind == LANE_HANDLER);
}

static void put_unpaired(struct trace_out *t, uint32_t rank, const struct trace_entry *e)
{
	char name[96], buf[32];

	snprintf(name, sizeof(name), "%s %s%s%s%s", trace_kind_name(e->kind),
		 msg_name(e, buf, sizeof(buf)), e->status ? " (" : "",
		 e->status ? trace_status_name(e->status) : "", e->status ? ")" : "");
	event(t, name, "unpaired", "i", rank, 0);
	fputs(",\"s\":\"t\"", t->f);
	put_us(t->f, "ts", e->time_ns, t->j->start_ns);
	put_args(t, e, NULL, false);
}

static void put_flow(struct trace_out *t, const char *name, const char *ph, uint64_t id,
		     const struct span *s, uint64_t ns)
{
	event(t, name, "rpc", ph, s->rank, lane_tid(s->kind, s->lane));
	fprintf(t->f, ",\"id\":%llu", (unsigned long long)id);
	/* A finish binds to the slice around it, not to the next one. */
	if (*ph == 'f')
		fputs(",\"bp\":\"e\"", t->f);
	put_us(t->f, "ts", ns, t->j->start_ns);
	fputc('}', t->f);
}

static int cmp_u64(uint64_t a, uint64_t b)
{
	return a < b ? -1 : a > b;
}

static int by_call(const void *x, const void *y)
{
	const struct trace_entry *a = *(const struct trace_entry *const *)x;
	const struct trace_entry *b = *(const struct trace_entry *const *)y;

	/* Then as trace_read put them, by time: a call's steps can be in
	 * different lanes, whose indexes do not compare. */
	return cmp_u64(a->peer, b->peer) ?: cmp_u64(a->msg_id, b->msg_id)
					 ?: cmp_u64((uintptr_t)a, (uintptr_t)b);
}

static int by_track(const void *x, const void *y)
{
	const struct span *a = x, *b = y;

	return cmp_u64(a->rank, b->rank) ?: cmp_u64(a->kind, b->kind)
					 ?: cmp_u64(a->a->time_ns, b->a->time_ns)
					 ?: cmp_u64(a->b->time_ns, b->b->time_ns);
}

static int span_cmp(uint32_t rank, uint32_t peer, uint64_t id, const struct span *s)
{
	return cmp_u64(rank, s->rank) ?: cmp_u64(peer, s->a->peer) ?: cmp_u64(id, s->a->msg_id);
}

static int by_id(const void *x, const void *y)
{
	const struct span *a = *(const struct span *const *)x;

	return span_cmp(a->rank, a->a->peer, a->a->msg_id, *(const struct span *const *)y);
}

/* The span of rank with peer and id among v (sorted by_id); NULL when its
 * records are gone. */
static const struct span *find_span(const struct span *const *v, size_t n, uint32_t rank,
				    uint32_t peer, uint64_t id)
{
	size_t lo = 0, hi = n;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		int d = span_cmp(rank, peer, id, v[mid]);

		if (!d)
			return v[mid];
		if (d < 0)
			hi = mid;
		else
			lo = mid + 1;
	}
	return NULL;
}

static void add_span(struct trace_out *t, uint32_t rank, uint32_t kind,
		     const struct trace_entry *a, const struct trace_entry *b)
{
	struct rank_recs *r = &t->r[rank];

	t->spans[t->nspans++] = (struct span){ a, b, rank, kind, 0 };
	r->paired[a - r->e] = true;
	/* A start without its finish stays unpaired beside its wait: the
	 * handler that was running when its worker died. */
	if (kind != LANE_QUEUED)
		r->paired[b - r->e] = true;
}

/* Among one call's records p[0..n) (oldest first), each pinned with the
 * next unpinned of the same message (request or reply), each blocked with
 * the next unblocked of the same type. */
static void pair_ends(struct trace_out *t, uint32_t rank, const struct trace_entry **p, size_t n)
{
	const bool *paired = t->r[rank].paired;
	const struct trace_entry *e0 = t->r[rank].e;

	for (size_t i = 0; i < n; i++) {
		const struct trace_entry *a = p[i];
		uint32_t end = a->kind == SHM_TRACE_PINNED ? SHM_TRACE_UNPINNED
			       : a->kind == SHM_TRACE_BLOCKED ? SHM_TRACE_UNBLOCKED : 0;

		for (size_t j = i + 1; end && j < n; j++) {
			const struct trace_entry *b = p[j];

			if (b->kind == end && !paired[b - e0] && b->reply == a->reply &&
			    b->type == a->type) {
				add_span(t, rank, end == SHM_TRACE_UNPINNED ? LANE_TENSORS : LANE_BLOCKED,
					 a, b);
				break;
			}
		}
	}
}

/* Rank's records paired into spans; p is scratch for r->n pointers. */
static void pair_rank(struct trace_out *t, uint32_t rank, const struct trace_entry **p)
{
	const struct rank_recs *r = &t->r[rank];

	for (size_t i = 0; i < r->n; i++)
		p[i] = &r->e[i];
	qsort(p, r->n, sizeof(*p), by_call);
	for (size_t g = 0, end; g < r->n; g = end) {
		/* The first record of each kind of one call (a late reply
		 * after a timeout is a second COMPLETED, left unpaired). */
		const struct trace_entry *k[SHM_TRACE_COMPLETED + 1] = { 0 };

		for (end = g; end < r->n && p[end]->peer == p[g]->peer &&
			      p[end]->msg_id == p[g]->msg_id; end++) {
			/* One record for received and started: the handler
			 * starts there, and no wait shows. */
			uint32_t kind = p[end]->kind == SHM_TRACE_RECEIVED_STARTED ? SHM_TRACE_STARTED
										   : p[end]->kind;

			if (kind <= SHM_TRACE_COMPLETED && !k[kind])
				k[kind] = p[end];
		}
		if (k[SHM_TRACE_SENT] && k[SHM_TRACE_COMPLETED])
			add_span(t, rank, LANE_CALL, k[SHM_TRACE_SENT], k[SHM_TRACE_COMPLETED]);
		if (k[SHM_TRACE_STARTED] && k[SHM_TRACE_FINISHED])
			add_span(t, rank, LANE_HANDLER, k[SHM_TRACE_STARTED], k[SHM_TRACE_FINISHED]);
		if (k[SHM_TRACE_RECEIVED] && k[SHM_TRACE_STARTED])
			add_span(t, rank, LANE_QUEUED, k[SHM_TRACE_RECEIVED], k[SHM_TRACE_STARTED]);
		pair_ends(t, rank, p + g, end - g);
	}
}

/* Each span onto the first lane of its rank and kind whose last event
 * ended strictly before it starts (a flow at an end binds to one slice
 * only); end is scratch for nspans times. */
static void assign_lanes(struct trace_out *t, uint64_t *end)
{
	qsort(t->spans, t->nspans, sizeof(*t->spans), by_track);
	for (size_t g = 0, i; g < t->nspans; g = i) {
		struct span *s0 = &t->spans[g];
		uint32_t *lanes = &t->r[s0->rank].lanes[s0->kind];

		for (i = g; i < t->nspans && t->spans[i].rank == s0->rank &&
			    t->spans[i].kind == s0->kind; i++) {
			struct span *s = &t->spans[i];
			uint32_t l = 0;

			while (l < *lanes && end[l] >= s->a->time_ns)
				l++;
			if (l == *lanes)
				++*lanes;
			s->lane = l;
			end[l] = s->b->time_ns > s->a->time_ns ? s->b->time_ns : s->a->time_ns;
		}
	}
	for (size_t i = 0; i < t->nspans; i++) {
		if (t->spans[i].kind == LANE_HANDLER)
			t->handlers[t->nhandlers++] = &t->spans[i];
		else if (t->spans[i].kind == LANE_CALL)
			t->calls[t->ncalls++] = &t->spans[i];
	}
	qsort(t->handlers, t->nhandlers, sizeof(*t->handlers), by_id);
	qsort(t->calls, t->ncalls, sizeof(*t->calls), by_id);
}

/* What the viewers do not show: what the file is, and each worker's end
 * and recorder. */
/* From when each recorder lane of r holds every record it got: the oldest
 * record of the lane whose oldest is newest among those that lost some
 * (their first record read is not their number 0); 0 when none lost any.
 * Before it, a call's other half may be gone from another lane (as it may
 * be, after it, for a call that began before). */
static uint64_t complete_since_ns(const struct rank_recs *r)
{
	bool seen[SHM_TRACE_LANES_MAX] = { false };
	uint64_t since = 0;

	for (size_t i = 0; i < r->n; i++) {
		const struct trace_entry *e = &r->e[i];

		if (e->lane >= SHM_TRACE_LANES_MAX || seen[e->lane])
			continue;
		seen[e->lane] = true; /* oldest first: its lane's oldest */
		if (e->index > 0 && e->time_ns > since)
			since = e->time_ns;
	}
	return since;
}

static void put_other_data(struct trace_out *t)
{
	const struct job *j = t->j;
	uint64_t since;

	fputs("\"otherData\":{\"tool\":\"shmrun --trace\",\"version\":", t->f);
	json_put_str(t->f, shmrpc_version());
	fputs(",\"job\":", t->f);
	json_put_str(t->f, basename(j->o->argv[0]));
	fprintf(t->f, ",\"time\":\"microseconds since shmrun started (CLOCK_MONOTONIC)\","
		"\"records_per_worker\":%u,\"note\":\"each worker's flight recorder is a ring of "
		"%u records in %u lanes, each holding its last records (a lane per thread, "
		"lane 0 shared): what came before is not here, and a call whose other side "
		"was overwritten has no flows; a worker's complete_since_us says from when "
		"all its lanes hold every record (null: since it started): before it, a "
		"lane may lack the other half of a call\",\"workers\":[",
		j->shm.seg.trace_records,
		j->shm.seg.trace_records, shm_trace_lanes(j->shm.seg.trace_records));
	for (uint32_t rank = 0; rank < j->o->nproc; rank++) {
		const struct rank_recs *r = &t->r[rank];
		const struct proc *p = &j->procs[rank];
		const char *slot = shm_worker(&j->shm.seg, rank)->name;
		char end[64], name[SHM_NAME_MAX + 1];

		if (!p->pid)
			snprintf(end, sizeof(end), "not started");
		else if (!p->exit_info)
			snprintf(end, sizeof(end), "exited 0");
		else
			shm_exit_info_format(p->exit_info, end, sizeof(end));
		fprintf(t->f, "%s{\"rank\":%u,\"name\":", rank ? "," : "", rank);
		/* A worker may rename itself in its slot: read it bounded. */
		snprintf(name, sizeof(name), "%.*s", (int)strnlen(slot, SHM_NAME_MAX), slot);
		json_put_str(t->f, name);
		fputs(",\"end\":", t->f);
		json_put_str(t->f, end);
		fprintf(t->f, ",\"records\":%llu,\"records_in_file\":%zu,\"records_dropped\":%llu",
			(unsigned long long)r->head, r->n, (unsigned long long)r->dropped);
		since = complete_since_ns(r);
		if (since)
			put_us(t->f, "complete_since_us", since, j->start_ns);
		else
			fputs(",\"complete_since_us\":null", t->f);
		fputc('}', t->f);
	}
	fputs("]}", t->f);
}

static void put_file(struct trace_out *t)
{
	const struct job *j = t->j;
	uint64_t flow = 0;
	size_t at = 0;

	fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[", t->f);
	for (uint32_t rank = 0; rank < j->o->nproc; rank++) {
		const struct rank_recs *r = &t->r[rank];

		rank_meta(t, rank);
		for (; at < t->nspans && t->spans[at].rank == rank; at++)
			put_span(t, &t->spans[at]);
		for (size_t i = 0; i < r->n; i++)
			if (!r->paired[i])
				put_unpaired(t, rank, &r->e[i]);
	}
	/* After every slice: a flow at a slice's first instant finds it open. */
	for (size_t i = 0; i < t->nspans; i++) {
		const struct span *s = &t->spans[i], *h, *r;

		if (s->kind == LANE_CALL &&
		    (h = find_span(t->handlers, t->nhandlers, s->a->peer, s->rank, s->a->msg_id))) {
			put_flow(t, "request", "s", ++flow, s, s->a->time_ns);
			put_flow(t, "request", "f", flow, h, h->a->time_ns);
			put_flow(t, "reply", "s", ++flow, h, h->b->time_ns);
			put_flow(t, "reply", "f", flow, s, s->b->time_ns);
		}
		if (s->kind != LANE_TENSORS)
			continue;
		/* The receiver: of a request's tensors, the handler, which
		 * takes them when it starts and lets them go with its reply;
		 * of a reply's, the call, which takes them with the reply and
		 * then sends its TENSOR_ACK. */
		r = s->a->reply ? find_span(t->calls, t->ncalls, s->a->peer, s->rank, s->a->msg_id)
				: find_span(t->handlers, t->nhandlers, s->a->peer, s->rank, s->a->msg_id);
		if (!r)
			continue;
		put_flow(t, "tensors", "s", ++flow, s, s->a->time_ns);
		put_flow(t, "tensors", "f", flow, r, s->a->reply ? r->b->time_ns : r->a->time_ns);
		put_flow(t, "ack", "s", ++flow, r, r->b->time_ns);
		put_flow(t, "ack", "f", flow, s, s->b->time_ns);
	}
	fputs("\n],", t->f);
	put_other_data(t);
	fputs("}\n", t->f);
}

int trace_json_write(const struct job *j, const char *path)
{
	const struct shm_seg *seg = &j->shm.seg;
	struct trace_out t = { .j = j, .first = true };
	const struct trace_entry **scratch = NULL;
	uint64_t *end = NULL;
	size_t total = 0;
	int rc = -1;

	t.r = calloc(j->o->nproc, sizeof(*t.r));
	if (!t.r)
		goto oom;
	/* Every worker is reaped: no record moves now. trace_read's seqlock
	 * check still skips the one a worker killed mid-write left torn, and
	 * slots never written. */
	for (uint32_t rank = 0; rank < j->o->nproc; rank++) {
		struct rank_recs *r = &t.r[rank];

		r->e = malloc(seg->trace_records * sizeof(*r->e));
		r->paired = calloc(seg->trace_records, sizeof(*r->paired));
		if (!r->e || !r->paired)
			goto oom;
		r->n = trace_read(seg, rank, seg->trace_records, r->e, &r->head, &r->dropped);
		total += r->n;
	}
	/* A span takes a record of its own: sent, started (or received and
	 * started), received, pinned or blocked. */
	t.spans = malloc((total ? total : 1) * sizeof(*t.spans));
	t.handlers = malloc((total ? total : 1) * sizeof(*t.handlers));
	t.calls = malloc((total ? total : 1) * sizeof(*t.calls));
	scratch = malloc(seg->trace_records * sizeof(*scratch));
	end = malloc((total ? total : 1) * sizeof(*end));
	if (!t.spans || !t.handlers || !t.calls || !scratch || !end)
		goto oom;
	for (uint32_t rank = 0; rank < j->o->nproc; rank++)
		pair_rank(&t, rank, scratch);
	assign_lanes(&t, end);

	if (!(t.f = fopen(path, "we"))) {
		fprintf(stderr, "shmrun: cannot write the trace to %s: %s\n", path, strerror(errno));
		goto out;
	}
	put_file(&t);
	errno = 0;
	if (ferror(t.f) | fclose(t.f)) {
		fprintf(stderr, "shmrun: cannot write the trace to %s: %s\n", path,
			errno ? strerror(errno) : "write error");
		goto out;
	}
	rc = 0;
	goto out;
oom:
	fprintf(stderr, "shmrun: out of memory writing the trace of %u workers\n", j->o->nproc);
out:
	for (uint32_t rank = 0; t.r && rank < j->o->nproc; rank++) {
		free(t.r[rank].e);
		free(t.r[rank].paired);
	}
	free(t.r);
	free(t.spans);
	free(t.handlers);
	free(t.calls);
	free(scratch);
	free(end);
	return rc;
}
