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
 * --check reports a worker slot that does not hold together (shm/slot.h:
 * a state out of range, a pid no process can have, a name without its
 * end, a heartbeat in the future...), a dead worker, one still RUNNING whose process is gone
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
 * (worker/trace.h) that could be read whole, oldest first (its lanes
 * merged by time). Its JSON (stable): {rank, name, capacity (records the
 * ring holds, all lanes), claimed (records written in the worker's life),
 * dropped, records: [{index (the record's number in its lane), lane (0:
 * the shared one; else one thread's), time_ns (CLOCK_MONOTONIC), age_ns (before the newest), kind ("sent",
 * "received", "started", "finished", "completed", "pinned", "unpinned",
 * "blocked", "unblocked"), type (message type name, or null), type_id,
 * peer, msg_id, size (payload bytes; for pinned and unpinned the
 * tensors'), tensors (pinned and unpinned: how many; else null), with
 * (pinned and unpinned: "request" or "reply", the message they went
 * with; else null), status ("ok", "error", "timeout", "peer-dead",
 * "shutdown", "late"), step ("waited", "ran", "took", "held", "blocked",
 * or null), step_ns (or null)}]}.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/json.h"
#include "tools/inspect/inspect.h"

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
	      "  --check    print \"ok\", or the anomalies found and exit 1: a corrupt\n"
	      "             worker slot, a DEAD\n"
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
	      "             started, finished, completed; recv+start: received and\n"
	      "             run at once by the thread that took it off the ring, one\n"
	      "             record at the arrival's time; pinned, unpinned: a message's\n"
	      "             tensors handed over, then released; blocked, unblocked: a\n"
	      "             send waiting for ring space), message type (for pins: the\n"
	      "             tensors and the message they went with), peer rank,\n"
	      "             message id, payload bytes (for pins: the tensors'), status\n"
	      "             (ok, error, timeout, peer-dead, shutdown, late), and the\n"
	      "             step's time: waited (queued), ran (started, or recv+start,\n"
	      "             to finished),\n"
	      "             took (sent to completed), held (pinned to unpinned),\n"
	      "             blocked (blocked to unblocked)\n"
	      "  --help     this text\n"
	      "  --version  the shmrpc version\n",
	      f);
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

static const struct subject *const subjects[] = { &workers_subject, &pool_subject,
						  &rrefs_subject };
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
		found[i] = attach(subjects[i], &v, why[i], sizeof(why[i]));
	for (size_t i = 0; i < NSUBJECTS; i++)
		snapped = snapped && (found[i] <= 0 || subjects[i]->snap(&v));
	for (size_t i = 0; i < NSUBJECTS && snapped && want_check && bad >= 0; i++) {
		int n = found[i] > 0 ? subjects[i]->check(&v) : 0;

		if (found[i] < 0)
			printf("%s cannot be read: %s\n", subjects[i]->what, why[i]);
		bad = n < 0 ? -1 : bad + n + (found[i] < 0);
	}
	for (size_t i = 0; i < NSUBJECTS && snapped && !want_check; i++) {
		if (found[i] > 0)
			(json ? subjects[i]->json : subjects[i]->text)(&v);
		else if (json)
			print_unread_json(subjects[i]->key, why[i]);
		else if (found[i] < 0)
			printf("\n%-14s cannot be read: %s\n", subjects[i]->title, why[i]);
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
			subjects[i]->detach(&v);
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
