/*
 * CUDA IPC, the producer's side: handles and events of our allocations
 * (see cuda.h).
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "worker/cuda.h"
#include "worker/cuda_driver.h"
#include "worker/cuda_impl.h"

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
			return cuda_fail(r, "cuMemGetAddressRange(0x%llx)", p);
		r = cu.cuIpcGetMemHandle(&h, base);
		if (r != CUDA_SUCCESS)
			return cuda_fail(r, "cuIpcGetMemHandle(0x%llx): sending CUDA memory of "
				       "cuMemCreate or a memory pool (torch's expandable_segments, "
				       "cudaMallocAsync) is not supported yet; use torch's default "
				       "caching allocator", base);
		/* The oldest entry goes: an allocation no longer sent costs one
		 * cuIpcGetMemHandle if it comes back. */
		a = &cu.allocs[cu.allocs_next++ % HANDLE_CACHE];
		if (!a->id) {
			cu.stats.allocs_exported++;
			cuda_publish();
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
			return cuda_fail(r, "cuEventCreate(interprocess)");
		e = &cu.evs[cu.nevs];
		r = cu.cuIpcGetEventHandle(&e->handle, ev);
		if (r != CUDA_SUCCESS) {
			cu.cuEventDestroy_v2(ev);
			return cuda_fail(r, "cuIpcGetEventHandle");
		}
		e->ctx = ctx;
		e->ev = ev;
		e->busy = false;
		cu.nevs++;
		cu.stats.events_exported++;
		cuda_publish();
	}
	r = cu.cuEventRecord(e->ev, s);
	if (r != CUDA_SUCCESS)
		return cuda_fail(r, "cuEventRecord");
	e->busy = true;
	memcpy(d->event_handle, &e->handle, sizeof(d->event_handle));
	return 0;
}

/* Our event that d names. Caller holds cu.lock. */
struct export_event *cuda_own_export_event(const struct cuda_ipc_desc *d)
{
	for (unsigned i = 0; i < cu.nevs; i++)
		if (!memcmp(&cu.evs[i].handle, d->event_handle, sizeof(d->event_handle)))
			return &cu.evs[i];
	return NULL;
}

void cuda_export_done(const struct cuda_ipc_desc *d)
{
	struct export_event *e;

	if (!cuda_driver_ok() || d->event_pid != (uint32_t)getpid())
		return;
	pthread_mutex_lock(&cu.lock);
	e = cuda_own_export_event(d);
	if (e)
		e->busy = false;
	pthread_mutex_unlock(&cu.lock);
}

/* The ordinal here of the device d names (by its UUID). */
int cuda_local_ordinal(const struct cuda_ipc_desc *d, int32_t *device)
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
	return cuda_ready() ?: cuda_local_ordinal(d, device);
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

	rc = cuda_ready();
	if (rc)
		return rc;
	/* One call for all four; a pointer CUDA does not know reads as
	 * memory type 0, not as an error. */
	r = cu.cuPointerGetAttributes(4, attrs, data, p);
	if (r != CUDA_SUCCESS)
		return cuda_fail(r, "cuPointerGetAttributes(%p)", dptr);
	if (memtype != CU_MEMORYTYPE_DEVICE || id == 0)
		return shmrpc__fail(-EINVAL, "%p is not CUDA device memory", dptr);
	memset(out, 0, sizeof(*out));
	pthread_mutex_lock(&cu.lock);
	/* Memory that belongs to no context (cuMemCreate) fails below, in the
	 * device's primary context, with cuIpcGetMemHandle's reason. */
	rc = ctx ? 0 : cuda_primary_ctx(device, &ctx);
	if (!rc)
		rc = cuda_push_ctx(ctx);
	if (!rc) {
		rc = export_alloc(p, id, out, &size);
		if (!rc && len > out->base + size - p)
			rc = shmrpc__fail(-EINVAL, "%llu bytes at %p leave their CUDA allocation "
					  "(0x%llx, %llu bytes)", (unsigned long long)len, dptr,
					  (unsigned long long)out->base, (unsigned long long)size);
		if (!rc)
			rc = export_event(ctx, (CUstream)stream, out);
		cuda_pop_ctx();
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
	int rc = cuda_ready();

	if (rc)
		return rc;
	/* Our own allocation (it came back to us): described afresh. */
	if (in->pid == self)
		return cuda_export((const void *)(uintptr_t)(in->base + in->offset), in->len, stream,
				   out);
	*out = *in;
	pthread_mutex_lock(&cu.lock);
	rc = cuda_local_ordinal(in, &device) ?: cuda_primary_ctx(device, &ctx);
	if (!rc)
		rc = cuda_push_ctx(ctx);
	if (!rc) {
		rc = export_event(ctx, (CUstream)stream, out);
		cuda_pop_ctx();
	}
	pthread_mutex_unlock(&cu.lock);
	out->event_pid = self;
	return rc;
}
