/*
 * The flight recorder: writing this worker's records, and reading any
 * worker's (shm/layout.h gives the protocol both follow).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/ticks.h"
#include "ipc/port.h"
#include "worker/msg.h"
#include "worker/trace.h"

struct trace_self trace_self;

/* trace_ring_init's count, from 1: a thread's lane is of the ring of this
 * number (relaxed: the number only has to differ). */
static _Atomic uint64_t openings;
/* This thread's lane: `lane` of the ring that `opening` made (0: none yet,
 * or the shared lane); `last`, the index of its newest record there (in
 * the shared lane, the index it claimed last, unique to it, written or
 * dropped): trace_fold_to rewrites only that one. */
static _Thread_local struct {
	uint64_t opening;
	uint64_t last;
	uint32_t lane;
} mine;

void trace_ring_init(struct trace_self *t, struct shm_trace_ctl *ctl, uint32_t records, bool ticks)
{
	uint32_t lanes = shm_trace_lanes(records);

	t->ring = ctl;
	t->recs = (struct shm_trace_rec *)(ctl + lanes);
	t->mask = records / lanes - 1;
	t->lanes = lanes;
	t->ticks = ticks;
	t->opening = atomic_fetch_add_explicit(&openings, 1, memory_order_relaxed) + 1;
	atomic_store_explicit(&t->given, 0, memory_order_relaxed);
	atomic_store_explicit(&t->ctl, ctl, memory_order_relaxed);
}

/* A child of a fork makes no calls (worker/agent.c), and its threads must
 * not write the lanes of its parent's. */
static void forget_in_child(void)
{
	trace_close();
}

static void process_once(void)
{
	pthread_atfork(NULL, NULL, forget_in_child);
}

void trace_open(const struct shm_seg *seg, uint32_t rank)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	const char *v = getenv("SHMRPC_TRACE");

	pthread_once(&once, process_once);
	if (v && !strcmp(v, "0"))
		return;
	trace_ring_init(&trace_self, shm_trace(seg, rank), seg->trace_records,
			seg->trace_clock == SHM_TRACE_CLOCK_TICKS);
}

void trace_close(void)
{
	atomic_store_explicit(&trace_self.ctl, NULL, memory_order_relaxed);
	trace_self.ring = NULL;
}

void trace_switch(bool on)
{
	atomic_store_explicit(&trace_self.ctl, on ? trace_self.ring : NULL, memory_order_relaxed);
}

/* The calling thread's lane of t: its own while t has lanes to give. */
static uint32_t my_lane(struct trace_self *t)
{
	if (mine.opening != t->opening) {
		/* Relaxed: the count only has to hand each lane out once. */
		uint32_t n = atomic_fetch_add_explicit(&t->given, 1, memory_order_relaxed) + 1;

		mine.lane = n < t->lanes ? n : 0;
		mine.opening = t->opening;
	}
	return mine.lane;
}

/* Record i of lane's slot in t. */
static struct shm_trace_rec *slot(const struct trace_self *t, uint32_t lane, uint64_t i)
{
	return &t->recs[((uint64_t)lane * (t->mask + 1)) | (i & t->mask)];
}

