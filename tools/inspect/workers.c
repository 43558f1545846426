/*
 * The segment's subject: its header and the worker table, the CUDA IPC
 * gauges, and --check's word on each worker (its slot checked first, as
 * shm/slot.h says, then its state, process, heartbeat and findings).
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/json.h"
#include "ipc/ring.h"
#include "shm/corrupt.h"
#include "shm/exit_info.h"
#include "shm/slot.h"
#include "tools/inspect/inspect.h"

#define STUCK_NS 5000000000u /* a READY agent stamps its heartbeat every 100 ms at most */
#define AHEAD_NS 1000000000u /* a heartbeat this far in the future is no clock's */

/* The worker fields shown besides the lifecycle, in table order. */
struct counter {
	const char *key;  /* JSON field */
	const char *head; /* column header */
	size_t off;
	bool wide; /* _Atomic uint64_t, else _Atomic uint32_t */
};

#define C64(key, head) { #key, head, offsetof(struct shm_worker, key), true }
#define C32(key, head) { #key, head, offsetof(struct shm_worker, key), false }
static const struct counter counters[] = {
	C64(calls_served, "SERVED"),
	C64(client_active_calls, "CLI"),
	C64(server_active_calls, "SRV"),
	C64(num_pending_futures, "PEND"),
	C32(thread_pool_size, "THR"),
	C32(num_idle_threads, "IDLE"),
	C64(errors, "ERR"),
	C64(timeouts, "TMO"),
	C64(late_replies, "LATE"),
	C64(frames_sent, "SENT"),
	C64(frames_recv, "RECV"),
	C64(corrupt_frames, "CORRUPT"),
};
_Static_assert(sizeof(counters) / sizeof(counters[0]) == NCOUNTERS, "NCOUNTERS");
#define CORRUPT_FRAMES (NCOUNTERS - 1)
_Static_assert(NCOUNTERS == 12, "CORRUPT_FRAMES is the last counter");

/* The CUDA IPC gauges of a worker slot, shown apart from the table. */
struct gauge {
	const char *key;  /* JSON field */
	const char *head; /* column header */
	size_t off;       /* of an _Atomic uint32_t */
};

#define G32(key, head) { #key, head, offsetof(struct shm_worker, key) }
static const struct gauge cuda_gauges[] = {
	G32(cuda_maps_open, "MAPS_OPEN"),
	G32(cuda_events_open, "EVENTS_OPEN"),
	G32(cuda_allocs_exported, "ALLOCS_EXPORTED"),
	G32(cuda_events_exported, "EVENTS_EXPORTED"),
};
_Static_assert(sizeof(cuda_gauges) / sizeof(cuda_gauges[0]) == NGAUGES, "NGAUGES");

/* The slot states (enum shm_worker_state), then STARTED: shown for an
 * EMPTY slot whose process has been started (shown_state). */
const char *const state_names[] = { "EMPTY", "RUNNING", "EXITED", "DEAD", "STARTED" };
#define NSTATES 5u
#define STATE_STARTED 4u

/* The state word of a slot: EMPTY with a pid is a started worker that has
 * not joined. The launcher stores the pid (release) before the worker can
 * attach; a slot read EMPTY with pid 0 is not started yet. */
uint32_t shown_state(uint32_t state, uint32_t pid)
{
	return state == SHM_WORKER_EMPTY && pid ? STATE_STARTED : state;
}
static const char *const agent_names[] = { "none", "ready", "leaving", "gone" };

static void snap_worker(const struct shm_seg *seg, uint32_t rank, uint64_t now, struct wsnap *s)
{
	const struct shm_worker *w = shm_worker(seg, rank);
	struct shm_slot_view sv;
	uint64_t hb;

	shm_slot_read(seg, rank, &sv);
	s->state = sv.state;
	s->pid = sv.pid;
	s->exit_info = sv.exit_info;
	s->agent = sv.agent_state;
	s->slot_ok = shm_slot_ok(rank, &sv, s->slot_why, sizeof(s->slot_why));
	/* Relaxed: the worker's fetch_or; a snapshot. */
	s->corrupt = atomic_load_explicit(&w->corrupt_found, memory_order_relaxed);
	hb = atomic_load_explicit(&w->heartbeat_ns, memory_order_relaxed);
	s->hb_age_ns = hb == 0 ? UINT64_MAX : now > hb ? now - hb : 0;
	if (s->slot_ok && hb > now + AHEAD_NS) {
		/* CLOCK_MONOTONIC of this machine, stamped by its owner before now. */
		s->slot_ok = false;
		snprintf(s->slot_why, sizeof(s->slot_why), "worker slot %u is corrupt: its "
			 "heartbeat is %.1f s in the future; the job's memory was written outside "
			 "shmrpc", rank, (double)(hb - now) / 1e9);
	}
	for (size_t i = 0; i < NCOUNTERS; i++) {
		const void *p = (const uint8_t *)w + counters[i].off;

		s->val[i] = counters[i].wide ?
			atomic_load_explicit((const _Atomic uint64_t *)p, memory_order_relaxed) :
			atomic_load_explicit((const _Atomic uint32_t *)p, memory_order_relaxed);
	}
	for (size_t i = 0; i < NGAUGES; i++)
		s->cuda[i] = atomic_load_explicit(
			(const _Atomic uint32_t *)((const uint8_t *)w + cuda_gauges[i].off),
			memory_order_relaxed);
	s->ring_in = s->ring_out = 0;
	for (uint32_t peer = 0; peer < seg->world; peer++) {
		if (peer == rank)
			continue;
		s->ring_in += ipc_ring_fill(shm_ring(seg, peer, rank));
		s->ring_out += ipc_ring_fill(shm_ring(seg, rank, peer));
	}
	copy_name(s->name, sv.name);
	s->exit_text[0] = '\0';
	if (s->state == SHM_WORKER_EXITED || s->state == SHM_WORKER_DEAD)
		shm_exit_info_format(s->exit_info, s->exit_text, sizeof(s->exit_text));
}

