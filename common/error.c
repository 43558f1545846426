/* The per-thread error message and shmrpc_strerror(). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "shmrpc.h"
#include "common/error.h"

static _Thread_local char errmsg[1024];

int shmrpc__vfail(int err, const char *fmt, va_list ap)
{
	vsnprintf(errmsg, sizeof(errmsg), fmt, ap);
	return err;
}

int shmrpc__fail(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	shmrpc__vfail(err, fmt, ap);
	va_end(ap);
	return err;
}

void shmrpc__warn_once(int *flag, const char *fmt, ...)
{
	va_list ap;

	/* Relaxed is enough: a duplicate line in a race is harmless. */
	if (__atomic_exchange_n(flag, 1, __ATOMIC_RELAXED))
		return;
	fputs("shmrpc: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

const char *shmrpc_errmsg(void)
{
	return errmsg;
}

const char *shmrpc_strerror(int err)
{
	if (err > 0)
		err = -err;
	switch (err) {
	case 0:
		return "success";
	case -SHMRPC_EBADSEG:
		return "not a shmrpc segment";
	case -SHMRPC_EVERSION:
		return "shmrpc segment format not supported by this library";
	case -SHMRPC_ETRUNC:
		return "shmrpc segment truncated";
	case -SHMRPC_ECORRUPT:
		return "corrupted shared memory (a frame or a shared structure failed its check)";
	case -SHMRPC_EPEERDEAD:
		return "peer worker died";
	case -SHMRPC_EREMOTE:
		return "the remote call failed";
	default:
		return strerror(-err);
	}
}
