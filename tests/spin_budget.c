/* The adaptive spin budget (common/spin.h), driven by hand: it starts at
 * 2 µs and doubles up to 64 µs while spins meet the work; at 64 µs it stays
 * while a quarter or more of the recent spins there meet it (a partner
 * quick half the time keeps it), else it halves down to 250 ns; below 64 µs
 * it spins the whole 64 µs every 16th wait, and such a probe that meets the
 * work sets the maximum at once, one that runs out changes nothing; nor
 * does a spin cut short by the waiter's deadline that runs out. */
#include <stdio.h>

#include "common/spin.h"
#include "tests/lib/testlib.h"

#define MAX SHMRPC_SPIN_MAX_NS
#define MIN SHMRPC_SPIN_MIN_NS

/* One wait: the budget it spins, then whether the work came within it. */
static uint32_t wait_once(struct shmrpc_spin_budget *b, bool came)
{
	uint32_t ns = (uint32_t)shmrpc_spin_budget_ns(b, UINT64_MAX);

	shmrpc_spin_budget_update(b, came);
	return ns;
}

/* A budget at the maximum after spins that all met the work. */
static struct shmrpc_spin_budget quick_partner(void)
{
	struct shmrpc_spin_budget b = { 0 };
	uint32_t ns = SHMRPC_SPIN_START_NS;

	for (int i = 0; i < 40; i++) {
		uint32_t got = wait_once(&b, true);

		CHECK(got == ns, "wait %d met the work: spun %u ns, want %u", i, got, ns);
		if (ns < MAX)
			ns *= 2;
	}
	CHECK(b.ns == MAX, "stays at the maximum: %u", b.ns);
	return b;
}

int main(void)
{
	struct shmrpc_spin_budget b = { 0 };
	uint32_t ns, at_max = 0;
	int i;

	CHECK(shmrpc_spin_budget_ns(&b, UINT64_MAX) == SHMRPC_SPIN_START_NS, "starts at %u ns",
	      b.ns);

	/* A partner that meets half the spins keeps the maximum. */
	b = quick_partner();
	for (i = 0; i < 200; i++) {
		ns = wait_once(&b, i % 2);
		CHECK(ns == MAX, "wait %d of a half-quick partner spun %u ns", i, ns);
	}

	/* One that stops meeting them: the maximum for a few more waits (a
	 * slow answer now and then is not enough), then halved to the minimum,
	 * probes aside. */
	b = quick_partner();
	for (i = 0; i < 64 && b.ns > MIN; i++) {
		uint32_t before = b.ns;

		ns = wait_once(&b, false);
		if (ns == MAX && before == MAX)
			at_max++;
		CHECK(b.ns == before || b.ns == before / 2, "wait %d ran out: %u -> %u", i, before,
		      b.ns);
		CHECK(ns != before || before == MAX || b.ns == before / 2,
		      "wait %d below the maximum ran out and kept %u", i, b.ns);
	}
	CHECK(b.ns == MIN, "not down to the minimum after 64 slow waits: %u", b.ns);
	CHECK(at_max > 1, "a single slow answer gave up the maximum");

	/* At the minimum, every 16th wait spins the maximum; one that runs
	 * out leaves the budget as it was. */
	for (i = 0; i < 64; i++) {
		ns = wait_once(&b, false);
		CHECK(ns == (b.waits % SHMRPC_SPIN_PROBE_EVERY ? MIN : MAX), "wait %u spun %u ns",
		      b.waits, ns);
		CHECK(b.ns == MIN, "wait %u: budget %u after running out", b.waits, b.ns);
	}

	/* A probe that meets the work sets the maximum at once. */
	while ((b.waits + 1) % SHMRPC_SPIN_PROBE_EVERY)
		wait_once(&b, false);
	CHECK(b.ns == MIN, "before the probe: %u", b.ns);
	ns = wait_once(&b, true);
	CHECK(ns == MAX && b.ns == MAX, "a probe that met the work: spun %u ns, then %u", ns, b.ns);

	/* A spin cut short by the waiter's time left: that long, and if it runs
	 * out the budget stays. */
	b = (struct shmrpc_spin_budget){ 0 };
	CHECK(shmrpc_spin_budget_ns(&b, 700) == 700, "a 700 ns limit gave %u ns", b.ns);
	shmrpc_spin_budget_update(&b, false);
	CHECK(b.ns == SHMRPC_SPIN_START_NS, "a cut spin that ran out changed the budget to %u", b.ns);
	CHECK(shmrpc_spin_budget_ns(&b, 0) == 0, "a deadline passed still spins");
	shmrpc_spin_budget_update(&b, true);
	CHECK(b.ns == 2 * SHMRPC_SPIN_START_NS, "a cut spin that met the work: %u", b.ns);
	printf("spin_budget: start, doubling, keeping, halving, probes and cut spins as documented\n");
	return 0;
}
