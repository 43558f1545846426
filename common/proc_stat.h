/* Reading /proc/PID/stat, whose second field (the command's name, in
 * parentheses) may hold spaces and parentheses of its own. */
#ifndef SHMRPC_COMMON_PROC_STAT_H
#define SHMRPC_COMMON_PROC_STAT_H

#include <stddef.h>
#include <sys/types.h>

#include "common/compiler.h"

/*
 * Reads pid's stat line into buf (len bytes) and returns its fields from
 * the third on ("S 123 ...": the state letter, the parent's pid...), past
 * the name. NULL when it cannot: *err (if err) gets 0 for an empty read,
 * -errno of open or read (-ENOENT or -ESRCH: the process is gone), or
 * -EINVAL for a line without its name.
 */
SHMRPC_HIDDEN const char *proc_stat_fields(pid_t pid, char *buf, size_t len, int *err);

#endif
