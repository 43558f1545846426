/*
 * shmrpc-inspect on a live 4-worker job in the middle of its work: the
 * figures it prints, in the text and in --json, are what the job did.
 *
 * Each rank r calls each peer p add() 1 + r + 2p times; rank 3 calls rank
 * 1's fail() 3 times (answered with an EXCEPTION) and hands it a tensor it
 * keeps; rank 0 makes an RRef owned by rank 1 and rank 3 one owned by rank
 * 0 (one request to the owner each). Rank 1 holds a 1 MiB tensor, rank 3 a
 * 4 KiB one and the 64 KiB one it handed to rank 1. Then ranks 1 and 3 each
 * call hold() on rank 2, which runs one call at a time (one executor
 * thread): the first waits on a gate in memory the test shares with the
 * workers, the second is queued behind it. Rank 0 waits until the job's
 * counters say all this has happened, runs the inspector on its launcher,
 * checks per worker calls served, active client and server calls, pending
 * futures, threads, errors, empty rings, the pool's use and holders, the
 * RRefs by owner; then --check ("ok"), and --check with rank 3's pool
 * holder marked DEAD through a writable mapping of the pool (a killed
 * worker the launcher has not swept yet: named, exit 1) and marked LIVE
 * again ("ok"). Then it opens the gate and the job ends.
 */
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "shm/pool.h"
#include "shm/rref_table.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"
#include "worker/link.h"

#define WORLD 4
#define FAILS 3
#define HOLDER 2 /* the rank whose one executor thread the hold() calls fill */
#define OUT_MAX 65536
#define WAIT_NS (20ull * 1000000000ull) /* only stops a hang */
#define GATE_ENV "INSPECT_LOAD_GATE_FD"

#define BIG_BYTES (1u << 20)
#define SMALL_BYTES 4096u
#define KEPT_BYTES (64u << 10)

static char out[OUT_MAX];

/* Shared by every worker through a memfd the test process made before the
 * launcher: hold() waits on `open`, which rank 0 sets after inspecting. */
struct gate {
	_Atomic uint32_t open;
};
static struct gate *gate;
static shmrpc_tensor *kept; /* rank 1: the tensor rank 3 handed over */

static int calls(int r, int p)
{
	return 1 + r + 2 * p;
}

/* Requests rank p serves before the holds: add() from each peer, and
 * rank 1 the fail()s, the keep() and rank 0's remote(); rank 0 rank 3's
 * remote(). */
static uint64_t served(int p)
{
	uint64_t n = 0;

	for (int r = 0; r < WORLD; r++)
		if (r != p)
			n += (uint64_t)calls(r, p);
	if (p == 1)
		n += FAILS + 1 + 1;
	if (p == 0)
		n += 1;
	return n;
}

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

static int fn_fail(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)a, (void)n, (void)r, (void)u;
	return shmrpc_call_error(c, "ValueError", "failing on purpose");
}

static int fn_keep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	CHECK_OK(shmrpc_tensor_retain(a[0].u.t, &kept));
	*r = shmrpc_int(0);
	return 0;
}

/* An RRef's value: more than the 8 bytes its table entry holds itself
 * (docs/RREF.md), so that it is stored in a pool block of its owner. */
static int fn_text(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_str("a value stored in a block");
	return 0;
}

/* Waits (futex, across processes) until rank 0 opens the gate. */
static int fn_hold(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uint64_t deadline = shmrpc_now_ns() + 3 * WAIT_NS;
	struct timespec ts = { 0, 100000000 };

	(void)c, (void)a, (void)n, (void)u;
	while (!atomic_load(&gate->open)) {
		CHECK(shmrpc_now_ns() < deadline, "the gate never opened");
		syscall(SYS_futex, &gate->open, FUTEX_WAIT, 0, &ts, NULL, 0);
	}
	*r = shmrpc_int(1);
	return 0;
}

static int inspect(const char *a1, const char *a2)
{
	const char *argv[4] = { tl_inspect_path(), a1, a2, NULL };

	return tl_run(out, sizeof(out), argv);
}

static struct shm_worker *slot(int r)
{
	return shm_worker(&worker_agent->seg, (uint32_t)r);
}

/* Relaxed: gauges and counters polled until they reach a value. */
static uint64_t get(_Atomic uint64_t *v)
{
	return atomic_load_explicit(v, memory_order_relaxed);
}

