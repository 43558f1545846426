/*
 * The CPU's time-stamp counter as a clock: a few nanoseconds a read where
 * CLOCK_MONOTONIC costs a vDSO call (20-40 ns), for the flight recorder,
 * which reads a clock on every record. Ticks are turned into
 * CLOCK_MONOTONIC nanoseconds by the line through two anchors, pairs of
 * (ticks, ns) read together: one taken where the ticks were, one where
 * they are read back (both on this machine, since this boot).
 */
#ifndef SHMRPC_COMMON_TICKS_H
#define SHMRPC_COMMON_TICKS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/clock.h"
#include "common/compiler.h"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

/* A tick count and the CLOCK_MONOTONIC time it was. */
struct shmrpc_anchor {
	uint64_t ticks, ns;
};

/* True where the counter runs at one rate on every CPU, in every power
 * state (x86's invariant TSC); elsewhere ticks must not be used. */
SHMRPC_HIDDEN bool shmrpc_ticks_usable(void);

/* The counter now (only where shmrpc_ticks_usable()). Not ordered with the
 * loads and stores around it: it may be a few cycles off, never more. */
static inline uint64_t shmrpc_ticks(void)
{
#if defined(__x86_64__) || defined(__i386__)
	return __rdtsc();
#else
	return 0;
#endif
}

/* An anchor taken now: the narrowest of a few brackets of the clock read by
 * two counter reads, at its middle (a preemption inside one try widens
 * only that try). */
SHMRPC_HIDDEN struct shmrpc_anchor shmrpc_anchor_now(void);

/* ticks in CLOCK_MONOTONIC ns along the line through a and b (any order;
 * ticks may lie outside them). 0 when the anchors do not make a rate
 * (equal ticks, time going back against the counter) or lie 2^63 or more
 * apart, as garbage read from shared memory may. */
SHMRPC_HIDDEN uint64_t shmrpc_ticks_to_ns(uint64_t ticks, struct shmrpc_anchor a,
					  struct shmrpc_anchor b);

#endif