void trace_put_to(struct trace_self *t, uint64_t msg_id, uint64_t info, struct trace_mark *at)
{
	uint64_t now = t->ticks ? shmrpc_ticks() : shmrpc_now_ns();
	struct shm_trace_ctl *ctl = atomic_load_explicit(&t->ctl, memory_order_relaxed), *c;
	struct shm_trace_rec *r;
	uint32_t lane;
	uint64_t i, seq;

	if (at)
		at->opening = 0;
	if (!ctl)
		return;
	lane = my_lane(t);
	c = &ctl[lane];
	if (lane) {
		/* Relaxed: only this thread writes this lane's head and slots. */
		i = atomic_load_explicit(&c->head, memory_order_relaxed);
		r = slot(t, lane, i);
		mine.last = i;
		atomic_store_explicit(&r->seq, 2 * i + 1, memory_order_relaxed);
	} else {
		/* Relaxed: the index only has to be unique; the record's seq
		 * publishes it. */
		i = atomic_fetch_add_explicit(&c->head, 1, memory_order_relaxed);
		r = slot(t, 0, i);
		mine.last = i;
		seq = atomic_load_explicit(&r->seq, memory_order_relaxed);

		/* Odd: a writer a lap away is still in this slot; above 2i: one
		 * a lap ahead has filled it. Either way this record is the one
		 * to lose. Acquire on success: our stores come after the last
		 * owner's. */
		if ((seq & 1) || seq > 2 * i ||
		    !atomic_compare_exchange_strong_explicit(&r->seq, &seq, 2 * i + 1,
							     memory_order_acquire,
							     memory_order_relaxed)) {
			atomic_fetch_add_explicit(&c->dropped, 1, memory_order_relaxed);
			return;
		}
	}
	/* Release fence: a reader that sees any word below sees seq odd (or
	 * newer) on its second load. */
	atomic_thread_fence(memory_order_release);
	atomic_store_explicit(&r->msg_id, msg_id, memory_order_relaxed);
	atomic_store_explicit(&r->time, now, memory_order_relaxed);
	atomic_store_explicit(&r->info, info, memory_order_relaxed);
	/* Release: the words are visible to whoever sees the even seq. */
	atomic_store_explicit(&r->seq, 2 * i + 2, memory_order_release);
	/* Relaxed: readers take what the seqs say; the head only says where
	 * to look (and a reader looks past it: shm/layout.h). */
	if (lane)
		atomic_store_explicit(&c->head, i + 1, memory_order_relaxed);
	if (at)
		*at = (struct trace_mark){ t->opening, i, lane };
}

bool trace_fold_to(struct trace_self *t, const struct trace_mark *at, uint64_t info)
{
	struct shm_trace_ctl *ctl = atomic_load_explicit(&t->ctl, memory_order_relaxed);
	struct shm_trace_rec *r;
	uint64_t i = at->index, seq = 2 * i + 2;

	/* This thread's newest record: in its own lane no other thread
	 * writes, and in the shared lane no other thread claimed index i. */
	if (!ctl || !at->opening || at->opening != t->opening || mine.opening != t->opening ||
	    mine.lane != at->lane || mine.last != i)
		return false;
	r = slot(t, at->lane, i);
	if (at->lane) {
		/* Relaxed, as a record's first store (trace_put_to). */
		atomic_store_explicit(&r->seq, 2 * i + 1, memory_order_relaxed);
	} else if (!atomic_compare_exchange_strong_explicit(&r->seq, &seq, 2 * i + 1,
							    memory_order_relaxed,
							    memory_order_relaxed)) {
		/* A writer a lap ahead has the slot: the record is gone.
		 * Relaxed on success: seq still 2i+2, the slot's last writer
		 * was this thread; a lapper now finds it odd and drops. */
		return false;
	}
	/* Release fence and release store: as trace_put_to's, so that a
	 * reader sees the record whole with the old info or the new. */
	atomic_thread_fence(memory_order_release);
	atomic_store_explicit(&r->info, info, memory_order_relaxed);
	atomic_store_explicit(&r->seq, 2 * i + 2, memory_order_release);
	return true;
}

void trace_fold_forget(void)
{
	mine.last = UINT64_MAX; /* no index: a lane wraps long before */
}

void trace_received(uint32_t src, uint32_t type, uint64_t msg_id, size_t size,
		    struct trace_mark *at)
{
	at->opening = 0;
	if (trace_on())
		trace_put_to(&trace_self, msg_id, trace_info(SHM_TRACE_RECEIVED, src, type, size,
							     SHM_TRACE_OK), at);
}

void trace_started(const struct trace_mark *at, uint32_t src, uint32_t type, uint64_t msg_id,
		   size_t size)
{
	if (!trace_on())
		return;
	/* A request taken off its ring and run by one thread with nothing
	 * between: its arrival is its start, give or take the queue's push
	 * and pop, and one record says both. */
	if (!trace_fold_to(&trace_self, at, trace_info(SHM_TRACE_RECEIVED_STARTED, src, type, size,
						       SHM_TRACE_OK)))
		trace_put(msg_id, trace_info(SHM_TRACE_STARTED, src, type, size, SHM_TRACE_OK));
}

