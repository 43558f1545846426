/*
 * shmrpc-inspect: look inside the running jobs of this user.
 *
 *   shmrpc-inspect              one line per live job (--json: as JSON)
 *   shmrpc-inspect JOB          the header and the worker table of one job
 *   shmrpc-inspect --json JOB   the same as one JSON object
 *   shmrpc-inspect --check JOB  "ok", or the anomalies found and exit 1
 *   shmrpc-inspect --watch JOB  the table redrawn every second, like top
 *   shmrpc-inspect --trace RANK JOB  that worker's flight recorder (--json too)
 *
 * JOB is the launcher's pid. A job is found through the launcher's memfd
 * ("/memfd:shmrpc-job", /proc/PID/fd/N); there is no file to look for. The
 * segment is mapped PROT_READ: the inspector can never disturb the job.
 * Every value is a relaxed load of a counter its owner keeps moving, so a
 * table is a set of recent values, not one instant.
 *
 * The tensor pool ("/memfd:shmrpc-pool") is mapped PROT_READ too; its
 * figures come from a walk of its records (pool_stats), exact when the job
 * is quiet. So is the RRef table ("/memfd:shmrpc-rrefs", shm/rref_table.h):
 * a walk of its slots gives the live RRefs by state and the oldest of them
 * (the text shows 20, the JSON 1000), each with its owner and who holds it.
 *
 * --check reports a dead worker, one still RUNNING whose process is gone
 * (the launcher has not reaped it), one stopped (SIGSTOP) or whose agent's
 * heartbeat is older than 5 s (stuck), corrupt frames, a shared structure a
 * worker found corrupt (its slot's corrupt_found), a dead holder of pool
 * references (or a live one whose process is gone), a pool or RRef table
 * the job has but this tool cannot read (it would hide anything wrong in
 * it; the text and JSON say why where the part would be), and three RRef
 * anomalies: an RRef whose owner is DEAD but
 * which is not OWNER_DEAD (the sweep missed it), one whose total is below
 * the sum of its counts (corrupt: a reference counted nowhere could free
 * the value in use), and one whose total is above that sum while no worker
 * that holds it is alive (a leak left by a death between the two steps of
 * a count change). A count change in flight looks like the last two for an
 * instant, so an RRef found so is read again after a pause and reported
 * only if it is still so.
 *
 * A worker's state is its slot's, but for a slot still EMPTY whose process
 * the launcher has started (its pid is set): STARTED, a worker that has not
 * joined yet (shmrpc_init not reached or not done), which EMPTY would hide.
 *
 * The job list's JSON (stable): {jobs: [{launcher_pid, job_name,
 * world_size, age_s, workers: {"EMPTY": n, "RUNNING": n, "EXITED": n,
 * "DEAD": n, "STARTED": n}}]}.
 *
 * JSON fields (stable): format_version, launcher_pid, job_name, world_size,
 * age_s, ring_size, generation, shutting_down, workers: [{rank, name, pid,
 * state ("EMPTY", "STARTED", "RUNNING", "EXITED", "DEAD"), exit (text or null),
 * agent_state ("none", "ready", "leaving", "gone"), heartbeat_age_s (null
 * before the first), calls_served, client_active_calls,
 * server_active_calls, num_pending_futures, thread_pool_size,
 * num_idle_threads, errors, timeouts, late_replies, frames_sent,
 * frames_recv, corrupt_frames, ring_fill_in, ring_fill_out,
 * cuda_maps_open (peers' CUDA allocations mapped by this worker, idle
 * cached ones too), cuda_events_open (peers' interprocess events it has
 * opened), cuda_allocs_exported (its allocations whose IPC handle it
 * keeps), cuda_events_exported (its interprocess events)}], pool (null
 * when the job has none, {error: text} when it cannot be read): {size, used, free, largest_free, blocks_live,
 * lost, refs_unrecorded, holders: [{rank, pid, state ("idle", "live",
 * "dead", "swept"), blocks, refs}]}, rrefs (null or {error} as pool):
 * {live, max, capacity, by_state: {pending, ready, error, unreferenced,
 * owner-dead}, entries (the oldest first): [{id ("CREATED_ON:LOCAL_ID"),
 * owner, creator, state (as by_state, or "invalid"), total, age_s, counts:
 * {"RANK": n, only the nonzero}}]}.
 *
 * --trace RANK prints the records of the worker's flight recorder
 * (worker/trace.h) that could be read whole, oldest first. Its JSON
 * (stable): {rank, name, capacity (records the ring holds), claimed
 * (records written in the worker's life), dropped, records: [{index,
 * time_ns (CLOCK_MONOTONIC), age_ns (before the newest), kind ("sent",
 * "received", "started", "finished", "completed", "pinned", "unpinned",
 * "blocked", "unblocked"), type (message type name, or null), type_id,
 * peer, msg_id, size (payload bytes; for pinned and unpinned the
 * tensors'), tensors (pinned and unpinned: how many; else null), with
 * (pinned and unpinned: "request" or "reply", the message they went
 * with; else null), status ("ok", "error", "timeout", "peer-dead",
 * "shutdown", "late"), step ("waited", "ran", "took", "held", "blocked",
 * or null), step_ns (or null)}]}.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/json.h"
#include "ipc/ring.h"
#include "shm/corrupt.h"
#include "shm/exit_info.h"
#include "shm/layout.h"
#include "shm/pool.h"
#include "shm/rref_table.h"
#include "shm/segment.h"
#include "worker/msg.h"
#include "worker/trace.h"

#define PROG "shmrpc-inspect"
#define SEG_LINK "/memfd:shmrpc-job (deleted)"
#define POOL_LINK "/memfd:shmrpc-pool (deleted)"
#define RREF_LINK "/memfd:shmrpc-rrefs (deleted)"

#define RR_SHOWN 20                /* RRefs the text lists */
#define RR_LISTED 1000             /* RRefs the JSON lists */
#define RR_NSTATES (RREF_OWNER_DEAD + 1)
#define RR_READS 8                 /* tries at a settled read of a busy entry */
#define RR_RECHECK_NS 100000000u   /* pause before an RRef anomaly is read again */
#define STUCK_NS 5000000000u       /* a READY agent stamps its heartbeat every 100 ms at most */

