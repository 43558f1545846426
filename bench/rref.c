/*
 * bench/rref: what an RRef costs. Runs itself under shmrun with 2 workers;
 * rank 0 measures, rank 1 owns the values:
 *   BENCH rref_remote_to_here value=empty median_ns= p99_ns= rpc_sync_ns= vs_rpc_sync= vs_torch=
 *   BENCH rref_remote_to_here value=1MiB_tensor (the same fields)
 *   BENCH rref_proxy_rpc_sync (the same fields)
 *   BENCH rref_remote_to_here value=empty mode=spin (the same fields)
 *   BENCH rref_remote_to_here value=empty mode=futex (the same fields)
 *   BENCH rref_remote_to_here value=empty fetch=message (the same fields)
 * remote_to_here is shmrpc_remote + shmrpc_rref_to_here + shmrpc_rref_free
 * of a function returning nil, or a 1 MiB float32 tensor made once in the
 * pool on rank 1 (a new handle to it each time; torch's peer returns a
 * tensor made once too, so neither measures making it). The proxy is
 * shmrpc_rref_rpc_sync on an RRef to an int held on rank 1. Each is timed
 * alternating with rpc_sync of the empty function (rpc_sync_ns, its
 * median); vs_rpc_sync divides by it (the target is at most 2). vs_torch
 * divides by torch.distributed.rpc doing the same (bench/torch_rref.py,
 * measured earlier in the same `make bench` run and passed in the file
 * named by SHMRPC_BENCH_PEERS; the target is at most 1/200). mode=spin is
 * a second job in spin mode (shmrun --wait=spin: threads spin at their
 * hand-offs without bound, and a waiting caller polls the rings), mode=futex
 * a third in the futex mode (issue 23's target, at most 1.5, is for every
 * wait mode; the first job runs the default, uring). The last line
 * is a fourth job with SHMRPC_RREF_FETCH=message, where to_here() asks the
 * owner instead of reading the shared RRef table, so that the table's
 * saving shows. -q: fewer round trips.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "bench/bench.h"

#define ONES_LEN 262144 /* float32: 1 MiB */

static void die(const char *what)
{
	fprintf(stderr, "bench/rref: %s: %s\n", what, shmrpc_errmsg());
	exit(1);
}

/* ---- rank 1: the owner ---- */

static int empty(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	return 0;
}

static int seven(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(7);
	return 0;
}

/* get(value): the proxy's target, the RRef's value as it is. */
static int get(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = a[0];
	return 0;
}

/* Made by the first call (a warm-up one); kept until the process ends,
 * when the launcher's sweep drops its pool reference. */
static shmrpc_tensor *ones;
static pthread_once_t ones_once = PTHREAD_ONCE_INIT;

static void make_ones(void)
{
	const int64_t shape[1] = { ONES_LEN };
	shmrpc_tensor *t;

	if (shmrpc_tensor_alloc((DLDataType){ kDLFloat, 32, 1 }, 1, shape, &t))
		return;
	for (int i = 0; i < ONES_LEN; i++)
		((float *)shmrpc_tensor_data(t))[i] = 1.0f;
	ones = t;
}

