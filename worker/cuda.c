/* CUDA IPC through the driver API, loaded at run time (see cuda.h). */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "worker/link.h"
#include "worker/cuda.h"
#include "worker/cuda_driver.h"

_Static_assert(sizeof(CUipcMemHandle) == CUDA_IPC_HANDLE_SIZE &&
		       sizeof(CUipcEventHandle) == CUDA_IPC_HANDLE_SIZE,
	       "an IPC handle travels whole in cuda_ipc_desc");

/* Each driver function used, by the name the headers map it to. */
#define CUDA_DRIVER_FUNCS(X)                                                       \
	X(cuInit, (unsigned flags))                                                \
	X(cuDeviceGetCount, (int *n))                                              \
	X(cuDeviceGet, (CUdevice *dev, int ordinal))                               \
	X(cuDeviceGetUuid, (CUuuid *uuid, CUdevice dev))                           \
	X(cuCtxSynchronize, (void))                                                \
	X(cuGetErrorName, (CUresult r, const char **s))                            \
	X(cuGetErrorString, (CUresult r, const char **s))                          \
	X(cuDevicePrimaryCtxRetain, (CUcontext *ctx, CUdevice dev))                \
	X(cuCtxPushCurrent_v2, (CUcontext ctx))                                    \
	X(cuCtxPopCurrent_v2, (CUcontext *ctx))                                    \
	X(cuPointerGetAttributes, (unsigned n, int *attrs, void **data, CUdeviceptr p)) \
	X(cuMemGetAddressRange_v2, (CUdeviceptr *base, size_t *size, CUdeviceptr p)) \
	X(cuIpcGetMemHandle, (CUipcMemHandle *h, CUdeviceptr p))                   \
	X(cuIpcOpenMemHandle_v2, (CUdeviceptr *p, CUipcMemHandle h, unsigned flags)) \
	X(cuIpcCloseMemHandle, (CUdeviceptr p))                                    \
	X(cuEventCreate, (CUevent *ev, unsigned flags))                            \
	X(cuEventRecord, (CUevent ev, CUstream s))                                 \
	X(cuEventDestroy_v2, (CUevent ev))                                         \
	X(cuIpcGetEventHandle, (CUipcEventHandle *h, CUevent ev))                  \
	X(cuIpcOpenEventHandle, (CUevent *ev, CUipcEventHandle h))                 \
	X(cuStreamWaitEvent, (CUstream s, CUevent ev, unsigned flags))            \
	X(cuMemAlloc_v2, (CUdeviceptr *p, size_t n))                               \
	X(cuMemFree_v2, (CUdeviceptr p))                                           \
	X(cuStreamSynchronize, (CUstream s))                                       \
	X(cuMemcpyPeerAsync, (CUdeviceptr dst, CUcontext dctx, CUdeviceptr src,    \
			      CUcontext sctx, size_t n, CUstream s))

#define MAX_DEVICES 64
#define HANDLE_CACHE 64 /* allocations whose IPC handle the producer keeps */
/* Interprocess events in use at once (one per tensor in flight): beyond
 * it a send fails, as something never gives its events back. */
#define MAX_EXPORT_EVENTS 65536

/* Producer: an allocation already exported. */
struct export_alloc {
	uint64_t id; /* driver buffer id; 0: free slot */
	CUdeviceptr base;
	uint64_t size;
	CUipcMemHandle handle;
};

/* Producer: an interprocess event, recorded for one send at a time: it
 * is busy from cuda_export until cuda_export_done (the receiver waited
 * on it), as cuStreamWaitEvent waits for an event's latest record only. */
struct export_event {
	CUcontext ctx;
	CUevent ev;
	CUipcEventHandle handle;
	bool busy;
};

/* Receiver: a producer's allocation mapped here. */
struct import_map {
	struct import_map *next;
	uint32_t pid;
	int32_t device;
	uint64_t id, base, size; /* as the producer knows them */
	CUdeviceptr local;
	uint64_t refs;
	bool stale; /* the producer reused its addresses: close once idle */
};

/* Receiver: another process's event opened here. */
struct import_event {
	struct import_event *next;
	uint32_t pid; /* whose event */
	int32_t device;
	CUipcEventHandle handle;
	CUevent ev;
};