#define EXIT_ANOMALY 1
#define EXIT_USAGE 2

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
#define NCOUNTERS (sizeof(counters) / sizeof(counters[0]))
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
#define NGAUGES (sizeof(cuda_gauges) / sizeof(cuda_gauges[0]))

/* One worker slot as read once. */
struct wsnap {
	uint32_t state, pid, exit_info, agent;
	uint32_t cuda[NGAUGES];
	uint64_t hb_age_ns; /* UINT64_MAX: no heartbeat yet */
	uint64_t corrupt;   /* SHM_CORRUPT_* bits: what it found corrupt */
	uint64_t val[NCOUNTERS];
	uint64_t ring_in, ring_out;
	char name[SHM_NAME_MAX + 1];
	char exit_text[96]; /* "" unless EXITED or DEAD */
};

/* One live RRef as read once. settled: its key and total were the same
 * before and after its counts were read, so the counts belong to that
 * total (a holder raises total before its count and lowers it after). */
struct rsnap {
	struct rref_info info;
	uint64_t sum; /* of the counts */
	bool settled;
};

/* An RRef found by a walk: its id names it, not a later one in its slot. */
struct pick {
	uint64_t created_ns;
	uint64_t id;
	uint32_t slot;
};

/* What a walk of the table found: every live RRef counted by state, and
 * the k oldest picked. Until the walk ends, pick is a heap with the
 * youngest kept on top, so an older entry replaces it in log(k) steps: a
 * table of millions of RRefs costs k picks of memory, not millions. */
struct rscan {
	uint32_t live;
	uint32_t by_state[RR_NSTATES];
	struct pick *pick;
	uint32_t n, k;
};

/* What show() read of a job: the segment's worker table, and the pool and
 * the RRef table when the job has them; for --check (check) or the JSON
 * (json) or the text. */
struct view {
	pid_t pid;
	bool json, check;
	struct shm_seg seg;
	struct wsnap *ws;
	struct shm_pool pool;
	struct pool_stats pool_st;
	struct pool_holder_stats *holders; /* world of them; state 0 (idle): none */
	struct rref_table rrefs;
	struct rscan sc;
	uint32_t *counts; /* world of them: an RRef's counts, as read last */
};

/*
 * A part of a job that show() shows, described once: a job has it when
 * its launcher holds the memfd named memfd (NULL: always, the segment);
 * map attaches that memfd (0, or -errno and the sentence that says why it
 * cannot be read: shown where the part would be, and an anomaly for
 * --check, as it would hide whatever is wrong in it; fd is map's on
 * success only); snap reads it (false: out of memory); text and json
 * print it (json: its fields of the job's object); check prints its
 * anomalies and returns their number (-1: out of memory); detach lets it
 * go.
 */
struct subject {
	const char *title; /* its heading in the text */
	const char *what;  /* in --check's sentence */
	const char *key;   /* its JSON field */
	const char *memfd;
	int (*map)(struct view *v, int fd);
	bool (*snap)(struct view *v);
	void (*text)(struct view *v);
	void (*json)(struct view *v);
	int (*check)(struct view *v);
	void (*detach)(struct view *v);
};

