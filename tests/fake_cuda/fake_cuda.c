/*
 * A stand-in for libcuda.so.1, for tests on machines without a GPU: the
 * driver entry points worker/cuda.c uses (and the few a test drives the
 * "GPU" with), with host memory playing device memory. Loaded by naming it
 * in SHMRPC_LIBCUDA (worker/cuda.h); never on a real GPU.
 *
 * - FAKE_CUDA_DEVICES devices (1 to 16; 1 when unset), ordinals from 0,
 *   each with one primary context. Contexts are a per-thread stack (push,
 *   pop, set); the calls that need a current context fail without one,
 *   as the driver's do, so a caller that forgets to push one is caught.
 *   An allocation, and a mapping, belongs to the device of the context
 *   current when it was made (cuPointerGetAttributes says which).
 * - Device memory: each cuMemAlloc is a memfd of its own, mapped
 *   MAP_SHARED, named "fake-cuda:PID:ID" with a buffer id unique in the
 *   process (never reused, as the driver's). An IPC memory handle holds
 *   (pid, fd, size, id); cuIpcOpenMemHandle opens /proc/PID/fd/FD, checks
 *   by the name that the fd is still that allocation, and maps it: the
 *   receiver reads and writes the producer's bytes. A mapping is an
 *   allocation of its own here (its own buffer id) that only
 *   cuIpcCloseMemHandle releases, and whose IPC handle cannot be taken.
 * - Streams and events are objects that every call checks against the
 *   live ones (a destroyed or made-up handle fails); work is synchronous,
 *   so recording and waiting do nothing else, and cuMemcpyPeerAsync copies
 *   at once (between two known ranges of the contexts it names). An IPC event handle holds
 *   (pid, event id); only an event made with CU_EVENT_INTERPROCESS and
 *   CU_EVENT_DISABLE_TIMING has one.
 * - fakeCuAllocCount(): allocations of this process not yet freed
 *   (mappings not counted), for tests that check memory went back.
 * - fakeCuStreamWaits(s) / fakeCuStreamSyncs(s): how many
 *   cuStreamWaitEvent / cuStreamSynchronize calls stream s had (0,
 *   CU_STREAM_LEGACY and CU_STREAM_PER_THREAD each count as their own),
 *   for tests that check a consumer's stream was ordered, or drained
 *   before a release.
 *
 * Values and layouts are the real driver's (cuda.h), as
 * worker/cuda_driver.h declares them for worker/cuda.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "worker/cuda_driver.h"

#define EXPORT __attribute__((visibility("default")))

/* The entry points are the driver's, whose prototypes are in the toolkit's
 * cuda.h, which is not on the include path (worker/cuda.c). */
#pragma GCC diagnostic ignored "-Wmissing-prototypes"

#define MEM_MAGIC 0x4d454d4b414b4146ull /* "FAKAKMEM" */
#define EVENT_MAGIC 0x5645454b414b4146ull

struct CUctx_st {
	int device;
};

struct alloc {
	struct alloc *next;
	CUdeviceptr base;
	size_t size;
	unsigned long long id;
	int device;
	int fd;        /* own allocations: the memfd; mappings: -1 */
	bool imported; /* a mapping of another process's allocation */
};

struct CUstream_st {
	struct CUstream_st *next;
	int waits; /* cuStreamWaitEvent calls on it */
	int syncs; /* cuStreamSynchronize calls on it */
};

/* The handles the driver gives the default streams: 0, and cuda.h's
 * CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, which DLPack consumers pass
 * (as 1 and 2). */
#define SPECIAL_STREAMS 3
static int special_waits[SPECIAL_STREAMS], special_syncs[SPECIAL_STREAMS];

struct CUevent_st {
	struct CUevent_st *next;
	unsigned flags;
	unsigned long long id;
	bool imported;
};

struct mem_handle {
	uint64_t magic;
	uint32_t pid;
	int32_t fd;
	uint64_t size;
	uint64_t id;
};

struct event_handle {
	uint64_t magic;
	uint32_t pid;
	uint32_t pad;
	uint64_t id;
};

_Static_assert(sizeof(struct mem_handle) <= sizeof(CUipcMemHandle), "handle fits");
_Static_assert(sizeof(struct event_handle) <= sizeof(CUipcEventHandle), "handle fits");

