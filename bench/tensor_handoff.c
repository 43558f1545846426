/*
 * bench/tensor_handoff: a CPU tensor of 1 KiB, 1 MiB, 64 MiB and 1 GiB
 * sent to another worker and back (rpc_sync of a function returning its
 * argument), under shmrun with 2 workers:
 *   BENCH tensor_handoff size=S median_ns= spin_caught_pct= vs_torch_rpc= vs_torch_mp=
 *   BENCH tensor_handoff ratio_1GiB_vs_1KiB=
 * spin_caught_pct: the share of the caller's hand-off spins that met the
 * reply (worker_handoff_counts): nothing in an echo touches the bytes, so a
 * size whose figure is far above the others' with a low share here lost
 * to the wait, not to the size (issue 23 saw 1.7 µs at 1 KiB, 6.4 µs at
 * 64 MiB: about the 6.5 µs of its slow default-mode rpc_sync).
 * The peers (bench/torch_tensor.py: torch.distributed.rpc and a
 * torch.multiprocessing queue moving the same tensors) are measured in the
 * same `make bench` run. -q: fewer round trips.
 *
 * Where CUDA is available, the same echo of a device tensor (cuMemAlloc'd
 * on device 0, handed over by CUDA IPC), warm: the callee keeps the
 * allocation mapped between calls, so only the first call opens it:
 *   BENCH tensor_handoff device=cuda size=S median_ns= opens= cache_hits=
 *         vs_torch_rpc= vs_torch_mp=
 *   BENCH tensor_handoff device=cuda ratio_1GiB_vs_1MiB=
 * opens and cache_hits are the callee's (cuda_stats) over the whole run;
 * the peers are bench/torch_tensor.py's CUDA lines, where its torch has
 * CUDA (rpc with a device map; the queue's handoff and an ack).
 * The target: 1 GiB warm echo at most 20 µs on the H100 box.
 * Without CUDA those lines are left out, with a note on stderr.
 *
 * Small tensors, inline against the pool (docs/ARCHITECTURE.md, where the
 * inline threshold comes from): the echo of a user's tensor in memory of
 * its own (as a plain torch tensor), taken afresh for each send as a
 * program sends it, with one copy either way: inline
 * (shmrpc_tensor_from_dlpack into this process's memory, its bytes in the
 * frame both ways; this bench raises SHMRPC_INLINE_MAX and the ring size
 * so that every size here goes inline) or by the pool (what from_dlpack
 * did before: a block, the copy, pinned and acknowledged):
 *   BENCH tensor_handoff path=pool size=S median_ns=
 *   BENCH tensor_handoff path=inline size=S median_ns= vs_pool=
 * vs_pool below 1: inline is cheaper at that size.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shmrpc.h"
#include "bench/bench.h"
#include "worker/cuda.h"
#include "worker/link.h"

static int echo(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = a[0];
	return 0;
}

static void die(const char *what)
{
	fprintf(stderr, "bench/tensor_handoff: %s: %s\n", what, shmrpc_errmsg());
	exit(1);
}

/* The callee's CUDA counters: opens << 32 | cache_hits. */
static int cuda_counts(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
		       void *u)
{
	struct cuda_stats st;

	(void)c, (void)a, (void)n, (void)u;
	cuda_stats_get(&st);
	*r = shmrpc_int((int64_t)(st.opens << 32 | (st.cache_hits & 0xffffffffu)));
	return 0;
}