/* Waits until cond() holds; what fails names what was waited for. */
static void wait_for(bool (*cond)(void), const char *what)
{
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;

	while (!cond()) {
		CHECK(shmrpc_now_ns() < deadline, "worker %d: waited in vain for %s", shmrpc_rank(),
		      what);
		usleep(1000);
	}
}

static bool holder_done(void)
{
	return get(&slot(HOLDER)->calls_served) >= served(HOLDER);
}

/* Every request of the first part served, and the two holds in place:
 * one running on rank 2, one queued there, each a call rank 1 and 3 wait on. */
static bool job_busy(void)
{
	for (int r = 0; r < WORLD; r++)
		if (get(&slot(r)->calls_served) < served(r))
			return false;
	return get(&slot(HOLDER)->server_active_calls) == 1 &&
	       get(&slot(HOLDER)->num_pending_futures) == 1 &&
	       get(&slot(1)->client_active_calls) == 1 && get(&slot(3)->client_active_calls) == 1;
}

/* The blocks each rank holds: its tensors, and an RRef's owner the block
 * its value (text()) is stored in (worker/rref_owner.c, 64 bytes): rank 0 rank 3's RRef,
 * rank 1 its 1 MiB tensor, the one rank 3 handed over, and rank 0's RRef;
 * rank 3 its 4 KiB tensor and the one it handed over. */
static uint32_t blocks_of(int r)
{
	static const uint32_t blocks[WORLD] = { 1, 3, 0, 2 };

	return blocks[r];
}

#define POOL_USED (BIG_BYTES + SMALL_BYTES + KEPT_BYTES + 2 * 64u)
#define POOL_BLOCKS 5

/* The handed-over tensor's pins released, the RRefs' values stored: each
 * holder with one reference per block it holds. */
static bool pool_settled(void)
{
	struct pool_holder_stats h;

	for (int r = 0; r < WORLD; r++)
		if (pool_holder_stats(&worker_agent->pool, (uint32_t)r, &h) || h.refs != blocks_of(r) ||
		    h.entries != blocks_of(r))
			return false;
	return true;
}

/* Both RRefs ready, each held by its creator alone (the owner's reference
 * for the run is dropped after it stores the value). */
static bool rrefs_settled(void)
{
	struct rref_table *t = &worker_agent->rrefs;
	struct rref_info info;
	int ready = 0;

	for (uint32_t s = 0; s < t->capacity; s++)
		if (rref_info_at(t, s, &info) && info.state == RREF_READY && info.total == 1 &&
		    rref_count_of(t, s, info.creator) == 1)
			ready++;
	return ready == 2;
}

/* The table row of rank r: its state, counters and ring fills. */
struct row {
	char state[16];
	unsigned long long v[12], ring_in, ring_out;
};

static void text_row(int r, struct row *w)
{
	char head[32];
	const char *at;

	snprintf(head, sizeof(head), "\n%4d worker%d ", r, r);
	at = strstr(out, head);
	CHECK(at, "no row for rank %d in %s", r, out);
	CHECK(sscanf(at, "%*u %*s %*u %15s %*s %*s %llu %llu %llu %llu %llu %llu %llu %llu %llu "
		     "%llu %llu %llu %llu %llu", w->state, &w->v[0], &w->v[1], &w->v[2], &w->v[3],
		     &w->v[4], &w->v[5], &w->v[6], &w->v[7], &w->v[8], &w->v[9], &w->v[10],
		     &w->v[11], &w->ring_in, &w->ring_out) == 15,
	      "rank %d's row does not parse", r);
}

/* What each rank must show: served, client, server, pending, threads, idle, errors. */
struct want {
	uint64_t served, cli, srv, pend, thr, idle, err;
};

static struct want wanted(int r)
{
	struct want w = { served(r), 0, 0, 0, 4, 4, 0 };

	if (r == 1 || r == 3)
		w.cli = 1;
	if (r == HOLDER)
		w.srv = 1, w.pend = 1, w.thr = 1, w.idle = 0;
	if (r == 1)
		w.err = FAILS;
	return w;
}

