/*
 * bench/rpc: what an RPC costs. Runs itself under shmrun with 2 workers,
 * RUNS times per wait mode (spin first); rank 0 measures, rank 1 serves:
 *   BENCH rpc_sync mode=M median_ns= p99_ns= runs= min_run_ns= max_run_ns=
 *         spin_caught_pct= vs_floor= vs_torch= [vs_spin=]
 *   BENCH rpc_async mode=uring calls_per_s= vs_torch=
 *   BENCH rpc_echo size=S median_ns= p99_ns= vs_torch=
 *   BENCH flight_recorder mode=M records_per_call= ns_per_record= folds_per_call= ns_per_fold=
 *         rpc_sync_ns= overhead_pct= measured_pct= on_ns= off_ns= blocks=
 * The last one is the recorder's share of an empty rpc_sync (issue 23: at
 * most 5 %), two ways. overhead_pct estimates it: the records both workers
 * wrote per call (their lanes' heads), times what one record costs, timed
 * on a private ring in a lane of the thread's own as the calls' are, plus
 * the folds per call (a request's RECEIVED rewritten as RECEIVED_STARTED
 * by the thread that runs it at once: the callee's last records, counted
 * against its FINISHED ones) times what one costs on that ring, over the
 * call's median. measured_pct measures it, in the same job: `blocks`
 * blocks of calls with the recorder switched on and off in both workers
 * (trace_switch, as SHMRPC_TRACE=0 leaves it), alternated in pairs (on
 * first in even pairs, off first in odd ones); the median of the pairs'
 * ratios of block medians, less one. on_ns and off_ns are the medians of
 * the on and off blocks' medians. A difference of two jobs' medians would
 * drown in the noise; on a loaded machine the blocks' can too.
 * rpc_sync's median_ns is the median of the runs' medians, each run a job
 * of its own (a wait mode's state can differ from job to job: issue 23
 * saw the default mode at 0.84 µs in one run and 6.5 µs in the next), and
 * min_run_ns / max_run_ns the extremes; spin_caught_pct is the share of
 * the caller's hand-off spins that met the reply (worker_handoff_counts),
 * over the runs; vs_spin divides by spin mode's median. The other figures
 * come from each mode's first run.
 * vs_floor divides by the raw wake-up ping-pong of the same mode and
 * vs_torch compares with torch.distributed.rpc doing the same; both peers
 * are measured in the same `make bench` run (bench/run.sh passes their
 * BENCH lines in the file named by SHMRPC_BENCH_PEERS). -q: fewer calls.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shmrpc.h"
#include "bench/bench.h"
#include "worker/link.h"
#include "worker/trace.h"

static int nothing(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	return 0;
}

static int echo(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = a[0];
	return 0;
}

static void die(const char *what)
{
	fprintf(stderr, "bench/rpc: %s: %s\n", what, shmrpc_errmsg());
	exit(1);
}

/* Median and p99 of n rpc_sync calls of fn with one argument (or none). */
static void timed_sync(const char *fn, const shmrpc_value *arg, int n, uint64_t *med, uint64_t *p99)
{
	uint64_t *t = malloc((size_t)n * sizeof(*t));
	shmrpc_future *f;

	for (int i = 0; i < n; i++) {
		uint64_t t0 = shmrpc_now_ns();

		if (shmrpc_rpc_sync(1, fn, arg, arg ? 1 : 0, SHMRPC_TIMEOUT_DEFAULT, &f))
			die(fn);
		t[i] = shmrpc_now_ns() - t0;
		shmrpc_future_free(f);
	}
	*med = bench_median(t, n);
	*p99 = t[(size_t)n * 99 / 100];
	free(t);
}

/* Records claimed so far by both workers (counted after the calls
 * returned, whose replies ordered the callee's records before). */
static uint64_t records_written(void)
{
	const struct shm_seg *seg = &worker_agent->seg;

	return trace_claimed(seg, 0) + trace_claimed(seg, 1);
}

/* The callee's requests run at once (their RECEIVED folded into
 * RECEIVED_STARTED) per request it answered, among its last records. */
