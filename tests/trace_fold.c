/*
 * The flight recorder's one record for a request received and started at
 * once (worker/trace.h: trace_received, trace_started), on the recorder
 * of a one-worker segment, with its ring of 4096 records (this thread in
 * a lane of its own) and of 64 (one lane, shared):
 *   - a request started by the thread that received it, with nothing
 *     written between: one RECEIVED_STARTED record at the arrival's time,
 *     printed "recv+start", and its FINISHED's step "ran" from it;
 *   - two requests received, then started (queued: the second arrival,
 *     then the first start, come between): RECEIVED and STARTED each,
 *     with their waits;
 *   - a request started by another thread: RECEIVED, then STARTED;
 *   - a request received while the recorder was off: STARTED alone;
 *   - a request started after a job ran on its thread (trace_fold_forget,
 *     which the executor calls after each job): RECEIVED, then STARTED;
 *   - in the shared lane, a request whose RECEIVED another thread's
 *     records lapped before it started: STARTED, never a fold into the
 *     slot's new record.
 * Then a writer folding 20000 requests in its own lane while a reader
 * checks that every record it reads is whole: RECEIVED or
 * RECEIVED_STARTED, with its own id and size; then two writers folding
 * as many each in the shared lane of the ring of 64, lapping each other
 * (a fold's CAS against a claim's), where a start that lost its RECEIVED
 * is a STARTED of its own.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "shm/segment.h"
#include "tests/lib/testlib.h"
#include "worker/msg.h"
#include "worker/trace.h"

#define LANED 4096u
#define SHARED 64u
#define PEER 3u
#define CALL MSG_SCRIPT_CALL
#define REQ_BYTES 20u
#define CONCURRENT 20000u

static struct shm_seg seg;
static struct trace_entry e[LANED];
static atomic_uint writing;

/* Opens the recorder on a fresh segment whose ring holds `records`. */
static void open_ring(uint32_t records)
{
	struct shm_seg_params sp = { .world_size = 1, .trace_records = records };

	CHECK_OK(shm_seg_create(&seg, &sp));
	trace_ring_init(&trace_self, shm_trace(&seg, 0), seg.trace_records,
			seg.trace_clock == SHM_TRACE_CLOCK_TICKS);
}

static void close_ring(void)
{
	trace_close();
	shm_seg_detach(&seg);
}

/* The ring's records now, oldest first. */
static size_t read_all(void)
{
	uint64_t head, dropped;

	return trace_read(&seg, 0, seg.trace_records, e, &head, &dropped);
}

static void expect(size_t n, size_t i, uint32_t kind, uint64_t id, const char *step)
{
	uint64_t ns;
	const char *got;

	CHECK(i < n, "record %zu missing: %zu records", i, n);
	CHECK(e[i].kind == kind && e[i].msg_id == id && e[i].peer == PEER,
	      "record %zu is %s id %llu peer %u, want %s id %llu peer %u", i,
	      trace_kind_name(e[i].kind), (unsigned long long)e[i].msg_id, e[i].peer,
	      trace_kind_name(kind), (unsigned long long)id, PEER);
	got = trace_step(e, i, &ns);
	CHECK(step ? got && !strcmp(got, step) : !got, "record %zu's step is %s, want %s", i,
	      got ? got : "none", step ? step : "none");
}

static void finish(uint64_t id)
{
	trace_rec(SHM_TRACE_FINISHED, PEER, MSG_SCRIPT_RET, id, 1, SHM_TRACE_OK);
}

/* Another thread starts the request at *arg. */
static void *start_elsewhere(void *arg)
{
	trace_started(arg, PEER, CALL, 4, REQ_BYTES);
	return NULL;
}

/* Another thread writes a lap of the shared lane. */
static void *lap(void *arg)
{
	(void)arg;
	for (uint32_t i = 0; i < SHARED; i++)
		trace_rec(SHM_TRACE_SENT, PEER + 1, CALL, 1000 + i, 8, SHM_TRACE_OK);
	return NULL;
}

