/*
 * shmrun --trace FILE: the job's flight recorders as Chrome trace JSON.
 *
 * A 3-worker job with 64-record rings in which rank 0 drives every call,
 * so that each ring's contents are known exactly: rank 0 calls rank 1 5
 * times and rank 2 4 times, asks rank 1 to call rank 2 3 times and rank 2
 * to call rank 0 6 times (nested calls: when they return, every record is
 * written), then calls itself 20 times, which wraps its own ring only.
 * /usr/bin/python3 parses the file (json, decimals kept exact) and prints
 * what it holds: the process names, the complete events per kind, rank and
 * peer (a callee's waits in the queue and its requests run at once, which
 * the machine picks, adding up to the calls it served), the unpaired
 * records, each flow checked (one start and one finish;
 * request from the call's start to the handler's start, reply from the
 * handler's end to the call's end; same message id, matching ranks; times
 * ordered send <= start <= end <= reply) and each worker's record counts.
 * A second job kills rank 1 inside a call under --on-failure=continue: the
 * file is still written and shows the death. A third hands tensors over,
 * with 4 KiB rings: rank 0 calls rank 1 3 times with two tensors (1000
 * and 40 bytes), which returns a copy of the first; then stops rank 1 (SIGSTOP)
 * and sends it 6 calls of 1500 bytes, which fill the ring, until a thread
 * lets rank 1 go on 100 ms later. Its file must show each handoff as a
 * slice with its tensors, bytes and release, joined to the receiver by a
 * "tensors" and an "ack" flow, and as many ring-space waits as rank 0's
 * own ring holds. A fourth writes to a directory that does not exist: a
 * job that succeeded exits 1.
 */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
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
#include "worker/trace.h"

#define PYTHON "/usr/bin/python3"
#define PART_ENV "TRACE_JSON_PART"
#define OUT_MAX 65536
#define CALLS_01 5
#define CALLS_02 4
#define CALLS_12 3
#define CALLS_20 6
#define SELF_CALLS 20
#define TENSOR_CALLS 3
#define BIG_BYTES 1000 /* the two tensors of each call: the first comes back */
#define SMALL_BYTES 40
#define BLOCKED_CALLS 6
#define BLOCKED_ARG 1500 /* bytes of string: two such frames fill a 4 KiB ring */
#define STOPPED_NS 100000000u
#define WAIT_NS 10000000000ull /* only stops a hang */

static char out[OUT_MAX];

