/*
 * CUDA IPC through the driver API, loaded at run time (see cuda.h): the
 * driver, its state, contexts, gauges.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <unistd.h>

#include "common/error.h"
#include "worker/link.h"
#include "worker/cuda.h"
#include "worker/cuda_driver.h"
#include "worker/cuda_impl.h"

struct cuda_state cu = { .once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER };

static void unavailable(int err, const char *fmt, ...) SHMRPC_PRINTF(2, 3);
static void unavailable(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(cu.why, sizeof(cu.why), fmt, ap);
	va_end(ap);
	cu.err = err;
	if (cu.lib)
		dlclose(cu.lib);
	cu.lib = NULL;
}

static const char *cu_name(CUresult r)
{
	const char *s = NULL;

	return cu.cuGetErrorName(r, &s) == CUDA_SUCCESS && s ? s : "unknown CUDA error";
}

static void cu_try(void)
{
	/* The stand-in driver of the tests (cuda.h); secure_getenv: never for
	 * a set-uid program. */
	const char *path = secure_getenv("SHMRPC_LIBCUDA");
	CUresult r;
	int n = 0;

	if (!path || !*path)
		path = "libcuda.so.1";
	cu.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!cu.lib) {
		unavailable(-ENOSYS, "%s not found (%s)", path, dlerror());
		return;
	}
#define X(name, params)                                                            \
	cu.name = (CUresult(*) params)dlsym(cu.lib, #name);                        \
	if (!cu.name) {                                                            \
		unavailable(-ENOSYS, "%s has no %s (driver too old)", path, #name);  \
		return;                                                            \
	}
	CUDA_DRIVER_FUNCS(X)
#undef X
	r = cu.cuInit(0);
	if (r == CUDA_SUCCESS)
		r = cu.cuDeviceGetCount(&n);
	cu.devices = n < MAX_DEVICES ? n : MAX_DEVICES;
	for (int i = 0; r == CUDA_SUCCESS && i < cu.devices; i++) {
		CUdevice dev;

		r = cu.cuDeviceGet(&dev, i);
		if (r == CUDA_SUCCESS)
			r = cu.cuDeviceGetUuid(&cu.uuid[i], dev);
	}
	if (r == CUDA_ERROR_NO_DEVICE || (r == CUDA_SUCCESS && n < 1))
		unavailable(-ENODEV, "no CUDA device");
	else if (r != CUDA_SUCCESS)
		unavailable(-ENODEV, "the driver does not start (%s)", cu_name(r));
}

/* A child forked after CUDA was loaded (a data loader's worker) inherits
 * handles the driver does not honour there: every call says so instead. */
static void forked(void)
{
	if (cu.err)
		return;
	snprintf(cu.why, sizeof(cu.why), "this process was forked from one that had started "
		 "CUDA (CUDA does not survive fork: start the child with spawn, or use CUDA only "
		 "after the fork)");
	cu.err = -ENOTSUP;
	/* The parent's lock may have been held by another of its threads. */
	pthread_mutex_init(&cu.lock, NULL);
}

static void cu_load(void)
{
	cu_try();
	pthread_atfork(NULL, NULL, forked);
	/* Release pairs with cuda_forget_peer's acquire. */
	atomic_store_explicit(&cu.tried, true, memory_order_release);
}

bool cuda_driver_ok(void)
{
	pthread_once(&cu.once, cu_load);
	return cu.err == 0;
}

/* 0, or the reason (in this thread's message) why nothing can be done. */
int cuda_ready(void)
{
	if (cuda_driver_ok())
		return 0;
	return shmrpc__fail(cu.err, "CUDA is not available on this machine: %s", cu.why);
}

int cuda_fail(CUresult r, const char *fmt, ...)
{
	const char *str = NULL;
	char what[320];
	va_list ap;
	int err;

	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	switch (r) {
	case CUDA_ERROR_OUT_OF_MEMORY:
		err = -ENOMEM;
		break;
	case CUDA_ERROR_INVALID_VALUE:
		err = -EINVAL;
		break;
	case CUDA_ERROR_NOT_PERMITTED:
	case CUDA_ERROR_NOT_SUPPORTED:
		err = -EOPNOTSUPP;
		break;
	default:
		err = -EIO;
	}
	cu.cuGetErrorString(r, &str);
	return shmrpc__fail(err, "%s: %s (%s)", what, cu_name(r), str ? str : "no description");
}

void *cuda_sym(const char *name)
{
	return cuda_driver_ok() ? dlsym(cu.lib, name) : NULL;
}

int cuda_probe(void)
{
	return cuda_ready();
}

int cuda_device_count(int *n)
{
	int rc = cuda_ready();

	*n = rc ? 0 : cu.devices;
	return rc;
}

void cuda_stats_get(struct cuda_stats *st)
{
	pthread_mutex_lock(&cu.lock);
	*st = cu.stats;
	pthread_mutex_unlock(&cu.lock);
}

/* The gauges of cu.stats into the slot of this process's worker, if an
 * agent runs, after a change. Caller holds cu.lock: stores of the counts
 * come in the order of the changes, so the slot ends with the last. */
void cuda_publish(void)
{
	struct agent *ag = worker_agent;

	if (!ag)
		return;
	/* Relaxed: gauges, which pair with nothing; shmrpc-inspect reads them
	 * relaxed and accepts a stale value. */
	atomic_store_explicit(&ag->self->cuda_maps_open, cu.stats.maps_open, memory_order_relaxed);
	atomic_store_explicit(&ag->self->cuda_events_open, cu.stats.events_open,
			      memory_order_relaxed);
	atomic_store_explicit(&ag->self->cuda_allocs_exported, cu.stats.allocs_exported,
			      memory_order_relaxed);
	atomic_store_explicit(&ag->self->cuda_events_exported, cu.stats.events_exported,
			      memory_order_relaxed);
}

/* The primary context of a device, retained once for the process's life
 * (as the runtime API and torch do). Caller holds cu.lock. */
int cuda_primary_ctx(int32_t device, CUcontext *ctx)
{
	CUdevice dev;
	CUresult r;

	if (device < 0 || device >= MAX_DEVICES)
		return shmrpc__fail(-EINVAL, "CUDA device %d is out of range", (int)device);
	if (!cu.primary[device]) {
		r = cu.cuDeviceGet(&dev, device);
		if (r == CUDA_SUCCESS)
			r = cu.cuDevicePrimaryCtxRetain(&cu.primary[device], dev);
		if (r != CUDA_SUCCESS)
			return cuda_fail(r, "opening CUDA device %d", (int)device);
	}
	*ctx = cu.primary[device];
	return 0;
}

/*
 * Every call below runs in the context it names, pushed for the call and
 * popped after it, so the caller's current context is left alone.
 */
int cuda_push_ctx(CUcontext ctx)
{
	CUresult r = cu.cuCtxPushCurrent_v2(ctx);

	return r == CUDA_SUCCESS ? 0 : cuda_fail(r, "cuCtxPushCurrent");
}

void cuda_pop_ctx(void)
{
	CUcontext ctx;

	cu.cuCtxPopCurrent_v2(&ctx);
}