void trace_pins(uint32_t kind, uint32_t peer, bool reply, uint64_t msg_id, uint32_t tensors,
		uint64_t bytes, uint32_t status)
{
	uint32_t field = (uint32_t)bytes;

	if (!trace_on())
		return;
	/* From 2 GiB the KiB, rounded up (saturated): a handoff's size stays
	 * right to the KiB up to 2 TiB. */
	if (bytes >= SHM_TRACE_PIN_BYTES_KIB) {
		uint64_t kib = bytes / 1024u + (bytes % 1024u != 0);

		field = SHM_TRACE_PIN_BYTES_KIB |
			(uint32_t)(kib < SHM_TRACE_PIN_BYTES_KIB ? kib : SHM_TRACE_PIN_BYTES_KIB - 1);
	}
	if (tensors > SHM_TRACE_PIN_MAX_TENSORS)
		tensors = SHM_TRACE_PIN_MAX_TENSORS;
	trace_put(msg_id, SHM_TRACE_PIN_INFO(kind, status, reply, tensors, peer, field));
}

int trace_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m)
{
	int rc = ipc_port_try_send(p, dst, m);
	size_t len = 0;

	if (rc != -EAGAIN)
		return rc;
	for (int i = 0; i < m->iovcnt; i++)
		len += m->iov[i].iov_len;
	trace_rec(SHM_TRACE_BLOCKED, dst, m->type, m->msg_id, len, SHM_TRACE_OK);
	rc = ipc_port_send(p, dst, m, 0);
	trace_rec(SHM_TRACE_UNBLOCKED, dst, m->type, m->msg_id, len, trace_status_of(rc));
	return rc;
}

uint32_t trace_status_of(int err)
{
	switch (err) {
	case 0:
		return SHM_TRACE_OK;
	case -ETIMEDOUT:
		return SHM_TRACE_TIMEOUT;
	case -SHMRPC_EPEERDEAD:
		return SHM_TRACE_PEER_DEAD;
	case -ESHUTDOWN:
		return SHM_TRACE_SHUTDOWN;
	default:
		return SHM_TRACE_ERROR;
	}
}

uint32_t trace_reply_status(uint32_t type)
{
	return type == MSG_EXCEPTION ? SHM_TRACE_ERROR : SHM_TRACE_OK;
}

/* ---- reading ---- */

/* Reads record i of a lane (its slots recs, mask its length - 1) into e;
 * false when it is not whole. */
static bool read_record(const struct shm_trace_rec *recs, uint64_t mask, uint64_t i,
			struct trace_entry *e, uint64_t *info)
{
	const struct shm_trace_rec *r = &recs[i & mask];
	uint64_t want = 2 * i + 2;

	/* Acquire pairs with the writer's release of the even seq. */
	if (atomic_load_explicit(&r->seq, memory_order_acquire) != want)
		return false;
	e->msg_id = atomic_load_explicit(&r->msg_id, memory_order_relaxed);
	e->time_ns = atomic_load_explicit(&r->time, memory_order_relaxed);
	*info = atomic_load_explicit(&r->info, memory_order_relaxed);
	/* Acquire fence: pairs with the release fence of a writer whose
	 * words we may have read; then its odd seq shows below. */
	atomic_thread_fence(memory_order_acquire);
	return atomic_load_explicit(&r->seq, memory_order_relaxed) == want;
}

/* Fills e's fields that info packs. */
static void unpack(struct trace_entry *e, uint64_t info)
{
	e->kind = SHM_TRACE_KIND(info);
	e->status = SHM_TRACE_STATUS(info);
	if (trace_is_pin(e->kind)) {
		uint32_t b = SHM_TRACE_SIZE(info);

		e->size = b & SHM_TRACE_PIN_BYTES_KIB ? (uint64_t)(b & ~SHM_TRACE_PIN_BYTES_KIB) * 1024u
						      : b;
		e->peer = SHM_TRACE_PIN_PEER(info);
		e->type = 0;
		e->tensors = SHM_TRACE_PIN_TENSORS(info);
		e->reply = SHM_TRACE_PIN_REPLY(info);
	} else {
		e->size = SHM_TRACE_SIZE(info);
		e->peer = SHM_TRACE_PEER(info);
		e->type = SHM_TRACE_TYPE(info);
		e->tensors = 0;
		e->reply = false;
	}
}