static void check_sequences(uint32_t records)
{
	struct trace_mark m1, m2, m3, m4, m5, m6;
	char line[192];
	pthread_t th;
	size_t n;

	open_ring(records);
	/* At once: one record, at the arrival's time. */
	trace_received(PEER, CALL, 1, REQ_BYTES, &m1);
	trace_started(&m1, PEER, CALL, 1, REQ_BYTES);
	finish(1);
	/* Queued: the second arrival comes between the first's two steps,
	 * the first start between the second's. */
	trace_received(PEER, CALL, 2, REQ_BYTES, &m2);
	trace_received(PEER, CALL, 3, REQ_BYTES, &m3);
	trace_started(&m2, PEER, CALL, 2, REQ_BYTES);
	trace_started(&m3, PEER, CALL, 3, REQ_BYTES);
	finish(2);
	finish(3);
	/* Started by another thread. */
	trace_received(PEER, CALL, 4, REQ_BYTES, &m4);
	CHECK(!pthread_create(&th, NULL, start_elsewhere, &m4), "pthread_create");
	pthread_join(th, NULL);
	finish(4);
	/* Received while off: nothing to fold into. */
	trace_switch(false);
	trace_received(PEER, CALL, 5, REQ_BYTES, &m5);
	trace_switch(true);
	CHECK(m5.opening == 0, "a record written while off");
	trace_started(&m5, PEER, CALL, 5, REQ_BYTES);
	/* A job ran between the two steps (the executor's mark after each:
	 * one writing no record, a Future's callback queued first): the
	 * request waited for it. */
	trace_received(PEER, CALL, 6, REQ_BYTES, &m6);
	trace_fold_forget();
	trace_started(&m6, PEER, CALL, 6, REQ_BYTES);

	n = read_all();
	CHECK(n == 14, "%u-record ring: %zu records, want 14", records, n);
	expect(n, 0, SHM_TRACE_RECEIVED_STARTED, 1, NULL);
	expect(n, 1, SHM_TRACE_FINISHED, 1, "ran");
	CHECK(e[0].size == REQ_BYTES && e[0].type == CALL && e[0].status == SHM_TRACE_OK,
	      "the folded record says %llu bytes of type %u, status %u", (unsigned long long)e[0].size,
	      e[0].type, e[0].status);
	trace_format(e, 0, trace_newest_ns(e, n), line, sizeof(line));
	CHECK(strstr(line, " recv+start SCRIPT_CALL "), "the folded record prints \"%s\"", line);
	trace_format(e, 1, trace_newest_ns(e, n), line, sizeof(line));
	CHECK(strstr(line, " ok        ran "), "its finish prints \"%s\"", line);
	expect(n, 2, SHM_TRACE_RECEIVED, 2, NULL);
	expect(n, 3, SHM_TRACE_RECEIVED, 3, NULL);
	expect(n, 4, SHM_TRACE_STARTED, 2, "waited");
	expect(n, 5, SHM_TRACE_STARTED, 3, "waited");
	expect(n, 6, SHM_TRACE_FINISHED, 2, "ran");
	expect(n, 7, SHM_TRACE_FINISHED, 3, "ran");
	expect(n, 8, SHM_TRACE_RECEIVED, 4, NULL);
	expect(n, 9, SHM_TRACE_STARTED, 4, "waited");
	expect(n, 10, SHM_TRACE_FINISHED, 4, "ran");
	expect(n, 11, SHM_TRACE_STARTED, 5, NULL);
	expect(n, 12, SHM_TRACE_RECEIVED, 6, NULL);
	expect(n, 13, SHM_TRACE_STARTED, 6, "waited");
	CHECK(records == SHARED || e[9].lane != e[8].lane,
	      "the other thread's start is in this thread's lane %u", e[8].lane);

	if (records == SHARED) {
		/* Lapped: the slot of the RECEIVED now holds another thread's
		 * record, which the start must leave alone. */
		trace_received(PEER, CALL, 7, REQ_BYTES, &m1);
		CHECK(!pthread_create(&th, NULL, lap, NULL), "pthread_create");
		pthread_join(th, NULL);
		trace_started(&m1, PEER, CALL, 7, REQ_BYTES);
		n = read_all();
		CHECK(n == SHARED, "%zu records after the lap", n);
		expect(n, n - 1, SHM_TRACE_STARTED, 7, NULL);
		for (size_t i = 0; i + 1 < n; i++)
			CHECK(e[i].kind == SHM_TRACE_SENT && e[i].peer == PEER + 1,
			      "record %zu is %s of %u after the lap", i, trace_kind_name(e[i].kind),
			      e[i].peer);
	}
	close_ring();
}

/* Requests received and started at once: the ids and sizes of writer
 * *arg (from 0), CONCURRENT apart from the next's. */
static void *folder(void *arg)
{
	uint32_t from = *(const uint32_t *)arg * CONCURRENT;
	struct trace_mark m;

	for (uint32_t k = from; k < from + CONCURRENT; k++) {
		trace_received(PEER, CALL, k, k, &m);
		trace_started(&m, PEER, CALL, k, k);
	}
	atomic_fetch_sub(&writing, 1);
	return NULL;
}

/* Every record read while `writers` threads fold into a ring of `records`
 * is whole: its id is its size, and its kind one of the two (or STARTED,
 * in the shared lane). */
static void check_concurrent(uint32_t records, uint32_t writers)
{
	uint32_t reads = 0, folded = 0, who[2] = { 0, 1 };
	pthread_t th[2];
	size_t n;

	open_ring(records);
	atomic_store(&writing, writers);
	for (uint32_t t = 0; t < writers; t++)
		CHECK(!pthread_create(&th[t], NULL, folder, &who[t]), "pthread_create");
	while (atomic_load(&writing)) {
		n = read_all();
		for (size_t i = 0; i < n; i++)
			CHECK((e[i].kind == SHM_TRACE_RECEIVED ||
			       e[i].kind == SHM_TRACE_RECEIVED_STARTED ||
			       (records == SHARED && e[i].kind == SHM_TRACE_STARTED)) &&
			      e[i].size == e[i].msg_id && e[i].peer == PEER,
			      "record %zu is torn: %s id %llu size %llu", i, trace_kind_name(e[i].kind),
			      (unsigned long long)e[i].msg_id, (unsigned long long)e[i].size);
		reads++;
	}
	for (uint32_t t = 0; t < writers; t++)
		pthread_join(th[t], NULL);
	n = read_all();
	for (size_t i = 0; i < n; i++)
		folded += e[i].kind == SHM_TRACE_RECEIVED_STARTED;
	if (records == SHARED)
		CHECK(n > 0 && folded > 0, "%zu records at the end, %u folded", n, folded);
	else
		CHECK(n == LANED / SHM_TRACE_LANES_MAX && folded == n,
		      "%zu records at the end, %u folded; want the lane's %u, all folded", n,
		      folded, LANED / SHM_TRACE_LANES_MAX);
	printf("ok: %u reads while %u folded into %u records\n", reads, writers, records);
	close_ring();
}

int main(void)
{
	check_sequences(LANED);
	check_sequences(SHARED);
	check_concurrent(LANED, 1);
	check_concurrent(SHARED, 2);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
