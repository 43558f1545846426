/* Two forked processes exchange 1,000,000 frames each way (scaled down under
 * sanitizers) in every wait mode: random-length payloads checked byte by
 * byte, none lost, duplicated or reordered, and no wait that hangs (a lost
 * wake-up would). */
#include "shmrpc.h"
#include "tests/lib/stress.h"
#include "tests/lib/testlib.h"

#define FRAMES 1000000

int main(void)
{
	uint64_t frames = (uint64_t)(FRAMES * tl_scale());
	const char *modes[3];
	int n = tl_wait_modes(modes, 3);

	for (int i = 0; i < n; i++)
		tl_stress_all_to_all(2, frames, modes[i]);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
