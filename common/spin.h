/*
 * Bounded busy-waiting before a thread sleeps. A hand-off between threads
 * of two processes costs a futex wake-up (microseconds, more on a loaded
 * machine) when the other side sleeps and a cache miss when it spins; the
 * agent spins this long at each hand-off and then sleeps. The spin yields
 * the CPU now and then so that, on a machine with fewer cores than busy
 * threads, the thread that has the work can run. How long to spin at a
 * hand-off is the agent's choice (worker/link.h: it follows the wait mode).
 *
 * Where the wait mode sleeps, the budget adapts (struct shmrpc_spin_budget,
 * one per waiting thread): doubled after a spin that saw the work come,
 * halved after one that ran out, unless a quarter or more of the recent
 * full-length spins met the work: then it stays at the maximum (a partner
 * that is quick most of the time is not given up for a slow answer now
 * and then). A partner that answers within a few microseconds is thus met
 * spinning, which spares both a wake-up (tens of microseconds on a VM whose
 * idle vCPU halts); one that takes longer, or a machine with more busy
 * threads than cores, soon costs a few µs a wait (the probes).
 *
 * The maximum is above a wake-up plus the partner's work of a Python call
 * (tens of µs): a side that sleeps adds its wake-up to the other side's
 * next wait, so with a maximum below both together, two sides that once
 * slept keep sleeping (each one's spin runs out on the other's wake-up).
 * At 16 µs, a 1 KiB tensor echo from Python (about 9 µs of work a side)
 * fell into that state in one run of two and took 5.5 times an empty call
 * instead of 2 (docs/ARCHITECTURE.md, "The spin's maximum").
 */
#ifndef SHMRPC_COMMON_SPIN_H
#define SHMRPC_COMMON_SPIN_H

#include <sched.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/clock.h"
#include "common/compiler.h"

#define SHMRPC_SPIN_MIN_NS 250u
#define SHMRPC_SPIN_MAX_NS 64000u
#define SHMRPC_SPIN_START_NS 2000u
/* Every so many waits a budget below the maximum spins the maximum once: a
 * spin that ran out says nothing of how much longer the work took (the
 * sleep's wake-up is in any time measured after it), so only a longer spin
 * can find that the partner has become quick again. */
#define SHMRPC_SPIN_PROBE_EVERY 16u

/* At or above this share (in 1/256) of full-length spins that met the
 * work, a budget at the maximum stays there. */
#define SHMRPC_SPIN_KEEP 64

/* An adaptive spin budget; { 0 } starts at SHMRPC_SPIN_START_NS. */
struct shmrpc_spin_budget {
	uint32_t ns;
	uint32_t waits;
	int32_t met;  /* share of full-length spins that met the work, 1/256, over about 8 */
	bool probing; /* this wait spins the maximum */
	bool clipped; /* ... or less: what is left of the waiter's time */
};

/* The budget of the next spin, at most limit_ns (the time the waiter has
 * left; UINT64_MAX: no limit). */
static inline uint64_t shmrpc_spin_budget_ns(struct shmrpc_spin_budget *b, uint64_t limit_ns)
{
	uint32_t ns;

	if (!b->ns)
		b->ns = SHMRPC_SPIN_START_NS;
	b->probing = b->ns < SHMRPC_SPIN_MAX_NS && ++b->waits % SHMRPC_SPIN_PROBE_EVERY == 0;
	ns = b->probing ? SHMRPC_SPIN_MAX_NS : b->ns;
	b->clipped = limit_ns < ns;
	return b->clipped ? limit_ns : ns;
}

/* After that spin: whether it saw the work come. A probe, or a spin cut
 * short by the limit, that ran out leaves the budget as it was. */
static inline void shmrpc_spin_budget_update(struct shmrpc_spin_budget *b, bool came)
{
	bool full = !b->clipped && (b->probing || b->ns == SHMRPC_SPIN_MAX_NS);

	if (full) /* an honest sample of how often the maximum meets the work */
		b->met += ((came ? 256 : 0) - b->met) / 8;
	if (came)
		b->ns = b->probing || 2 * b->ns > SHMRPC_SPIN_MAX_NS ? SHMRPC_SPIN_MAX_NS : 2 * b->ns;
	else if (!b->probing && !b->clipped && b->met < SHMRPC_SPIN_KEEP &&
		 b->ns / 2 >= SHMRPC_SPIN_MIN_NS)
		b->ns /= 2;
}

/* Spins until ready(arg) or budget_ns pass; returns ready's last answer. */
static inline bool shmrpc_spin_until(bool (*ready)(void *), void *arg, uint64_t budget_ns)
{
	uint64_t start;

	if (budget_ns == 0)
		return ready(arg);
	start = shmrpc_now_ns();
	for (uint32_t i = 1;; i++) {
		if (ready(arg))
			return true;
		if ((i & 63) == 0) {
			if (shmrpc_now_ns() - start >= budget_ns)
				return ready(arg);
			sched_yield();
		}
		shmrpc_cpu_relax();
	}
}

#endif