static bool snap_workers(struct view *v)
{
	uint64_t now = shmrpc_now_ns();

	if (!(v->ws = calloc(v->seg.world, sizeof(*v->ws))))
		return false;
	for (uint32_t r = 0; r < v->seg.world; r++)
		snap_worker(&v->seg, r, now, &v->ws[r]);
	return true;
}

static void detach_workers(struct view *v)
{
	free(v->ws);
}

static bool cuda_used(const struct wsnap *s)
{
	for (size_t i = 0; i < NGAUGES; i++)
		if (s->cuda[i])
			return true;
	return false;
}

/* The CUDA IPC gauges of the workers that have any open. */
static void print_cuda_text(const struct shm_seg *seg, const struct wsnap *ws)
{
	bool any = false;

	for (uint32_t r = 0; r < seg->world && !any; r++)
		any = cuda_used(&ws[r]);
	if (!any) {
		printf("\ncuda ipc       no mappings, events or exports open\n");
		return;
	}
	printf("\ncuda ipc\n%4s", "RANK");
	for (size_t i = 0; i < NGAUGES; i++)
		printf(" %15s", cuda_gauges[i].head);
	printf("\n");
	for (uint32_t r = 0; r < seg->world; r++) {
		if (!cuda_used(&ws[r]))
			continue;
		printf("%4u", r);
		for (size_t i = 0; i < NGAUGES; i++)
			printf(" %15u", ws[r].cuda[i]);
		printf("\n");
	}
}

static void print_workers_text(struct view *v)
{
	const struct shm_seg *seg = &v->seg;
	const struct wsnap *ws = v->ws;
	const struct shm_header *h = seg->hdr;
	char name[SHM_NAME_MAX + 1], pbuf[SHM_NAME_MAX + 1], dur[32];

	copy_name(name, h->job_name);
	printf("job            %s\n", printable(name, pbuf));
	printf("launcher pid   %u\n", h->launcher_pid);
	printf("format version %u\n", h->format_version);
	printf("world size     %u\n", seg->world);
	printf("age            %s\n", fmt_dur(age_ns(seg), dur, sizeof(dur)));
	printf("ring size      %u\n", seg->ring_size);
	printf("generation     %u\n", atomic_load_explicit(&h->generation, memory_order_relaxed));
	if (atomic_load_explicit(&h->shutting_down, memory_order_relaxed))
		printf("shutting down\n");

	printf("\n%4s %-16s %7s %-7s %-7s %6s", "RANK", "NAME", "PID", "STATE", "AGENT", "BEAT");
	for (size_t i = 0; i < NCOUNTERS; i++)
		printf(" %*s", counters[i].wide ? 8 : 4, counters[i].head);
	printf(" %8s %8s\n", "RING_IN", "RING_OUT");
	for (uint32_t r = 0; r < seg->world; r++) {
		const struct wsnap *s = &ws[r];

		printf("%4u %-16s %7u %-7s %-7s %6s", r, printable(s->name, pbuf), s->pid,
		       name_of(state_names, NSTATES, shown_state(s->state, s->pid)),
		       name_of(agent_names, 4, s->agent), fmt_dur(s->hb_age_ns, dur, sizeof(dur)));
		for (size_t i = 0; i < NCOUNTERS; i++)
			printf(" %*llu", counters[i].wide ? 8 : 4, (unsigned long long)s->val[i]);
		printf(" %8llu %8llu\n", (unsigned long long)s->ring_in, (unsigned long long)s->ring_out);
	}
	for (uint32_t r = 0; r < seg->world; r++)
		if (ws[r].exit_text[0])
			printf("rank %u (%s): %s\n", r, printable(ws[r].name, pbuf), ws[r].exit_text);
	print_cuda_text(seg, ws);
}

/* Opens the job's object: show() closes it, after the other subjects'
 * fields. */
