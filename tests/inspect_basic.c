/*
 * shmrpc-inspect on a live 2-worker job: rank 0 calls rank 1 and holds an
 * RRef made by remote(1, ...), then runs the inspector on its own launcher
 * (its parent) and checks what the text, --json and --check say, the RRef
 * table included, and the CUDA IPC gauges (0: no worker used CUDA; then
 * set in rank 1's slot through a writable mapping of the segment, shown
 * in text and JSON), that --check names rank 1 while it is stopped
 * (SIGSTOP) and says "ok" once it runs again, that the job list names the
 * launcher, and the errors: a
 * pid with no process, a worker's pid instead of the launcher's (exit 1),
 * a bad option and a JOB that is no pid (exit 2). Then, through its own
 * mapping of the job's RRef table, it makes an RRef whose counts are wrong,
 * corrupt and then leaked, and checks that --check names each, and says
 * "ok" again once it is gone.
 *
 * Before that job, one whose workers never join (/bin/sh, no shmrpc_init):
 * its workers show as STARTED, not EMPTY, in the text, the JSON and the
 * job list, which --json with no JOB prints as JSON.
 */
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/proc_stat.h"
#include "shm/pool.h"
#include "shm/rref_table.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define CALLS 50
#define OUT_MAX 65536
#define SETTLE_NS 10000000000ull /* only stops a hang */

static char out[OUT_MAX];
/* The job's RRef table as this worker maps it (read-write): to see an RRef
 * settle, and to make the faults --check must find. */
static struct rref_table table;

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

/* Runs the inspector with up to two arguments (NULL: fewer); its exit code. */
static int inspect(const char *a1, const char *a2)
{
	const char *argv[4] = { tl_inspect_path(), a1, a2, NULL };

	return tl_run(out, sizeof(out), argv);
}

/* --watch redraws until stopped: a second table comes (10 s is only a
 * bound against a hang: a sanitized build on a loaded machine is slow). */
static void watch_twice(const char *job)
{
	const char *argv[] = { tl_inspect_path(), "--watch=0.1", job, NULL };
	size_t len = 0;
	int fd, tables = 0;
	pid_t pid = tl_spawn(argv, &fd);

	CHECK(pid > 0, "cannot run shmrpc-inspect --watch");
	for (int waited = 0; tables < 2 && waited < 1000 && len < sizeof(out) - 1; waited++) {
		struct pollfd p = { fd, POLLIN, 0 };
		ssize_t n;

		if (poll(&p, 1, 10) <= 0)
			continue;
		if ((n = read(fd, out + len, sizeof(out) - 1 - len)) <= 0)
			break;
		len += (size_t)n;
		out[len] = '\0';
		tables = 0;
		for (const char *at = out; (at = strstr(at, "launcher pid")); at++)
			tables++;
	}
	kill(pid, SIGTERM);
	tl_collect(pid, fd, out + len, sizeof(out) - len);
	CHECK(tables >= 2, "--watch drew %d tables", tables);
}

/* The state letter of /proc/PID/stat ('T': stopped). */
static char process_state(pid_t pid)
{
	char buf[512];
	const char *f = proc_stat_fields(pid, buf, sizeof(buf), NULL);

	return f ? f[0] : 0;
}