static struct {
	pthread_once_t once;
	/* Set (release) once loading was tried; cuda_forget_peer reads it
	 * (acquire) so that a process that never used CUDA never loads it. */
	_Atomic bool tried;
	int err;       /* 0 when the driver is usable */
	char why[256]; /* when it is not */
	int devices;   /* when it is: cuDeviceGetCount's */
	/* Each ordinal's device UUID: descriptors name devices by it, as an
	 * ordinal depends on each process's CUDA_VISIBLE_DEVICES. */
	CUuuid uuid[MAX_DEVICES];
	void *lib;
#define X(name, params) CUresult (*name) params;
	CUDA_DRIVER_FUNCS(X)
#undef X
	/* Everything below is guarded by lock. */
	pthread_mutex_t lock;
	CUcontext primary[MAX_DEVICES];
	struct export_alloc allocs[HANDLE_CACHE];
	unsigned allocs_next;
	struct export_event *evs;
	unsigned nevs;
	struct import_map *maps;
	struct import_event *events;
	struct cuda_stats stats;
} cu = { .once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER };

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

static bool driver_ok(void)
{
	pthread_once(&cu.once, cu_load);
	return cu.err == 0;
}

/* 0, or the reason (in this thread's message) why nothing can be done. */
static int ready(void)
{
	if (driver_ok())
		return 0;
	return shmrpc__fail(cu.err, "CUDA is not available on this machine: %s", cu.why);
}

static int cu_fail(CUresult r, const char *fmt, ...) SHMRPC_PRINTF(2, 3);
static int cu_fail(CUresult r, const char *fmt, ...)
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
	return driver_ok() ? dlsym(cu.lib, name) : NULL;
}

int cuda_probe(void)
{
	return ready();
}

int cuda_device_count(int *n)
{
	int rc = ready();

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
static void publish(void)
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
static int primary_ctx(int32_t device, CUcontext *ctx)
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
			return cu_fail(r, "opening CUDA device %d", (int)device);
	}
	*ctx = cu.primary[device];
	return 0;
}

/*
 * Every call below runs in the context it names, pushed for the call and
 * popped after it, so the caller's current context is left alone.
 */
static int push_ctx(CUcontext ctx)
{
	CUresult r = cu.cuCtxPushCurrent_v2(ctx);

	return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuCtxPushCurrent");
}

static void pop_ctx(void)
{
	CUcontext ctx;

	cu.cuCtxPopCurrent_v2(&ctx);
}

/* Fills d's allocation fields for the allocation id holding p; *size is
 * its size. Caller holds cu.lock, in the allocation's context. */
static int export_alloc(CUdeviceptr p, uint64_t id, struct cuda_ipc_desc *d, uint64_t *size)
{
	struct export_alloc *a = NULL;
	CUdeviceptr base;
	size_t sz;
	CUresult r;

	for (unsigned i = 0; i < HANDLE_CACHE && !a; i++)
		if (cu.allocs[i].id == id)
			a = &cu.allocs[i];
	if (a) {
		cu.stats.handle_cache_hits++;
	} else {
		CUipcMemHandle h;

		r = cu.cuMemGetAddressRange_v2(&base, &sz, p);
		if (r != CUDA_SUCCESS)
			return cu_fail(r, "cuMemGetAddressRange(0x%llx)", p);
		r = cu.cuIpcGetMemHandle(&h, base);
		if (r != CUDA_SUCCESS)
			return cu_fail(r, "cuIpcGetMemHandle(0x%llx): sending CUDA memory of "
				       "cuMemCreate or a memory pool (torch's expandable_segments, "
				       "cudaMallocAsync) is not supported yet; use torch's default "
				       "caching allocator", base);
		/* The oldest entry goes: an allocation no longer sent costs one
		 * cuIpcGetMemHandle if it comes back. */
		a = &cu.allocs[cu.allocs_next++ % HANDLE_CACHE];
		if (!a->id) {
			cu.stats.allocs_exported++;
			publish();
		}
		*a = (struct export_alloc){ .id = id, .base = base, .size = sz, .handle = h };
	}
	memcpy(d->mem_handle, &a->handle, sizeof(d->mem_handle));
	d->base = a->base;
	d->alloc_id = id;
	*size = a->size;
	return 0;
}

/* A free interprocess event of ctx (made when none is), recorded on s,
 * busy until cuda_export_done; its handle goes to d. Caller holds
 * cu.lock, in ctx. */