static void print_workers_json(struct view *v)
{
	const struct shm_seg *seg = &v->seg;
	const struct wsnap *ws = v->ws;
	const struct shm_header *h = seg->hdr;
	char name[SHM_NAME_MAX + 1];

	copy_name(name, h->job_name);
	printf("{\"format_version\":%u,\"launcher_pid\":%u,\"job_name\":", h->format_version,
	       h->launcher_pid);
	json_put_str(stdout, name);
	printf(",\"world_size\":%u,\"age_s\":%.3f,\"ring_size\":%u,\"generation\":%u,"
	       "\"shutting_down\":%s,\"workers\":[",
	       seg->world, (double)age_ns(seg) / 1e9, seg->ring_size,
	       atomic_load_explicit(&h->generation, memory_order_relaxed),
	       atomic_load_explicit(&h->shutting_down, memory_order_relaxed) ? "true" : "false");
	for (uint32_t r = 0; r < seg->world; r++) {
		const struct wsnap *s = &ws[r];

		printf("%s{\"rank\":%u,\"name\":", r ? "," : "", r);
		json_put_str(stdout, s->name);
		printf(",\"pid\":%u,\"state\":\"%s\",\"exit\":", s->pid,
		       name_of(state_names, NSTATES, shown_state(s->state, s->pid)));
		if (s->exit_text[0])
			json_put_str(stdout, s->exit_text);
		else
			fputs("null", stdout);
		printf(",\"agent_state\":\"%s\",\"heartbeat_age_s\":", name_of(agent_names, 4, s->agent));
		if (s->hb_age_ns == UINT64_MAX)
			fputs("null", stdout);
		else
			printf("%.3f", (double)s->hb_age_ns / 1e9);
		for (size_t i = 0; i < NCOUNTERS; i++)
			printf(",\"%s\":%llu", counters[i].key, (unsigned long long)s->val[i]);
		printf(",\"ring_fill_in\":%llu,\"ring_fill_out\":%llu", (unsigned long long)s->ring_in,
		       (unsigned long long)s->ring_out);
		for (size_t i = 0; i < NGAUGES; i++)
			printf(",\"%s\":%u", cuda_gauges[i].key, s->cuda[i]);
		printf("}");
	}
	printf("]");
}

/* Prints each anomaly; the number found. */
static int check_workers(struct view *v)
{
	const struct shm_seg *seg = &v->seg;
	const struct wsnap *ws = v->ws;
	char pbuf[SHM_NAME_MAX + 1];
	int bad = 0;

	for (uint32_t r = 0; r < seg->world; r++) {
		const struct wsnap *s = &ws[r];

		/* A slot that does not hold together says nothing of its
		 * worker: its state or pid would send the checks astray. */
		if (!s->slot_ok) {
			printf("%s\n", s->slot_why);
			bad++;
		} else if (s->state == SHM_WORKER_DEAD) {
			printf("rank %u (%s) is DEAD: %s\n", r, printable(s->name, pbuf), s->exit_text);
			bad++;
		} else if (s->state == SHM_WORKER_RUNNING && s->pid && process_gone(s->pid) &&
			   atomic_load_explicit(&shm_worker(seg, r)->state, memory_order_acquire) ==
				   SHM_WORKER_RUNNING &&
			   atomic_load_explicit(&shm_worker(seg, r)->pid, memory_order_relaxed) == s->pid) {
			/* Read again: the launcher may have marked it since the snapshot.
			 * Still RUNNING: it has not reaped it (stopped, stuck), so
			 * nothing it held was swept and its peers wait on it. */
			printf("rank %u (%s) is RUNNING, but its process %u is gone: the launcher has "
			       "not seen it end\n", r, printable(s->name, pbuf), s->pid);
			bad++;
		} else if (s->state == SHM_WORKER_RUNNING && s->pid &&
			   (process_state(s->pid) == 'T' || process_state(s->pid) == 't')) {
			printf("rank %u (%s) is stopped (process %u: SIGSTOP or a debugger): calls to "
			       "it wait\n", r, printable(s->name, pbuf), s->pid);
			bad++;
		} else if (s->state == SHM_WORKER_RUNNING && s->agent == SHM_AGENT_READY &&
			   s->hb_age_ns != UINT64_MAX && s->hb_age_ns > STUCK_NS) {
			/* Its loop thread stamps at least every 100 ms. */
			printf("rank %u (%s) has not stamped its heartbeat for %.1f s: its agent's loop "
			       "thread is stuck\n", r, printable(s->name, pbuf), (double)s->hb_age_ns / 1e9);
			bad++;
		}
		if (s->val[CORRUPT_FRAMES]) {
			printf("rank %u (%s) received %llu corrupt frames\n", r, printable(s->name, pbuf),
			       (unsigned long long)s->val[CORRUPT_FRAMES]);
			bad++;
		}
		/* Only the bits it knows: the word is the job's, anything may be in it. */
		for (uint64_t bit = 1; bit & SHM_CORRUPT_ALL; bit <<= 1) {
			if (!(s->corrupt & bit))
				continue;
			printf("rank %u (%s) found %s corrupt: the job's memory was written outside "
			       "shmrpc\n", r, printable(s->name, pbuf), shm_corrupt_name(bit));
			bad++;
		}
	}
	return bad;
}

const struct subject workers_subject = { NULL, NULL, NULL, NULL, NULL, snap_workers,
					 print_workers_text, print_workers_json, check_workers,
					 detach_workers };
