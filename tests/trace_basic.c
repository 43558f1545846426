/*
 * The flight recorder. A 2-worker job with 64-record rings: rank 0 calls
 * rank 1 (a result, a remote error, an unknown function), itself, and a
 * function that blocks until a second call releases it (so the first call
 * times out, and its reply comes late, whatever the machine's speed).
 * Rank 0 then reads both rings through its own read-only mapping of the
 * segment and checks every record in order: kind, type, peer, id,
 * status, sizes that match across the two sides, times that never go
 * back (rank 1's arrival and start of each request as RECEIVED then
 * STARTED, or one RECEIVED_STARTED when the thread that took it ran it
 * at once: the machine picks the thread; rank 0's calls to itself from
 * its main thread, which runs no requests, always both); then
 * shmrpc-inspect --trace in text and JSON, and its errors; then 100
 * more calls wrap its ring, which must hold the last 64, whole
 * and in order. Then tensors: a call with two (1000 and 40 bytes) whose
 * reply returns a copy of the first, recorded pinned and unpinned on both
 * sides with their counts and bytes; the same call whose reply returns the
 * first itself, which only the request's pin covers (rank 1 pins nothing);
 * and with rank 1 stopped (SIGSTOP), three
 * calls of 30000 bytes: the second or third finds the 64 KiB ring full
 * and is recorded blocked, then unblocked once rank 1 goes on. The
 * inspector shows both, text and JSON. A second job kills rank 1 inside a call under
 * --dump-on-failure: the launcher's output must show, after the death
 * line, rank 1's last records, the fatal call received and started (in
 * one record or two), and
 * rank 0's ring must end with that call completed as peer-dead; again
 * with rings of 4096 records, whose lanes (one per thread) the dump merges.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"
#include "worker/msg.h"
#include "worker/trace.h"

#define RECORDS 64
#define WRAP_CALLS 100
#define WAIT_NS 10000000000ull /* only stops a hang */
#define PART_ENV "TRACE_BASIC_PART"
#define LANED "4096" /* the death job's rings the second time: 8 lanes */
#define RECORDS_ENV "TRACE_BASIC_RECORDS"
#define OUT_MAX 65536
#define BIG_BYTES 1000 /* the tensors of the handoff: the first comes back (a copy, then itself) */
#define SMALL_BYTES 40
#define FILL_CALLS 3   /* of FILL_BYTES: more than a 64 KiB ring holds */
#define FILL_BYTES 30000
#define STOPPED_NS 50000000u

static char out[OUT_MAX];
static struct shm_seg seg; /* the job's segment, mapped read-only once more */
static atomic_bool released;

/* One expected record; type 0 is "no type" (a call failed locally). */
struct want {
	uint32_t kind, peer, type, status;
	uint64_t id;
};

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

static int fn_fail(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)a, (void)n, (void)r, (void)u;
	return shmrpc_call_error(c, "ValueError", "refused");
}

/* Returns once "release" has run, so a short timeout always expires first. */
static int fn_block(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;

	(void)c, (void)a, (void)n, (void)r, (void)u;
	while (!atomic_load(&released) && shmrpc_now_ns() < deadline)
		usleep(1000);
	return 0;
}

static int fn_release(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	atomic_store(&released, true);
	return 0;
}

static int fn_sink(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	return 0;
}

/* Returns its first tensor: the reply hands it back, covered by the
 * request's pin (no pin of the reply's, no ack). */
static int fn_first(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = a[0];
	return 0;
}

static int fn_die(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	raise(SIGKILL);
	return 0;
}

static void attach_segment(void)
{
	const char *fd = getenv(SHMRPC_ENV_JOB_FD);
	int dup_fd;

	CHECK(fd, "no %s", SHMRPC_ENV_JOB_FD);
	dup_fd = fcntl(atoi(fd), F_DUPFD_CLOEXEC, 0); /* the agent keeps its own */
	CHECK(dup_fd >= 0, "dup(%s)", fd);
	CHECK_OK(shm_seg_attach_fd(&seg, dup_fd, true));
	CHECK(seg.trace_records == (uint32_t)atoi(getenv(RECORDS_ENV)),
	      "the ring holds %u records, asked for %s", seg.trace_records, getenv(RECORDS_ENV));
}

/* rank's ring, whole records oldest first; none may have been dropped. */
static size_t read_ring(uint32_t rank, struct trace_entry *e, uint64_t *head)
{
	uint64_t dropped;
	size_t n = trace_read(&seg, rank, RECORDS, e, head, &dropped);

	CHECK(dropped == 0, "rank %u dropped %llu records", rank, (unsigned long long)dropped);
	return n;
}