static int export_event(CUcontext ctx, CUstream s, struct cuda_ipc_desc *d)
{
	struct export_event *e = NULL;
	CUresult r;

	for (unsigned i = 0; i < cu.nevs && !e; i++)
		if (!cu.evs[i].busy && cu.evs[i].ctx == ctx)
			e = &cu.evs[i];
	if (!e) {
		struct export_event *grown;
		CUevent ev;

		if (cu.nevs == MAX_EXPORT_EVENTS)
			return shmrpc__fail(-ENOSPC, "%d CUDA tensors are in flight, none of them "
					    "waited on by its receiver yet: no more can be sent",
					    MAX_EXPORT_EVENTS);
		grown = realloc(cu.evs, (cu.nevs + 1) * sizeof(*grown));
		if (!grown)
			return shmrpc__fail(-ENOMEM, "out of memory for a CUDA event");
		cu.evs = grown;
		r = cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
		if (r != CUDA_SUCCESS)
			return cu_fail(r, "cuEventCreate(interprocess)");
		e = &cu.evs[cu.nevs];
		r = cu.cuIpcGetEventHandle(&e->handle, ev);
		if (r != CUDA_SUCCESS) {
			cu.cuEventDestroy_v2(ev);
			return cu_fail(r, "cuIpcGetEventHandle");
		}
		e->ctx = ctx;
		e->ev = ev;
		e->busy = false;
		cu.nevs++;
		cu.stats.events_exported++;
		publish();
	}
	r = cu.cuEventRecord(e->ev, s);
	if (r != CUDA_SUCCESS)
		return cu_fail(r, "cuEventRecord");
	e->busy = true;
	memcpy(d->event_handle, &e->handle, sizeof(d->event_handle));
	return 0;
}

/* Our event that d names. Caller holds cu.lock. */
static struct export_event *own_export_event(const struct cuda_ipc_desc *d)
{
	for (unsigned i = 0; i < cu.nevs; i++)
		if (!memcmp(&cu.evs[i].handle, d->event_handle, sizeof(d->event_handle)))
			return &cu.evs[i];
	return NULL;
}

void cuda_export_done(const struct cuda_ipc_desc *d)
{
	struct export_event *e;

	if (!driver_ok() || d->event_pid != (uint32_t)getpid())
		return;
	pthread_mutex_lock(&cu.lock);
	e = own_export_event(d);
	if (e)
		e->busy = false;
	pthread_mutex_unlock(&cu.lock);
}

/* The ordinal here of the device d names (by its UUID). */
static int local_device(const struct cuda_ipc_desc *d, int32_t *device)
{
	for (int i = 0; i < cu.devices; i++)
		if (!memcmp(&cu.uuid[i], d->uuid, sizeof(d->uuid))) {
			*device = i;
			return 0;
		}
	return shmrpc__fail(-ENODEV, "a CUDA tensor of pid %u is on a device this process does "
			    "not see (its cuda:%d there; check CUDA_VISIBLE_DEVICES of both)",
			    d->pid, (int)d->device);
}

int cuda_local_device(const struct cuda_ipc_desc *d, int32_t *device)
{
	return ready() ?: local_device(d, device);
}

int cuda_export(const void *dptr, uint64_t len, uintptr_t stream, struct cuda_ipc_desc *out)
{
	CUdeviceptr p = (uintptr_t)dptr;
	int attrs[] = { CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_CONTEXT,
			CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_BUFFER_ID };
	unsigned memtype = 0;
	CUcontext ctx = NULL;
	int device = -1;
	unsigned long long id = 0;
	void *data[] = { &memtype, &ctx, &device, &id };
	uint64_t size = 0;
	CUresult r;
	int rc;

	rc = ready();
	if (rc)
		return rc;
	/* One call for all four; a pointer CUDA does not know reads as
	 * memory type 0, not as an error. */
	r = cu.cuPointerGetAttributes(4, attrs, data, p);
	if (r != CUDA_SUCCESS)
		return cu_fail(r, "cuPointerGetAttributes(%p)", dptr);
	if (memtype != CU_MEMORYTYPE_DEVICE || id == 0)
		return shmrpc__fail(-EINVAL, "%p is not CUDA device memory", dptr);
	memset(out, 0, sizeof(*out));
	pthread_mutex_lock(&cu.lock);
	/* Memory that belongs to no context (cuMemCreate) fails below, in the
	 * device's primary context, with cuIpcGetMemHandle's reason. */
	rc = ctx ? 0 : primary_ctx(device, &ctx);
	if (!rc)
		rc = push_ctx(ctx);
	if (!rc) {
		rc = export_alloc(p, id, out, &size);
		if (!rc && len > out->base + size - p)
			rc = shmrpc__fail(-EINVAL, "%llu bytes at %p leave their CUDA allocation "
					  "(0x%llx, %llu bytes)", (unsigned long long)len, dptr,
					  (unsigned long long)out->base, (unsigned long long)size);
		if (!rc)
			rc = export_event(ctx, (CUstream)stream, out);
		pop_ctx();
	}
	if (!rc)
		cu.stats.exports++;
	pthread_mutex_unlock(&cu.lock);
	if (rc)
		return rc;
	out->offset = p - out->base;
	out->len = len;
	/* The receiver bounds the mapping by it: what the driver says of an
	 * IPC mapping's range is not documented (it may be a whole block of
	 * sub-allocations). */
	out->size = size;
	out->pid = (uint32_t)getpid();
	out->event_pid = out->pid;
	out->device = device;
	memcpy(out->uuid, &cu.uuid[device], sizeof(out->uuid));
	return 0;
}

