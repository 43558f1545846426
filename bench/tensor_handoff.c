/*
 * bench/tensor_handoff: a CPU tensor of 1 KiB, 1 MiB, 64 MiB and 1 GiB
 * sent to another worker and back (rpc_sync of a function returning its
 * argument), under shmrun with 2 workers:
 *   BENCH tensor_handoff size=S median_ns= vs_torch_rpc= vs_torch_mp=
 *   BENCH tensor_handoff ratio_1GiB_vs_1KiB=
 * The peers (bench/torch_tensor.py: torch.distributed.rpc and a
 * torch.multiprocessing queue moving the same tensors) are measured in the
 * same `make bench` run. -q: fewer round trips.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shmrpc.h"
#include "bench/bench.h"

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

static uint64_t handoff(uint64_t size, int n)
{
	const DLDataType u8 = { kDLUInt, 8, 1 };
	int64_t shape[1] = { (int64_t)size };
	uint64_t *t = malloc((size_t)n * sizeof(*t)), med;
	shmrpc_tensor *x;
	shmrpc_future *f;
	shmrpc_value v;

	if (shmrpc_tensor_alloc(u8, 1, shape, &x))
		die("alloc");
	v = shmrpc_tensor_value(x);
	for (int i = -n / 10 - 1; i < n; i++) { /* the first ones warm up */
		uint64_t t0 = shmrpc_now_ns();

		if (shmrpc_rpc_sync(1, "echo", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
			die("echo");
		if (i >= 0)
			t[i] = shmrpc_now_ns() - t0;
		shmrpc_future_free(f);
	}
	shmrpc_tensor_free(x);
	med = bench_median(t, n);
	free(t);
	return med;
}

static void measure(bool quick)
{
	static const uint64_t sizes[] = { 1u << 10, 1u << 20, 64u << 20, 1u << 30 };
	uint64_t med[4];

	for (int i = 0; i < 4; i++) {
		char filter[40];

		med[i] = handoff(sizes[i], quick ? 200 : 5000);
		snprintf(filter, sizeof(filter), "size=%llu ", (unsigned long long)sizes[i]);
		printf("BENCH tensor_handoff size=%llu median_ns=%llu", (unsigned long long)sizes[i],
		       (unsigned long long)med[i]);
		bench_ratio("vs_torch_rpc", (double)med[i], bench_peer("torch_rpc_tensor", filter, "median_ns"));
		bench_ratio("vs_torch_mp", (double)med[i], bench_peer("torch_mp_tensor", filter, "median_ns"));
		printf("\n");
	}
	printf("BENCH tensor_handoff ratio_1GiB_vs_1KiB=%.3g\n", (double)med[3] / (double)med[0]);
}

int main(int argc, char **argv)
{
	bool quick = argc > 1 && strcmp(argv[1], "-q") == 0;

	if (!getenv("SHMRPC_RANK"))
		return bench_run_self("-n 2 --quiet --pool-size 1100M", quick);
	if (shmrpc_register("echo", "t", echo, NULL) || shmrpc_init(NULL))
		die("init");
	if (shmrpc_rank() == 0)
		measure(quick);
	fflush(stdout);
	if (shmrpc_shutdown(1, 60000))
		die("shutdown");
	return 0;
}