static int tensor(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_tensor *t;

	(void)a, (void)n, (void)u;
	pthread_once(&ones_once, make_ones);
	if (!ones)
		return shmrpc_call_error(c, "RuntimeError", "the 1 MiB tensor could not be made");
	if (shmrpc_tensor_retain(ones, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	*r = shmrpc_tensor_value(t);
	return 0;
}

/* ---- rank 0: the measures ---- */

enum how { RPC_SYNC, REMOTE_TO_HERE, PROXY };

struct op {
	enum how how;
	const char *fn;    /* on rank 1 (PROXY: through box) */
	uint32_t type;     /* what it gives back */
	shmrpc_rref *box;  /* PROXY: the RRef */
};

/* Checks what came back, so that a bench of failing calls cannot pass. */
static void check(const struct op *op, const shmrpc_value *v)
{
	if (v->type != op->type || (v->type == SHMRPC_TENSOR &&
				    (shmrpc_tensor_nbytes(v->u.t) != ONES_LEN * sizeof(float) ||
				     *(const float *)shmrpc_tensor_data(v->u.t) != 1.0f)) ||
	    (v->type == SHMRPC_INT && v->u.i != 7)) {
		fprintf(stderr, "bench/rref: %s gave a wrong %s\n", op->fn, shmrpc_type_name(v->type));
		exit(1);
	}
}

static void once(const struct op *op)
{
	shmrpc_future *f = NULL;
	shmrpc_rref *r = NULL;
	int rc;

	switch (op->how) {
	case RPC_SYNC:
		rc = shmrpc_rpc_sync(1, op->fn, NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f);
		break;
	case REMOTE_TO_HERE:
		rc = shmrpc_remote(1, op->fn, NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &r) ?:
		     shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f);
		break;
	default:
		rc = shmrpc_rref_rpc_sync(op->box, op->fn, NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f);
		break;
	}
	if (rc)
		die(op->fn);
	check(op, shmrpc_future_value(f));
	shmrpc_future_free(f);
	if (r)
		shmrpc_rref_free(r);
}

/* One timed run of op; stored in t[i] unless it warms up (i < 0). */
static void time_one(const struct op *op, uint64_t *t, int i)
{
	uint64_t t0 = shmrpc_now_ns();

	once(op);
	if (i >= 0)
		t[i] = shmrpc_now_ns() - t0;
}

/*
 * Median (and *p99) of n runs of op, after n/10 to warm up, in blocks that
 * alternate with as many runs of base, whose median goes to *base_med: on
 * a shared machine the load moves from one second to the next, and both
 * see the same. Blocks rather than pairs, so that the work an rref_free
 * leaves to the agents is not counted in base.
 */
static uint64_t timed(const struct op *op, const struct op *base, int n, uint64_t *p99,
		      uint64_t *base_med)
{
	enum { BLOCK = 50 };
	uint64_t *t = malloc((size_t)n * 2 * sizeof(*t)), *tb = t + n, med;

	if (!t)
		die("malloc");
	for (int b = -n / 10; b < n; b += BLOCK) {
		for (int i = b; i < b + BLOCK && i < n; i++)
			time_one(base, tb, i);
		for (int i = b; i < b + BLOCK && i < n; i++)
			time_one(op, t, i);
	}
	med = bench_median(t, n);
	*p99 = t[(size_t)n * 99 / 100];
	*base_med = bench_median(tb, n);
	free(t);
	return med;
}

/* "BENCH what median_ns= p99_ns= rpc_sync_ns= vs_rpc_sync= vs_torch=" for
 * op; the torch figure is the median on the peer line `peer` holding
 * `filter`. */
static void report(const char *what, const struct op *op, int n, const char *peer,
		   const char *filter)
{
	const struct op sync = { RPC_SYNC, "empty", SHMRPC_NIL, NULL };
	uint64_t p99, base, med = timed(op, &sync, n, &p99, &base);

	printf("BENCH %s median_ns=%llu p99_ns=%llu rpc_sync_ns=%llu", what,
	       (unsigned long long)med, (unsigned long long)p99, (unsigned long long)base);
	bench_ratio("vs_rpc_sync", (double)med, (double)base);
	bench_ratio("vs_torch", (double)med, bench_peer(peer, filter, "median_ns"));
	printf("\n");
	fflush(stdout);
}

/* mode: the job's forced wait mode, NULL for the default. */
static void measure(bool by_message, const char *mode, bool quick)
{
	const struct op empty_op = { REMOTE_TO_HERE, "empty", SHMRPC_NIL, NULL };
	int n = quick ? 1000 : 10000;
	char what[96];

	if (by_message || mode) {
		snprintf(what, sizeof(what), "rref_remote_to_here value=empty %s%s",
			 by_message ? "fetch=message" : "mode=", by_message ? "" : mode);
		report(what, &empty_op, n, "torch_rref_remote_to_here", "value=empty ");
		return;
	}
	report("rref_remote_to_here value=empty", &empty_op, n, "torch_rref_remote_to_here",
	       "value=empty ");
	{
		const struct op op = { REMOTE_TO_HERE, "tensor", SHMRPC_TENSOR, NULL };

		report("rref_remote_to_here value=1MiB_tensor", &op, n / 4,
		       "torch_rref_remote_to_here", "value=1MiB_tensor ");
	}
	{
		struct op op = { PROXY, "get", SHMRPC_INT, NULL };

		if (shmrpc_remote(1, "seven", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &op.box))
			die("remote");
		report("rref_proxy_rpc_sync", &op, n, "torch_rref_proxy_rpc_sync", NULL);
		shmrpc_rref_free(op.box);
	}
}

static int worker(bool quick)
{
	const char *fetch = getenv("SHMRPC_RREF_FETCH"), *mode = getenv("SHMRPC_WAIT");

	if (shmrpc_register("empty", "", empty, NULL) || shmrpc_register("seven", "", seven, NULL) ||
	    shmrpc_register("get", "i", get, NULL) || shmrpc_register("tensor", "", tensor, NULL))
		die("register");
	if (shmrpc_init(NULL))
		die("init");
	if (shmrpc_rank() == 0)
		measure(fetch && !strcmp(fetch, "message"), mode, quick);
	fflush(stdout);
	if (shmrpc_shutdown(1, 60000))
		die("shutdown");
	return 0;
}

int main(int argc, char **argv)
{
	bool quick = argc > 1 && strcmp(argv[1], "-q") == 0;

	if (getenv("SHMRPC_RANK"))
		return worker(quick);
	unsetenv("SHMRPC_RREF_FETCH"); /* the first job reads the table */
	unsetenv("SHMRPC_WAIT");       /* ... in the default wait mode */
	if (bench_run_self("-n 2 --quiet", quick))
		return 1;
	/* The second job spins at its hand-offs (rpc_sync there is too). */
	if (bench_run_self("-n 2 --quiet --wait=spin", quick))
		return 1;
	if (bench_run_self("-n 2 --quiet --wait=futex", quick))
		return 1;
	/* The workers inherit it: to_here() by message for the last job. */
	setenv("SHMRPC_RREF_FETCH", "message", 1);
	return bench_run_self("-n 2 --quiet", quick);
}
