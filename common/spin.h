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
 * and then). Below the maximum, every wait that begins in the first
 * SHMRPC_SPIN_PROBE_WINDOW_NS of each SHMRPC_SPIN_PROBE_PERIOD_NS of the
 * monotonic clock spins the maximum (a probe). A partner that answers within a few microseconds is thus met
 * spinning, which spares both a wake-up (tens of microseconds on a VM whose
 * idle vCPU halts); one that takes longer, or a machine with more busy
 * threads than cores, soon costs about 1 µs a wait.
 */
#ifndef SHMRPC_COMMON_SPIN_H
#define SHMRPC_COMMON_SPIN_H

#include <sched.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/clock.h"
#include "common/compiler.h"

#define SHMRPC_SPIN_MIN_NS 250u
#define SHMRPC_SPIN_MAX_NS 16000u
#define SHMRPC_SPIN_START_NS 2000u
/* Now and then a budget below the maximum spins the maximum: a spin that
 * ran out says nothing of how much longer the work took (the sleep's
 * wake-up is in any time measured after it), so only a longer spin can
 * find that the partner has become quick again. Two partners that both
 * sleep are each slow because the other sleeps: a probe meets the work
 * only while the partner probes too. So the probes follow the clock, which
 * every process of the box shares, not a count of one's own waits: with
 * "every 16th wait", two sides waiting in lockstep kept the phase their
 * counters started with, and a job whose phases differed never left the
 * sleeping state (rpc_sync 6.5 µs against 0.84 µs in another run). The
 * window costs a thread that always waits at most window/period (6 %) of
 * spinning while its partner is really slow. */
#define SHMRPC_SPIN_PROBE_PERIOD_NS (1u << 20)
#define SHMRPC_SPIN_PROBE_WINDOW_NS (1u << 16)

/* At or above this share (in 1/256) of full-length spins that met the
 * work, a budget at the maximum stays there. */
#define SHMRPC_SPIN_KEEP 64

/* An adaptive spin budget; { 0 } starts at SHMRPC_SPIN_START_NS. */
struct shmrpc_spin_budget {
	uint32_t ns;
	int32_t met;  /* share of full-length spins that met the work, 1/256, over about 8 */
	bool probing; /* this wait spins the maximum */
	bool clipped; /* ... or less: what is left of the waiter's time */
};

/* The budget of a spin that begins at now_ns (the monotonic clock), at
 * most limit_ns (the time the waiter has left; UINT64_MAX: no limit). */
static inline uint64_t shmrpc_spin_budget_ns_at(struct shmrpc_spin_budget *b, uint64_t limit_ns,
						uint64_t now_ns)
{
	uint32_t ns;

	if (!b->ns)
		b->ns = SHMRPC_SPIN_START_NS;
	b->probing = b->ns < SHMRPC_SPIN_MAX_NS &&
		     now_ns % SHMRPC_SPIN_PROBE_PERIOD_NS < SHMRPC_SPIN_PROBE_WINDOW_NS;
	ns = b->probing ? SHMRPC_SPIN_MAX_NS : b->ns;
	b->clipped = limit_ns < ns;
	return b->clipped ? limit_ns : ns;
}

/* The same, now; the clock is read only below the maximum (no probe
 * there), so a thread whose spins meet the work pays nothing for it. */
static inline uint64_t shmrpc_spin_budget_ns(struct shmrpc_spin_budget *b, uint64_t limit_ns)
{
	return shmrpc_spin_budget_ns_at(b, limit_ns,
					b->ns == SHMRPC_SPIN_MAX_NS ? 0 : shmrpc_now_ns());
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