/* The slot states (enum shm_worker_state), then STARTED: shown for an
 * EMPTY slot whose process has been started (shown_state). */
static const char *const state_names[] = { "EMPTY", "RUNNING", "EXITED", "DEAD", "STARTED" };
#define NSTATES 5u
#define STATE_STARTED 4u

/* The state word of a slot: EMPTY with a pid is a started worker that has
 * not joined. The launcher stores the pid (release) before the worker can
 * attach; a slot read EMPTY with pid 0 is not started yet. */
static uint32_t shown_state(uint32_t state, uint32_t pid)
{
	return state == SHM_WORKER_EMPTY && pid ? STATE_STARTED : state;
}
static const char *const agent_names[] = { "none", "ready", "leaving", "gone" };

static const char *name_of(const char *const *names, size_t n, uint32_t v)
{
	return v < n ? names[v] : "?";
}

static int fail(const char *fmt, ...) SHMRPC_PRINTF(1, 2);
static int fail(const char *fmt, ...)
{
	va_list ap;

	fputs(PROG ": ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return EXIT_ANOMALY;
}

/*
 * Whether process pid has ended: no such process, or a zombie its parent
 * has not reaped yet (it holds no fds any more). A pid taken again by
 * another process reads as alive: the slot's pid is all there is to go by.
 */
/* The state letter of /proc/PID/stat ('R', 'S', 'T'...), or 0 when the
 * process is gone. */
static char process_state(uint32_t pid)
{
	char path[32], buf[512], *paren;
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%u/stat", pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT || errno == ESRCH ? 0 : '?';
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return n == 0 || errno == ESRCH ? 0 : '?';
	buf[n] = '\0';
	/* "PID (COMM) S ...": the name may hold spaces and parentheses. */
	paren = strrchr(buf, ')');
	return paren && paren[1] == ' ' ? paren[2] : '?';
}

static bool process_gone(uint32_t pid)
{
	char st = process_state(pid);

	return !st || st == 'Z' || st == 'X';
}

static void usage(FILE *f)
{
	fputs("usage: " PROG " [--json | --check | --watch[=SEC]] [JOB]\n"
	      "       " PROG " [--json] --trace RANK JOB\n"
	      "With no JOB, lists the live shmrpc jobs of this user; with JOB (the\n"
	      "launcher's pid), shows its header, worker table, the CUDA IPC mappings\n"
	      "and events each worker has open, tensor pool and RRef table (the live\n"
	      "RRefs by state, the 20 oldest with their owner and holders), read-only.\n"
	      "  --json     the job as one JSON object (up to 1000 RRefs listed); with\n"
	      "             no JOB, the job list as one\n"
	      "  --check    print \"ok\", or the anomalies found and exit 1: a DEAD\n"
	      "             worker (or one whose process is gone, not yet reaped),\n"
	      "             a stopped one, one whose heartbeat is older than 5 s,\n"
	      "             corrupt frames, pool references of a dead holder,\n"
	      "             an RRef of a DEAD owner not marked owner-dead, an RRef\n"
	      "             counted below its holders' references (corrupt) or above\n"
	      "             them with no holder alive (leaked by a death)\n"
	      "  --watch[=SEC]  redraw the job every SEC seconds (default 1) until\n"
	      "             Ctrl-C; when the job ends, say so and exit 1\n"
	      "  --trace RANK  the flight recorder of worker RANK: its last messages\n"
	      "             and call steps (4096 by default), oldest first, one a line:\n"
	      "             time in seconds before the newest, kind (sent, received,\n"
	      "             started, finished, completed; pinned, unpinned: a message's\n"
	      "             tensors handed over, then released; blocked, unblocked: a\n"
	      "             send waiting for ring space), message type (for pins: the\n"
	      "             tensors and the message they went with), peer rank,\n"
	      "             message id, payload bytes (for pins: the tensors'), status\n"
	      "             (ok, error, timeout, peer-dead, shutdown, late), and the\n"
	      "             step's time: waited (queued), ran (started to finished),\n"
	      "             took (sent to completed), held (pinned to unpinned),\n"
	      "             blocked (blocked to unblocked)\n"
	      "  --help     this text\n"
	      "  --version  the shmrpc version\n",
	      f);
}

/*
 * Finds the job segment among the fds of pid: path gets /proc/PID/fd/N.
 * 0 when found, -ENOENT when pid holds none, or -errno of /proc.
 */
static int find_memfd(pid_t pid, const char *target, char *path, size_t len)
{
	char dir[64], link[64];
	struct dirent *d;
	DIR *fds;
	int err = -ENOENT;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
	fds = opendir(dir);
	if (!fds)
		return -errno;
	while ((d = readdir(fds))) {
		ssize_t n;

		if (d->d_name[0] == '.')
			continue;
		snprintf(path, len, "%s/%s", dir, d->d_name);
		n = readlink(path, link, sizeof(link) - 1);
		if (n < 0)
			continue;
		link[n] = '\0';
		if (strcmp(link, target) == 0) {
			err = 0;
			break;
		}
	}
	closedir(fds);
	return err;
}

static uint64_t age_ns(const struct shm_seg *seg)
{
	uint64_t now = shmrpc_realtime_ns();

	return now > seg->hdr->created_ns ? now - seg->hdr->created_ns : 0;
}

/* "850ms", "12.3s", "4m05s", "3h07m", "2d04h". */
static const char *fmt_dur(uint64_t ns, char *buf, size_t len)
{
	uint64_t s = ns / 1000000000u;

	if (ns == UINT64_MAX)
		snprintf(buf, len, "-");
	else if (ns < 1000000000u)
		snprintf(buf, len, "%llums", (unsigned long long)(ns / 1000000u));
	else if (s < 60)
		snprintf(buf, len, "%.1fs", (double)ns / 1e9);
	else if (s < 3600)
		snprintf(buf, len, "%llum%02llus", (unsigned long long)(s / 60), (unsigned long long)(s % 60));
	else if (s < 86400)
		snprintf(buf, len, "%lluh%02llum", (unsigned long long)(s / 3600),
			 (unsigned long long)(s % 3600 / 60));
	else
		snprintf(buf, len, "%llud%02lluh", (unsigned long long)(s / 86400),
			 (unsigned long long)(s % 86400 / 3600));
	return buf;
}

/* A name from the segment, bounded and NUL-terminated whatever is there. */
static void copy_name(char *dst, const char *src)
{
	size_t n = strnlen(src, SHM_NAME_MAX);

	memcpy(dst, src, n);
	dst[n] = '\0';
}

/* The same name for a terminal: control bytes become '?'. */
static const char *printable(const char *s, char *buf)
{
	size_t i;

	for (i = 0; s[i]; i++)
		buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
	buf[i] = '\0';
	return buf;
}

static void snap_worker(const struct shm_seg *seg, uint32_t rank, uint64_t now, struct wsnap *s)
{
	const struct shm_worker *w = shm_worker(seg, rank);
	uint64_t hb;

	/* Acquire: exit_info is visible once state says DEAD or EXITED. */
	s->state = atomic_load_explicit(&w->state, memory_order_acquire);
	s->pid = atomic_load_explicit(&w->pid, memory_order_relaxed);
	s->exit_info = atomic_load_explicit(&w->exit_info, memory_order_relaxed);
	s->agent = atomic_load_explicit(&w->agent_state, memory_order_relaxed);
	/* Relaxed: the worker's fetch_or; a snapshot. */
	s->corrupt = atomic_load_explicit(&w->corrupt_found, memory_order_relaxed);
	hb = atomic_load_explicit(&w->heartbeat_ns, memory_order_relaxed);
	s->hb_age_ns = hb == 0 ? UINT64_MAX : now > hb ? now - hb : 0;
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
	copy_name(s->name, w->name);
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

/* pid's memfd whose link is target, opened read-only; -1 when none. */
static int open_memfd(pid_t pid, const char *target)
{
	char path[PATH_MAX];

	return find_memfd(pid, target, path, sizeof(path)) ? -1 : open(path, O_RDONLY);
}

/* The job's tensor pool, read-only, from its memfd (struct subject's map). */
static int map_pool(struct view *v, int fd)
{
	return pool_attach_fd(&v->pool, fd, true);
}

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

static const char *const holder_names[] = { "idle", "live", "dead", "swept" };

/* The pool's figures and its holders (a holder that cannot be read shown
 * as none). */
static bool snap_pool(struct view *v)
{
	if (!(v->holders = calloc(v->pool.world, sizeof(*v->holders))))
		return false;
	pool_stats(&v->pool, &v->pool_st);
	for (uint32_t r = 0; r < v->pool.world; r++)
		if (pool_holder_stats(&v->pool, r, &v->holders[r]))
			v->holders[r] = (struct pool_holder_stats){ 0 };
	return true;
}

static void detach_pool(struct view *v)
{
	free(v->holders);
	pool_detach(&v->pool);
}

static void print_pool_text(struct view *v)
{
	const struct pool_stats st = v->pool_st;

	printf("\ntensor pool    %llu bytes, %llu used, %llu free, largest free block %llu\n",
	       (unsigned long long)st.size, (unsigned long long)st.used, (unsigned long long)st.free,
	       (unsigned long long)st.largest_free);
	printf("               %llu live blocks; %llu bytes lost and %llu references unrecorded "
	       "(left by deaths)\n", (unsigned long long)st.blocks_live, (unsigned long long)st.lost,
	       (unsigned long long)st.refs_unrecorded);
	printf("%4s %7s %-6s %8s %8s\n", "RANK", "PID", "HOLDER", "BLOCKS", "REFS");
	for (uint32_t r = 0; r < v->pool.world; r++) {
		const struct pool_holder_stats *hs = &v->holders[r];

		if (hs->state)
			printf("%4u %7u %-6s %8u %8llu\n", r, hs->pid,
			       name_of(holder_names, 4, hs->state), hs->entries,
			       (unsigned long long)hs->refs);
	}
}

static void print_pool_json(struct view *v)
{
	const struct pool_stats st = v->pool_st;
	bool first = true;

	printf(",\"pool\":{\"size\":%llu,\"used\":%llu,\"free\":%llu,\"largest_free\":%llu,"
	       "\"blocks_live\":%llu,\"lost\":%llu,\"refs_unrecorded\":%llu,\"holders\":[",
	       (unsigned long long)st.size, (unsigned long long)st.used, (unsigned long long)st.free,
	       (unsigned long long)st.largest_free, (unsigned long long)st.blocks_live,
	       (unsigned long long)st.lost, (unsigned long long)st.refs_unrecorded);
	for (uint32_t r = 0; r < v->pool.world; r++) {
		const struct pool_holder_stats *hs = &v->holders[r];

		if (!hs->state)
			continue;
		printf("%s{\"rank\":%u,\"pid\":%u,\"state\":\"%s\",\"blocks\":%u,\"refs\":%llu}",
		       first ? "" : ",", r, hs->pid, name_of(holder_names, 4, hs->state),
		       hs->entries, (unsigned long long)hs->refs);
		first = false;
	}
	printf("]}");
}

/*
 * A dead holder that still holds references: the sweep has not run. Also
 * one still LIVE whose process is gone: the launcher, which marks it DEAD
 * and sweeps it as it reaps the worker, has not done so (stopped, stuck,
 * or killed), so its blocks stay taken. The holder is read again after its
 * process is found gone: a worker that leaves cleanly releases its
 * references before it exits, and the launcher may have swept it since.
 */
static int check_pool(struct view *v)
{
	struct shm_pool *pool = &v->pool;
	int bad = 0;

	for (uint32_t r = 0; r < pool->world; r++) {
		struct pool_holder_stats hs = v->holders[r];

		if (!hs.refs)
			continue;
		if (hs.state == POOL_HOLDER_DEAD) {
			printf("rank %u died holding %llu references in the tensor pool\n", r,
			       (unsigned long long)hs.refs);
			bad++;
		} else if (hs.state == POOL_HOLDER_LIVE && process_gone(hs.pid)) {
			uint32_t pid = hs.pid;

			if (pool_holder_stats(pool, r, &hs) || hs.state != POOL_HOLDER_LIVE ||
			    hs.pid != pid || !hs.refs)
				continue;
			printf("rank %u (pid %u) is gone holding %llu references in the tensor pool, "
			       "not swept: its holder is still live\n", r, pid,
			       (unsigned long long)hs.refs);
			bad++;
		}
	}
	return bad;
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

		if (s->state == SHM_WORKER_DEAD) {
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

/* Attaches to the job whose launcher is pid; quiet: no message on failure. */
static int attach_job(pid_t pid, struct shm_seg *seg, bool quiet)
{
	char path[PATH_MAX], proc[32];
	struct stat st;
	int err;

	snprintf(proc, sizeof(proc), "/proc/%d", (int)pid);
	if (stat(proc, &st) < 0)
		return quiet ? -1 : fail("no such job: no process %d", (int)pid);
	if (st.st_uid != getuid())
		return quiet ? -1 : fail("process %d belongs to another user", (int)pid);
	err = find_memfd(pid, SEG_LINK, path, sizeof(path));
	/* A launcher that has exited but is not reaped yet holds no fds:
	 * its job has ended, which "not a shmrpc job" would hide. */
	if (err && process_gone((uint32_t)pid))
		return quiet ? -1 : fail("no such job: process %d has ended", (int)pid);
	if (err == -ENOENT)
		return quiet ? -1 : fail("process %d is not a shmrpc job", (int)pid);
	if (err)
		return quiet ? -1 : fail("cannot read %s/fd: %s", proc, strerror(-err));
	if (shm_seg_attach_path(seg, path, true)) {
		if (quiet)
			return -1;
		if (process_gone((uint32_t)pid)) /* it exited as we opened it */
			return fail("no such job: process %d has ended", (int)pid);
		return fail("process %d: %s", (int)pid, shmrpc_errmsg());
	}
	if (seg->hdr->launcher_pid != (uint32_t)pid) {
		uint32_t launcher = seg->hdr->launcher_pid;

		shm_seg_detach(seg);
		return quiet ? -1 :
			fail("process %d is a worker, not a launcher: the job is %u", (int)pid, launcher);
	}
	return 0;
}

static int list_jobs(bool json)
{
	DIR *proc = opendir("/proc");
	struct dirent *d;
	int found = 0;

	if (!proc)
		return fail("cannot read /proc: %s", strerror(errno));
	if (json)
		printf("{\"jobs\":[");
	while ((d = readdir(proc))) {
		char *end, name[SHM_NAME_MAX + 1], pbuf[SHM_NAME_MAX + 1], dur[32];
		long pid = strtol(d->d_name, &end, 10);
		uint32_t n[NSTATES] = { 0 };
		struct shm_seg seg;

		if (*end || pid <= 0 || attach_job((pid_t)pid, &seg, true))
			continue;
		for (uint32_t r = 0; r < seg.world; r++) {
			const struct shm_worker *w = shm_worker(&seg, r);
			/* Acquire, as snap_worker: the pid the launcher stored first. */
			uint32_t st = atomic_load_explicit(&w->state, memory_order_acquire);

			st = shown_state(st, atomic_load_explicit(&w->pid, memory_order_relaxed));
			n[st < NSTATES ? st : 0]++;
		}
		copy_name(name, seg.hdr->job_name);
		if (json) {
			printf("%s{\"launcher_pid\":%ld,\"job_name\":", found++ ? "," : "", pid);
			json_put_str(stdout, name);
			printf(",\"world_size\":%u,\"age_s\":%.3f,\"workers\":{", seg.world,
			       (double)age_ns(&seg) / 1e9);
			for (uint32_t st = 0; st < NSTATES; st++)
				printf("%s\"%s\":%u", st ? "," : "", state_names[st], n[st]);
			printf("}}");
			shm_seg_detach(&seg);
			continue;
		}
		if (!found++)
			printf("%7s %-24s %5s %8s %7s %7s %6s %4s\n", "PID", "JOB", "WORLD", "AGE",
			       "STARTED", "RUNNING", "EXITED", "DEAD");
		printf("%7ld %-24s %5u %8s %7u %7u %6u %4u\n", pid, printable(name, pbuf), seg.world,
		       fmt_dur(age_ns(&seg), dur, sizeof(dur)), n[STATE_STARTED],
		       n[SHM_WORKER_RUNNING], n[SHM_WORKER_EXITED], n[SHM_WORKER_DEAD]);
		shm_seg_detach(&seg);
	}
	closedir(proc);
	if (json)
		printf("]}\n");
	else if (!found)
		printf("no shmrpc jobs of this user\n");
	return 0;
}

/* A part the job has but this tool cannot read: {"error": why}; null when
 * the job has none. */
static void print_unread_json(const char *key, const char *why)
{
	printf(",\"%s\":", key);
	if (!why[0]) {
		printf("null");
		return;
	}
	printf("{\"error\":");
	json_put_str(stdout, why);
	printf("}");
}

static const struct subject subjects[] = {
	/* The segment, attached before: always there. */
	{ NULL, NULL, NULL, NULL, NULL, snap_workers, print_workers_text, print_workers_json,
	  check_workers, detach_workers },
	{ "tensor pool", "the tensor pool", "pool", POOL_LINK, map_pool, snap_pool,
	  print_pool_text, print_pool_json, check_pool, detach_pool },
	{ "rref table", "the RRef table", "rrefs", RREF_LINK, map_rrefs, snap_rrefs,
	  print_rrefs_text, print_rrefs_json, check_rrefs, detach_rrefs },
};
#define NSUBJECTS (sizeof(subjects) / sizeof(subjects[0]))

/* 1 when the job has s and it is attached; 0 when the job has none; -1
 * when it has one that cannot be read, why set. */
static int attach(const struct subject *s, struct view *v, char *why, size_t len)
{
	int fd;

	if (!s->memfd)
		return 1;
	if ((fd = open_memfd(v->pid, s->memfd)) < 0)
		return 0;
	if (s->map(v, fd)) {
		snprintf(why, len, "%s", shmrpc_errmsg());
		close(fd);
		return -1;
	}
	return 1;
}

/* Shows the job whose segment seg (attached, launcher pid) is: each
 * subject attached, then each read, then each shown; detaches it. */
static int show(pid_t pid, struct shm_seg *seg, bool json, bool want_check)
{
	struct view v = { .pid = pid, .json = json, .check = want_check, .seg = *seg };
	char why[NSUBJECTS][256] = { { 0 } };
	int found[NSUBJECTS], bad = 0, rc = 0;
	bool snapped = true;

	for (size_t i = 0; i < NSUBJECTS; i++)
		found[i] = attach(&subjects[i], &v, why[i], sizeof(why[i]));
	for (size_t i = 0; i < NSUBJECTS; i++)
		snapped = snapped && (found[i] <= 0 || subjects[i].snap(&v));
	for (size_t i = 0; i < NSUBJECTS && snapped && want_check && bad >= 0; i++) {
		int n = found[i] > 0 ? subjects[i].check(&v) : 0;

		if (found[i] < 0)
			printf("%s cannot be read: %s\n", subjects[i].what, why[i]);
		bad = n < 0 ? -1 : bad + n + (found[i] < 0);
	}
	for (size_t i = 0; i < NSUBJECTS && snapped && !want_check; i++) {
		if (found[i] > 0)
			(json ? subjects[i].json : subjects[i].text)(&v);
		else if (json)
			print_unread_json(subjects[i].key, why[i]);
		else if (found[i] < 0)
			printf("\n%-14s cannot be read: %s\n", subjects[i].title, why[i]);
	}
	if (!snapped || bad < 0)
		rc = fail("out of memory");
	else if (bad)
		rc = EXIT_ANOMALY;
	else if (want_check)
		printf("ok\n");
	else if (json)
		printf("}\n");
	for (size_t i = 0; i < NSUBJECTS; i++)
		if (found[i] > 0)
			subjects[i].detach(&v);
	shm_seg_detach(&v.seg);
	return rc;
}

static int inspect(pid_t pid, bool json, bool want_check)
{
	struct shm_seg seg;

	if (attach_job(pid, &seg, false))
		return EXIT_ANOMALY;
	return show(pid, &seg, json, want_check);
}

static void print_trace_text(const struct shm_seg *seg, uint32_t rank, const struct trace_entry *e,
			     size_t n, uint64_t head, uint64_t dropped)
{
	char name[SHM_NAME_MAX + 1], pbuf[SHM_NAME_MAX + 1], line[192];
	uint64_t newest = trace_newest_ns(e, n);

	copy_name(name, shm_worker(seg, rank)->name);
	printf("rank %u (%s): %zu of %llu records (the ring holds %u; %llu dropped), oldest first,\n"
	       "time in seconds before the newest\n%s\n", rank, printable(name, pbuf), n,
	       (unsigned long long)head, seg->trace_records, (unsigned long long)dropped,
	       trace_header());
	for (size_t i = 0; i < n; i++) {
		trace_format(e, i, newest, line, sizeof(line));
		printf("%s\n", line);
	}
}

static void print_trace_json(const struct shm_seg *seg, uint32_t rank, const struct trace_entry *e,
			     size_t n, uint64_t head, uint64_t dropped)
{
	char name[SHM_NAME_MAX + 1];
	uint64_t newest = trace_newest_ns(e, n), ns;

	copy_name(name, shm_worker(seg, rank)->name);
	printf("{\"rank\":%u,\"name\":", rank);
	json_put_str(stdout, name);
	printf(",\"capacity\":%u,\"claimed\":%llu,\"dropped\":%llu,\"records\":[", seg->trace_records,
	       (unsigned long long)head, (unsigned long long)dropped);
	for (size_t i = 0; i < n; i++) {
		const struct trace_entry *r = &e[i];
		const char *type = worker_msg_name(r->type), *step = trace_step(e, i, &ns);

		printf("%s{\"index\":%llu,\"time_ns\":%llu,\"age_ns\":%llu,\"kind\":\"%s\",\"type\":",
		       i ? "," : "", (unsigned long long)r->index, (unsigned long long)r->time_ns,
		       (unsigned long long)(newest - r->time_ns), trace_kind_name(r->kind));
		if (type)
			printf("\"%s\"", type);
		else
			fputs("null", stdout);
		printf(",\"type_id\":%u,\"peer\":%u,\"msg_id\":%llu,\"size\":%llu,", r->type,
		       r->peer, (unsigned long long)r->msg_id, (unsigned long long)r->size);
		if (trace_is_pin(r->kind))
			printf("\"tensors\":%u,\"with\":\"%s\",", r->tensors,
			       r->reply ? "reply" : "request");
		else
			fputs("\"tensors\":null,\"with\":null,", stdout);
		printf("\"status\":\"%s\",\"step\":", trace_status_name(r->status));
		if (step)
			printf("\"%s\",\"step_ns\":%llu}", step, (unsigned long long)ns);
		else
			fputs("null,\"step_ns\":null}", stdout);
	}
	printf("]}\n");
}

/* --trace: the flight recorder of one worker. */
static int show_trace(pid_t pid, uint32_t rank, bool json)
{
	struct trace_entry *e;
	uint64_t head, dropped;
	struct shm_seg seg;
	size_t n;
	int rc = 0;

	if (attach_job(pid, &seg, false))
		return EXIT_ANOMALY;
	if (rank >= seg.world) {
		rc = fail("no worker of rank %u: the job has %u workers", rank, seg.world);
	} else if (!(e = calloc(seg.trace_records, sizeof(*e)))) {
		rc = fail("out of memory");
	} else {
		n = trace_read(&seg, rank, seg.trace_records, e, &head, &dropped);
		if (json)
			print_trace_json(&seg, rank, e, n, head, dropped);
		else
			print_trace_text(&seg, rank, e, n, head, dropped);
		free(e);
	}
	shm_seg_detach(&seg);
	return rc;
}

/*
 * A top-like view: the table redrawn in place until the job ends, which is
 * an error (exit 1, one line on stderr): a watch that ended on its own
 * would look like one that was stopped. The job is attached before the
 * screen is cleared, so that a failure leaves its message alone, not a
 * cleared screen.
 */
static int watch(pid_t pid, double every_s)
{
	struct timespec pause = { (time_t)every_s, (long)((every_s - (double)(time_t)every_s) * 1e9) };

	for (bool first = true;; first = false) {
		struct shm_seg seg;

		/* Later, a failure is the launcher gone, a zombie, or its pid
		 * taken by a process that is no job. */
		if (attach_job(pid, &seg, !first))
			return first ? EXIT_ANOMALY : fail("job %d has ended", (int)pid);
		/* Home and clear: the new table replaces the old one. */
		fputs("\033[H\033[2J", stdout);
		show(pid, &seg, false, false);
		fflush(stdout);
		nanosleep(&pause, NULL);
	}
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "json", no_argument, NULL, 'j' },
		{ "check", no_argument, NULL, 'c' },
		{ "watch", optional_argument, NULL, 'w' },
		{ "trace", required_argument, NULL, 't' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ 0 },
	};
	bool json = false, want_check = false;
	double watch_s = 0;
	long trace_rank = -1;
	char *end;
	long pid;
	int c;

	opterr = 0; /* our own one-line message, then the usage */
	while ((c = getopt_long(argc, argv, "+", opts, NULL)) != -1) {
		switch (c) {
		case 'j': json = true; break;
		case 'c': want_check = true; break;
		case 'w':
			watch_s = optarg ? strtod(optarg, &end) : 1.0;
			if (optarg && (*end || !(watch_s >= 0.1 && watch_s <= 3600))) {
				fprintf(stderr, PROG ": --watch wants 0.1 to 3600 seconds, not \"%s\"\n",
					optarg);
				usage(stderr);
				return EXIT_USAGE;
			}
			break;
		case 't':
			errno = 0;
			trace_rank = strtol(optarg, &end, 10);
			if (errno || end == optarg || *end || trace_rank < 0 ||
			    trace_rank >= SHM_MAX_WORLD) {
				fprintf(stderr, PROG ": --trace wants a rank, not \"%s\"\n", optarg);
				usage(stderr);
				return EXIT_USAGE;
			}
			break;
		case 'h': usage(stdout); return 0;
		case 'V': printf(PROG " %s\n", shmrpc_version()); return 0;
		default:
			fprintf(stderr, PROG ": unknown option %s\n", argv[optind - 1]);
			usage(stderr);
			return EXIT_USAGE;
		}
	}
	if (argc - optind > 1 || json + want_check + (watch_s > 0) > 1 ||
	    (trace_rank >= 0 && (want_check || watch_s > 0)) ||
	    ((want_check || watch_s > 0 || trace_rank >= 0) && optind == argc)) {
		usage(stderr);
		return EXIT_USAGE;
	}
	if (optind == argc)
		return list_jobs(json);
	errno = 0;
	pid = strtol(argv[optind], &end, 10);
	if (errno || end == argv[optind] || *end || pid <= 0 || pid > INT_MAX) {
		fprintf(stderr, PROG ": JOB must be a launcher's pid, not \"%s\"\n", argv[optind]);
		usage(stderr);
		return EXIT_USAGE;
	}
	if (watch_s > 0)
		return watch((pid_t)pid, watch_s);
	if (trace_rank >= 0)
		return show_trace((pid_t)pid, (uint32_t)trace_rank, json);
	return inspect((pid_t)pid, json, want_check);
}