#define MAX_DEVICES 16
static struct CUctx_st primary[MAX_DEVICES];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *allocs;
static struct CUstream_st *streams;
static struct CUevent_st *events;
static unsigned long long next_id = 1; /* buffer and event ids, never reused */
static int owned;                      /* own allocations not yet freed */

#define CTX_DEPTH 16
static __thread CUcontext stack[CTX_DEPTH];
static __thread int depth;

static CUcontext current(void)
{
	return depth ? stack[depth - 1] : NULL;
}

/* FAKE_CUDA_DEVICES, read once. */
static int ndevices;

static void count_devices(void)
{
	const char *s = getenv("FAKE_CUDA_DEVICES");
	int n = s && *s ? atoi(s) : 1;

	ndevices = n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
	for (int i = 0; i < MAX_DEVICES; i++)
		primary[i].device = i;
}

static int devices(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;

	pthread_once(&once, count_devices);
	return ndevices;
}

static bool is_ctx(CUcontext ctx)
{
	return ctx >= primary && ctx < primary + devices();
}

EXPORT CUresult cuInit(unsigned flags)
{
	return flags ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *n)
{
	*n = devices();
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
	if (ordinal < 0 || ordinal >= devices())
		return CUDA_ERROR_INVALID_DEVICE;
	*dev = ordinal;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult r, const char **s)
{
	static const struct {
		CUresult r;
		const char *name;
	} names[] = {
		{ CUDA_SUCCESS, "CUDA_SUCCESS" },
		{ CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE" },
		{ CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY" },
		{ CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE" },
		{ CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT" },
		{ CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED" },
		{ CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE" },
		{ CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND" },
	};

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (names[i].r == r) {
			*s = names[i].name;
			return CUDA_SUCCESS;
		}
	*s = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s)
{
	CUresult rc = cuGetErrorName(r, s);

	if (rc == CUDA_SUCCESS)
		*s = "fake CUDA driver (tests/fake_cuda)";
	return rc;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
	if (dev < 0 || dev >= devices())
		return CUDA_ERROR_INVALID_DEVICE;
	*ctx = &primary[dev];
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
	if (!is_ctx(ctx))
		return CUDA_ERROR_INVALID_CONTEXT;
	if (depth == CTX_DEPTH)
		return CUDA_ERROR_INVALID_VALUE;
	stack[depth++] = ctx;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
	if (!depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	*ctx = stack[--depth];
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
	if (ctx && !is_ctx(ctx))
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!ctx) {
		if (depth)
			depth--;
		return CUDA_SUCCESS;
	}
	if (!depth)
		depth = 1;
	stack[depth - 1] = ctx;
	return CUDA_SUCCESS;
}

/* The allocation holding p. Caller holds lock. */
static struct alloc *find(CUdeviceptr p)
{
	for (struct alloc *a = allocs; a; a = a->next)
		if (p >= a->base && p - a->base < a->size)
			return a;
	return NULL;
}

/* In the current context (the caller checked there is one). */
static CUresult add_alloc(void *at, size_t size, int fd, bool imported, CUdeviceptr *p)
{
	struct alloc *a = calloc(1, sizeof(*a));

	if (!a)
		return CUDA_ERROR_OUT_OF_MEMORY;
	a->device = current()->device;
	a->base = (CUdeviceptr)(uintptr_t)at;
	a->size = size;
	a->fd = fd;
	a->imported = imported;
	pthread_mutex_lock(&lock);
	a->id = next_id++;
	a->next = allocs;
	allocs = a;
	owned += !imported;
	pthread_mutex_unlock(&lock);
	*p = a->base;
	return CUDA_SUCCESS;
}

/* Unlinks the allocation starting at p, if it is of the kind. */
static struct alloc *take_alloc(CUdeviceptr p, bool imported)
{
	struct alloc **pp, *a;

	pthread_mutex_lock(&lock);
	for (pp = &allocs; (a = *pp); pp = &a->next)
		if (a->base == p && a->imported == imported) {
			*pp = a->next;
			owned -= !imported;
			break;
		}
	pthread_mutex_unlock(&lock);
	return a;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
	char name[64];
	void *at;
	int fd;
	CUresult r;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!n)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&lock);
	snprintf(name, sizeof(name), "fake-cuda:%d:%llu", (int)getpid(), next_id);
	pthread_mutex_unlock(&lock);
	fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (ftruncate(fd, (off_t)n) ||
	    (at = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	r = add_alloc(at, n, fd, false, p);
	if (r != CUDA_SUCCESS) {
		munmap(at, n);
		close(fd);
	}
	return r;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
	struct alloc *a = take_alloc(p, false);

	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)(uintptr_t)a->base, a->size);
	close(a->fd);
	free(a);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p)
{
	struct alloc *a;
	unsigned long long id = 0;
	int device = -2;

	pthread_mutex_lock(&lock);
	a = find(p);
	if (a) {
		id = a->id;
		device = a->device;
	}
	pthread_mutex_unlock(&lock);
	/* As the driver: memory it does not know is memory type 0, no error. */
	for (unsigned i = 0; i < n; i++) {
		switch (attrs[i]) {
		case CU_POINTER_ATTRIBUTE_CONTEXT:
			*(CUcontext *)data[i] = a ? &primary[device] : NULL;
			break;
		case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
			*(unsigned *)data[i] = a ? CU_MEMORYTYPE_DEVICE : 0;
			break;
		case CU_POINTER_ATTRIBUTE_BUFFER_ID:
			*(unsigned long long *)data[i] = id;
			break;
		case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
			*(int *)data[i] = device;
			break;
		default:
			return CUDA_ERROR_INVALID_VALUE;
		}
	}
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	struct alloc *a;

	pthread_mutex_lock(&lock);
	a = find(p);
	if (a) {
		*base = a->base;
		*size = a->size;
	}
	pthread_mutex_unlock(&lock);
	return a ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
	struct mem_handle mh = { MEM_MAGIC, (uint32_t)getpid(), -1, 0, 0 };
	struct alloc *a;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	a = find(p);
	if (a && a->base == p && !a->imported) {
		mh.fd = a->fd;
		mh.size = a->size;
		mh.id = a->id;
	}
	pthread_mutex_unlock(&lock);
	if (mh.fd < 0)
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof(*h));
	memcpy(h, &mh, sizeof(mh));
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags)
{
	struct mem_handle mh;
	char path[64], want[64], got[128];
	struct stat st;
	ssize_t n;
	void *at;
	int fd;
	CUresult r;

	(void)flags;
	memcpy(&mh, &h, sizeof(mh));
	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	/* The driver refuses a handle of the calling process itself. */
	if (mh.magic != MEM_MAGIC || mh.pid == (uint32_t)getpid() || mh.fd < 0 || !mh.size)
		return CUDA_ERROR_INVALID_HANDLE;
	snprintf(path, sizeof(path), "/proc/%u/fd/%d", mh.pid, mh.fd);
	snprintf(want, sizeof(want), "/memfd:fake-cuda:%u:%llu ", mh.pid, (unsigned long long)mh.id);
	n = readlink(path, got, sizeof(got) - 1);
	if (n < 0)
		return CUDA_ERROR_INVALID_HANDLE; /* its process or allocation is gone */
	got[n] = '\0';
	/* The fd number may have been reused: the name says which allocation. */
	if (strncmp(got, want, strlen(want)))
		return CUDA_ERROR_INVALID_HANDLE;
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_INVALID_HANDLE;
	if (fstat(fd, &st) || (uint64_t)st.st_size != mh.size ||
	    (at = mmap(NULL, mh.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
		close(fd);
		return CUDA_ERROR_MAP_FAILED;
	}
	close(fd);
	r = add_alloc(at, mh.size, -1, true, p);
	if (r != CUDA_SUCCESS)
		munmap(at, mh.size);
	return r;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
	struct alloc *a;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	a = take_alloc(p, true);
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)(uintptr_t)a->base, a->size);
	free(a);
	return CUDA_SUCCESS;
}

/* Caller holds lock. */
static bool stream_ok(CUstream s)
{
	if ((uintptr_t)s < SPECIAL_STREAMS)
		return true; /* a default stream */
	for (struct CUstream_st *x = streams; x; x = x->next)
		if (x == s)
			return true;
	return false;
}

static bool event_ok(CUevent ev)
{
	for (struct CUevent_st *x = events; x; x = x->next)
		if (x == ev)
			return true;
	return false;
}

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
	struct CUstream_st *x;

	(void)flags;
	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!(x = calloc(1, sizeof(*x))))
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&lock);
	x->next = streams;
	streams = x;
	pthread_mutex_unlock(&lock);
	*s = x;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
	struct CUstream_st **pp, *x;

	pthread_mutex_lock(&lock);
	for (pp = &streams; (x = *pp); pp = &x->next)
		if (x == s) {
			*pp = x->next;
			break;
		}
	pthread_mutex_unlock(&lock);
	if (!x)
		return CUDA_ERROR_INVALID_HANDLE;
	free(x);
	return CUDA_SUCCESS;
}

/* Where s's waits (syncs: its synchronizations) are counted; s is a live
 * stream. Caller holds lock. */
static int *stream_count(CUstream s, bool syncs)
{
	if ((uintptr_t)s < SPECIAL_STREAMS)
		return syncs ? &special_syncs[(uintptr_t)s] : &special_waits[(uintptr_t)s];
	return syncs ? &s->syncs : &s->waits;
}

EXPORT CUresult cuStreamSynchronize(CUstream s)
{
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	ok = stream_ok(s);
	if (ok)
		(*stream_count(s, true))++;
	pthread_mutex_unlock(&lock);
	return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult new_event(unsigned flags, bool imported, unsigned long long id, CUevent *ev)
{
	struct CUevent_st *x;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!(x = calloc(1, sizeof(*x))))
		return CUDA_ERROR_OUT_OF_MEMORY;
	x->flags = flags;
	x->imported = imported;
	pthread_mutex_lock(&lock);
	x->id = imported ? id : next_id++;
	x->next = events;
	events = x;
	pthread_mutex_unlock(&lock);
	*ev = x;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(CUevent *ev, unsigned flags)
{
	return new_event(flags, false, 0, ev);
}

EXPORT CUresult cuEventRecord(CUevent ev, CUstream s)
{
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	/* An opened interprocess event cannot be recorded here (the driver's rule). */
	ok = event_ok(ev) && !ev->imported && stream_ok(s);
	pthread_mutex_unlock(&lock);
	return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

EXPORT CUresult cuEventDestroy_v2(CUevent ev)
{
	struct CUevent_st **pp, *x;

	pthread_mutex_lock(&lock);
	for (pp = &events; (x = *pp); pp = &x->next)
		if (x == ev) {
			*pp = x->next;
			break;
		}
	pthread_mutex_unlock(&lock);
	if (!x)
		return CUDA_ERROR_INVALID_HANDLE;
	free(x);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent ev)
{
	struct event_handle eh = { EVENT_MAGIC, (uint32_t)getpid(), 0, 0 };
	bool ok;

	pthread_mutex_lock(&lock);
	ok = event_ok(ev) && !ev->imported &&
	     (ev->flags & (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)) ==
		     (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
	if (ok)
		eh.id = ev->id;
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof(*h));
	memcpy(h, &eh, sizeof(eh));
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenEventHandle(CUevent *ev, CUipcEventHandle h)
{
	struct event_handle eh;

	memcpy(&eh, &h, sizeof(eh));
	if (eh.magic != EVENT_MAGIC || eh.pid == (uint32_t)getpid() || !eh.id)
		return CUDA_ERROR_INVALID_HANDLE;
	/* Its process must still be there, as the driver's would. */
	if (kill((pid_t)eh.pid, 0) && errno == ESRCH)
		return CUDA_ERROR_INVALID_HANDLE;
	return new_event(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, true, eh.id, ev);
}



EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent ev, unsigned flags)
{
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	ok = !flags && event_ok(ev) && stream_ok(s);
	if (ok)
		(*stream_count(s, false))++;
	pthread_mutex_unlock(&lock);
	return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Both ranges must be known memory of the contexts named. */
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
				  size_t n, CUstream s)
{
	struct alloc *d, *f;
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!is_ctx(dctx) || !is_ctx(sctx))
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	d = find(dst);
	f = find(src);
	ok = stream_ok(s) && d && f && d->device == dctx->device && f->device == sctx->device &&
	     n <= d->size - (dst - d->base) && n <= f->size - (src - f->base);
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
	return CUDA_SUCCESS;
}

EXPORT int fakeCuAllocCount(void)
{
	int n;

	pthread_mutex_lock(&lock);
	n = owned;
	pthread_mutex_unlock(&lock);
	return n;
}

/* The count of s (a live stream), or -1. */
static int stream_counted(CUstream s, bool syncs)
{
	int n = -1;

	pthread_mutex_lock(&lock);
	if (stream_ok(s))
		n = *stream_count(s, syncs);
	pthread_mutex_unlock(&lock);
	return n;
}

EXPORT int fakeCuStreamSyncs(CUstream s)
{
	return stream_counted(s, true);
}

EXPORT int fakeCuStreamWaits(CUstream s)
{
	return stream_counted(s, false);
}
