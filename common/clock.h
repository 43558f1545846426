/* Monotonic time in nanoseconds: the one clock every deadline uses. */
#ifndef SHMRPC_COMMON_CLOCK_H
#define SHMRPC_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t shmrpc_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The same clock as of its last tick (CLOCK_MONOTONIC_COARSE): never
 * ahead of shmrpc_now_ns, at most a tick (1-4 ms) behind, and about 10 ns
 * a read against 43 (2-core VM): for a check on every call's path where a
 * tick late is harmless (a reply past its deadline, worker/client.c). */
static inline uint64_t shmrpc_coarse_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t shmrpc_realtime_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
