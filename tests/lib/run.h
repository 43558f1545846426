/*
 * Running a command from a test with its stdout and stderr captured
 * through one pipe: the launcher tests run shmrun with /bin/sh workers.
 */
#ifndef SHMRPC_TESTS_RUN_H
#define SHMRPC_TESTS_RUN_H

#include <stddef.h>
#include <sys/types.h>

/* Starts argv (NULL-terminated; argv[0] a path) with stdout and stderr into
 * a pipe whose read end goes to *out_fd. The pid, or -1. */
pid_t tl_spawn(const char *const *argv, int *out_fd);
/* Reads out_fd to its end into out (NUL-terminated, truncated to len; also
 * echoed to stderr, so that a failing test shows it), closes it, and waits
 * for pid. The exit code, 128+signal if it was killed, -1 on error. */
int tl_collect(pid_t pid, int out_fd, char *out, size_t len);
/* tl_spawn then tl_collect. */
int tl_run(char *out, size_t len, const char *const *argv);

#endif