static void check_text(const char *job)
{
	char line[128];
	int rc = inspect(job, NULL);

	CHECK(rc == 0, "inspect %s exited %d", job, rc);
	for (int r = 0; r < WORLD; r++) {
		struct want w = wanted(r);
		struct row got;

		text_row(r, &got);
		CHECK(!strcmp(got.state, "RUNNING"), "rank %d is %s", r, got.state);
		/* SERVED CLI SRV PEND THR IDLE ERR TMO LATE SENT RECV CORRUPT */
		CHECK(got.v[0] == w.served && got.v[1] == w.cli && got.v[2] == w.srv &&
		      got.v[3] == w.pend && got.v[4] == w.thr && got.v[5] == w.idle &&
		      got.v[6] == w.err && got.v[7] == 0 && got.v[8] == 0 && got.v[11] == 0,
		      "rank %d: served %llu cli %llu srv %llu pend %llu thr %llu idle %llu err %llu "
		      "tmo %llu late %llu corrupt %llu; want %llu %llu %llu %llu %llu %llu %llu 0 0 0",
		      r, got.v[0], got.v[1], got.v[2], got.v[3], got.v[4], got.v[5], got.v[6],
		      got.v[7], got.v[8], got.v[11], (unsigned long long)w.served,
		      (unsigned long long)w.cli, (unsigned long long)w.srv, (unsigned long long)w.pend,
		      (unsigned long long)w.thr, (unsigned long long)w.idle, (unsigned long long)w.err);
		/* Every frame sent was taken off its ring: the queued hold too. */
		CHECK(got.ring_in == 0 && got.ring_out == 0, "rank %d: rings hold %llu in, %llu out", r,
		      got.ring_in, got.ring_out);
	}
	/* The default pool: its size is the machine's (shm/pool.h). */
	snprintf(line, sizeof(line), "\ntensor pool    %llu bytes, %u used,",
		 (unsigned long long)pool_default_bytes(), POOL_USED);
	CHECK(strstr(out, line), "no \"%s\"", line + 1);
	snprintf(line, sizeof(line), "\n               %u live blocks; 0 bytes lost and 0 references "
		 "unrecorded", POOL_BLOCKS);
	CHECK(strstr(out, line), "no \"%s\"", line + 1);
	for (int r = 0; r < WORLD; r++) {
		snprintf(line, sizeof(line), "\n%4d %7u %-6s %8u %8u\n", r, atomic_load(&slot(r)->pid),
			 "live", blocks_of(r), blocks_of(r));
		CHECK(strstr(out, line), "no pool holder line \"%s\"", line + 1);
	}
	snprintf(line, sizeof(line), "\nrref table     2 live of %u (capacity ", RREF_DEFAULT_MAX_RREFS);
	CHECK(strstr(out, line), "no \"%s\"", line + 1);
	CHECK(strstr(out, " 0 pending, 2 ready, 0 error, 0 unreferenced, 0 owner-dead\n"),
	      "RRefs by state");
}

static void check_json(const char *job)
{
	unsigned long long sent = 0, recv = 0;
	const char *pool, *rrefs, *at;
	char key[96];
	int rc = inspect("--json", job);

	CHECK(rc == 0, "inspect --json exited %d", rc);
	CHECK(out[0] == '{' && strstr(out, "}\n"), "not one JSON object");
	CHECK(tl_json_num(out, "world_size") == WORLD, "world_size");
	for (int r = 0; r < WORLD; r++) {
		struct want w = wanted(r);
		const char *o;

		snprintf(key, sizeof(key), "{\"rank\":%d,\"name\":\"worker%d\",", r, r);
		CHECK((o = strstr(out, key)), "no worker %d", r);
		CHECK(strstr(o, "\"state\":\"RUNNING\"") < strstr(o, "}"), "rank %d not RUNNING", r);
		CHECK(tl_json_num(o, "calls_served") == w.served && tl_json_num(o, "client_active_calls") == w.cli &&
		      tl_json_num(o, "server_active_calls") == w.srv &&
		      tl_json_num(o, "num_pending_futures") == w.pend &&
		      tl_json_num(o, "thread_pool_size") == w.thr && tl_json_num(o, "num_idle_threads") == w.idle &&
		      tl_json_num(o, "errors") == w.err && tl_json_num(o, "timeouts") == 0 &&
		      tl_json_num(o, "corrupt_frames") == 0 && tl_json_num(o, "ring_fill_in") == 0 &&
		      tl_json_num(o, "ring_fill_out") == 0,
		      "rank %d in the JSON: %.400s", r, o);
		sent += tl_json_num(o, "frames_sent");
		recv += tl_json_num(o, "frames_recv");
	}
	/* Rings empty: every frame sent in the job has been received. */
	CHECK(sent == recv && sent > 0, "%llu frames sent, %llu received", sent, recv);

	CHECK((pool = strstr(out, ",\"pool\":{")), "no pool");
	CHECK(tl_json_num(pool, "size") == pool_default_bytes() &&
	      tl_json_num(pool, "used") == POOL_USED &&
	      tl_json_num(pool, "blocks_live") == POOL_BLOCKS && tl_json_num(pool, "lost") == 0 &&
	      tl_json_num(pool, "refs_unrecorded") == 0, "the pool in the JSON: %.300s", pool);
	for (int r = 0; r < WORLD; r++) {
		unsigned blocks = blocks_of(r);

		snprintf(key, sizeof(key), "{\"rank\":%d,\"pid\":%u,\"state\":\"live\",\"blocks\":%u,"
			 "\"refs\":%u}", r, atomic_load(&slot(r)->pid), blocks, blocks);
		CHECK(strstr(pool, key), "no %s in %.400s", key, pool);
	}

	CHECK((rrefs = strstr(out, ",\"rrefs\":{")), "no rrefs");
	CHECK(tl_json_num(rrefs, "live") == 2, "RRefs live");
	/* One per owner: rank 1's made by rank 0, rank 0's made by rank 3. */
	CHECK((at = strstr(rrefs, "\"owner\":1,\"creator\":0,\"state\":\"ready\",\"total\":1,")) &&
	      strstr(at, "\"counts\":{\"0\":1}}"), "rank 1's RRef: %s", rrefs);
	CHECK((at = strstr(rrefs, "\"owner\":0,\"creator\":3,\"state\":\"ready\",\"total\":1,")) &&
	      strstr(at, "\"counts\":{\"3\":1}}"), "rank 0's RRef: %s", rrefs);
	for (int owner = 2; owner < WORLD; owner++) {
		snprintf(key, sizeof(key), "\"owner\":%d,", owner);
		CHECK(!strstr(rrefs, key), "an RRef owned by rank %d", owner);
	}
}