static bool matches(const struct trace_entry *e, const struct want *w)
{
	return e->kind == w->kind && e->peer == w->peer && e->type == w->type &&
	       e->status == w->status && e->msg_id == w->id;
}

/* e is a pin record of n tensors of bytes, with a reply (or a request). */
static void expect_pin(const struct trace_entry *e, bool reply, uint32_t n, uint64_t bytes)
{
	CHECK(e->reply == reply && e->tensors == n && e->size == bytes,
	      "%s record %llu: %u tensors of %llu bytes with a %s; want %u of %llu with a %s",
	      trace_kind_name(e->kind), (unsigned long long)e->index, e->tensors,
	      (unsigned long long)e->size, e->reply ? "reply" : "request", n,
	      (unsigned long long)bytes, reply ? "reply" : "request");
}

static void expect_at(const struct trace_entry *e, size_t n, size_t i, const struct want *w)
{
	CHECK(i < n, "record %zu missing: %zu records", i, n);
	CHECK(matches(&e[i], w), "record %zu is %s %s peer %u id %llu %s; want %s %s peer %u id "
	      "%llu %s", i, trace_kind_name(e[i].kind), worker_msg_name(e[i].type) ?: "-", e[i].peer,
	      (unsigned long long)e[i].msg_id, trace_status_name(e[i].status),
	      trace_kind_name(w->kind), worker_msg_name(w->type) ?: "-", w->peer,
	      (unsigned long long)w->id, trace_status_name(w->status));
	/* Nothing missing between it and the record before it in its lane. */
	for (size_t j = i; j-- > 0;) {
		if (e[j].lane != e[i].lane)
			continue;
		CHECK(e[i].index == e[j].index + 1, "record %zu has index %llu after %llu in lane %u",
		      i, (unsigned long long)e[i].index, (unsigned long long)e[j].index, e[i].lane);
		break;
	}
}

/* The record among e[from, n) that matches w. */
static const struct trace_entry *find(const struct trace_entry *e, size_t from, size_t n,
				      const struct want *w)
{
	for (size_t i = from; i < n; i++)
		if (matches(&e[i], w))
			return &e[i];
	CHECK(false, "no %s %s peer %u id %llu %s after record %zu", trace_kind_name(w->kind),
	      worker_msg_name(w->type) ?: "-", w->peer, (unsigned long long)w->id,
	      trace_status_name(w->status), from);
	return NULL;
}

/* The arrival and start of rank 1's request id from rank 0 at e[at]:
 * RECEIVED then STARTED (it waited in the executors' queue), or one
 * RECEIVED_STARTED (the thread that took it off the ring ran it at once:
 * which thread takes it is the machine's choice). How many records. */
static size_t expect_start(const struct trace_entry *e, size_t n, size_t at, uint32_t type,
			   uint64_t id)
{
	struct want once = { SHM_TRACE_RECEIVED_STARTED, 0, type, SHM_TRACE_OK, id };

	if (at < n && matches(&e[at], &once)) {
		expect_at(e, n, at, &once);
		return 1;
	}
	expect_at(e, n, at, &(struct want){ SHM_TRACE_RECEIVED, 0, type, SHM_TRACE_OK, id });
	expect_at(e, n, at + 1, &(struct want){ SHM_TRACE_STARTED, 0, type, SHM_TRACE_OK, id });
	CHECK(e[at].time_ns <= e[at + 1].time_ns, "call %llu started before it arrived",
	      (unsigned long long)id);
	return 2;
}

/* The record that says request id started among e[from, n): STARTED or
 * RECEIVED_STARTED. */
static const struct trace_entry *find_start(const struct trace_entry *e, size_t from, size_t n,
					    uint64_t id)
{
	for (size_t i = from; i < n; i++)
		if ((e[i].kind == SHM_TRACE_STARTED || e[i].kind == SHM_TRACE_RECEIVED_STARTED) &&
		    e[i].msg_id == id && e[i].peer == 0 && e[i].type == MSG_SCRIPT_CALL)
			return &e[i];
	CHECK(false, "call %llu never started after record %zu", (unsigned long long)id, from);
	return NULL;
}

/* The id of the call rank 0 sent last (its newest SENT record). */
static uint64_t last_sent_id(void)
{
	struct trace_entry e[RECORDS];
	uint64_t head;
	size_t n = read_ring(0, e, &head);

	while (n-- > 0)
		if (e[n].kind == SHM_TRACE_SENT)
			return e[n].msg_id;
	CHECK(false, "rank 0 recorded no call");
	return 0;
}

