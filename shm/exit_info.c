/* Formatting shm_worker.exit_info; see exit_info.h and shm/layout.h. */
#include <stdio.h>
#include <string.h>

#include "shm/exit_info.h"
#include "shm/layout.h"

int shm_exit_info_format(uint32_t exit_info, char *buf, size_t len)
{
	uint32_t kind = exit_info >> 24, v = exit_info & 0xffu;
	const char *abbrev;

	if (kind == 1)
		return snprintf(buf, len, "exited with code %u", v);
	if (kind == 2) {
		abbrev = sigabbrev_np((int)v);
		return abbrev ? snprintf(buf, len, "killed by signal %u (SIG%s)", v, abbrev)
			      : snprintf(buf, len, "killed by signal %u", v);
	}
	if (kind == 3)
		return snprintf(buf, len, "was refused: worker %u has its name",
				SHM_EXIT_VALUE(exit_info));
	return snprintf(buf, len, "ended (cause unknown)");
}