/* Prints the file's contents as lines the checks below look for. */
static const char summary_py[] =
	"import collections, decimal, json, sys\n"
	"d = json.load(open(sys.argv[1]), parse_float=decimal.Decimal)\n"
	"n = collections.Counter()\n"
	"starts, ends, flows = {}, {}, {}\n"
	"for e in d['traceEvents']:\n"
	"    ph = e['ph']\n"
	"    if ph == 'M' and e['name'] == 'process_name':\n"
	"        print('process', e['pid'], e['args']['name'])\n"
	"    elif ph == 'X':\n"
	"        a = e['args']\n"
	"        n['X', e['cat'], e['pid'], a['peer']] += 1\n"
	"        n['X', e['cat']] += 1\n"
	"        n['status', e['cat'], e['pid'], a['status']] += 1\n"
	"        if a.get('at_once'):\n"
	"            n['at_once', e['pid'], a['peer']] += 1\n"
	"        if e['cat'] == 'tensors':\n"
	"            n['handoff', e['pid'], a['peer'], a['with'], a['tensors'], a['bytes']] += 1\n"
	"        starts[e['pid'], e['tid'], e['ts']] = e\n"
	"        ends[e['pid'], e['tid'], e['ts'] + e['dur']] = e\n"
	"    elif ph == 'i':\n"
	"        n['i', e['pid'], e['name'], e['args']['msg_id']] += 1\n"
	"        if e['args'].get('at_once'):\n"
	"            n['at_once', e['pid'], e['args']['peer']] += 1\n"
	"        n['i'] += 1\n"
	"    elif ph in ('s', 'f'):\n"
	"        flows.setdefault((e['name'], e['id']), []).append(e)\n"
	"def at(d, e):\n"
	"    return d.get((e['pid'], e['tid'], e['ts']))\n"
	"def handoff(name, s, f):\n"
	"    # tensors: pin to where the receiver took them (handler start for a\n"
	"    # request's, call end for a reply's); ack: from where it said so\n"
	"    # (handler end, call end) to the release\n"
	"    x = at(starts, s) if name == 'tensors' else at(ends, f)\n"
	"    if not x or x['cat'] != 'tensors' or f.get('bp') != 'e':\n"
	"        return None\n"
	"    req = x['args']['with'] == 'request'\n"
	"    r = f if name == 'tensors' else s\n"
	"    y = at(starts if req and name == 'tensors' else ends, r)\n"
	"    if (not y or y['cat'] != ('handlers' if req else 'calls') or\n"
	"            y['args']['msg_id'] != x['args']['msg_id'] or\n"
	"            y['pid'] != x['args']['peer'] or x['pid'] != y['args']['peer'] or\n"
	"            not x['ts'] <= r['ts'] <= x['ts'] + x['dur']):\n"
	"        return None\n"
	"    return x['pid'], y['pid'], x['args']['with']\n"
	"bad = 0\n"
	"for (name, i), v in flows.items():\n"
	"    s = [e for e in v if e['ph'] == 's']\n"
	"    f = [e for e in v if e['ph'] == 'f']\n"
	"    if len(s) != 1 or len(f) != 1 or name not in ('request', 'reply', 'tensors', 'ack'):\n"
	"        bad += 1\n"
	"        continue\n"
	"    s, f = s[0], f[0]\n"
	"    if name in ('tensors', 'ack'):\n"
	"        k = handoff(name, s, f)\n"
	"        if not k:\n"
	"            bad += 1\n"
	"        else:\n"
	"            n[('flow', name) + k] += 1\n"
	"        continue\n"
	"    if name == 'request':\n"
	"        c = starts.get((s['pid'], s['tid'], s['ts']))\n"
	"        h = starts.get((f['pid'], f['tid'], f['ts']))\n"
	"    else:\n"
	"        h = ends.get((s['pid'], s['tid'], s['ts']))\n"
	"        c = ends.get((f['pid'], f['tid'], f['ts']))\n"
	"    if (not c or not h or c['cat'] != 'calls' or h['cat'] != 'handlers' or\n"
	"            f.get('bp') != 'e' or c['args']['msg_id'] != h['args']['msg_id'] or\n"
	"            c['pid'] != h['args']['peer'] or h['pid'] != c['args']['peer'] or\n"
	"            not c['ts'] <= h['ts'] <= h['ts'] + h['dur'] <= c['ts'] + c['dur']):\n"
	"        bad += 1\n"
	"        continue\n"
	"    n['flow', name, c['pid'], h['pid']] += 1\n"
	"print('flows', len(flows), 'bad', bad)\n"
	"for k, v in n.items():\n"
	"    print(*k, v)\n"
	"o = d['otherData']\n"
	"print('records_per_worker', o['records_per_worker'])\n"
	"for w in o['workers']:\n"
	"    print('worker', w['rank'], w['name'], w['end'], w['records'], w['records_in_file'])\n"
	"    cs = w['complete_since_us']\n"
	"    ts = [e['ts'] for e in d['traceEvents'] if e['pid'] == w['rank'] and e['ph'] in 'Xi']\n"
	"    print('complete_since', w['rank'], 'null' if cs is None else\n"
	"          'oldest' if ts and cs == min(ts) else cs)\n";

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

static void call_add(int dst)
{
	shmrpc_value args[2] = { shmrpc_int(40), shmrpc_int(2) };
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_sync(dst, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->u.i == 42, "add on %d gave %lld", dst,
	      (long long)shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
}

/* Calls add on rank a[0], a[1] times: the nested calls rank 0 asks for. */
static int fn_fan(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)r, (void)u;
	for (int64_t i = 0; i < a[1].u.i; i++)
		call_add((int)a[0].u.i);
	return 0;
}