static void inspect_job(const char *job)
{
	char self[16], line[64];
	const char *w1;
	pid_t peer;
	int rc;

	snprintf(self, sizeof(self), "%d", (int)getpid());

	rc = inspect(job, NULL);
	CHECK(rc == 0, "inspect %s exited %d", job, rc);
	snprintf(line, sizeof(line), "launcher pid   %s\n", job);
	CHECK(strstr(out, line), "no \"%s\"", line);
	CHECK(strstr(out, "world size     2\n"), "world size");
	CHECK(strstr(out, "worker0") && strstr(out, "worker1"), "workers not named");
	CHECK(strstr(out, "RUNNING"), "no RUNNING worker");
	CHECK(strstr(out, self), "own pid %s not shown", self);
	CHECK(strstr(out, "\ncuda ipc       no mappings, events or exports open\n"), "no CUDA line");

	rc = inspect("--json", job);
	CHECK(rc == 0, "inspect --json exited %d", rc);
	CHECK(out[0] == '{' && strstr(out, "]}}\n"), "not one JSON object");
	CHECK(tl_json_num(out, "launcher_pid") == (unsigned long long)getppid(), "launcher_pid");
	CHECK(tl_json_num(out, "world_size") == 2, "world_size");
	CHECK(strstr(out, "\"job_name\":\""), "no job_name");
	CHECK(strstr(out, "{\"rank\":0,\"name\":\"worker0\",") &&
	      strstr(out, "{\"rank\":1,\"name\":\"worker1\","), "workers not named");
	CHECK(strstr(out, "\"state\":\"RUNNING\""), "no RUNNING worker");
	w1 = strstr(out, "{\"rank\":1,");
	CHECK(tl_json_num(w1, "calls_served") >= CALLS, "rank 1 served %llu calls, %d made",
	      tl_json_num(w1, "calls_served"), CALLS);
	CHECK(tl_json_num(out, "frames_sent") >= CALLS, "rank 0 sent %llu frames", tl_json_num(out, "frames_sent"));
	CHECK(tl_json_num(out, "corrupt_frames") == 0, "corrupt frames");
	/* The CUDA IPC gauges: each worker has them, and neither used CUDA. */
	for (int r = 0; r < 2; r++) {
		static const char *const gauges[] = { "cuda_maps_open", "cuda_events_open",
						      "cuda_allocs_exported", "cuda_events_exported" };
		const char *w;

		snprintf(line, sizeof(line), "{\"rank\":%d,\"name\":\"worker%d\",", r, r);
		CHECK((w = strstr(out, line)), "no worker %d", r);
		for (size_t g = 0; g < sizeof(gauges) / sizeof(gauges[0]); g++)
			CHECK(tl_json_num(w, gauges[g]) == 0, "rank %d: %s %llu", r, gauges[g],
			      tl_json_num(w, gauges[g]));
	}
	/* The tensor pool, read-only: shmrun's default size, both ranks holding it. */
	CHECK(strstr(out, "\"pool\":{") &&
	      tl_json_num(strstr(out, "\"pool\":{"), "size") == pool_default_bytes(),
	      "no tensor pool of the default size (%llu bytes) in the JSON",
	      (unsigned long long)pool_default_bytes());
	CHECK(strstr(out, "{\"rank\":1,\"pid\":") && strstr(out, "\"state\":\"live\""),
	      "the pool's holders are not listed");

	peer = (pid_t)tl_json_num(w1, "pid");
	watch_twice(job);
	rc = inspect("--check", job);
	CHECK(rc == 0 && strcmp(out, "ok\n") == 0, "--check exited %d: %s", rc, out);
	/* A stopped worker is an anomaly: calls to it wait. */
	CHECK(peer > 0 && kill(peer, SIGSTOP) == 0, "SIGSTOP rank 1 (%d)", (int)peer);
	for (int i = 0; i < 1000 && process_state(peer) != 'T'; i++)
		usleep(1000);
	rc = inspect("--check", job);
	CHECK(kill(peer, SIGCONT) == 0, "SIGCONT");
	CHECK(rc == 1 && strstr(out, "rank 1 (worker1) is stopped"), "--check of a stopped worker "
	      "exited %d: %s", rc, out);
	rc = inspect("--check", job);
	CHECK(rc == 0 && strcmp(out, "ok\n") == 0, "--check after SIGCONT exited %d: %s", rc, out);

	rc = inspect(NULL, NULL);
	CHECK(rc == 0, "the job list exited %d", rc);
	snprintf(line, sizeof(line), "\n%7s ", job);
	CHECK(strstr(out, line), "the job list lacks the launcher %s", job);

	/* A worker holds the segment too, but it is not the job's name. */
	CHECK(inspect(self, NULL) == 1 && strstr(out, "not a launcher"), "a worker's pid");
	CHECK(inspect("999999", NULL) == 1 && strstr(out, "shmrpc-inspect: no such job"), "no process");
	CHECK(inspect("--bogus", NULL) == 2 && strstr(out, "usage:"), "bad option");
	CHECK(inspect("12ab", NULL) == 2, "a JOB that is no pid");
	CHECK(inspect("--check", NULL) == 2, "--check without JOB");
}

