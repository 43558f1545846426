/* The text of a worker's end, as the launcher and the agent both say it. */
#ifndef SHMRPC_SHM_EXIT_INFO_H
#define SHMRPC_SHM_EXIT_INFO_H

#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"

/* "killed by signal 9 (SIGKILL)", "exited with code 1"; returns snprintf's count. */
SHMRPC_HIDDEN int shm_exit_info_format(uint32_t exit_info, char *buf, size_t len);

#endif
