/*
 * CUDA IPC, the receiver's side: mappings and events of peers'
 * allocations (see cuda.h).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "worker/cuda.h"
#include "worker/cuda_driver.h"
#include "worker/cuda_impl.h"

/* The event of ours that d names, and its context. Caller holds cu.lock. */
static int own_event(const struct cuda_ipc_desc *d, CUevent *ev, CUcontext *ctx)
{
	struct export_event *e = cuda_own_export_event(d);

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
	rc = cuda_push_ctx(ctx);
	if (rc)
		return rc;
	r = cu.cuStreamWaitEvent(s, ev, 0);
	cuda_pop_ctx();
	if (r != CUDA_SUCCESS)
		return cuda_fail(r, "cuStreamWaitEvent");
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

/* An import closed (or not: a failure leaves nothing to do, it is
 * forgotten either way) and unlinked: freed, and one fewer open. */
static void forget(void *import, uint32_t *open)
{
	free(import);
	(*open)--;
	cuda_publish();
}

/* Closes and frees m, unlinked by the caller (holding cu.lock). */
static void unmap(struct import_map *m)
{
	if (!cuda_push_ctx(cu.primary[m->device])) {
		cu.cuIpcCloseMemHandle(m->local);
		cuda_pop_ctx();
	}
	forget(m, &cu.stats.maps_open);
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
			return cuda_fail(r, "cuIpcOpenMemHandle (allocation of pid %u on device %d)",
				       d->pid, (int)d->device);
		}
		cu.stats.opens++;
		/* Open from here: unmap closes it, on every path. */
		cu.stats.maps_open++;
		cuda_publish();
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
		return cuda_fail(r, "a CUDA descriptor names 0x%llx of this process",
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
		return cuda_fail(r, "cuIpcOpenEventHandle (event of pid %u)", d->event_pid);
	}
	e->pid = d->event_pid;
	e->device = device;
	e->next = cu.events;
	cu.events = e;
	cu.stats.events_open++;
	cuda_publish();
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
	rc = cuda_ready();
	if (rc)
		return rc;
	if (d->pid == self && d->event_pid == self)
		return import_local(d, (CUstream)stream, dptr);
	pthread_mutex_lock(&cu.lock);
	rc = cuda_local_ordinal(d, &device) ?: cuda_primary_ctx(device, &ctx);
	if (!rc)
		rc = cuda_push_ctx(ctx);
	if (!rc) {
		rc = import_source(d, device, &m, &ev, &src, stale);
		if (!rc) {
			r = cu.cuStreamWaitEvent((CUstream)stream, ev, 0);
			if (r != CUDA_SUCCESS)
				rc = cuda_fail(r, "cuStreamWaitEvent");
			if (rc && m)
				m->refs--;
		}
		/* Under the lock: cuda_forget_peer may free m once it is dropped. */
		if (!rc)
			*dptr = (void *)(uintptr_t)src;
		cuda_pop_ctx();
	}
	pthread_mutex_unlock(&cu.lock);
	return rc;
}

/* Pushes device's primary context (made if need be) on this thread;
 * cuda_pop_ctx after. */
static int enter_device(int32_t device)
{
	CUcontext ctx;
	int rc;

	pthread_mutex_lock(&cu.lock);
	rc = cuda_primary_ctx(device, &ctx) ?: cuda_push_ctx(ctx);
	pthread_mutex_unlock(&cu.lock);
	return rc;
}

int cuda_order(int32_t device, uintptr_t from, uintptr_t to)
{
	CUevent ev;
	CUresult r;
	int rc = cuda_ready();

	if (rc || from == to)
		return rc;
	if ((rc = enter_device(device)))
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
	cuda_pop_ctx();
	return r == CUDA_SUCCESS ? 0 : cuda_fail(r, "ordering CUDA stream 0x%lx after 0x%lx on "
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
	rc = cuda_ready();
	if (rc)
		return rc;
	pthread_mutex_lock(&cu.lock);
	rc = cuda_local_ordinal(d, &from) ?: cuda_primary_ctx(from, &sctx) ?: cuda_primary_ctx(device, &dctx) ?:
	     cuda_push_ctx(sctx);
	if (!rc) {
		rc = import_source(d, from, &m, &ev, &src, stale);
		cuda_pop_ctx();
	}
	if (!rc && (rc = cuda_push_ctx(dctx)) && m)
		m->refs--;
	if (!rc) {
		/* The GPU waits for the sender's writes before the copy; the
		 * host never does. Stream 0: the legacy default stream of the
		 * landing device, where the receiver's own work goes. */
		r = cu.cuStreamWaitEvent(NULL, ev, 0);
		if (r != CUDA_SUCCESS)
			rc = cuda_fail(r, "cuStreamWaitEvent");
		if (!rc && (r = cu.cuMemAlloc_v2(&dst, d->len ? d->len : 1)) != CUDA_SUCCESS)
			rc = cuda_fail(r, "allocating %llu bytes on CUDA device %d for a tensor landing "
				     "there", (unsigned long long)d->len, (int)device);
		if (!rc && (r = cu.cuMemcpyPeerAsync(dst, dctx, src, sctx, d->len, NULL)) !=
				   CUDA_SUCCESS) {
			rc = cuda_fail(r, "copying %llu bytes from CUDA device %d to device %d",
				     (unsigned long long)d->len, (int)from, (int)device);
			cu.cuMemFree_v2(dst);
		}
		if (rc && m)
			m->refs--;
		cuda_pop_ctx();
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
	if (!cuda_primary_ctx(device, &ctx) && !cuda_push_ctx(ctx)) {
		cu.cuMemFree_v2((CUdeviceptr)(uintptr_t)p);
		cuda_pop_ctx();
	}
	pthread_mutex_unlock(&cu.lock);
}

int cuda_stream_sync(int32_t device, uintptr_t stream)
{
	CUresult r;
	int rc = cuda_ready();

	if (rc)
		return rc;
	if ((rc = enter_device(device)))
		return rc;
	/* Outside cu.lock: the GPU may take a while, and others need the lock.
	 * A per-thread default stream is its thread's own, and this may be
	 * another thread: the whole context is waited for instead. */
	r = (CUstream)stream == CU_STREAM_PER_THREAD ? cu.cuCtxSynchronize()
						     : cu.cuStreamSynchronize((CUstream)stream);
	cuda_pop_ctx();
	return r == CUDA_SUCCESS ? 0 : cuda_fail(r, "cuStreamSynchronize");
}

void cuda_import_release(const struct cuda_ipc_desc *d, bool keep)
{
	struct import_map **pp, *m;

	if (!cuda_driver_ok() || d->pid == (uint32_t)getpid())
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

	if (!cuda_driver_ok() || d->pid == (uint32_t)getpid())
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
	if (!atomic_load_explicit(&cu.tried, memory_order_acquire) || !cuda_driver_ok())
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
		if (!cuda_push_ctx(cu.primary[e->device])) {
			cu.cuEventDestroy_v2(e->ev);
			cuda_pop_ctx();
		}
		forget(e, &cu.stats.events_open);
	}
	pthread_mutex_unlock(&cu.lock);
}