/* Rank 1's CUDA IPC gauges as if it had mapped 2 allocations and opened 3
 * events: the text lists it, with them, and the JSON has them. */
static void inspect_cuda(const char *job)
{
	const char *fd = getenv(SHMRPC_ENV_JOB_FD), *w1;
	struct shm_worker *w;
	struct shm_seg seg;
	int dup_fd, rc;

	CHECK(fd, "no %s", SHMRPC_ENV_JOB_FD);
	dup_fd = fcntl(atoi(fd), F_DUPFD_CLOEXEC, 0); /* the agent keeps its own */
	CHECK(dup_fd >= 0, "dup(%s)", fd);
	CHECK_OK(shm_seg_attach_fd(&seg, dup_fd, false));
	w = shm_worker(&seg, 1);
	/* Relaxed, as cuda.c stores them: the inspector runs after, in a
	 * process started after these stores. */
	atomic_store_explicit(&w->cuda_maps_open, 2, memory_order_relaxed);
	atomic_store_explicit(&w->cuda_events_open, 3, memory_order_relaxed);

	rc = inspect(job, NULL);
	CHECK(rc == 0, "inspect %s exited %d", job, rc);
	CHECK(strstr(out, "\ncuda ipc\nRANK       MAPS_OPEN     EVENTS_OPEN ALLOCS_EXPORTED "
		      "EVENTS_EXPORTED\n   1               2               3               0 "
		      "              0\n\n"), "rank 1's CUDA gauges not listed alone: %s", out);
	rc = inspect("--json", job);
	CHECK(rc == 0, "inspect --json exited %d", rc);
	w1 = strstr(out, "{\"rank\":1,\"name\":\"worker1\",");
	CHECK(w1 && tl_json_num(w1, "cuda_maps_open") == 2 && tl_json_num(w1, "cuda_events_open") == 3 &&
	      tl_json_num(w1, "cuda_allocs_exported") == 0, "rank 1's CUDA gauges in the JSON");
	CHECK(tl_json_num(out, "cuda_maps_open") == 0, "rank 0's gauge moved");

	atomic_store_explicit(&w->cuda_maps_open, 0, memory_order_relaxed);
	atomic_store_explicit(&w->cuda_events_open, 0, memory_order_relaxed);
	shm_seg_detach(&seg);
}

static void attach_table(void)
{
	const char *fd = getenv(SHMRPC_ENV_RREF_FD);
	int dup_fd;

	CHECK(fd, "no %s: shmrun made no RRef table", SHMRPC_ENV_RREF_FD);
	dup_fd = dup(atoi(fd)); /* the table owns it; the library keeps its own */
	CHECK(dup_fd >= 0, "dup(%s)", fd);
	CHECK_OK(rref_table_attach_fd(&table, dup_fd, false));
}

/* rr's id, as "CREATED_ON:LOCAL_ID" (the inspector's form) into name. */
static uint64_t rref_id(shmrpc_rref *rr, char *name, size_t len)
{
	char str[256];
	const char *at;
	unsigned rank;
	unsigned long long local;

	CHECK(shmrpc_rref_str(rr, str, sizeof(str)) > 0, "rref_str");
	at = strstr(str, "created_on=");
	CHECK(at && sscanf(at, "created_on=%u, local_id=%llu", &rank, &local) == 2, "no id in %s", str);
	snprintf(name, len, "%u:%llu", rank, local);
	return RREF_ID(rank, local);
}

/* The owner drops its pending run's reference just after it stores the
 * value to_here saw: wait for it, so that rank 0's is the only one. */
static void wait_settled(uint64_t id)
{
	uint64_t deadline = shmrpc_now_ns() + SETTLE_NS;
	struct rref_info info;
	uint32_t slot;

	CHECK_OK(rref_find(&table, id, &slot));
	while (!rref_info_at(&table, slot, &info) || info.total != 1 ||
	       rref_count_of(&table, slot, 1) != 0) {
		CHECK(shmrpc_now_ns() < deadline, "the owner keeps its reference to %llx",
		      (unsigned long long)id);
		usleep(1000);
	}
}

/* The RRef name (of rank 0, owned by rank 1, ready, held by rank 0 alone)
 * in the text, the JSON and --check. */
