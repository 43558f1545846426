/*
 * CUDA IPC for device tensors: a producer describes a device pointer so
 * that another process of the node reads and writes the same bytes.
 *
 * Why dlopen. The driver API (libcuda.so.1) is loaded at run time, never
 * linked, so one build runs on machines with and without a GPU; without
 * one every call fails with "CUDA is not available on this machine: <why>"
 * (-ENOSYS: no driver, -ENODEV: no device). cuda.c declares the few
 * driver types it needs itself, so the build needs no CUDA toolkit either.
 *
 * What is cached, and why. Each cache is in process memory, under one
 * mutex; only its sizes are in shared memory (the gauges below).
 *  - Producer: the IPC handle, base and size of each allocation, keyed by
 *    the driver's buffer id (unique for the allocation's lifetime, so an
 *    address freed and reused never returns a stale handle):
 *    cuIpcGetMemHandle costs ~9 µs. And a pool of interprocess events
 *    per context, made once with their handles: each export takes a free
 *    one and records it, and it stays busy until cuda_export_done, once
 *    the receiver has queued its wait (the message's pin is released:
 *    the peer's reply or TENSOR_ACK), as TensorPipe does. An event is
 *    never recorded again while a receiver may still wait on it:
 *    cuStreamWaitEvent waits for an event's latest record only, which
 *    could be on another stream, before the writes it was to order.
 *  - Receiver: the mapping of each (producer pid, allocation) and each
 *    opened event: cuIpcOpenMemHandle and cuIpcOpenEventHandle cost
 *    ~140 µs each on an H100, so a warm import pays neither. Mappings are
 *    counted by cuda_import / cuda_import_release, and stay open while
 *    referenced. A release that says keep leaves an idle mapping open
 *    until cuda_forget_peer, for a producer that keeps its allocations for
 *    the receiver's lifetime (tests/cuda_ipc). Device tensors
 *    (worker/tensor.c) release without keep: their producer may free an
 *    allocation once nothing of the receiver pins it, and no mapping may
 *    outlive that (CUDA: freeing memory another process has mapped is
 *    undefined). Their cache is the references themselves: tensor.c's idle
 *    cache keeps the reference of the last tensor of an allocation, with
 *    the token that pins that tensor in its producer, so the mapping stays
 *    open exactly as long as the memory is kept alive for it (at most
 *    TENSOR_IDLE_MAPS such, worker/tensor.h). When the same producer sends
 *    another allocation over a mapping's addresses, the old one was freed:
 *    it is closed at once if idle, else at its last release, and
 *    cuda_import says so (stale) for the holders of idle references to
 *    drop theirs.
 *
 * Ordering. cuda_export records an interprocess event on the producer's
 * stream after the work already queued there (its last write); cuda_import
 * makes the receiver's stream wait for that event (cuStreamWaitEvent: the
 * GPU waits, the host does not). What the receiver queues on its stream
 * afterwards therefore never runs before the producer's writes finished.
 * A consumer that reads on another stream later (cuda_order) is ordered
 * after the import's stream with an event of its own, not the producer's,
 * which may be back in its pool by then.
 *
 * Devices. An ordinal depends on each process's CUDA_VISIBLE_DEVICES, so a
 * descriptor names its device by UUID too; the receiver maps and waits in
 * its own ordinal of that device (cuda_local_device).
 *
 * Sizes. The producer sends its allocation's size (cuMemGetAddressRange
 * on its own pointer, which the driver documents). The receiver bounds
 * descriptors by it and never asks the driver about an IPC mapping's
 * range: small allocations may be sub-allocated from one block, which
 * an IPC mapping maps whole, and guessing from it made neighbours look
 * like freed allocations.
 *
 * A producer's exit. Freeing an exported allocation while another process
 * has it mapped is undefined (CUDA's documentation), and so is reading a
 * mapping whose producer exited. So the producer must keep each
 * allocation alive while any receiver has it mapped, idle cached mappings
 * included (device tensors: the lifetime tokens of worker/tensor.h, counts
 * in the pool, which the idle cache's entries hold too); receivers must
 * fail the tensors of a producer that died instead of reading them, and
 * call cuda_forget_peer to close its mappings (the agent does, when it
 * sees a peer end, then releases the idle cache's entries of it).
 *
 * Passing a received tensor on. A receiver cannot export a mapping it
 * opened (IPC handles are for the allocating process's own memory), so it
 * sends the producer's descriptor again with an event of its own, recorded
 * after its writes (cuda_export_forward); event_pid names whose event a
 * descriptor holds.
 *
 * The driver library is libcuda.so.1. Tests load a stand-in instead by
 * naming its path in the environment variable SHMRPC_LIBCUDA
 * (tests/fake_cuda/: host memory that plays device memory); it is for
 * tests only, never needed otherwise.
 *
 * CUDA does not survive fork(): fork before the first call here. A child
 * forked after it gets "not available" errors, never the parent's handles.
 */