static double folds_per_call(void)
{
	const struct shm_seg *seg = &worker_agent->seg;
	struct trace_entry *e = malloc(seg->trace_records * sizeof(*e));
	uint64_t head, dropped, folded = 0, finished = 0;
	size_t n;

	if (!e)
		die("malloc");
	n = trace_read(seg, 1, seg->trace_records, e, &head, &dropped);
	for (size_t i = 0; i < n; i++) {
		folded += e[i].kind == SHM_TRACE_RECEIVED_STARTED;
		finished += e[i].kind == SHM_TRACE_FINISHED;
	}
	free(e);
	return finished ? (double)folded / (double)finished : 0.0;
}

/* What one record costs, and one fold, on a ring like a worker's but this
 * bench's own, in a lane of this thread's. */
static void ns_per_record(double *record, double *fold)
{
	enum { RECS = 4096, N = 1000000 };
	size_t bytes = shm_trace_lanes(RECS) * sizeof(struct shm_trace_ctl) +
		       RECS * sizeof(struct shm_trace_rec);
	struct shm_trace_ctl *ctl = aligned_alloc(64, bytes);
	uint64_t info = SHM_TRACE_INFO(SHM_TRACE_RECEIVED_STARTED, SHM_TRACE_OK, 1, 1, 16);
	struct trace_self t;
	struct trace_mark at;
	uint64_t t0;

	if (!ctl)
		die("malloc");
	memset(ctl, 0, bytes);
	trace_ring_init(&t, ctl, RECS, worker_agent->seg.trace_clock == SHM_TRACE_CLOCK_TICKS);
	t0 = shmrpc_now_ns();
	for (uint64_t i = 0; i < N; i++)
		trace_put_to(&t, i, SHM_TRACE_INFO(SHM_TRACE_SENT, SHM_TRACE_OK, 1, 1, 16), &at);
	*record = (double)(shmrpc_now_ns() - t0) / N;
	/* The newest record, folded again and again: each time the whole
	 * rewrite (it stays this thread's newest). */
	t0 = shmrpc_now_ns();
	for (uint64_t i = 0; i < N; i++)
		if (!trace_fold_to(&t, &at, info))
			die("a fold of the newest record");
	*fold = (double)(shmrpc_now_ns() - t0) / N;
	free(ctl);
}

/* One run's rpc_sync figures, a line of the file named by
 * BENCH_RUNS_ENV, which the parent reads back after the mode's runs. */
#define BENCH_RUNS_ENV "SHMRPC_BENCH_RPC_RUNS"
#define RUN_FMT "%llu %llu %llu %llu\n" /* median, p99, spins met, spins missed */

/* "recorder": switches rank 1's recorder as its argument says. */
static int recorder(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)r, (void)u;
	trace_switch(a[0].u.i != 0);
	return 0;
}