int cuda_export_forward(const struct cuda_ipc_desc *in, uintptr_t stream, struct cuda_ipc_desc *out)
{
	uint32_t self = (uint32_t)getpid();
	CUcontext ctx;
	int32_t device;
	int rc = ready();

	if (rc)
		return rc;
	/* Our own allocation (it came back to us): described afresh. */
	if (in->pid == self)
		return cuda_export((const void *)(uintptr_t)(in->base + in->offset), in->len, stream,
				   out);
	*out = *in;
	pthread_mutex_lock(&cu.lock);
	rc = local_device(in, &device) ?: primary_ctx(device, &ctx);
	if (!rc)
		rc = push_ctx(ctx);
	if (!rc) {
		rc = export_event(ctx, (CUstream)stream, out);
		pop_ctx();
	}
	pthread_mutex_unlock(&cu.lock);
	out->event_pid = self;
	return rc;
}

/* The event of ours that d names, and its context. Caller holds cu.lock. */
static int own_event(const struct cuda_ipc_desc *d, CUevent *ev, CUcontext *ctx)
{
	struct export_event *e = own_export_event(d);

	if (!e)
		return shmrpc__fail(-EINVAL, "a CUDA descriptor of this process names an event it "
				    "never recorded");
	*ev = e->ev;
	*ctx = e->ctx;
	return 0;
}

/* A descriptor this process exported, with its own event: its own pointer,
 * after that event. */
static int import_local(const struct cuda_ipc_desc *d, CUstream s, void **dptr)
{
	CUevent ev = NULL;
	CUcontext ctx = NULL;
	CUresult r;
	int rc;

	pthread_mutex_lock(&cu.lock);
	rc = own_event(d, &ev, &ctx);
	pthread_mutex_unlock(&cu.lock);
	if (rc)
		return rc;
	rc = push_ctx(ctx);
	if (rc)
		return rc;
	r = cu.cuStreamWaitEvent(s, ev, 0);
	pop_ctx();
	if (r != CUDA_SUCCESS)
		return cu_fail(r, "cuStreamWaitEvent");
	*dptr = (void *)(uintptr_t)(d->base + d->offset);
	return 0;
}

static struct import_map *find_map(uint32_t pid, uint64_t id)
{
	for (struct import_map *m = cu.maps; m; m = m->next)
		if (m->pid == pid && m->id == id)
			return m;
	return NULL;
}

/* Closes and frees m, unlinked by the caller (holding cu.lock). */
static void unmap(struct import_map *m)
{
	/* A failure leaves nothing to do: the mapping is forgotten either way. */
	if (!push_ctx(cu.primary[m->device])) {
		cu.cuIpcCloseMemHandle(m->local);
		pop_ctx();
	}
	free(m);
	cu.stats.maps_open--;
	publish();
}

/* fresh is a new allocation of its producer: any other mapping of that
 * producer over the same addresses was freed there, so it goes (now if
 * idle, else at its last release). True when one is still referenced. */