/* Rank 3's pool holder marked DEAD with its blocks recorded: what a kill
 * leaves until the launcher sweeps it. Only the state bits change (life
 * is generation << 32 | state << 30 | pid, shm/pool.h). */
static void check_dead_holder(const char *job)
{
	const char *fd = getenv(SHMRPC_ENV_POOL_FD);
	struct pool_holder_stats hs;
	struct shm_pool pool;
	uint64_t live, dead;
	char line[128];
	int dup_fd, rc;

	CHECK(fd, "no %s", SHMRPC_ENV_POOL_FD);
	dup_fd = dup(atoi(fd)); /* the pool owns it; the library keeps its own */
	CHECK(dup_fd >= 0, "dup(%s)", fd);
	CHECK_OK(pool_attach_fd(&pool, dup_fd, false));
	CHECK_OK(pool_holder_stats(&pool, 3, &hs));
	CHECK(hs.state == POOL_HOLDER_LIVE && hs.refs == 2, "rank 3's holder: state %u refs %llu",
	      hs.state, (unsigned long long)hs.refs);
	live = (uint64_t)hs.generation << 32 | (uint64_t)POOL_HOLDER_LIVE << 30 | hs.pid;
	dead = (uint64_t)hs.generation << 32 | (uint64_t)POOL_HOLDER_DEAD << 30 | hs.pid;
	/* Rank 3 waits in hold(): nothing of it touches the pool meanwhile. */
	CHECK(atomic_compare_exchange_strong(&pool.holders[3].life, &live, dead), "life changed");

	rc = inspect("--check", job);
	snprintf(line, sizeof(line), "rank 3 died holding 2 references in the tensor pool\n");
	CHECK(rc == 1 && !strcmp(out, line), "--check exited %d: %s", rc, out);
	rc = inspect("--json", job);
	CHECK(rc == 0 && strstr(out, "\"state\":\"dead\",\"blocks\":2,\"refs\":2}"),
	      "the dead holder in the JSON: %s", out);

	CHECK(atomic_compare_exchange_strong(&pool.holders[3].life, &dead, live), "life changed");
	rc = inspect("--check", job);
	CHECK(rc == 0 && !strcmp(out, "ok\n"), "--check once repaired exited %d: %s", rc, out);
	pool_detach(&pool);
}

