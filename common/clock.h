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

static inline uint64_t shmrpc_realtime_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
