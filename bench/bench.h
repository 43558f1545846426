/*
 * What the bench programs share (header only: each bench is one program):
 * medians, the peers' figures measured earlier in the same
 * `make bench` run (bench/run.sh collects every BENCH line in the file
 * named by SHMRPC_BENCH_PEERS), and running oneself as a job under shmrun.
 */
#ifndef SHMRPC_BENCH_BENCH_H
#define SHMRPC_BENCH_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"

static inline int bench_cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Sorts t[0..n) and returns its median. */
static inline uint64_t bench_median(uint64_t *t, int n)
{
	qsort(t, (size_t)n, sizeof(*t), bench_cmp_u64);
	return t[n / 2];
}

/* The value of `metric` on the peer line "BENCH name ..." that holds
 * `filter` (or any, if NULL); 0 when there is none. */
static inline double bench_peer(const char *name, const char *filter, const char *metric)
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

/* Prints " label=ours/theirs" when the peer was measured. */
static inline void bench_ratio(const char *label, double ours, double theirs)
{
	if (theirs > 0)
		printf(" %s=%.3g", label, ours / theirs);
}

/* Runs this program as a job: `shmrun OPTS -- self [-q]`. 0 or 1. */
static inline int bench_run_self(const char *opts, bool quick)
{
	char self[4096], cmd[9000];
	const char *build = getenv("SHMRPC_BUILD");
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);

	if (n < 0)
		return 1;
	self[n] = '\0';
	snprintf(cmd, sizeof(cmd), "'%s/bin/shmrun' %s -- '%s' %s", build ? build : "build", opts,
		 self, quick ? "-q" : "");
	fflush(stdout);
	if (system(cmd) != 0) {
		fprintf(stderr, "bench: '%s' failed\n", cmd);
		return 1;
	}
	return 0;
}

#endif