#ifndef SHMRPC_WORKER_CUDA_H
#define SHMRPC_WORKER_CUDA_H

#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"

#define CUDA_IPC_HANDLE_SIZE 64

/* What a device tensor travels as; fixed-width fields, no pointers. */
struct cuda_ipc_desc {
	uint8_t mem_handle[CUDA_IPC_HANDLE_SIZE];   /* CUipcMemHandle of the allocation */
	uint8_t event_handle[CUDA_IPC_HANDLE_SIZE]; /* CUipcEventHandle, after the last write */
	uint64_t base;     /* the allocation's address in the producer */
	uint64_t alloc_id; /* the producer driver's buffer id of the allocation */
	uint64_t offset;   /* of the tensor, from base */
	uint64_t len;      /* of the tensor, in bytes */
	uint64_t size;     /* of the allocation, as its producer knows it */
	uint32_t pid;      /* the producer: whose allocation it is */
	int32_t device;    /* the producer's ordinal of the device holding it */
	uint32_t event_pid; /* whose event: the producer's, or that of a receiver
			     * passing the tensor on (cuda_export_forward) */
	uint32_t reserved;  /* 0 */
	uint8_t uuid[16];   /* the device's UUID: the same in every process */
};
_Static_assert(sizeof(struct cuda_ipc_desc) == 2 * CUDA_IPC_HANDLE_SIZE + 5 * 8 + 4 * 4 + 16,
	       "cuda_ipc_desc is part of the wire format: no padding");

/*
 * Counters, and gauges: what is open now. The agent's worker slot shows
 * the gauges to shmrpc-inspect (struct shm_worker's cuda_* fields), stored
 * at each change while an agent runs in this process; each is the size of
 * a cache above, so it stays bounded by it.
 */
struct cuda_stats {
	uint64_t opens;             /* receiver: cuIpcOpenMemHandle calls */
	uint64_t cache_hits;        /* receiver: imports that found the mapping open */
	uint64_t exports;           /* producer: cuda_export calls that succeeded */
	uint64_t handle_cache_hits; /* producer: exports that found the handle cached */
	uint32_t maps_open;         /* receiver: mappings open, idle cached ones too */
	uint32_t events_open;       /* receiver: producers' events opened */
	uint32_t allocs_exported;   /* producer: allocations whose IPC handle is cached */
	uint32_t events_exported;   /* producer: interprocess events made */
};

/* 0 when a driver and at least one device are present. */
SHMRPC_HIDDEN int cuda_probe(void);
/* cuda_probe, and the devices it found in *n (0 when it fails). */
SHMRPC_HIDDEN int cuda_device_count(int *n);

/*
 * Describes len bytes at device pointer dptr, after the work queued so far
 * on stream (a CUstream; 0 is the legacy default stream of the pointer's
 * context). -EINVAL for memory that is not a device allocation or a range
 * that leaves it.
 */
SHMRPC_HIDDEN int cuda_export(const void *dptr, uint64_t len, uintptr_t stream,
			      struct cuda_ipc_desc *out);

/* The event of out, a descriptor of cuda_export or cuda_export_forward,
 * back to its pool: its receiver has queued its wait (or never will). */
