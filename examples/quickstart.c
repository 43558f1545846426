/*
 * quickstart: the smallest real shmrpc program. Run it as a job:
 *
 *     shmrun -n 4 -- build/examples/quickstart
 *
 * Every worker registers three functions, then calls its neighbour; rank 0
 * also makes a remote reference (an RRef) on its neighbour and reads it,
 * shows what a remote error looks like and measures an empty call's round
 * trip.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "shmrpc.h"

static int hello(shmrpc_call *call, const shmrpc_value *args, uint32_t nargs,
		 shmrpc_value *result, void *user)
{
	char *text = shmrpc_call_alloc(call, 128);

	(void)nargs, (void)user;
	snprintf(text, 128, "hello %s, this is worker %d", args[0].u.s, shmrpc_rank());
	*result = shmrpc_str(text);
	return 0;
}

static int divide(shmrpc_call *call, const shmrpc_value *args, uint32_t nargs,
		  shmrpc_value *result, void *user)
{
	(void)nargs, (void)user;
	if (args[1].u.i == 0)
		return shmrpc_call_error(call, "ZeroDivisionError", "division by zero");
	*result = shmrpc_int(args[0].u.i / args[1].u.i);
	return 0;
}

static int nothing(shmrpc_call *call, const shmrpc_value *args, uint32_t nargs,
		   shmrpc_value *result, void *user)
{
	(void)call, (void)args, (void)nargs, (void)result, (void)user;
	return 0;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int fail(const char *what)
{
	fprintf(stderr, "quickstart: %s: %s\n", what, shmrpc_errmsg());
	return 1;
}

int main(void)
{
	struct shmrpc_worker_info me, next;
	shmrpc_future *f;
	int rank, world;

	if (shmrpc_register("hello", "s", hello, NULL) || shmrpc_register("divide", "ii", divide, NULL) ||
	    shmrpc_register("nothing", "", nothing, NULL))
		return fail("register");
	if (shmrpc_init(NULL))
		return fail("init");
	rank = shmrpc_rank();
	world = shmrpc_world_size();
	shmrpc_get_worker_info(NULL, &me);
	shmrpc_get_worker_info_by_rank((rank + 1) % world, &next);

	shmrpc_value name = shmrpc_str(me.name);
	if (shmrpc_rpc_sync(next.rank, "hello", &name, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
		return fail("hello");
	printf("%s asked %s: \"%s\"\n", me.name, next.name, shmrpc_future_value(f)->u.s);
	shmrpc_future_free(f);

	if (rank == 0) {
		enum { N = 20000 };
		static uint64_t t[N];
		shmrpc_value args[2];

		shmrpc_rref *r;
		char rs[160];

		/* remote(): the neighbour computes 84 / 2 and keeps it. */
		args[0] = shmrpc_int(84);
		args[1] = shmrpc_int(2);
		if (shmrpc_remote(next.rank, "divide", args, 2, SHMRPC_TIMEOUT_DEFAULT, &r))
			return fail("remote");
		if (shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f))
			return fail("to_here");
		shmrpc_rref_str(r, rs, sizeof(rs));
		printf("%s on %s holds %lld\n", rs, shmrpc_rref_owner_name(r),
		       (long long)shmrpc_future_value(f)->u.i);
		shmrpc_future_free(f);
		shmrpc_rref_free(r);

		args[0] = shmrpc_int(1);
		args[1] = shmrpc_int(0);
		if (shmrpc_rpc_sync(next.rank, "divide", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f) == 0)
			return fail("divide by zero succeeded");
		printf("a remote error, as the caller sees it:\n  %s\n", shmrpc_errmsg());

		for (int i = 0; i < N; i++) {
			uint64_t t0 = now_ns();

			if (shmrpc_rpc_sync(next.rank, "nothing", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f))
				return fail("nothing");
			t[i] = now_ns() - t0;
			shmrpc_future_free(f);
		}
		qsort(t, N, sizeof(t[0]), cmp_u64);
		printf("round trip of an empty rpc_sync: median %.1f us, p99 %.1f us (%d calls)\n",
		       (double)t[N / 2] / 1e3, (double)t[N * 99 / 100] / 1e3, N);
	}
	fflush(stdout);
	if (shmrpc_shutdown(1, 30000))
		return fail("shutdown");
	return 0;
}