static void call(int dst, const char *fn, int64_t timeout_ms, int want_rc, uint64_t *id)
{
	shmrpc_value args[2] = { shmrpc_int(40), shmrpc_int(2) };
	shmrpc_future *f = NULL;
	int rc = shmrpc_rpc_sync(dst, fn, args, strcmp(fn, "add") ? 0 : 2, timeout_ms, &f);

	CHECK(rc == want_rc, "%s on %d returned %d (%s), want %d", fn, dst, rc, shmrpc_errmsg(),
	      want_rc);
	if (f)
		shmrpc_future_free(f);
	*id = last_sent_id();
}

/* Waits until rank 0's ring shows the late reply of call id. */
static void wait_late(uint64_t id)
{
	struct want late = { SHM_TRACE_COMPLETED, 1, MSG_SCRIPT_RET, SHM_TRACE_LATE, id };
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS, head;
	struct trace_entry e[RECORDS];

	for (;;) {
		size_t n = read_ring(0, e, &head);

		for (size_t i = 0; i < n; i++)
			if (matches(&e[i], &late))
				return;
		CHECK(shmrpc_now_ns() < deadline, "the late reply of call %llu was not recorded",
		      (unsigned long long)id);
		usleep(1000);
	}
}

/* Rank 0's own ring: each call's records in order, and nothing else. */
static void check_caller(const uint64_t *id, struct trace_entry *e, size_t n)
{
	const struct want w[] = {
		{ SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[0] },
		{ SHM_TRACE_COMPLETED, 1, MSG_SCRIPT_RET, SHM_TRACE_OK, id[0] },
		{ SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[1] },
		{ SHM_TRACE_COMPLETED, 1, MSG_EXCEPTION, SHM_TRACE_ERROR, id[1] },
		{ SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[2] },
		{ SHM_TRACE_COMPLETED, 1, MSG_EXCEPTION, SHM_TRACE_ERROR, id[2] },
		/* A call to itself: both sides in one ring. */
		{ SHM_TRACE_SENT, 0, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[3] },
		{ SHM_TRACE_RECEIVED, 0, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[3] },
		{ SHM_TRACE_STARTED, 0, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[3] },
		{ SHM_TRACE_FINISHED, 0, MSG_SCRIPT_RET, SHM_TRACE_OK, id[3] },
		{ SHM_TRACE_COMPLETED, 0, MSG_SCRIPT_RET, SHM_TRACE_OK, id[3] },
		{ SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[4] },
		{ SHM_TRACE_COMPLETED, 1, 0, SHM_TRACE_TIMEOUT, id[4] },
		{ SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[5] },
	};
	/* The release's reply and the blocked call's late one race. */
	const struct want tail[] = {
		{ SHM_TRACE_COMPLETED, 1, MSG_SCRIPT_RET, SHM_TRACE_OK, id[5] },
		{ SHM_TRACE_COMPLETED, 1, MSG_SCRIPT_RET, SHM_TRACE_LATE, id[4] },
	};
	size_t nw = sizeof(w) / sizeof(w[0]);

	CHECK(n == nw + 2, "rank 0 has %zu records, want %zu", n, nw + 2);
	CHECK(e[0].index == 0, "rank 0's first record is number %llu", (unsigned long long)e[0].index);
	for (size_t i = 0; i < nw; i++)
		expect_at(e, n, i, &w[i]);
	find(e, nw, n, &tail[0]);
	find(e, nw, n, &tail[1]);
	for (size_t i = 0; i < n; i++)
		CHECK(e[i].kind == SHM_TRACE_COMPLETED || e[i].size > 0, "record %zu has no size", i);
	/* Each call's steps in time order. */
	for (size_t i = 1; i <= 11; i++)
		if (e[i].msg_id == e[i - 1].msg_id)
			CHECK(e[i].time_ns >= e[i - 1].time_ns, "record %zu is older than %zu", i, i - 1);
	CHECK(e[7].size == e[6].size, "a request of %llu bytes received as %llu",
	      (unsigned long long)e[6].size, (unsigned long long)e[7].size);
}

/* Rank 1's ring: the calls it served, each received, started (one record
 * or two: expect_start), finished. */