SHMRPC_HIDDEN void cuda_export_done(const struct cuda_ipc_desc *out);

/* The ordinal in this process of the device d names (by UUID). */
SHMRPC_HIDDEN int cuda_local_device(const struct cuda_ipc_desc *d, int32_t *device);

/*
 * in, a descriptor this process imported (or exported), described again
 * for another receiver: the same allocation, with an event of this
 * process recorded on stream (a CUstream of in->device's primary context;
 * 0 its legacy default stream) after the work queued there so far.
 */
SHMRPC_HIDDEN int cuda_export_forward(const struct cuda_ipc_desc *in, uintptr_t stream,
				      struct cuda_ipc_desc *out);

/*
 * The tensor of d, mapped in this process (in the primary context of
 * d->device), holding one reference; stream (a CUstream of that device)
 * waits for the producer's writes. A descriptor of this process gives its
 * own pointer back, with the same wait. stale (NULL: not wanted) is set
 * when the import opened an allocation over the addresses of another of
 * the producer's that is still referenced here: the producer freed that
 * one, and whoever keeps references to it for the cache should drop them
 * (cuda_import_stale says which).
 */
SHMRPC_HIDDEN int cuda_import(const struct cuda_ipc_desc *d, uintptr_t stream, void **dptr,
			      bool *stale);
/* Stream to (of device's primary context; 0: its legacy default one)
 * runs what is queued on it from now on after what is queued on from so
 * far: a consumer of a tensor on another stream than the one its import
 * or its writes were ordered on. */
SHMRPC_HIDDEN int cuda_order(int32_t device, uintptr_t from, uintptr_t to);
/*
 * The tensor of d copied onto device (not d->device: a device map lands
 * it there): d mapped as cuda_import does (one reference, dropped with
 * cuda_import_release once the copy is no longer needed), device's
 * legacy default stream made to wait for the producer's writes, len
 * bytes allocated on device and a device-to-device copy queued on that
 * stream (cuMemcpyPeerAsync): what the receiver queues there after runs
 * after the copy; the host waits for nothing. *copy: the new memory,
 * freed with cuda_free. *stale as cuda_import's.
 */
SHMRPC_HIDDEN int cuda_import_copy(const struct cuda_ipc_desc *d, int32_t device, void **copy,
				   bool *stale);
/* Waits until the work queued on stream (of device's primary context; 0:
 * its legacy default stream) is done: a receiver releasing a tensor it
 * consumed there, before the producer may reuse the memory. The
 * per-thread default stream (CU_STREAM_PER_THREAD, 2) may be another
 * thread's: the whole context is waited for. */
SHMRPC_HIDDEN int cuda_stream_sync(int32_t device, uintptr_t stream);
/* Frees memory of cuda_import_copy. */
SHMRPC_HIDDEN void cuda_free(int32_t device, void *p);
/* Drops the reference of one cuda_import of d. keep: an idle mapping stays
 * cached; otherwise the last reference closes it (see above). */
SHMRPC_HIDDEN void cuda_import_release(const struct cuda_ipc_desc *d, bool keep);
/* True when d's mapping is closed (cuda_forget_peer) or its producer
 * reused its addresses for another allocation: a reference kept only to
 * cache it is to be dropped. */
SHMRPC_HIDDEN bool cuda_import_stale(const struct cuda_ipc_desc *d);
/* Closes every mapping and event of producer pid (gone, or to be forgotten),
 * referenced or not: pointers still held from it must not be used again.
 * Loads nothing: a process that never used CUDA has nothing to close. */
SHMRPC_HIDDEN void cuda_forget_peer(uint32_t pid);

SHMRPC_HIDDEN void cuda_stats_get(struct cuda_stats *st);

/*
 * A driver function by the versioned name it has in libcuda.so.1
 * ("cuMemAlloc_v2"), for tests and tools that drive the GPU themselves;
 * NULL when CUDA is not available or the driver lacks it.
 */
SHMRPC_HIDDEN void *cuda_sym(const char *name);

#endif