static void add_calls(void)
{
	int me = shmrpc_rank();
	shmrpc_future *f;

	for (int p = 0; p < WORLD; p++) {
		for (int i = 0; p != me && i < calls(me, p); i++) {
			shmrpc_value args[2] = { shmrpc_int(i), shmrpc_int(me) };

			CHECK_OK(shmrpc_rpc_sync(p, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
			CHECK(shmrpc_future_value(f)->u.i == i + me, "add");
			shmrpc_future_free(f);
		}
	}
}

static void hold(shmrpc_future **f)
{
	wait_for(holder_done, "rank 2 to serve its add() calls");
	CHECK_OK(shmrpc_rpc_async(HOLDER, "hold", NULL, 0, SHMRPC_TIMEOUT_NONE, f));
}

static int worker(void)
{
	struct shmrpc_options opts = SHMRPC_OPTIONS();
	const char *gate_fd = getenv(GATE_ENV);
	shmrpc_tensor *big = NULL, *small = NULL, *handed = NULL;
	shmrpc_rref *rr = NULL;
	shmrpc_future *f = NULL;
	int me;

	CHECK(gate_fd, "no %s", GATE_ENV);
	gate = mmap(NULL, sizeof(*gate), PROT_READ | PROT_WRITE, MAP_SHARED, atoi(gate_fd), 0);
	CHECK(gate != MAP_FAILED, "cannot map the gate");
	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_register("text", "", fn_text, NULL));
	CHECK_OK(shmrpc_register("fail", NULL, fn_fail, NULL));
	CHECK_OK(shmrpc_register("keep", "t", fn_keep, NULL));
	CHECK_OK(shmrpc_register("hold", NULL, fn_hold, NULL));
	if (atoi(getenv("SHMRPC_RANK")) == HOLDER)
		opts.num_threads = 1;
	CHECK_OK(shmrpc_init(&opts));
	me = shmrpc_rank();

	add_calls();
	if (me == 0)
		CHECK_OK(shmrpc_remote(1, "text", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &rr));
	if (me == 1) {
		int64_t shape = BIG_BYTES;

		CHECK_OK(shmrpc_tensor_alloc((DLDataType){ kDLUInt, 8, 1 }, 1, &shape, &big));
		hold(&f);
	}
	if (me == 3) {
		int64_t s1 = SMALL_BYTES, s2 = KEPT_BYTES;
		shmrpc_future *g;

		for (int i = 0; i < FAILS; i++)
			CHECK(shmrpc_rpc_sync(1, "fail", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &g) == -SHMRPC_EREMOTE,
			      "fail() did not fail");
		CHECK_OK(shmrpc_tensor_alloc((DLDataType){ kDLUInt, 8, 1 }, 1, &s1, &small));
		CHECK_OK(shmrpc_tensor_alloc((DLDataType){ kDLUInt, 8, 1 }, 1, &s2, &handed));
		shmrpc_value t = shmrpc_tensor_value(handed);
		CHECK_OK(shmrpc_rpc_sync(1, "keep", &t, 1, SHMRPC_TIMEOUT_DEFAULT, &g));
		shmrpc_future_free(g);
		CHECK_OK(shmrpc_remote(0, "text", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &rr));
		hold(&f);
	}
	if (me == 0) {
		char job[16];

		wait_for(job_busy, "the calls and the holds");
		wait_for(pool_settled, "the pool to settle");
		wait_for(rrefs_settled, "the RRefs to settle");
		snprintf(job, sizeof(job), "%d", (int)getppid());
		check_text(job);
		check_json(job);
		CHECK(inspect("--check", job) == 0 && !strcmp(out, "ok\n"), "--check: %s", out);
		check_dead_holder(job);
		atomic_store(&gate->open, 1);
		syscall(SYS_futex, &gate->open, FUTEX_WAKE, WORLD, NULL, NULL, 0);
	}
	if (f) {
		CHECK_OK(shmrpc_future_wait(f, -1));
		shmrpc_future_free(f);
	}
	shmrpc_rref_free(rr);
	shmrpc_tensor_free(big);
	shmrpc_tensor_free(small);
	shmrpc_tensor_free(handed);
	shmrpc_tensor_free(kept);
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	char fd_text[16];
	int fd;

	if (tl_is_worker())
		return worker();
	/* Not close-on-exec: shmrun and its workers inherit it. */
	fd = memfd_create("inspect-load-gate", 0);
	CHECK(fd >= 0 && ftruncate(fd, sizeof(struct gate)) == 0, "cannot make the gate");
	snprintf(fd_text, sizeof(fd_text), "%d", fd);
	setenv(GATE_ENV, fd_text, 1);
	return tl_job_test(worker, "-n", "4", NULL);
}