static bool drop_overlapped(const struct import_map *fresh)
{
	struct import_map **pp = &cu.maps, *m;
	bool held = false;

	while ((m = *pp)) {
		if (m != fresh && m->pid == fresh->pid && m->base < fresh->base + fresh->size &&
		    fresh->base < m->base + m->size) {
			m->stale = true;
			if (!m->refs) {
				*pp = m->next;
				unmap(m);
				continue;
			}
			held = true;
		}
		pp = &m->next;
	}
	return held;
}

/* d's allocation mapped, one reference more; *stale as cuda_import's.
 * Caller holds cu.lock, in the primary context of device (d's, here). */
static int import_map(const struct cuda_ipc_desc *d, int32_t device, struct import_map **out,
		      bool *stale)
{
	struct import_map *m = find_map(d->pid, d->alloc_id);
	CUipcMemHandle h;
	CUresult r;

	if (m) {
		cu.stats.cache_hits++;
	} else {
		m = calloc(1, sizeof(*m));
		if (!m)
			return shmrpc__fail(-ENOMEM, "out of memory for a CUDA mapping");
		memcpy(&h, d->mem_handle, sizeof(h));
		r = cu.cuIpcOpenMemHandle_v2(&m->local, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
		if (r != CUDA_SUCCESS) {
			free(m);
			return cu_fail(r, "cuIpcOpenMemHandle (allocation of pid %u on device %d)",
				       d->pid, (int)d->device);
		}
		cu.stats.opens++;
		/* Open from here: unmap closes it, on every path. */
		cu.stats.maps_open++;
		publish();
		/* The producer's size of the allocation bounds every
		 * descriptor of it, and tells which of the producer's
		 * addresses it covers (drop_overlapped). */
		m->device = device;
		m->pid = d->pid;
		m->id = d->alloc_id;
		m->base = d->base;
		m->size = d->size;
		m->next = cu.maps;
		cu.maps = m;
		if (drop_overlapped(m) && stale)
			*stale = true;
	}
	if (d->offset > m->size || d->len > m->size - d->offset)
		return shmrpc__fail(-EINVAL, "CUDA descriptor (offset %llu, %llu bytes) leaves its "
				    "allocation of %llu bytes", (unsigned long long)d->offset,
				    (unsigned long long)d->len, (unsigned long long)m->size);
	m->refs++;
	*out = m;
	return 0;
}

/* d names an allocation of this process: it must be one, and hold the
 * range. Caller holds cu.lock, in the primary context of d->device. */
static int check_own(const struct cuda_ipc_desc *d)
{
	CUdeviceptr base;
	size_t size;
	CUresult r = cu.cuMemGetAddressRange_v2(&base, &size, d->base);

	if (r != CUDA_SUCCESS)
		return cu_fail(r, "a CUDA descriptor names 0x%llx of this process",
			       (unsigned long long)d->base);
	if (base != d->base || d->offset > size || d->len > size - d->offset)
		return shmrpc__fail(-EINVAL, "a CUDA descriptor (offset %llu, %llu bytes at 0x%llx) "
				    "leaves this process's allocation", (unsigned long long)d->offset,
				    (unsigned long long)d->len, (unsigned long long)d->base);
	return 0;
}

/* d's event, opened here. Caller holds cu.lock, in the primary context of
 * device (d's, here). */
static int import_event(const struct cuda_ipc_desc *d, int32_t device, CUevent *ev)
{
	struct import_event *e;
	CUresult r;

	for (e = cu.events; e; e = e->next)
		if (e->pid == d->event_pid && !memcmp(&e->handle, d->event_handle, sizeof(e->handle))) {
			*ev = e->ev;
			return 0;
		}
	e = calloc(1, sizeof(*e));
	if (!e)
		return shmrpc__fail(-ENOMEM, "out of memory for a CUDA event");
	memcpy(&e->handle, d->event_handle, sizeof(e->handle));
	r = cu.cuIpcOpenEventHandle(&e->ev, e->handle);
	if (r != CUDA_SUCCESS) {
		free(e);
		return cu_fail(r, "cuIpcOpenEventHandle (event of pid %u)", d->event_pid);
	}
	e->pid = d->event_pid;
	e->device = device;
	e->next = cu.events;
	cu.events = e;
	cu.stats.events_open++;
	publish();
	*ev = e->ev;
	return 0;
}

/* d's bytes here (*src) and the event to wait for, with one reference on
 * d's mapping (*m; NULL for our own allocation). Caller holds cu.lock, in
 * the primary context of device (d's, here). */
static int import_source(const struct cuda_ipc_desc *d, int32_t device, struct import_map **m,
			 CUevent *ev, CUdeviceptr *src, bool *stale)
{
	uint32_t self = (uint32_t)getpid();
	CUcontext ctx;
	int rc;

	*m = NULL;
	/* Our own allocation, passed back by a receiver: nothing to map, but
	 * the range comes from another process. */
	rc = d->pid == self ? check_own(d) : import_map(d, device, m, stale);
	/* Our own event (a tensor we received, sent to ourselves): the driver
	 * opens no handle of the calling process. */
	if (!rc)
		rc = d->event_pid == self ? own_event(d, ev, &ctx) : import_event(d, device, ev);
	if (rc && *m)
		(*m)->refs--; /* the mapping stays cached; only the reference goes */
	if (!rc)
		*src = (*m ? (*m)->local : d->base) + d->offset;
	return rc;
}

int cuda_import(const struct cuda_ipc_desc *d, uintptr_t stream, void **dptr, bool *stale)
{
	struct import_map *m = NULL;
	CUevent ev = NULL;
	CUdeviceptr src;
	CUresult r;
	CUcontext ctx;
	int32_t device;
	int rc;

	uint32_t self = (uint32_t)getpid();

	if (stale)
		*stale = false;
	rc = ready();
	if (rc)
		return rc;
	if (d->pid == self && d->event_pid == self)
		return import_local(d, (CUstream)stream, dptr);
	pthread_mutex_lock(&cu.lock);
	rc = local_device(d, &device) ?: primary_ctx(device, &ctx);
	if (!rc)
		rc = push_ctx(ctx);
	if (!rc) {
		rc = import_source(d, device, &m, &ev, &src, stale);
		if (!rc) {
			r = cu.cuStreamWaitEvent((CUstream)stream, ev, 0);
			if (r != CUDA_SUCCESS)
				rc = cu_fail(r, "cuStreamWaitEvent");
			if (rc && m)
				m->refs--;
		}
		/* Under the lock: cuda_forget_peer may free m once it is dropped. */
		if (!rc)
			*dptr = (void *)(uintptr_t)src;
		pop_ctx();
	}
	pthread_mutex_unlock(&cu.lock);
	return rc;
}

int cuda_order(int32_t device, uintptr_t from, uintptr_t to)
{
	CUcontext ctx;
	CUevent ev;
	CUresult r;
	int rc = ready();

	if (rc || from == to)
		return rc;
	pthread_mutex_lock(&cu.lock);
	rc = primary_ctx(device, &ctx) ?: push_ctx(ctx);
	pthread_mutex_unlock(&cu.lock);
	if (rc)
		return rc;
	/* An event of this wait alone: recorded once, so nothing records it
	 * again before the wait is queued. Destroying it with the wait still
	 * queued is allowed (the driver frees it after). */
	r = cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
	if (r == CUDA_SUCCESS) {
		r = cu.cuEventRecord(ev, (CUstream)from);
		if (r == CUDA_SUCCESS)
			r = cu.cuStreamWaitEvent((CUstream)to, ev, 0);
		cu.cuEventDestroy_v2(ev);
	}
	pop_ctx();
	return r == CUDA_SUCCESS ? 0 : cu_fail(r, "ordering CUDA stream 0x%lx after 0x%lx on "
					       "device %d", (unsigned long)to, (unsigned long)from,
					       (int)device);
}

int cuda_import_copy(const struct cuda_ipc_desc *d, int32_t device, void **copy, bool *stale)
{
	struct import_map *m = NULL;
	CUdeviceptr src = 0, dst = 0;
	CUcontext sctx, dctx;
	CUevent ev = NULL;
	CUresult r;
	int32_t from;
	int rc;

	*stale = false;
	rc = ready();
	if (rc)
		return rc;
	pthread_mutex_lock(&cu.lock);
	rc = local_device(d, &from) ?: primary_ctx(from, &sctx) ?: primary_ctx(device, &dctx) ?:
	     push_ctx(sctx);
	if (!rc) {
		rc = import_source(d, from, &m, &ev, &src, stale);
		pop_ctx();
	}
	if (!rc && (rc = push_ctx(dctx)) && m)
		m->refs--;
	if (!rc) {
		/* The GPU waits for the sender's writes before the copy; the
		 * host never does. Stream 0: the legacy default stream of the
		 * landing device, where the receiver's own work goes. */
		r = cu.cuStreamWaitEvent(NULL, ev, 0);
		if (r != CUDA_SUCCESS)
			rc = cu_fail(r, "cuStreamWaitEvent");
		if (!rc && (r = cu.cuMemAlloc_v2(&dst, d->len ? d->len : 1)) != CUDA_SUCCESS)
			rc = cu_fail(r, "allocating %llu bytes on CUDA device %d for a tensor landing "
				     "there", (unsigned long long)d->len, (int)device);
		if (!rc && (r = cu.cuMemcpyPeerAsync(dst, dctx, src, sctx, d->len, NULL)) !=
				   CUDA_SUCCESS) {
			rc = cu_fail(r, "copying %llu bytes from CUDA device %d to device %d",
				     (unsigned long long)d->len, (int)from, (int)device);
			cu.cuMemFree_v2(dst);
		}
		if (rc && m)
			m->refs--;
		pop_ctx();
	}
	pthread_mutex_unlock(&cu.lock);
	if (!rc)
		*copy = (void *)(uintptr_t)dst;
	return rc;
}

void cuda_free(int32_t device, void *p)
{
	CUcontext ctx;

	pthread_mutex_lock(&cu.lock);
	/* A failure leaves nothing to do: the memory is lost either way. */
	if (!primary_ctx(device, &ctx) && !push_ctx(ctx)) {
		cu.cuMemFree_v2((CUdeviceptr)(uintptr_t)p);
		pop_ctx();
	}
	pthread_mutex_unlock(&cu.lock);
}

int cuda_stream_sync(int32_t device, uintptr_t stream)
{
	CUcontext ctx;
	CUresult r;
	int rc = ready();

	if (rc)
		return rc;
	pthread_mutex_lock(&cu.lock);
	rc = primary_ctx(device, &ctx) ?: push_ctx(ctx);
	pthread_mutex_unlock(&cu.lock);
	if (rc)
		return rc;
	/* Outside cu.lock: the GPU may take a while, and others need the lock.
	 * A per-thread default stream is its thread's own, and this may be
	 * another thread: the whole context is waited for instead. */
	r = (CUstream)stream == CU_STREAM_PER_THREAD ? cu.cuCtxSynchronize()
						     : cu.cuStreamSynchronize((CUstream)stream);
	pop_ctx();
	return r == CUDA_SUCCESS ? 0 : cu_fail(r, "cuStreamSynchronize");
}

void cuda_import_release(const struct cuda_ipc_desc *d, bool keep)
{
	struct import_map **pp, *m;

	if (!driver_ok() || d->pid == (uint32_t)getpid())
		return;
	pthread_mutex_lock(&cu.lock);
	for (pp = &cu.maps; (m = *pp); pp = &m->next)
		if (m->pid == d->pid && m->id == d->alloc_id)
			break;
	if (m && m->refs && !--m->refs && (m->stale || !keep)) {
		*pp = m->next;
		unmap(m);
	}
	pthread_mutex_unlock(&cu.lock);
}

bool cuda_import_stale(const struct cuda_ipc_desc *d)
{
	struct import_map *m;
	bool stale;

	if (!driver_ok() || d->pid == (uint32_t)getpid())
		return false;
	pthread_mutex_lock(&cu.lock);
	m = find_map(d->pid, d->alloc_id);
	stale = !m || m->stale;
	pthread_mutex_unlock(&cu.lock);
	return stale;
}

void cuda_forget_peer(uint32_t pid)
{
	struct import_map **mp = &cu.maps, *m;
	struct import_event **ep = &cu.events, *e;

	/* Acquire pairs with cu_load's release: not tried, nothing opened. */
	if (!atomic_load_explicit(&cu.tried, memory_order_acquire) || !driver_ok())
		return;
	pthread_mutex_lock(&cu.lock);
	while ((m = *mp)) {
		if (m->pid != pid) {
			mp = &m->next;
			continue;
		}
		*mp = m->next;
		unmap(m);
	}
	while ((e = *ep)) {
		if (e->pid != pid) {
			ep = &e->next;
			continue;
		}
		*ep = e->next;
		if (!push_ctx(cu.primary[e->device])) {
			cu.cuEventDestroy_v2(e->ev);
			pop_ctx();
		}
		free(e);
		cu.stats.events_open--;
		publish();
	}
	pthread_mutex_unlock(&cu.lock);
}
