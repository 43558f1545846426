/*
 * What cuda.c (the driver, the state, contexts), cuda_export.c (the
 * producer's side) and cuda_import.c (the receiver's side) share, and no
 * other file: the loaded driver and its state, under one lock.
 */
#ifndef SHMRPC_WORKER_CUDA_IMPL_H
#define SHMRPC_WORKER_CUDA_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"
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

struct cuda_state {
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
};
SHMRPC_HIDDEN extern struct cuda_state cu;

/* cuda.c: the driver, the state, contexts. */
/* Loads the driver once; whether it is usable. */
SHMRPC_HIDDEN bool cuda_driver_ok(void);
/* 0, or the reason (in this thread's message) why nothing can be done. */
SHMRPC_HIDDEN int cuda_ready(void);
/* -errno for a driver error r, with the call's text (fmt) and the
 * driver's in this thread's message. */
SHMRPC_HIDDEN int cuda_fail(CUresult r, const char *fmt, ...) SHMRPC_PRINTF(2, 3);
/* The gauges of cu.stats into the slot of this process's worker, if an
 * agent runs, after a change. Caller holds cu.lock: stores of the counts
 * come in the order of the changes, so the slot ends with the last. */
SHMRPC_HIDDEN void cuda_publish(void);
/* The primary context of a device, retained once for the process's life
 * (as the runtime API and torch do). Caller holds cu.lock. */
SHMRPC_HIDDEN int cuda_primary_ctx(int32_t device, CUcontext *ctx);
/* Every call runs in the context it names, pushed for the call and popped
 * after it, so the caller's current context is left alone. */
SHMRPC_HIDDEN int cuda_push_ctx(CUcontext ctx);
SHMRPC_HIDDEN void cuda_pop_ctx(void);

/* cuda_export.c: the producer's side. */
/* Our event that d names. Caller holds cu.lock. */
SHMRPC_HIDDEN struct export_event *cuda_own_export_event(const struct cuda_ipc_desc *d);
/* The ordinal here of the device d names (by its UUID). */
SHMRPC_HIDDEN int cuda_local_ordinal(const struct cuda_ipc_desc *d, int32_t *device);

#endif
