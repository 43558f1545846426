/* The adaptive spin budget (common/spin.h), driven by hand: it starts at
 * 2 µs, doubles up to 16 µs while spins meet the work, halves down to
 * 250 ns while they run out, and below 16 µs spins the whole 16 µs every
 * 16th wait: a probe that meets the work sets the maximum at once, one that
 * runs out changes nothing; nor does a spin cut short by the waiter's
 * deadline that runs out. */
#include <stdio.h>

#include "common/spin.h"
#include "tests/lib/testlib.h"

/* One wait: the budget it spins, then whether the work came within it. */
static uint32_t wait_once(struct shmrpc_spin_budget *b, bool came)
{
	uint32_t ns = (uint32_t)shmrpc_spin_budget_ns(b, UINT64_MAX);

	shmrpc_spin_budget_update(b, came);
	return ns;
}

int main(void)
{
	struct shmrpc_spin_budget b = { 0 };
	uint32_t ns;
	int i;

	CHECK(shmrpc_spin_budget_ns(&b, UINT64_MAX) == SHMRPC_SPIN_START_NS, "starts at %u ns", b.ns);
	b = (struct shmrpc_spin_budget){ 0 };

	/* Spins that meet the work: 2, 4, 8, 16 µs, and there it stays
	 * (no probe at the maximum). */
	for (i = 0, ns = SHMRPC_SPIN_START_NS; i < 40; i++) {
		uint32_t got = wait_once(&b, true);

		CHECK(got == ns, "wait %d met the work: spun %u ns, want %u", i, got, ns);
		if (ns < SHMRPC_SPIN_MAX_NS)
			ns *= 2;
	}
	CHECK(b.ns == SHMRPC_SPIN_MAX_NS, "stays at the maximum: %u", b.ns);

	/* Spins that run out: halved to the minimum, probes aside. */
	for (i = 0; i < 15; i++) {
		uint32_t before = b.ns, want;

		ns = wait_once(&b, false);
		if (ns != before) /* a probe */
			want = before;
		else
			want = before / 2 >= SHMRPC_SPIN_MIN_NS ? before / 2 : before;
		CHECK(b.ns == want, "wait %d ran out: spun %u ns, budget %u -> %u, want %u", i, ns,
		      before, b.ns, want);
	}
	CHECK(b.ns == SHMRPC_SPIN_MIN_NS, "down to the minimum: %u", b.ns);

	/* At the minimum, every 16th wait spins the maximum; one that runs
	 * out leaves the budget as it was. */
	for (i = 0; i < 64; i++) {
		ns = wait_once(&b, false);
		CHECK(ns == (b.waits % SHMRPC_SPIN_PROBE_EVERY ? SHMRPC_SPIN_MIN_NS
							     : SHMRPC_SPIN_MAX_NS),
		      "wait %u spun %u ns", b.waits, ns);
		CHECK(b.ns == SHMRPC_SPIN_MIN_NS, "wait %u: budget %u after running out", b.waits,
		      b.ns);
	}

	/* A probe that meets the work sets the maximum at once. */
	while ((b.waits + 1) % SHMRPC_SPIN_PROBE_EVERY)
		wait_once(&b, false);
	CHECK(b.ns == SHMRPC_SPIN_MIN_NS, "before the probe: %u", b.ns);
	ns = wait_once(&b, true);
	CHECK(ns == SHMRPC_SPIN_MAX_NS && b.ns == SHMRPC_SPIN_MAX_NS,
	      "a probe that met the work: spun %u ns, then %u", ns, b.ns);
	/* A spin cut short by the waiter's time left: that long, and if it runs
	 * out the budget stays. */
	b = (struct shmrpc_spin_budget){ 0 };
	CHECK(shmrpc_spin_budget_ns(&b, 700) == 700, "a 700 ns limit gave %u ns", b.ns);
	shmrpc_spin_budget_update(&b, false);
	CHECK(b.ns == SHMRPC_SPIN_START_NS, "a cut spin that ran out changed the budget to %u", b.ns);
	CHECK(shmrpc_spin_budget_ns(&b, 0) == 0, "a deadline passed still spins");
	shmrpc_spin_budget_update(&b, true);
	CHECK(b.ns == 2 * SHMRPC_SPIN_START_NS, "a cut spin that met the work: %u", b.ns);
	printf("spin_budget: start, doubling, halving and probes as documented\n");
	return 0;
}