static void inspect_rref(const char *job, const char *name)
{
	const char *tail = "\"counts\":{\"0\":1}}]}}\n";
	char line[160], state[16], counts[16];
	unsigned owner, total;
	const char *at;
	int rc;

	rc = inspect(job, NULL);
	CHECK(rc == 0, "inspect %s exited %d", job, rc);
	snprintf(line, sizeof(line), "\nrref table     1 live of %u (capacity ", RREF_DEFAULT_MAX_RREFS);
	CHECK(strstr(out, line), "no \"%s\"", line + 1);
	CHECK(strstr(out, " 0 pending, 1 ready, 0 error, 0 unreferenced, 0 owner-dead\n"),
	      "RRefs by state");
	snprintf(line, sizeof(line), "\n%s ", name);
	at = strstr(out, line);
	CHECK(at && sscanf(at, "%*s %u %15s %u %*s %15s", &owner, state, &total, counts) == 4,
	      "no line for RRef %s", name);
	CHECK(owner == 1 && !strcmp(state, "ready") && total == 1 && !strcmp(counts, "0:1"),
	      "RRef %s: owner %u, %s, total %u, counts %s", name, owner, state, total, counts);

	rc = inspect("--json", job);
	CHECK(rc == 0, "inspect --json exited %d", rc);
	snprintf(line, sizeof(line), ",\"rrefs\":{\"live\":1,\"max\":%u,", RREF_DEFAULT_MAX_RREFS);
	CHECK(strstr(out, line), "no %s", line);
	CHECK(strstr(out, "\"by_state\":{\"pending\":0,\"ready\":1,\"error\":0,"
		      "\"unreferenced\":0,\"owner-dead\":0}"), "RRefs by state");
	snprintf(line, sizeof(line), "\"entries\":[{\"id\":\"%s\",\"owner\":1,\"creator\":0,"
		 "\"state\":\"ready\",\"total\":1,", name);
	CHECK(strstr(out, line), "no %s", line);
	/* The entry, the last in the object, closes it. */
	CHECK(strlen(out) > strlen(tail) && !strcmp(out + strlen(out) - strlen(tail), tail),
	      "the JSON does not end with %s", tail);

	rc = inspect("--check", job);
	CHECK(rc == 0 && strcmp(out, "ok\n") == 0, "--check with an RRef exited %d: %s", rc, out);
}

/* An RRef of rank 0 owned by rank 1 that the library does not know, its
 * counts made wrong: --check must name each fault, and pass once it goes. */
static void inspect_faults(const char *job)
{
	uint64_t id = RREF_ID(0, 1ull << 39); /* far above rank 0's counter */
	char name[48], line[160];
	struct rref_entry *e;
	uint32_t slot;
	int rc;

	snprintf(name, sizeof(name), "0:%llu", (unsigned long long)RREF_ID_LOCAL(id));
	/* Pending: one reference for rank 0, one for rank 1's run; total 2. */
	CHECK_OK(rref_insert(&table, id, 1, 0, 0, &slot));
	e = rref_entry_at(&table, slot);

	/* A count that total does not include. */
	atomic_fetch_add(&e->counts[0], 1);
	rc = inspect("--check", job);
	snprintf(line, sizeof(line), "RRef %s is corrupt: total 2 is below the 3 references", name);
	CHECK(rc == 1 && strstr(out, line), "--check exited %d: %s", rc, out);
	atomic_fetch_sub(&e->counts[0], 1);

	/* Its holders' counts gone, total left: what a death between the two
	 * steps of a release leaves. */
	atomic_store(&e->counts[0], 0);
	atomic_store(&e->counts[1], 0);
	rc = inspect("--check", job);
	snprintf(line, sizeof(line), "RRef %s leaked: total 2 is above the 0 references", name);
	CHECK(rc == 1 && strstr(out, line) && !strstr(out, "corrupt"), "--check exited %d: %s", rc, out);
	atomic_store(&e->counts[0], 1);
	atomic_store(&e->counts[1], 1);

	/* Removed as the protocol does: stored, the last reference dropped. */
	CHECK(rref_store(&table, slot, id, RREF_READY, 0, 0) == 0, "store: %s", shmrpc_errmsg());
	CHECK(rref_release(&table, slot, id, 0, 1) == 1, "release: %s", shmrpc_errmsg());
	CHECK_OK(rref_remove(&table, slot, id));
	rc = inspect("--check", job);
	CHECK(rc == 0 && strcmp(out, "ok\n") == 0, "--check exited %d: %s", rc, out);
}

