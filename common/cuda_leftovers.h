/*
 * The files the CUDA driver leaves in /dev/shm for a process that ends
 * without its atexit handlers (_exit, os._exit, a signal): one
 * cuda.shm.UID.PID.N per such process (PID in hex), 80 KiB each, the
 * state behind its IPC handles. Nothing can use one once PID has ended,
 * and nothing else removes it: a long-lived machine collects thousands.
 */
#ifndef SHMRPC_COMMON_CUDA_LEFTOVERS_H
#define SHMRPC_COMMON_CUDA_LEFTOVERS_H

#include <sys/types.h>

#include "common/compiler.h"

/*
 * Removes the files of ended process pid that this user owns; the number
 * removed. Call it while pid is a zombie (dead, not yet reaped), so that
 * the pid cannot name another process yet.
 */
SHMRPC_HIDDEN int cuda_leftovers_remove(pid_t pid);

#endif