/* Reads the last `max` whole records of lane `lane` (control c, slots
 * recs) into out, oldest first; returns how many. */
static size_t read_lane(const struct shm_trace_ctl *c, const struct shm_trace_rec *recs,
			uint64_t mask, uint32_t lane, size_t max, struct trace_entry *out)
{
	/* Relaxed: each record's seq says whether it is there. */
	uint64_t h = atomic_load_explicit(&c->head, memory_order_relaxed), n, info;
	struct trace_entry probe;
	size_t got = 0;

	/* A lane's own thread stores its head after the record: a record
	 * whole past the head is there (one, unless the head is corrupt). */
	for (uint64_t k = 0; k <= mask && read_record(recs, mask, h, &probe, &info); k++)
		h++;
	n = h < mask + 1 ? h : mask + 1;
	if (n > max)
		n = max;
	for (uint64_t i = h - n; i != h; i++) {
		struct trace_entry *e = &out[got];

		if (!read_record(recs, mask, i, e, &info))
			continue;
		e->index = i;
		e->lane = lane;
		unpack(e, info);
		got++;
	}
	return got;
}

/* Oldest first: by time, then lane, then index. */
static int by_time(const void *pa, const void *pb)
{
	const struct trace_entry *a = pa, *b = pb;

	if (a->time_ns != b->time_ns)
		return a->time_ns < b->time_ns ? -1 : 1;
	if (a->lane != b->lane)
		return a->lane < b->lane ? -1 : 1;
	return a->index < b->index ? -1 : a->index > b->index;
}

uint64_t trace_claimed(const struct shm_seg *seg, uint32_t rank)
{
	const struct shm_trace_ctl *c = shm_trace(seg, rank);
	uint64_t n = 0;

	for (uint32_t l = 0; l < shm_trace_lanes(seg->trace_records); l++)
		n += atomic_load_explicit(&c[l].head, memory_order_relaxed);
	return n;
}

size_t trace_read(const struct shm_seg *seg, uint32_t rank, size_t max, struct trace_entry *out,
		  uint64_t *head, uint64_t *dropped)
{
	const struct shm_trace_ctl *c = shm_trace(seg, rank);
	const struct shm_trace_rec *recs = shm_trace_recs(seg, rank);
	uint32_t lanes = shm_trace_lanes(seg->trace_records);
	uint64_t len = seg->trace_records / lanes;
	size_t per = max < len ? max : len, got = 0;
	/* Ticks become ns along the creator's anchor and ours, taken after
	 * every record read here. */
	bool ticks = seg->trace_clock == SHM_TRACE_CLOCK_TICKS;
	struct trace_entry *all = lanes > 1 ? malloc(lanes * per * sizeof(*all)) : out;
	struct shmrpc_anchor now;

	*head = *dropped = 0;
	if (!all)
		return 0;
	for (uint32_t l = 0; l < lanes; l++) {
		/* Relaxed: counted, not read through. */
		*head += atomic_load_explicit(&c[l].head, memory_order_relaxed);
		*dropped += atomic_load_explicit(&c[l].dropped, memory_order_relaxed);
		got += read_lane(&c[l], recs + l * len, len - 1, l, per, all + got);
	}
	now = ticks ? shmrpc_anchor_now() : (struct shmrpc_anchor){ 0, 0 };
	for (size_t i = 0; ticks && i < got; i++)
		all[i].time_ns = shmrpc_ticks_to_ns(all[i].time_ns, seg->trace_anchor, now);
	if (all != out) {
		qsort(all, got, sizeof(*all), by_time);
		if (got > max) {
			memmove(all, all + (got - max), max * sizeof(*all));
			got = max;
		}
		memcpy(out, all, got * sizeof(*out));
		free(all);
	}
	return got;
}

const char *trace_kind_name(uint32_t kind)
{
	static const char *const names[] = { "?",        "sent",       "received", "started",
					     "finished", "completed",  "pinned",   "unpinned",
					     "blocked",  "unblocked", "recv+start" };

	return kind < sizeof(names) / sizeof(names[0]) ? names[kind] : "?";
}

const char *trace_status_name(uint32_t status)
{
	static const char *const names[] = { "ok", "error", "timeout", "peer-dead", "shutdown",
					     "late" };

	return status < sizeof(names) / sizeof(names[0]) ? names[status] : "?";
}

