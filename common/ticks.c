/* The time-stamp counter as a clock (common/ticks.h). */
#include "common/ticks.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

bool shmrpc_ticks_usable(void)
{
#if defined(__x86_64__) || defined(__i386__)
	unsigned a, b, c, d;

	/* CPUID 0x80000007, EDX bit 8: the invariant TSC (Intel SDM 17.17.1;
	 * Linux's nonstop_tsc). */
	if (!__get_cpuid(0x80000000u, &a, &b, &c, &d) || a < 0x80000007u)
		return false;
	__get_cpuid(0x80000007u, &a, &b, &c, &d);
	return d & (1u << 8);
#else
	return false;
#endif
}

struct shmrpc_anchor shmrpc_anchor_now(void)
{
	struct shmrpc_anchor best = { 0, 0 };
	uint64_t width = UINT64_MAX;

	for (int i = 0; i < 5; i++) {
		uint64_t t0 = shmrpc_ticks(), ns = shmrpc_now_ns(), t1 = shmrpc_ticks();

		if (t1 >= t0 && t1 - t0 < width) {
			width = t1 - t0;
			best = (struct shmrpc_anchor){ t0 + (t1 - t0) / 2, ns };
		}
	}
	return best;
}

uint64_t shmrpc_ticks_to_ns(uint64_t ticks, struct shmrpc_anchor a, struct shmrpc_anchor b)
{
	const __int128 lim = (__int128)1 << 63;
	__int128 dt = (__int128)b.ticks - (__int128)a.ticks;
	__int128 dns = (__int128)b.ns - (__int128)a.ns;
	__int128 d = (__int128)ticks - (__int128)a.ticks, ns;

	if (dt < 0)
		dt = -dt, dns = -dns;
	/* Below 2^63 each, the product stays below 2^126: no overflow, whatever
	 * the anchors (one of them is read from shared memory). */
	if (dt == 0 || dns < 0 || dns >= lim || d >= lim || d <= -lim)
		return 0;
	ns = (__int128)a.ns + d * dns / dt;
	return ns < 0 ? 0 : ns > (__int128)UINT64_MAX ? UINT64_MAX : (uint64_t)ns;
}