/* Round trips of n echoes of x into t (the first tenth and one more untimed). */
static void echo_times(shmrpc_tensor *x, int n, uint64_t *t)
{
	shmrpc_value v = shmrpc_tensor_value(x);
	shmrpc_future *f;

	for (int i = -n / 10 - 1; i < n; i++) { /* the first ones warm up */
		uint64_t t0 = shmrpc_now_ns();

		if (shmrpc_rpc_sync(1, "echo", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
			die("echo");
		if (i >= 0)
			t[i] = shmrpc_now_ns() - t0;
		shmrpc_future_free(f);
	}
}

/* Median round trip of n echoes of x. */
static uint64_t echo_median(shmrpc_tensor *x, int n)
{
	uint64_t *t = malloc((size_t)n * sizeof(*t)), med;

	if (!t)
		die("malloc");
	echo_times(x, n, t);
	med = bench_median(t, n);
	free(t);
	return med;
}

/* The user's tensor, in memory of its own (a plain torch tensor's). */
struct plain {
	DLManagedTensor m;
	int64_t shape[1];
};

/* One send of the user's plain tensor p, as shmrpc_tensor_from_dlpack
 * takes it (one copy of its bytes, into the pool or, inline, our memory):
 * pool forces the pool, with the copy from_dlpack would make. */
static shmrpc_tensor *take_plain(struct plain *p, bool pool)
{
	shmrpc_tensor *t;

	if (pool) {
		if (shmrpc_tensor_alloc(p->m.dl_tensor.dtype, 1, p->shape, &t))
			die("alloc");
		memcpy(shmrpc_tensor_data(t), p->m.dl_tensor.data, (size_t)p->shape[0]);
		return t;
	}
	/* No deleter: the bytes stay the user's for the next send. */
	if (shmrpc_tensor_from_dlpack(&p->m, &t))
		die("a tensor from DLPack");
	if (shmrpc_tensor_pool_offset(t) != UINT64_MAX) {
		fprintf(stderr, "bench/tensor_handoff: a %llu-byte tensor went to the pool, not "
			"inline\n", (unsigned long long)p->shape[0]);
		exit(1);
	}
	return t;
}

/* Round trips of n sends of p into t, each taking it afresh. */
static void plain_times(struct plain *p, bool pool, int n, uint64_t *t)
{
	for (int i = -n / 10 - 1; i < n; i++) { /* the first ones warm up */
		uint64_t t0 = shmrpc_now_ns();
		shmrpc_tensor *x = take_plain(p, pool);
		shmrpc_value v = shmrpc_tensor_value(x);
		shmrpc_future *f;

		if (shmrpc_rpc_sync(1, "echo", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
			die("echo");
		shmrpc_future_free(f);
		shmrpc_tensor_free(x);
		if (i >= 0)
			t[i] = shmrpc_now_ns() - t0;
	}
}

/* Both paths measured in turns (ROUNDS of each), so that the machine's
 * noise falls on both alike. */
#define ROUNDS 10

static void measure_inline(bool quick)
{
	static const uint64_t sizes[] = { 16, 1u << 10, 2u << 10, 4u << 10, 8u << 10, 16u << 10,
					  64u << 10 };
	const int per = quick ? 50 : 500;
	uint64_t *tp = malloc(ROUNDS * per * sizeof(*tp)), *ti = malloc(ROUNDS * per * sizeof(*ti));

	if (!tp || !ti)
		die("malloc");
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		struct plain p = { .shape = { (int64_t)sizes[i] } };
		uint64_t pool, inl;

		p.m.dl_tensor = (DLTensor){ .data = calloc(1, sizes[i]), .device = { kDLCPU, 0 },
					    .ndim = 1, .dtype = { kDLUInt, 8, 1 }, .shape = p.shape };
		if (!p.m.dl_tensor.data)
			die("calloc");
		for (int r = 0; r < ROUNDS; r++) {
			plain_times(&p, true, per, tp + r * per);
			plain_times(&p, false, per, ti + r * per);
		}
		pool = bench_median(tp, ROUNDS * per);
		inl = bench_median(ti, ROUNDS * per);
		free(p.m.dl_tensor.data);
		printf("BENCH tensor_handoff path=pool size=%llu median_ns=%llu\n",
		       (unsigned long long)sizes[i], (unsigned long long)pool);
		printf("BENCH tensor_handoff path=inline size=%llu median_ns=%llu vs_pool=%.3g\n",
		       (unsigned long long)sizes[i], (unsigned long long)inl,
		       (double)inl / (double)pool);
	}
	free(tp);
	free(ti);
}

/* Round trips of n echoes of x into t; *met and *missed grow by our
 * hand-off spins meanwhile that met the reply and that did not. */
static void handoff_times(shmrpc_tensor *x, int n, uint64_t *t, uint64_t *met, uint64_t *missed)
{
	uint64_t met0, missed0, met1, missed1;

	worker_handoff_counts(&met0, &missed0);
	echo_times(x, n, t);
	worker_handoff_counts(&met1, &missed1);
	*met += met1 - met0;
	*missed += missed1 - missed0;
}

/* ---- device tensors ---- */

struct dev_tensor {
	DLManagedTensor m;
	int64_t shape[1];
};

static int (*cu_free)(uint64_t p);
static int (*cu_push)(void *ctx), (*cu_pop)(void **ctx);
static void *dev_ctx; /* device 0's primary context */

/* The driver frees in a current context only, and the deleter runs on
 * whichever thread releases the tensor (an executor's, often). */
static void dev_delete(DLManagedTensor *m)
{
	void *was;

	if (cu_push(dev_ctx) == 0) {
		cu_free((uint64_t)(uintptr_t)m->dl_tensor.data);
		cu_pop(&was);
	}
	free(m);
}

/* A device tensor of size bytes on device 0, or NULL (with why on stderr). */
static shmrpc_tensor *dev_tensor(uint64_t size)
{
	int (*alloc)(uint64_t *p, size_t n) = cuda_sym("cuMemAlloc_v2");
	struct dev_tensor *d = calloc(1, sizeof(*d));
	shmrpc_tensor *t;
	uint64_t p;
	int rc;

	if (!d || (rc = alloc(&p, size)) != 0) {
		fprintf(stderr, "bench/tensor_handoff: no %llu bytes on the GPU (cuMemAlloc %d): "
			"that size is left out\n", (unsigned long long)size, d ? rc : -1);
		free(d);
		return NULL;
	}
	d->shape[0] = (int64_t)size;
	d->m.dl_tensor = (DLTensor){ .data = (void *)(uintptr_t)p, .device = { kDLCUDA, 0 },
				     .ndim = 1, .dtype = { kDLUInt, 8, 1 }, .shape = d->shape };
	d->m.deleter = dev_delete;
	if (shmrpc_tensor_from_dlpack(&d->m, &t))
		die("a device tensor from DLPack");
	return t;
}

static void measure_cuda(bool quick)
{
	static const uint64_t sizes[] = { 1u << 20, 64u << 20, 1u << 30 };
	int (*retain)(void **ctx, int dev) = cuda_sym("cuDevicePrimaryCtxRetain");
	int (*set)(void *ctx) = cuda_sym("cuCtxSetCurrent");
	uint64_t med[3] = { 0 };

	cu_free = cuda_sym("cuMemFree_v2");
	cu_push = cuda_sym("cuCtxPushCurrent_v2");
	cu_pop = cuda_sym("cuCtxPopCurrent_v2");
	if (cuda_probe() || !retain || !set || !cu_free || !cu_push || !cu_pop ||
	    !cuda_sym("cuMemAlloc_v2") || retain(&dev_ctx, 0) || set(dev_ctx)) {
		fprintf(stderr, "bench/tensor_handoff: no CUDA device tensors: %s\n",
			shmrpc_errmsg());
		return;
	}
	for (int i = 0; i < 3; i++) {
		shmrpc_tensor *x = dev_tensor(sizes[i]);
		shmrpc_future *f;
		char filter[40];
		int64_t counts;

		if (!x)
			continue;
		med[i] = echo_median(x, quick ? 200 : 2000);
		shmrpc_tensor_free(x);
		if (shmrpc_rpc_sync(1, "cuda_counts", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f))
			die("cuda_counts");
		counts = shmrpc_future_value(f)->u.i;
		shmrpc_future_free(f);
		snprintf(filter, sizeof(filter), "size=%llu ", (unsigned long long)sizes[i]);
		printf("BENCH tensor_handoff device=cuda size=%llu median_ns=%llu opens=%lld "
		       "cache_hits=%lld", (unsigned long long)sizes[i], (unsigned long long)med[i],
		       (long long)(counts >> 32), (long long)(counts & 0xffffffff));
		bench_ratio("vs_torch_rpc", (double)med[i],
			    bench_peer("torch_rpc_cuda_tensor", filter, "median_ns"));
		bench_ratio("vs_torch_mp", (double)med[i],
			    bench_peer("torch_mp_cuda_tensor", filter, "median_ns"));
		printf("\n");
	}
	if (med[0] && med[2])
		printf("BENCH tensor_handoff device=cuda ratio_1GiB_vs_1MiB=%.3g\n",
		       (double)med[2] / (double)med[0]);
}

/* The four sizes in turns, ROUNDS rounds of per echoes each, so that the
 * machine's speed, which swings from second to second here, weighs on
 * each alike: a figure is the median of all its size's echoes, the ratio
 * the median of the rounds' ratios (measured one size after the other,
 * the 1 GiB figure came out 1.0 to 2.0 times the 1 KiB one, run to run). */
static void measure(bool quick)
{
	enum { NSIZES = 4 };
	static const uint64_t sizes[NSIZES] = { 1u << 10, 1u << 20, 64u << 20, 1u << 30 };
	const DLDataType u8 = { kDLUInt, 8, 1 };
	const int per = quick ? 20 : 500;
	uint64_t *t[NSIZES], met[NSIZES] = { 0 }, missed[NSIZES] = { 0 }, ratio[ROUNDS];
	shmrpc_tensor *x[NSIZES];

	for (int i = 0; i < NSIZES; i++) {
		int64_t shape[1] = { (int64_t)sizes[i] };

		if (!(t[i] = malloc(ROUNDS * per * sizeof(*t[i]))))
			die("malloc");
		if (shmrpc_tensor_alloc(u8, 1, shape, &x[i]))
			die("alloc");
	}
	for (int r = 0; r < ROUNDS; r++) {
		for (int i = 0; i < NSIZES; i++)
			handoff_times(x[i], per, t[i] + r * per, &met[i], &missed[i]);
		ratio[r] = 1000 * bench_median(t[NSIZES - 1] + r * per, per) /
			   bench_median(t[0] + r * per, per); /* per mille */
	}
	for (int i = 0; i < NSIZES; i++) {
		uint64_t med = bench_median(t[i], ROUNDS * per);
		char filter[40];

		snprintf(filter, sizeof(filter), "size=%llu ", (unsigned long long)sizes[i]);
		printf("BENCH tensor_handoff size=%llu median_ns=%llu spin_caught_pct=%.1f",
		       (unsigned long long)sizes[i], (unsigned long long)med,
		       met[i] + missed[i] ? 100.0 * (double)met[i] / (double)(met[i] + missed[i]) : 0.0);
		bench_ratio("vs_torch_rpc", (double)med, bench_peer("torch_rpc_tensor", filter, "median_ns"));
		bench_ratio("vs_torch_mp", (double)med, bench_peer("torch_mp_tensor", filter, "median_ns"));
		printf("\n");
		shmrpc_tensor_free(x[i]);
		free(t[i]);
	}
	printf("BENCH tensor_handoff ratio_1GiB_vs_1KiB=%.3g\n",
	       (double)bench_median(ratio, ROUNDS) / 1000.0);
	measure_inline(quick);
	measure_cuda(quick);
}

int main(int argc, char **argv)
{
	bool quick = argc > 1 && strcmp(argv[1], "-q") == 0;

	if (!getenv("SHMRPC_RANK"))
		return bench_run_self("-n 2 --quiet --pool-size 1200M --ring-size 524288", quick);
	/* Every size of measure_inline inline (the ring's half frame bounds
	 * a message's inline bytes). */
	setenv("SHMRPC_INLINE_MAX", "65536", 1);
	if (shmrpc_register("echo", "t", echo, NULL) ||
	    shmrpc_register("cuda_counts", "", cuda_counts, NULL) || shmrpc_init(NULL))
		die("init");
	if (shmrpc_rank() == 0)
		measure(quick);
	fflush(stdout);
	if (shmrpc_shutdown(1, 60000))
		die("shutdown");
	return 0;
}