const char *trace_step(const struct trace_entry *e, size_t i, uint64_t *ns)
{
	uint32_t before;
	const char *what;

	switch (e[i].kind) {
	case SHM_TRACE_STARTED:
		before = SHM_TRACE_RECEIVED, what = "waited";
		break;
	case SHM_TRACE_FINISHED:
		before = SHM_TRACE_STARTED, what = "ran";
		break;
	case SHM_TRACE_COMPLETED:
		before = SHM_TRACE_SENT, what = "took";
		break;
	case SHM_TRACE_UNPINNED:
		before = SHM_TRACE_PINNED, what = "held";
		break;
	case SHM_TRACE_UNBLOCKED:
		before = SHM_TRACE_BLOCKED, what = "blocked";
		break;
	default:
		return NULL;
	}
	for (size_t j = i; j-- > 0;) {
		/* A request of ours and our reply to the peer's request of the
		 * same id are two messages: for pins the reply flag tells them
		 * apart, for blocked sends the message type. A run that one
		 * record says received and started ran from the arrival. */
		uint32_t kind = e[j].kind == SHM_TRACE_RECEIVED_STARTED ? SHM_TRACE_STARTED
									 : e[j].kind;

		if (kind == before && e[j].peer == e[i].peer && e[j].msg_id == e[i].msg_id &&
		    e[j].reply == e[i].reply &&
		    (before != SHM_TRACE_BLOCKED || e[j].type == e[i].type)) {
			*ns = e[i].time_ns > e[j].time_ns ? e[i].time_ns - e[j].time_ns : 0;
			return what;
		}
	}
	return NULL;
}

uint64_t trace_newest_ns(const struct trace_entry *e, size_t n)
{
	uint64_t newest = 0;

	for (size_t i = 0; i < n; i++)
		if (e[i].time_ns > newest)
			newest = e[i].time_ns;
	return newest;
}

const char *trace_header(void)
{
	return "    TIME_S KIND       TYPE                     PEER     MSG_ID     SIZE STATUS    STEP";
}

/* "850ns", "12.3us", "4.56ms", "1.23s". */
static void fmt_ns(uint64_t ns, char *buf, size_t len)
{
	if (ns < 1000u)
		snprintf(buf, len, "%lluns", (unsigned long long)ns);
	else if (ns < 1000000u)
		snprintf(buf, len, "%.1fus", (double)ns / 1e3);
	else if (ns < 1000000000u)
		snprintf(buf, len, "%.2fms", (double)ns / 1e6);
	else
		snprintf(buf, len, "%.2fs", (double)ns / 1e9);
}

void trace_format(const struct trace_entry *e, size_t i, uint64_t newest_ns, char *buf, size_t len)
{
	const struct trace_entry *r = &e[i];
	const char *name = worker_msg_name(r->type), *step;
	char type[32], dur[32] = "";
	uint64_t ns;
	int n;

	/* A pin has no message type: what it holds, and what it went with. */
	if (trace_is_pin(r->kind)) {
		snprintf(type, sizeof(type), "%u tensor%s, %s", r->tensors, r->tensors == 1 ? "" : "s",
			 r->reply ? "reply" : "request");
		name = type;
	} else if (!name && r->type) {
		snprintf(type, sizeof(type), "%u", r->type);
		name = type;
	} else if (!name) {
		name = "-";
	}
	if ((step = trace_step(e, i, &ns))) {
		size_t at = (size_t)snprintf(dur, sizeof(dur), "%s ", step);

		fmt_ns(ns, dur + at, sizeof(dur) - at);
	}
	/* Signed: the newest prints as 0, not -0. */
	n = snprintf(buf, len, "%10.6f %-10s %-23s %5u %10llu %8llu %-9s %s",
		     (double)((int64_t)r->time_ns - (int64_t)newest_ns) / 1e9,
		     trace_kind_name(r->kind), name, r->peer, (unsigned long long)r->msg_id,
		     (unsigned long long)r->size, trace_status_name(r->status), dur);
	/* No padding at the end of a line without a step. */
	for (n = n < (int)len ? n : (int)len - 1; n > 0 && buf[n - 1] == ' '; n--)
		buf[n - 1] = '\0';
}
