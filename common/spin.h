/*
 * Bounded busy-waiting before a thread sleeps. A hand-off between threads
 * of two processes costs a futex wake-up (microseconds, more on a loaded
 * machine) when the other side sleeps and a cache miss when it spins; the
 * agent spins this long at each hand-off and then sleeps. The spin yields
 * the CPU now and then so that, on a machine with fewer cores than busy
 * threads, the thread that has the work can run. How long to spin at a
 * hand-off is the agent's choice (worker/agent.h: it follows the wait mode).
 */
#ifndef SHMRPC_COMMON_SPIN_H
#define SHMRPC_COMMON_SPIN_H

#include <sched.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/clock.h"
#include "common/compiler.h"


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