static void check_callee(const uint64_t *id, const struct trace_entry *e0, size_t n0,
			 const struct trace_entry *e, size_t n)
{
	const uint32_t reply[3] = { MSG_SCRIPT_RET, MSG_EXCEPTION, MSG_EXCEPTION };
	const struct trace_entry *sent, *done, *in, *fin;
	size_t at = 0, starts;

	for (int c = 0; c < 3; c++) {
		struct want wfin = { SHM_TRACE_FINISHED, 0, reply[c],
				     c ? SHM_TRACE_ERROR : SHM_TRACE_OK, id[c] };
		struct want wsent = { SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK, id[c] };
		struct want wdone = { SHM_TRACE_COMPLETED, 1, reply[c], wfin.status, id[c] };

		in = &e[at];
		at += expect_start(e, n, at, MSG_SCRIPT_CALL, id[c]);
		expect_at(e, n, at, &wfin);
		fin = &e[at++];
		/* The same bytes on both sides, and one clock for both. */
		sent = find(e0, 0, n0, &wsent);
		done = find(e0, 0, n0, &wdone);
		CHECK(sent->size == in->size && done->size == fin->size,
		      "call %d: sent %llu, received %llu; replied %llu, completed %llu", c,
		      (unsigned long long)sent->size, (unsigned long long)in->size,
		      (unsigned long long)fin->size, (unsigned long long)done->size);
		CHECK(sent->time_ns <= in->time_ns && fin[-1].time_ns <= fin->time_ns &&
		      fin->time_ns <= done->time_ns, "call %d: times go back", c);
	}
	/* The blocked call arrived before its release; what follows races. */
	starts = e[at].kind == SHM_TRACE_RECEIVED_STARTED ? 1 : 2;
	CHECK(e[at].kind == SHM_TRACE_RECEIVED || starts == 1, "record %zu is %s, want the blocked "
	      "call's arrival", at, trace_kind_name(e[at].kind));
	CHECK(e[at].msg_id == id[4], "record %zu is of call %llu, want %llu", at,
	      (unsigned long long)e[at].msg_id, (unsigned long long)id[4]);
	find_start(e, at, n, id[4]);
	find(e, at, n, &(struct want){ SHM_TRACE_FINISHED, 0, MSG_SCRIPT_RET, SHM_TRACE_OK, id[4] });
	find(e, at, n, &(struct want){ SHM_TRACE_FINISHED, 0, MSG_SCRIPT_RET, SHM_TRACE_OK, id[5] });
	starts += find_start(e, at, n, id[5])->kind == SHM_TRACE_STARTED ? 2 : 1;
	CHECK(n == at + starts + 2, "rank 1 has %zu records, want %zu", n, at + starts + 2);
}

static int inspect(const char *a1, const char *a2, const char *a3, const char *a4)
{
	const char *argv[6] = { tl_inspect_path(), a1, a2, a3, a4, NULL };

	return tl_run(out, sizeof(out), argv);
}

/* The line of text that shows the record of these fields, into buf;
 * false when there is none. */
static bool record_line(const char *text, const char *kind, const char *type, uint32_t peer,
			uint64_t id, char *buf, size_t len)
{
	const char *at, *start, *end;
	char key[96];

	snprintf(key, sizeof(key), " %-10s %-23s %5u %10llu ", kind, type, peer,
		 (unsigned long long)id);
	if (!(at = strstr(text, key)))
		return false;
	for (start = at; start > text && start[-1] != '\n'; start--)
		;
	end = strchr(at, '\n');
	snprintf(buf, len, "%.*s", (int)(end ? end - start : (ptrdiff_t)strlen(start)), start);
	return true;
}

/* claimed1: the records rank 1 has claimed (12 to 15: how many of its
 * 5 requests were run at once). */
static void check_inspector(const char *job, const uint64_t *id, uint64_t claimed1)
{
	const char *status = "\"status\":\"error\",\"step\":\"ran\",\"step_ns\":";
	char line[192], head[160], *at;
	int rc;

	snprintf(head, sizeof(head), "{\"rank\":1,\"name\":\"worker1\",\"capacity\":64,"
		 "\"claimed\":%llu,\"dropped\":0,\"records\":[{\"index\":0,",
		 (unsigned long long)claimed1);
	rc = inspect("--trace", "0", job, NULL);
	CHECK(rc == 0, "--trace 0 exited %d", rc);
	CHECK(strstr(out, "rank 0 (worker0): 16 of 16 records (the ring holds 64; 0 dropped)"),
	      "no summary line");
	CHECK(strstr(out, trace_header()), "no column header");
	CHECK(record_line(out, "completed", "-", 1, id[4], line, sizeof(line)) &&
	      strstr(line, " timeout   took "), "the timeout: \"%s\"", line);
	CHECK(record_line(out, "completed", "SCRIPT_RET", 1, id[4], line, sizeof(line)) &&
	      strstr(line, " late "), "the late reply: \"%s\"", line);
	CHECK(record_line(out, "completed", "EXCEPTION", 1, id[2], line, sizeof(line)) &&
	      strstr(line, " error     took "), "the unknown function: \"%s\"", line);
	CHECK(record_line(out, "finished", "SCRIPT_RET", 0, id[3], line, sizeof(line)) &&
	      strstr(line, " ok        ran "), "the call to itself: \"%s\"", line);

	rc = inspect("--json", "--trace", "1", job);
	CHECK(rc == 0, "--json --trace 1 exited %d", rc);
	CHECK(!strncmp(out, head, strlen(head)) && strstr(out, "}]}\n"),
	      "not the JSON of rank 1's ring");
	snprintf(line, sizeof(line), "\"kind\":\"finished\",\"type\":\"EXCEPTION\",\"type_id\":%u,"
		 "\"peer\":0,\"msg_id\":%llu,", MSG_EXCEPTION, (unsigned long long)id[1]);
	CHECK((at = strstr(out, line)) && (at = strstr(at, "\"status\"")) &&
	      !strncmp(at, status, strlen(status)), "no %s ... error, ran", line);

	CHECK(inspect("--trace", "2", job, NULL) == 1 && strstr(out, "no worker of rank 2"),
	      "a rank beyond the job");
	CHECK(inspect("--trace", "x", job, NULL) == 2 && strstr(out, "--trace wants a rank"),
	      "a rank that is no number");
	CHECK(inspect("--trace", "0", NULL, NULL) == 2 && strstr(out, "usage:"), "--trace without JOB");
	CHECK(inspect("--check", "--trace", "0", job) == 2, "--trace with --check");
}