static int worker(void)
{
	shmrpc_value two[2] = { shmrpc_int(2), shmrpc_int(3) };
	char job[16], name[48];
	shmrpc_rref *rr;
	shmrpc_future *f;
	uint64_t id;

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		for (int i = 0; i < CALLS; i++) {
			shmrpc_value args[2] = { shmrpc_int(i), shmrpc_int(1) };

			CHECK_OK(shmrpc_rpc_sync(1, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
			CHECK(shmrpc_future_value(f)->u.i == i + 1, "add");
			shmrpc_future_free(f);
		}
		attach_table();
		CHECK_OK(shmrpc_remote(1, "add", two, 2, SHMRPC_TIMEOUT_DEFAULT, &rr));
		CHECK_OK(shmrpc_rref_to_here(rr, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == 5, "remote add");
		shmrpc_future_free(f);
		id = rref_id(rr, name, sizeof(name));
		wait_settled(id);

		snprintf(job, sizeof(job), "%d", (int)getppid());
		inspect_job(job);
		inspect_cuda(job);
		inspect_rref(job, name);
		inspect_faults(job);
		shmrpc_rref_free(rr);
		rref_table_detach(&table);
	}
	/* Rank 1 waits here, still serving, until rank 0 is done inspecting. */
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

/* A job of two /bin/sh workers, started and never joined: STARTED. */
static void inspect_started(void)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--quiet", "--grace", "0", "--",
			       "/bin/sh", "-c", "exec sleep 60", NULL };
	uint64_t deadline = shmrpc_now_ns() + SETTLE_NS;
	char job[16], line[96];
	const char *at;
	int fd, rc;
	pid_t pid = tl_spawn(argv, &fd);

	CHECK(pid > 0, "cannot run shmrun");
	snprintf(job, sizeof(job), "%d", (int)pid);
	/* The launcher stores each pid as it forks: wait for both. */
	for (;;) {
		rc = inspect("--json", job);
		if (rc == 0 && strstr(out, "{\"rank\":1,") &&
		    strstr(strstr(out, "{\"rank\":1,"), "\"state\":\"STARTED\"") &&
		    strstr(out, "{\"rank\":0,") &&
		    strstr(strstr(out, "{\"rank\":0,"), "\"state\":\"STARTED\""))
			break;
		CHECK(shmrpc_now_ns() < deadline, "the workers never showed STARTED (%d): %s", rc, out);
		usleep(10000);
	}
	CHECK(!strstr(out, "\"EMPTY\""), "a started worker shows EMPTY: %s", out);
	rc = inspect(job, NULL);
	CHECK(rc == 0 && strstr(out, " STARTED none ") && !strstr(out, "EMPTY"),
	      "the text lacks STARTED (%d): %s", rc, out);

	rc = inspect("--json", NULL);
	CHECK(rc == 0 && strncmp(out, "{\"jobs\":[", 9) == 0 && strstr(out, "]}\n"),
	      "the job list is not JSON (%d): %s", rc, out);
	snprintf(line, sizeof(line), "{\"launcher_pid\":%d,\"job_name\":\"sh\",\"world_size\":2,",
		 (int)pid);
	CHECK((at = strstr(out, line)), "the JSON job list lacks %s: %s", line, out);
	CHECK(strstr(at, "\"workers\":{\"EMPTY\":0,\"RUNNING\":0,\"EXITED\":0,\"DEAD\":0,"
			 "\"STARTED\":2}}"), "job %d's workers: %s", (int)pid, at);
	rc = inspect(NULL, NULL);
	CHECK(rc == 0 && strstr(out, " STARTED RUNNING "), "the job list (%d): %s", rc, out);

	kill(pid, SIGTERM);
	rc = tl_collect(pid, fd, out, sizeof(out));
	CHECK(rc == 128 + SIGTERM, "shmrun exited %d after SIGTERM", rc);
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK) || access(tl_inspect_path(), X_OK))
		return tl_skip("shmrun or shmrpc-inspect is not built");
	inspect_started();
	return tl_job_test(worker, "-n", "2", NULL);
}
