/*
 * Error reporting. Functions return 0 or -errno (liburing style); the
 * detailed sentence a user should read ("segment format 3, this library
 * reads format 2") is kept per thread and read with shmrpc_errmsg().
 */
#ifndef SHMRPC_COMMON_ERROR_H
#define SHMRPC_COMMON_ERROR_H

#include <stdarg.h>

#include "common/compiler.h"

/* Records the message for this thread and returns err (a negative errno). */
SHMRPC_HIDDEN int shmrpc__fail(int err, const char *fmt, ...) SHMRPC_PRINTF(2, 3);
/* The same with the arguments as a va_list. */
SHMRPC_HIDDEN int shmrpc__vfail(int err, const char *fmt, va_list ap) SHMRPC_PRINTF(2, 0);

/* Writes one line to stderr, once per process for each distinct key. */
SHMRPC_HIDDEN void shmrpc__warn_once(int *flag, const char *fmt, ...) SHMRPC_PRINTF(2, 3);

#endif