/* Enough calls to wrap the ring: it holds the last RECORDS, whole, in order. */
static void check_wrap(void)
{
	struct trace_entry e[RECORDS];
	uint64_t head, before, id;
	size_t n;

	read_ring(0, e, &before);
	for (int i = 0; i < WRAP_CALLS; i++)
		call(1, "add", SHMRPC_TIMEOUT_DEFAULT, 0, &id);
	n = read_ring(0, e, &head);
	CHECK(head == before + 2 * WRAP_CALLS, "%llu records claimed, want %llu",
	      (unsigned long long)head, (unsigned long long)(before + 2 * WRAP_CALLS));
	CHECK(n == RECORDS && e[0].index == head - RECORDS, "%zu records from %llu", n,
	      (unsigned long long)e[0].index);
	for (size_t i = 0; i < n; i += 2) {
		expect_at(e, n, i, &(struct want){ SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK,
						   e[i].msg_id });
		expect_at(e, n, i + 1, &(struct want){ SHM_TRACE_COMPLETED, 1, MSG_SCRIPT_RET,
						       SHM_TRACE_OK, e[i].msg_id });
		CHECK(!i || e[i].msg_id > e[i - 2].msg_id, "ids not increasing at %zu", i);
	}
	CHECK(e[n - 2].msg_id == id, "the newest call is %llu, want %llu",
	      (unsigned long long)e[n - 2].msg_id, (unsigned long long)id);
}

static shmrpc_tensor *tensor(int64_t bytes)
{
	static const DLDataType u8 = { kDLUInt, 8, 1 };
	shmrpc_tensor *t;

	CHECK_OK(shmrpc_tensor_alloc(u8, 1, &bytes, &t));
	return t;
}

/* The records of rank's ring from index `from` on, into e; how many. */
static size_t read_from(uint32_t rank, uint64_t from, struct trace_entry *e)
{
	uint64_t head;
	size_t n = read_ring(rank, e, &head), skip = 0;

	while (skip < n && e[skip].index < from)
		skip++;
	memmove(e, e + skip, (n - skip) * sizeof(*e));
	return n - skip;
}

/* Waits until rank's ring, from index `from`, holds want records. */
static size_t wait_records(uint32_t rank, uint64_t from, size_t want, struct trace_entry *e)
{
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;
	size_t n;

	while ((n = read_from(rank, from, e)) < want) {
		CHECK(shmrpc_now_ns() < deadline, "rank %u has %zu new records, want %zu", rank, n,
		      want);
		usleep(1000);
	}
	return n;
}

/* A handoff each way: rank 0's request pins both tensors until the reply
 * is unpacked (after the call completes), rank 1's reply pins a copy of
 * the first until rank 0's TENSOR_ACK. */