static void switch_both(bool on)
{
	shmrpc_value v = shmrpc_int(on);
	shmrpc_future *f;

	trace_switch(on);
	if (shmrpc_rpc_sync(1, "recorder", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
		die("recorder");
	shmrpc_future_free(f);
}

/* mode's flight_recorder line: the estimate from per_call records and
 * folds folds a call and med, the calls' median; then the measure,
 * blocks of n calls each. */
static void recorder_figures(const char *mode, double per_call, double folds, uint64_t med, int n)
{
	enum { BLOCKS = 20 };
	uint64_t on[BLOCKS / 2], off[BLOCKS / 2], ratio[BLOCKS / 2], m, p99;
	double per_rec, per_fold;

	for (int b = 0; b < BLOCKS; b++) {
		/* on, off; off, on; ...: neither goes first more often. */
		bool is_on = (b % 2 == 0) == (b / 2 % 2 == 0);

		switch_both(is_on);
		timed_sync("nothing", NULL, n, &m, &p99);
		(is_on ? on : off)[b / 2] = m;
	}
	switch_both(true);
	/* After the blocks: writing the private ring takes this thread a lane
	 * of it, and its next record in the worker's ring another lane there
	 * (worker/trace.c, my_lane), which would leave the blocks fewer own
	 * lanes than the job has writing threads. */
	ns_per_record(&per_rec, &per_fold);
	for (int k = 0; k < BLOCKS / 2; k++)
		ratio[k] = on[k] * 1000000u / (off[k] ? off[k] : 1); /* parts per million */
	printf("BENCH flight_recorder mode=%s records_per_call=%.2f ns_per_record=%.1f "
	       "folds_per_call=%.2f ns_per_fold=%.1f rpc_sync_ns=%llu overhead_pct=%.2f "
	       "measured_pct=%.2f on_ns=%llu off_ns=%llu blocks=%d\n", mode, per_call, per_rec,
	       folds, per_fold, (unsigned long long)med,
	       100.0 * (per_call * per_rec + folds * per_fold) / (double)med,
	       ((double)bench_median(ratio, BLOCKS / 2) - 1e6) / 1e4,
	       (unsigned long long)bench_median(on, BLOCKS / 2),
	       (unsigned long long)bench_median(off, BLOCKS / 2), BLOCKS);
}

static void measure(const char *mode, bool quick)
{
	int n = quick ? 2000 : 50000;
	uint64_t med, p99, t0, recs, met0, missed0, met, missed;
	const char *runs = getenv(BENCH_RUNS_ENV);
	FILE *out;

	timed_sync("nothing", NULL, n / 10, &med, &p99); /* warm-up */
	recs = records_written();
	worker_handoff_counts(&met0, &missed0);
	timed_sync("nothing", NULL, n, &med, &p99);
	worker_handoff_counts(&met, &missed);
	recs = records_written() - recs;
	if (!runs || !(out = fopen(runs, "a")))
		die("the runs' file (" BENCH_RUNS_ENV ")");
	fprintf(out, RUN_FMT, (unsigned long long)med, (unsigned long long)p99,
		(unsigned long long)(met - met0), (unsigned long long)(missed - missed0));
	fclose(out);
	if (strcmp(getenv("SHMRPC_BENCH_RUN"), "0"))
		return; /* the other figures: the first run's */
	/* The callee's ring still ends with these calls' records. */
	recorder_figures(mode, (double)recs / n, folds_per_call(), med, quick ? n / 2 : n / 5);
	if (strcmp(mode, "uring"))
		return;

	{
		int calls = quick ? 20000 : 200000;
		shmrpc_future **f = malloc((size_t)calls * sizeof(*f));
		double per_s;

		t0 = shmrpc_now_ns();
		for (int i = 0; i < calls; i++)
			if (shmrpc_rpc_async(1, "nothing", NULL, 0, SHMRPC_TIMEOUT_NONE, &f[i]))
				die("rpc_async");
		for (int i = 0; i < calls; i++) {
			if (shmrpc_future_wait(f[i], -1))
				die("rpc_async wait");
			shmrpc_future_free(f[i]);
		}
		per_s = calls * 1e9 / (double)(shmrpc_now_ns() - t0);
		free(f);
		printf("BENCH rpc_async mode=uring calls_per_s=%.0f", per_s);
		/* Higher is better here: the ratio says how many times torch's rate. */
		bench_ratio("vs_torch", per_s, bench_peer("torch_rpc_async", NULL, "calls_per_s"));
		printf("\n");
	}
	for (uint32_t size = 1024; size <= (1u << 20); size *= 1024) {
		void *buf = calloc(1, size);
		shmrpc_value v = shmrpc_bytes(buf, size);
		char sz[32];

		snprintf(sz, sizeof(sz), "size=%u ", size);
		timed_sync("echo", &v, size > 4096 ? n / 20 : n / 2, &med, &p99);
		printf("BENCH rpc_echo size=%u median_ns=%llu p99_ns=%llu MB_per_s=%.0f", size,
		       (unsigned long long)med, (unsigned long long)p99, 2.0 * size * 1e3 / (double)med);
		bench_ratio("vs_torch", (double)med, bench_peer("torch_rpc_echo", sz, "median_ns"));
		printf("\n");
		free(buf);
	}
}

static int worker(bool quick)
{
	const char *mode = getenv("SHMRPC_WAIT");

	if (shmrpc_register("nothing", "", nothing, NULL) || shmrpc_register("echo", "y", echo, NULL) ||
	    shmrpc_register("recorder", "i", recorder, NULL))
		die("register");
	if (shmrpc_init(NULL))
		die("init");
	if (shmrpc_rank() == 0)
		measure(mode ? mode : "uring", quick);
	fflush(stdout);
	if (shmrpc_shutdown(1, 60000))
		die("shutdown");
	return 0;
}

/* Prints mode's rpc_sync line from its runs' lines in path (and empties
 * it); the median of the medians, which it returns (0: no run). */
static uint64_t report_runs(const char *mode, const char *path, uint64_t spin_ns)
{
	enum { MAX_RUNS = 16 };
	unsigned long long med[MAX_RUNS], p99[MAX_RUNS], m, x, all_met = 0, all_missed = 0;
	uint64_t sorted[MAX_RUNS], mid;
	int n = 0, at = 0;
	char filter[32];
	FILE *f = fopen(path, "r+");

	if (!f)
		return 0;
	while (n < MAX_RUNS && fscanf(f, RUN_FMT, &med[n], &p99[n], &m, &x) == 4) {
		sorted[n] = med[n];
		all_met += m;
		all_missed += x;
		n++;
	}
	if (ftruncate(fileno(f), 0))
		n = 0;
	fclose(f);
	if (!n)
		return 0;
	mid = bench_median(sorted, n);
	for (int i = 0; i < n; i++)
		if (med[i] == mid)
			at = i; /* its p99 goes with it */
	snprintf(filter, sizeof(filter), "mode=%s ", mode);
	printf("BENCH rpc_sync mode=%s median_ns=%llu p99_ns=%llu runs=%d min_run_ns=%llu "
	       "max_run_ns=%llu spin_caught_pct=%.1f", mode, (unsigned long long)mid, p99[at], n,
	       (unsigned long long)sorted[0], (unsigned long long)sorted[n - 1],
	       all_met + all_missed ? 100.0 * (double)all_met / (double)(all_met + all_missed)
				    : 0.0);
	bench_ratio("vs_floor", (double)mid, bench_peer("floor", filter, "median_ns"));
	bench_ratio("vs_torch", (double)mid, bench_peer("torch_rpc_sync", NULL, "median_ns"));
	if (strcmp(mode, "spin"))
		bench_ratio("vs_spin", (double)mid, (double)spin_ns);
	printf("\n");
	fflush(stdout);
	return mid;
}

int main(int argc, char **argv)
{
	/* Spin mode first: the others' lines divide by it. */
	static const char *const modes[] = { "spin", "uring", "futex" };
	bool quick = argc > 1 && strcmp(argv[1], "-q") == 0;
	int runs = quick ? 3 : 5;
	char path[] = "/tmp/shmrpc-bench-rpc.XXXXXX";
	uint64_t spin_ns = 0, mid;
	int fd, rc = 0;

	if (getenv("SHMRPC_RANK"))
		return worker(quick);
	if ((fd = mkstemp(path)) < 0) {
		perror("bench/rpc: mkstemp");
		return 1;
	}
	close(fd);
	setenv(BENCH_RUNS_ENV, path, 1);
	for (int m = 0; m < 3 && !rc; m++) {
		for (int r = 0; r < runs && !rc; r++) {
			char opts[128], run[16];

			snprintf(run, sizeof(run), "%d", r);
			setenv("SHMRPC_BENCH_RUN", run, 1);
			/* 4 MiB rings carry the 1 MiB echo (a frame is at most half a ring). */
			snprintf(opts, sizeof(opts), "-n 2 --quiet --ring-size 4194304 --wait=%s",
				 modes[m]);
			rc = bench_run_self(opts, quick);
		}
		mid = report_runs(modes[m], path, spin_ns);
		if (m == 0)
			spin_ns = mid;
	}
	unlink(path);
	return rc;
}
