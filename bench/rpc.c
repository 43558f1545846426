/*
 * bench/rpc: what an RPC costs. Runs itself under shmrun with 2 workers,
 * once per wait mode; rank 0 measures, rank 1 serves:
 *   BENCH rpc_sync mode=M median_ns= p99_ns= vs_floor= vs_torch=
 *   BENCH rpc_async mode=uring calls_per_s= vs_torch=
 *   BENCH rpc_echo size=S median_ns= p99_ns= vs_torch=
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

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* The value of `metric` on the peer line "BENCH name ..." that holds
 * `filter` (or any, if NULL); 0 when there is none. */
static double peer(const char *name, const char *filter, const char *metric)
{
	const char *path = getenv("SHMRPC_BENCH_PEERS");
	char line[512], head[96], key[64];
	double v = 0;
	FILE *f;

	if (!path || !(f = fopen(path, "r")))
		return 0;
	snprintf(head, sizeof(head), "BENCH %s ", name);
	snprintf(key, sizeof(key), " %s=", metric);
	while (fgets(line, sizeof(line), f)) {
		char *at;

		if (strncmp(line, head, strlen(head)) || (filter && !strstr(line, filter)))
			continue;
		if ((at = strstr(line, key)))
			v = atof(at + strlen(key));
		break;
	}
	fclose(f);
	return v;
}

static void ratio(const char *label, double ours, double theirs)
{
	if (theirs > 0)
		printf(" %s=%.3g", label, ours / theirs);
}

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
		uint64_t t0 = now_ns();

		if (shmrpc_rpc_sync(1, fn, arg, arg ? 1 : 0, SHMRPC_TIMEOUT_DEFAULT, &f))
			die(fn);
		t[i] = now_ns() - t0;
		shmrpc_future_free(f);
	}
	qsort(t, (size_t)n, sizeof(*t), cmp_u64);
	*med = t[n / 2];
	*p99 = t[(size_t)n * 99 / 100];
	free(t);
}

static void measure(const char *mode, bool quick)
{
	int n = quick ? 2000 : 50000;
	uint64_t med, p99, t0;
	char filter[32];

	timed_sync("nothing", NULL, n / 10, &med, &p99); /* warm-up */
	timed_sync("nothing", NULL, n, &med, &p99);
	snprintf(filter, sizeof(filter), "mode=%s ", mode);
	printf("BENCH rpc_sync mode=%s median_ns=%llu p99_ns=%llu", mode, (unsigned long long)med,
	       (unsigned long long)p99);
	ratio("vs_floor", (double)med, peer("floor", filter, "median_ns"));
	ratio("vs_torch", (double)med, peer("torch_rpc_sync", NULL, "median_ns"));
	printf("\n");
	if (strcmp(mode, "uring"))
		return;

	{
		int calls = quick ? 20000 : 200000;
		shmrpc_future **f = malloc((size_t)calls * sizeof(*f));
		double per_s;

		t0 = now_ns();
		for (int i = 0; i < calls; i++)
			if (shmrpc_rpc_async(1, "nothing", NULL, 0, SHMRPC_TIMEOUT_NONE, &f[i]))
				die("rpc_async");
		for (int i = 0; i < calls; i++) {
			if (shmrpc_future_wait(f[i], -1))
				die("rpc_async wait");
			shmrpc_future_free(f[i]);
		}
		per_s = calls * 1e9 / (double)(now_ns() - t0);
		free(f);
		printf("BENCH rpc_async mode=uring calls_per_s=%.0f", per_s);
		/* Higher is better here: the ratio says how many times torch's rate. */
		ratio("vs_torch", per_s, peer("torch_rpc_async", NULL, "calls_per_s"));
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
		ratio("vs_torch", (double)med, peer("torch_rpc_echo", sz, "median_ns"));
		printf("\n");
		free(buf);
	}
}

static int worker(bool quick)
{
	const char *mode = getenv("SHMRPC_WAIT");

	if (shmrpc_register("nothing", "", nothing, NULL) || shmrpc_register("echo", "y", echo, NULL))
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

int main(int argc, char **argv)
{
	static const char *const modes[] = { "uring", "futex", "spin" };
	bool quick = argc > 1 && strcmp(argv[1], "-q") == 0;
	char self[4096], shmrun[4096];
	const char *build = getenv("SHMRPC_BUILD");
	ssize_t n;

	if (getenv("SHMRPC_RANK"))
		return worker(quick);
	n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n < 0)
		return 1;
	self[n] = '\0';
	snprintf(shmrun, sizeof(shmrun), "%s/bin/shmrun", build ? build : "build");
	for (int m = 0; m < 3; m++) {
		char wait[32], cmd[10000];

		snprintf(wait, sizeof(wait), "--wait=%s", modes[m]);
		/* 3 MiB rings carry the 1 MiB echo (a frame is at most half a ring). */
		snprintf(cmd, sizeof(cmd), "'%s' -n 2 --quiet --ring-size 4194304 %s -- '%s' %s", shmrun,
			 wait, self, quick ? "-q" : "");
		fflush(stdout);
		if (system(cmd) != 0) {
			fprintf(stderr, "bench/rpc: the %s run failed\n", modes[m]);
			return 1;
		}
	}
	return 0;
}