static void check_handoff(const char *job)
{
	shmrpc_tensor *big = tensor(BIG_BYTES), *small = tensor(SMALL_BYTES);
	shmrpc_value args[2] = { shmrpc_tensor_value(big), shmrpc_tensor_value(small) };
	struct trace_entry e0[RECORDS], e1[RECORDS];
	uint64_t head0, head1, id;
	shmrpc_future *f;
	char line[192], want[160];
	size_t n0, n1, s;

	read_ring(0, e0, &head0);
	read_ring(1, e1, &head1);
	CHECK_OK(shmrpc_rpc_sync(1, "copy_first", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
	id = last_sent_id();

	n0 = read_from(0, head0, e0);
	CHECK(n0 == 4, "rank 0 recorded %zu records for a call with tensors, want 4", n0);
	expect_at(e0, n0, 0, &(struct want){ SHM_TRACE_PINNED, 1, 0, SHM_TRACE_OK, id });
	expect_at(e0, n0, 1, &(struct want){ SHM_TRACE_SENT, 1, MSG_SCRIPT_CALL, SHM_TRACE_OK, id });
	expect_at(e0, n0, 2, &(struct want){ SHM_TRACE_COMPLETED, 1, MSG_SCRIPT_RET, SHM_TRACE_OK, id });
	expect_at(e0, n0, 3, &(struct want){ SHM_TRACE_UNPINNED, 1, 0, SHM_TRACE_OK, id });
	expect_pin(&e0[0], false, 2, BIG_BYTES + SMALL_BYTES);
	expect_pin(&e0[3], false, 2, BIG_BYTES + SMALL_BYTES);

	/* Rank 1's reply pin goes when rank 0's ack comes, after the call. */
	n1 = wait_records(1, head1, 4, e1);
	s = expect_start(e1, n1, 0, MSG_SCRIPT_CALL, id);
	n1 = wait_records(1, head1, s + 3, e1);
	CHECK(n1 == s + 3, "rank 1 recorded %zu records for a call with tensors, want %zu", n1,
	      s + 3);
	expect_at(e1, n1, s, &(struct want){ SHM_TRACE_PINNED, 0, 0, SHM_TRACE_OK, id });
	expect_at(e1, n1, s + 1, &(struct want){ SHM_TRACE_FINISHED, 0, MSG_SCRIPT_RET, SHM_TRACE_OK, id });
	expect_at(e1, n1, s + 2, &(struct want){ SHM_TRACE_UNPINNED, 0, 0, SHM_TRACE_OK, id });
	expect_pin(&e1[s], true, 1, BIG_BYTES);
	expect_pin(&e1[s + 2], true, 1, BIG_BYTES);
	CHECK(e0[0].time_ns <= e1[0].time_ns && e1[s + 1].time_ns <= e0[2].time_ns &&
	      e0[2].time_ns <= e1[s + 2].time_ns, "the handoff's times go back");

	CHECK(inspect("--trace", "0", job, NULL) == 0, "--trace 0 exited");
	snprintf(want, sizeof(want), " %8u ok", BIG_BYTES + SMALL_BYTES);
	CHECK(record_line(out, "pinned", "2 tensors, request", 1, id, line, sizeof(line)) &&
	      strstr(line, want), "the request's pin: \"%s\"", line);
	CHECK(record_line(out, "unpinned", "2 tensors, request", 1, id, line, sizeof(line)) &&
	      strstr(line, " ok        held "), "the request's release: \"%s\"", line);
	CHECK(inspect("--json", "--trace", "1", job) == 0, "--json --trace 1 exited");
	snprintf(want, sizeof(want), "\"kind\":\"unpinned\",\"type\":null,\"type_id\":0,\"peer\":0,"
		 "\"msg_id\":%llu,\"size\":%u,\"tensors\":1,\"with\":\"reply\",\"status\":\"ok\","
		 "\"step\":\"held\",", (unsigned long long)id, BIG_BYTES);
	CHECK(strstr(out, want), "no %s in %s", want, out);

	/* The echo: the reply hands back the request's own block, which rank
	 * 0's request pin keeps until the reply is unpacked; rank 1 pins
	 * nothing, so no ack is owed. What rank 0 got is the block it sent. */
	read_ring(0, e0, &head0);
	read_ring(1, e1, &head1);
	CHECK_OK(shmrpc_rpc_sync(1, "first", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->type == SHMRPC_TENSOR &&
	      shmrpc_tensor_data(shmrpc_future_value(f)->u.t) == shmrpc_tensor_data(big),
	      "the echo did not bring back the block sent");
	shmrpc_future_free(f);
	shmrpc_tensor_free(big);
	shmrpc_tensor_free(small);
	id = last_sent_id();
	n0 = read_from(0, head0, e0);
	CHECK(n0 == 4, "rank 0 recorded %zu records for an echo, want 4", n0);
	expect_at(e0, n0, 2, &(struct want){ SHM_TRACE_COMPLETED, 1, MSG_SCRIPT_RET, SHM_TRACE_OK, id });
	expect_at(e0, n0, 3, &(struct want){ SHM_TRACE_UNPINNED, 1, 0, SHM_TRACE_OK, id });
	n1 = wait_records(1, head1, 2, e1);
	s = expect_start(e1, n1, 0, MSG_SCRIPT_CALL, id);
	n1 = wait_records(1, head1, s + 1, e1);
	expect_at(e1, n1, s, &(struct want){ SHM_TRACE_FINISHED, 0, MSG_SCRIPT_RET, SHM_TRACE_OK, id });
}

/* Rank 1 stopped: the calls fill its ring, and one waits for space
 * until rank 1 goes on. */
static void check_blocked(const char *job)
{
	static char text[FILL_BYTES];
	shmrpc_value arg = shmrpc_strn(text, FILL_BYTES);
	/* Acquire: the pid rank 1 stored (release) when it attached. */
	pid_t callee = (pid_t)atomic_load_explicit(&shm_worker(&seg, 1)->pid, memory_order_acquire);
	shmrpc_future *f[FILL_CALLS];
	struct trace_entry e[RECORDS];
	const struct trace_entry *b, *u;
	uint64_t head, id[FILL_CALLS];
	struct tl_pause stop;
	char line[192];
	size_t n, waits = 0;

	memset(text, 'x', sizeof(text));
	read_ring(0, e, &head);
	tl_pause_begin(&stop, callee, STOPPED_NS);
	for (int i = 0; i < FILL_CALLS; i++) {
		CHECK_OK(shmrpc_rpc_async(1, "sink", &arg, 1, SHMRPC_TIMEOUT_DEFAULT, &f[i]));
		id[i] = last_sent_id();
	}
	tl_pause_end(&stop);
	for (int i = 0; i < FILL_CALLS; i++) {
		CHECK_OK(shmrpc_future_wait(f[i], -1));
		shmrpc_future_free(f[i]);
	}
	/* Each call sent and completed, and the waits: the ring holds one or
	 * two such frames (records do not wrap: where the ring stands
	 * decides), so the second or the third waited for rank 1 to go on;
	 * a later one may have waited again, briefly. */
	n = read_from(0, head, e);
	for (size_t i = 0; i < n; i++)
		waits += e[i].kind == SHM_TRACE_BLOCKED;
	CHECK(waits >= 1 && waits < FILL_CALLS && n == 2 * FILL_CALLS + 2 * waits,
	      "rank 0 recorded %zu records, %zu waits", n, waits);
	for (b = e; b->kind != SHM_TRACE_BLOCKED; b++)
		;
	CHECK(b > e && b[-1].kind == SHM_TRACE_SENT && b[-1].msg_id == b->msg_id &&
	      b->size == b[-1].size && b->msg_id != id[0],
	      "the first wait does not follow its call's send");
	u = find(e, (size_t)(b - e), n, &(struct want){ SHM_TRACE_UNBLOCKED, 1, MSG_SCRIPT_CALL,
							SHM_TRACE_OK, b->msg_id });
	CHECK(u->size == b->size && u->time_ns - b->time_ns >= STOPPED_NS / 2,
	      "the send waited %llu ns, rank 1 was stopped for %u",
	      (unsigned long long)(u->time_ns - b->time_ns), STOPPED_NS);

	CHECK(inspect("--trace", "0", job, NULL) == 0, "--trace 0 exited");
	CHECK(record_line(out, "blocked", "SCRIPT_CALL", 1, b->msg_id, line, sizeof(line)),
	      "no blocked line");
	CHECK(record_line(out, "unblocked", "SCRIPT_CALL", 1, b->msg_id, line, sizeof(line)) &&
	      strstr(line, " ok        blocked "), "the wait's end: \"%s\"", line);
}

static void calls_part(void)
{
	struct trace_entry e0[RECORDS], e1[RECORDS];
	uint64_t id[6], head;
	char job[16];
	size_t n0, n1;

	attach_segment();
	call(1, "add", SHMRPC_TIMEOUT_DEFAULT, 0, &id[0]);
	call(1, "fail", SHMRPC_TIMEOUT_DEFAULT, -SHMRPC_EREMOTE, &id[1]);
	call(1, "nosuch", SHMRPC_TIMEOUT_DEFAULT, -SHMRPC_EREMOTE, &id[2]);
	call(0, "add", SHMRPC_TIMEOUT_DEFAULT, 0, &id[3]);
	call(1, "block", 100, -ETIMEDOUT, &id[4]);
	call(1, "release", SHMRPC_TIMEOUT_DEFAULT, 0, &id[5]);
	wait_late(id[4]);

	n0 = read_ring(0, e0, &head);
	check_caller(id, e0, n0);
	n1 = read_ring(1, e1, &head);
	check_callee(id, e0, n0, e1, n1);
	snprintf(job, sizeof(job), "%d", (int)getppid());
	check_inspector(job, id, head);
	check_wrap();
	check_handoff(job);
	check_blocked(job);
	shm_seg_detach(&seg);
}

/* Rank 1 dies inside a call; rank 0's ring ends with it completed as
 * peer-dead, and its id goes on stdout for the launcher's dump. */
static void death_part(void)
{
	struct trace_entry e[RECORDS];
	uint64_t id, head;
	size_t n;

	attach_segment();
	call(1, "add", SHMRPC_TIMEOUT_DEFAULT, 0, &id);
	call(1, "add", SHMRPC_TIMEOUT_DEFAULT, 0, &id);
	call(1, "die", SHMRPC_TIMEOUT_DEFAULT, -SHMRPC_EPEERDEAD, &id);
	n = read_ring(0, e, &head);
	CHECK(n == 6, "rank 0 has %zu records, want 6", n);
	expect_at(e, n, 5, &(struct want){ SHM_TRACE_COMPLETED, 1, 0, SHM_TRACE_PEER_DEAD, id });
	printf("DIE_ID=%llu\n", (unsigned long long)id);
	fflush(stdout);
	shm_seg_detach(&seg);
}

static int worker(void)
{
	const char *part = getenv(PART_ENV);

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_register("fail", "", fn_fail, NULL));
	CHECK_OK(shmrpc_register("block", "", fn_block, NULL));
	CHECK_OK(shmrpc_register("release", "", fn_release, NULL));
	CHECK_OK(shmrpc_register("die", "", fn_die, NULL));
	CHECK_OK(shmrpc_register("first", "tt", fn_first, NULL));
	tl_copy_register();
	CHECK_OK(shmrpc_register("sink", "s", fn_sink, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		if (part && !strcmp(part, "death"))
			death_part();
		else
			calls_part();
	}
	/* Rank 1 serves until rank 0 is done (or dies in the second job). */
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

/* The dump after the death line: rank 1's records, 5 to 8 (3 calls, each
 * received and started in one record or two, and the first two
 * finished), the last the fatal call started (after its arrival, or with
 * it). */
static void check_dump(void)
{
	char line[192], *death, *dump, *id_at;
	unsigned long long id;
	unsigned shown, all;

	id_at = strstr(out, "DIE_ID=");
	CHECK(id_at && sscanf(id_at, "DIE_ID=%llu", &id) == 1, "rank 0 did not say the call's id");
	death = strstr(out, "shmrun: worker 1 (worker1) died: killed by signal 9 (SIGKILL)\n");
	CHECK(death, "no death line");
	dump = strstr(death, "shmrun: the last ");
	CHECK(dump && sscanf(dump, "shmrun: the last %u of the %u records of worker 1", &shown,
			     &all) == 2 && shown == all && all >= 5 && all <= 8,
	      "no dump of rank 1's 5 to 8 records after the death line");
	CHECK(strstr(dump, trace_header()), "no column header in the dump");
	if (record_line(dump, "recv+start", "SCRIPT_CALL", 0, id, line, sizeof(line))) {
		CHECK(strstr(line, " ok") && !record_line(dump, "received", "SCRIPT_CALL", 0, id, line,
							  sizeof(line)),
		      "the fatal call run at once: \"%s\"", line);
	} else {
		CHECK(record_line(dump, "received", "SCRIPT_CALL", 0, id, line, sizeof(line)) &&
		      strstr(line, " ok"), "the dump lacks the fatal call received: \"%s\"", line);
		CHECK(record_line(dump, "started", "SCRIPT_CALL", 0, id, line, sizeof(line)) &&
		      strstr(line, " ok        waited "), "the dump lacks it started: \"%s\"", line);
	}
	CHECK(strstr(dump, " finished   SCRIPT_RET "), "the dump lacks the calls before");
}

int main(void)
{
	int rc;

	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	setenv(PART_ENV, "calls", 1);
	setenv(RECORDS_ENV, "64", 1);
	rc = tl_shmrun(out, sizeof(out), "-n", "2", "--trace-records", "64", NULL);
	CHECK(rc == 0, "the first job exited %d", rc);

	setenv(PART_ENV, "death", 1);
	rc = tl_shmrun(out, sizeof(out), "-n", "2", "--trace-records", "64", "--on-failure=continue",
		       "--dump-on-failure", NULL);
	CHECK(rc == 1, "the job with a death exited %d, want 1", rc);
	check_dump();
	setenv(RECORDS_ENV, LANED, 1);
	rc = tl_shmrun(out, sizeof(out), "-n", "2", "--trace-records", LANED,
		       "--on-failure=continue", "--dump-on-failure", NULL);
	CHECK(rc == 1, "the job with a death and lanes exited %d, want 1", rc);
	check_dump();
	CHECK(!strstr(out, "left in the RRef table"), "the job leaked RRefs");
	CHECK(tl_wait_children(), "a child failed");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