static int fn_die(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	raise(SIGKILL);
	return 0;
}

static void fan(int via, int dst, int calls)
{
	shmrpc_value args[2] = { shmrpc_int(dst), shmrpc_int(calls) };
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_sync(via, "fan", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
}

static int fn_sink(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_nil();
	return 0;
}

static shmrpc_tensor *tensor(int64_t bytes)
{
	static const DLDataType u8 = { kDLUInt, 8, 1 };
	shmrpc_tensor *t;

	CHECK_OK(shmrpc_tensor_alloc(u8, 1, &bytes, &t));
	return t;
}

static void tensor_calls(void)
{
	for (int i = 0; i < TENSOR_CALLS; i++) {
		shmrpc_tensor *big = tensor(BIG_BYTES), *small = tensor(SMALL_BYTES);
		shmrpc_value args[2] = { shmrpc_tensor_value(big), shmrpc_tensor_value(small) };
		shmrpc_future *f;

		CHECK_OK(shmrpc_rpc_sync(1, "copy_first", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->type == SHMRPC_TENSOR &&
		      shmrpc_tensor_nbytes(shmrpc_future_value(f)->u.t) == BIG_BYTES,
		      "the tensor did not come back");
		shmrpc_future_free(f);
		shmrpc_tensor_free(big);
		shmrpc_tensor_free(small);
	}
}

/* rank's records of kind in its ring now. */
static int count_records(const struct shm_seg *seg, uint32_t rank, uint32_t kind)
{
	static struct trace_entry e[SHM_TRACE_MAX];
	uint64_t head, dropped;
	size_t n = trace_read(seg, rank, SHM_TRACE_MAX, e, &head, &dropped);
	int found = 0;

	for (size_t i = 0; i < n; i++)
		found += e[i].kind == kind;
	return found;
}

/* Rank 1 stopped while rank 0 sends it more than its ring holds: the
 * sends that find no room wait until it goes on. */
static void blocked_calls(pid_t callee)
{
	static char text[BLOCKED_ARG + 1];
	shmrpc_value arg = shmrpc_strn(text, BLOCKED_ARG);
	shmrpc_future *f[BLOCKED_CALLS];
	struct tl_pause stop;

	memset(text, 'x', BLOCKED_ARG);
	tl_pause_begin(&stop, callee, STOPPED_NS);
	for (int i = 0; i < BLOCKED_CALLS; i++)
		CHECK_OK(shmrpc_rpc_async(1, "sink", &arg, 1, SHMRPC_TIMEOUT_DEFAULT, &f[i]));
	tl_pause_end(&stop);
	for (int i = 0; i < BLOCKED_CALLS; i++) {
		CHECK_OK(shmrpc_future_wait(f[i], -1));
		shmrpc_future_free(f[i]);
	}
}

/* Rank 0 of the tensors job: the handoffs, the waits, and how many waits
 * its own ring holds (BLOCKED=n on stdout), once rank 1's ring shows
 * every reply's tensors released by rank 0's ack. */
static void tensors_part(void)
{
	const char *fd = getenv(SHMRPC_ENV_JOB_FD);
	uint64_t deadline = shmrpc_now_ns() + WAIT_NS;
	struct shm_seg seg;
	int dup_fd;

	CHECK(fd, "no %s", SHMRPC_ENV_JOB_FD);
	dup_fd = fcntl(atoi(fd), F_DUPFD_CLOEXEC, 0); /* the agent keeps its own */
	CHECK(dup_fd >= 0, "dup(%s)", fd);
	CHECK_OK(shm_seg_attach_fd(&seg, dup_fd, true));
	tensor_calls();
	/* Acquire: the pid rank 1 stored (release) when it attached. */
	blocked_calls((pid_t)atomic_load_explicit(&shm_worker(&seg, 1)->pid, memory_order_acquire));
	while (count_records(&seg, 1, SHM_TRACE_UNPINNED) < TENSOR_CALLS) {
		CHECK(shmrpc_now_ns() < deadline, "rank 1's tensors were not released");
		usleep(1000);
	}
	printf("BLOCKED=%d\n", count_records(&seg, 0, SHM_TRACE_BLOCKED));
	fflush(stdout);
	shm_seg_detach(&seg);
}

static int worker(void)
{
	const char *part = getenv(PART_ENV);

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_register("fan", "ii", fn_fan, NULL));
	CHECK_OK(shmrpc_register("die", "", fn_die, NULL));
	tl_copy_register();
	CHECK_OK(shmrpc_register("sink", "s", fn_sink, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0 && !strcmp(part, "calls")) {
		for (int i = 0; i < CALLS_01; i++)
			call_add(1);
		for (int i = 0; i < CALLS_02; i++)
			call_add(2);
		fan(1, 2, CALLS_12);
		fan(2, 0, CALLS_20);
		for (int i = 0; i < SELF_CALLS; i++)
			call_add(0);
	} else if (shmrpc_rank() == 0 && !strcmp(part, "death")) {
		shmrpc_future *f;

		call_add(1);
		CHECK(shmrpc_rpc_sync(1, "die", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f) ==
		      -SHMRPC_EPEERDEAD, "the call to a worker that died: %s", shmrpc_errmsg());
	} else if (shmrpc_rank() == 0 && !strcmp(part, "tensors")) {
		tensors_part();
	}
	/* The others serve until rank 0 is done (or die in the second job). */
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

/* Runs the job of part with --trace path (and rings of ring_size bytes,
 * if not NULL), then the summary of the file into out; returns the
 * launcher's exit code. *blocked (if not NULL) gets the BLOCKED=n the job
 * said. */
static int traced_job(const char *part, const char *path, const char *on_failure,
		      const char *ring_size, int *blocked)
{
	const char *argv[] = { PYTHON, "-c", summary_py, path, NULL };
	const char *said;
	int rc;

	unlink(path);
	setenv(PART_ENV, part, 1);
	rc = tl_shmrun(out, sizeof(out), "-n", "3", "--trace-records", "64", "--trace", path,
		       on_failure, ring_size ? "--ring-size" : NULL, ring_size, NULL);
	CHECK(!strstr(out, "left in the RRef table"), "the job leaked RRefs");
	CHECK(!strstr(out, "cannot write the trace"), "the trace was not written");
	if (blocked)
		CHECK((said = strstr(out, "BLOCKED=")) && sscanf(said, "BLOCKED=%d", blocked) == 1,
		      "rank 0 did not say its waits: %s", out);
	CHECK(tl_run(out, sizeof(out), argv) == 0, "the trace of the %s job does not parse", part);
	unlink(path);
	return rc;
}

/* The summary holds line (the whole line). */
static void expect(const char *line)
{
	char key[256];
	const char *at = out;
	size_t len;

	len = (size_t)snprintf(key, sizeof(key), "%s\n", line);
	while ((at = strstr(at, key)) && at != out && at[-1] != '\n')
		at += len;
	CHECK(at, "the trace lacks \"%s\"", line);
}

static void expectf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void expectf(const char *fmt, ...)
{
	char line[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	expect(line);
}

/* The count on the summary's line that starts with prefix (0: none,
 * which the summary prints for nothing counted). */
static int count_of(const char *prefix)
{
	const char *at = out;
	int n = 0;

	while ((at = strstr(at, prefix)) && at != out && at[-1] != '\n')
		at++;
	if (at && sscanf(at + strlen(prefix), "%d", &n) != 1)
		n = 0;
	return n;
}

/* The requests rank served from peer that were run at once by the thread
 * that took them off the ring (one record for received and started; no
 * wait in the queue): which thread takes one is the machine's choice. */
static int at_once(int rank, int peer)
{
	char prefix[32];

	snprintf(prefix, sizeof(prefix), "at_once %d %d ", rank, peer);
	return count_of(prefix);
}

/* rank's requests from peer that waited in the queue, and those run at
 * once, are its handled calls. */
static void expect_queued(int rank, int peer, int calls)
{
	char prefix[32];
	int queued;

	snprintf(prefix, sizeof(prefix), "X queued %d %d ", rank, peer);
	queued = count_of(prefix);
	CHECK(queued + at_once(rank, peer) == calls, "rank %d served %d calls from %d: %d queued, "
	      "%d at once", rank, calls, peer, queued, at_once(rank, peer));
}

static int count_lines(const char *prefix)
{
	int n = 0;

	for (const char *at = out; (at = strstr(at, prefix)); at++)
		n += at == out || at[-1] == '\n';
	return n;
}

static void check_calls(void)
{
	int w0, w1, w2;

	expect("process 0 worker 0 (worker0)");
	expect("process 1 worker 1 (worker1)");
	expect("process 2 worker 2 (worker2)");
	CHECK(count_lines("process ") == 3, "%d process names", count_lines("process "));

	/* Every call's handler run, with the wait before it unless the
	 * thread that took the request ran it at once, where the callee's
	 * ring still holds it; rank 1 and 2's rings never wrap (24 and 36
	 * records at most), each fan call is one more handled. */
	expectf("X handlers 1 0 %d", CALLS_01 + 1);
	expectf("X handlers 2 0 %d", CALLS_02 + 1);
	expectf("X handlers 2 1 %d", CALLS_12);
	expect_queued(1, 0, CALLS_01 + 1);
	expect_queued(2, 0, CALLS_02 + 1);
	expect_queued(2, 1, CALLS_12);
	/* Rank 0 made 140 records, less those of rank 2's calls run at
	 * once; its ring holds the last 64 = 12 × 5 + 4: 12 calls to itself
	 * whole, and the last four records of the one before: received,
	 * started, finished (a wait and a handler run) and completed, whose
	 * sent is gone: unpaired. A call to itself from the main thread,
	 * which runs no requests, always waits in the queue. Rank 2's calls
	 * to rank 0 and rank 0's to the others are in their callers' rings
	 * only. */
	expect("X handlers 0 0 13");
	expect("X queued 0 0 13");
	CHECK(at_once(0, 0) == 0, "a call to itself from rank 0's main thread ran at once");
	expect("X calls 0 0 12");
	expectf("X handlers %d", CALLS_01 + CALLS_02 + CALLS_12 + 2 + 13);
	expectf("X queued %d", CALLS_01 + CALLS_02 + CALLS_12 + 2 + 13 - at_once(1, 0) -
		at_once(2, 0) - at_once(2, 1));
	expectf("X calls 1 2 %d", CALLS_12);
	expectf("X calls 2 0 %d", CALLS_20);
	expectf("X calls %d", CALLS_12 + CALLS_20 + 12);
	expect("status calls 0 ok 12");
	expect("i 1");
	CHECK(count_lines("i 0 completed SCRIPT_RET ") == 1, "no unpaired completion on rank 0");

	/* Two flows per call whose both sides are there, all well formed. */
	expectf("flows %d bad 0", 2 * (12 + CALLS_12));
	expect("flow request 0 0 12");
	expect("flow reply 0 0 12");
	expectf("flow request 1 2 %d", CALLS_12);
	expectf("flow reply 1 2 %d", CALLS_12);

	expect("records_per_worker 64");
	/* Rank 2's calls that rank 0 ran at once are out of its ring. */
	w0 = count_of("worker 0 worker0 exited 0 ");
	CHECK(w0 <= 2 * (CALLS_01 + CALLS_02 + 2) + 3 * CALLS_20 + 5 * SELF_CALLS &&
	      w0 >= 2 * (CALLS_01 + CALLS_02 + 2) + 2 * CALLS_20 + 5 * SELF_CALLS,
	      "rank 0 made %d records", w0);
	expectf("worker 0 worker0 exited 0 %d 64", w0);
	w1 = 3 * (CALLS_01 + 1) + 2 * CALLS_12 - at_once(1, 0);
	w2 = 3 * (CALLS_02 + 1 + CALLS_12) + 2 * CALLS_20 - at_once(2, 0) - at_once(2, 1);
	expectf("worker 1 worker1 exited 0 %d %d", w1, w1);
	expectf("worker 2 worker2 exited 0 %d %d", w2, w2);
	/* Rank 0's ring (one lane) wrapped: it holds every record from its
	 * oldest on; the others hold all they wrote. */
	expect("complete_since 0 oldest");
	expect("complete_since 1 null");
	expect("complete_since 2 null");
}

/* Rank 1 died inside "die": rank 0's call to it ended peer-dead, and
 * rank 1's handler was started (at once, or after its wait), never
 * finished. */
static void check_death(void)
{
	expectf("worker 1 worker1 killed by signal 9 (SIGKILL) %d %d", 5 - at_once(1, 0),
		5 - at_once(1, 0));
	expect("worker 0 worker0 exited 0 4 4");
	expect("X calls 0 1 2");
	expect("status calls 0 peer-dead 1");
	expect("X handlers 1 0 1");
	expect_queued(1, 0, 2);
	CHECK(count_lines("i 1 started SCRIPT_CALL ") + count_lines("i 1 recv+start SCRIPT_CALL ") ==
	      1, "the fatal call is not shown started");
	expect("i 1");
	expect("flows 2 bad 0");
	expect("worker 2 worker2 exited 0 0 0");
}

/* The handoffs, their flows and the waits of the tensors job. */
static void check_tensors(int blocked)
{
	/* Rank 0's requests pinned two tensors each, released by the reply;
	 * rank 1's replies one, released by rank 0's ack. */
	expectf("handoff 0 1 request 2 %d %d", BIG_BYTES + SMALL_BYTES, TENSOR_CALLS);
	expectf("handoff 1 0 reply 1 %d %d", BIG_BYTES, TENSOR_CALLS);
	expectf("status tensors 0 ok %d", TENSOR_CALLS);
	expectf("status tensors 1 ok %d", TENSOR_CALLS);
	expectf("flow tensors 0 1 request %d", TENSOR_CALLS);
	expectf("flow ack 0 1 request %d", TENSOR_CALLS);
	expectf("flow tensors 1 0 reply %d", TENSOR_CALLS);
	expectf("flow ack 1 0 reply %d", TENSOR_CALLS);
	expectf("flows %d bad 0", 2 * (TENSOR_CALLS + BLOCKED_CALLS) + 4 * TENSOR_CALLS);
	/* The first sends fill the ring; the rest waited while rank 1 was stopped. */
	CHECK(blocked >= 1 && blocked <= BLOCKED_CALLS, "rank 0 recorded %d waits", blocked);
	expectf("X blocked 0 1 %d", blocked);
	expectf("status blocked 0 ok %d", blocked);
	expectf("X blocked %d", blocked);
	CHECK(count_lines("i ") == 0, "a record left unpaired");
}

int main(void)
{
	char path[64];
	int rc, blocked;

	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK) || access(PYTHON, X_OK))
		return tl_skip("shmrun is not built or " PYTHON " is missing");
	snprintf(path, sizeof(path), "/tmp/shmrpc-trace-json-%d.json", (int)getpid());

	rc = traced_job("calls", path, "--on-failure=abort", NULL, NULL);
	CHECK(rc == 0, "the job exited %d", rc);
	check_calls();

	rc = traced_job("death", path, "--on-failure=continue", NULL, NULL);
	CHECK(rc == 1, "the job with a death exited %d, want 1", rc);
	check_death();

	rc = traced_job("tensors", path, "--on-failure=abort", "4096", &blocked);
	CHECK(rc == 0, "the tensors job exited %d", rc);
	check_tensors(blocked);

	/* A trace that cannot be written fails a job that succeeded. */
	setenv(PART_ENV, "idle", 1);
	rc = tl_shmrun(out, sizeof(out), "-n", "3", "--trace", "/nonexistent/dir/trace.json", NULL);
	CHECK(rc == 1, "a job whose trace cannot be written exited %d, want 1", rc);
	CHECK(strstr(out, "shmrun: cannot write the trace to /nonexistent/dir/trace.json: "
		      "No such file or directory"), "no message for the trace not written");

	CHECK(tl_wait_children(), "a child failed");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
