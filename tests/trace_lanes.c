/*
 * The flight recorder's lanes (shm/layout.h), on a segment of one worker
 * whose ring holds 4096 records (8 lanes of 512), written by 12 threads
 * through trace_put_to: the first 7 to record take a lane each, the other
 * 5 share lane 0. Each thread writes 3000 records, so every lane wraps.
 * Meanwhile a reader checks that every record it gets is whole (its words
 * agree), that the records come oldest first, and that each thread's come
 * in the order it wrote them. At the end: 7 threads own a lane each, and
 * each one's last 512 records are all there, in order; the heads count
 * every record claimed; the newest 32 read alone are the whole read's
 * last 32.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "shmrpc.h"
#include "shm/segment.h"
#include "tests/lib/testlib.h"
#include "worker/trace.h"

#define RECORDS 4096u
#define LANE (RECORDS / SHM_TRACE_LANES_MAX)
#define THREADS 12u
#define PER_THREAD 3000u
#define NEWEST 32u

static struct shm_seg seg;
static struct trace_self ring;
static atomic_uint writing = THREADS;

/* Thread t's record k: t in the id's high half and the peer, k in its low
 * half and the size, so that a record mixed from two is seen. */
static void *writer(void *arg)
{
	uint32_t t = (uint32_t)(uintptr_t)arg;

	for (uint32_t k = 0; k < PER_THREAD; k++)
		trace_put_to(&ring, (uint64_t)t << 32 | k,
			     SHM_TRACE_INFO(SHM_TRACE_SENT, SHM_TRACE_OK, 1, t, k), NULL);
	atomic_fetch_sub(&writing, 1);
	return NULL;
}

/* Checks one read of n records: whole, oldest first, each thread's in
 * the order written; counts each thread's into per[] (its last k in
 * last[]). */
static void check_read(const struct trace_entry *e, size_t n, uint32_t *per, int64_t *last)
{
	for (uint32_t t = 0; t < THREADS; t++)
		per[t] = 0, last[t] = -1;
	for (size_t i = 0; i < n; i++) {
		uint32_t t = (uint32_t)(e[i].msg_id >> 32), k = (uint32_t)e[i].msg_id;

		CHECK(t < THREADS && e[i].peer == t && e[i].size == k &&
		      e[i].kind == SHM_TRACE_SENT && e[i].type == 1,
		      "record %zu is torn: id %llx, peer %u, size %llu, kind %u", i,
		      (unsigned long long)e[i].msg_id, e[i].peer, (unsigned long long)e[i].size,
		      e[i].kind);
		CHECK(i == 0 || e[i].time_ns >= e[i - 1].time_ns, "record %zu is older than %zu", i,
		      i - 1);
		CHECK((int64_t)k > last[t], "thread %u's record %u comes after its %lld", t, k,
		      (long long)last[t]);
		last[t] = k;
		per[t]++;
	}
}

int main(void)
{
	struct shm_seg_params sp = { .world_size = 1, .trace_records = RECORDS };
	static struct trace_entry e[RECORDS], newest[NEWEST];
	uint32_t per[THREADS], owners = 0, reads = 0;
	int64_t last[THREADS];
	uint64_t head, dropped;
	pthread_t th[THREADS];
	size_t n;

	CHECK(shm_trace_lanes(RECORDS) == SHM_TRACE_LANES_MAX, "%u records make %u lanes", RECORDS,
	      shm_trace_lanes(RECORDS));
	CHECK_OK(shm_seg_create(&seg, &sp));
	trace_ring_init(&ring, shm_trace(&seg, 0), seg.trace_records,
			seg.trace_clock == SHM_TRACE_CLOCK_TICKS);
	for (uint32_t t = 0; t < THREADS; t++)
		CHECK(!pthread_create(&th[t], NULL, writer, (void *)(uintptr_t)t), "pthread_create");
	while (atomic_load(&writing) > 0) {
		n = trace_read(&seg, 0, RECORDS, e, &head, &dropped);
		check_read(e, n, per, last);
		reads++;
	}
	for (uint32_t t = 0; t < THREADS; t++)
		pthread_join(th[t], NULL);

	n = trace_read(&seg, 0, RECORDS, e, &head, &dropped);
	check_read(e, n, per, last);
	CHECK(head == THREADS * PER_THREAD, "the heads count %llu records, %u were claimed",
	      (unsigned long long)head, THREADS * PER_THREAD);
	for (uint32_t t = 0; t < THREADS; t++) {
		uint32_t lane = UINT32_MAX;

		for (size_t i = 0; i < n; i++)
			if (e[i].msg_id >> 32 == t && e[i].lane != 0)
				lane = e[i].lane;
		if (lane == UINT32_MAX)
			continue;
		owners++;
		/* A lane of its own: its last LANE records, nothing else's. */
		CHECK(per[t] == LANE && last[t] == PER_THREAD - 1,
		      "thread %u (lane %u): %u records, the last %lld; want %u, the last %u", t, lane,
		      per[t], (long long)last[t], LANE, PER_THREAD - 1);
		for (size_t i = 0; i < n; i++)
			CHECK(e[i].lane != lane || e[i].msg_id >> 32 == t,
			      "lane %u holds a record of thread %llu and of %u", lane,
			      (unsigned long long)(e[i].msg_id >> 32), t);
	}
	CHECK(owners == SHM_TRACE_LANES_MAX - 1, "%u threads own a lane, want %u", owners,
	      SHM_TRACE_LANES_MAX - 1);
	CHECK(n <= RECORDS && n >= (SHM_TRACE_LANES_MAX - 1) * LANE, "%zu records read", n);

	CHECK(trace_read(&seg, 0, NEWEST, newest, &head, &dropped) == NEWEST,
	      "fewer than %u newest records", NEWEST);
	for (uint32_t i = 0; i < NEWEST; i++)
		CHECK(newest[i].msg_id == e[n - NEWEST + i].msg_id &&
		      newest[i].lane == e[n - NEWEST + i].lane,
		      "the newest %u's record %u is not the whole read's", NEWEST, i);
	printf("ok: %u reads while writing, %zu records at the end, %llu dropped\n", reads, n,
	       (unsigned long long)dropped);
	shm_seg_detach(&seg);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
