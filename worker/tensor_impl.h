/*
 * What tensor.c (handles), tensor_dev.c (device tensors' bytes) and
 * tensor_wire.c (descriptors) share, and no other file.
 */
#ifndef SHMRPC_WORKER_TENSOR_IMPL_H
#define SHMRPC_WORKER_TENSOR_IMPL_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/compiler.h"
#include "shm/pool.h"
#include "worker/cuda.h"
#include "worker/tensor.h"

/* The descriptor on the wire (little endian, as the machine;
 * docs/PROTOCOL.md): this, the shape, and for a CUDA tensor a struct
 * tensor_wire_cuda. */
struct tensor_wire {
	uint64_t off; /* CPU: the pool block; CUDA: the lifetime token's block */
	uint64_t nbytes;
	uint8_t code;
	uint8_t bits;
	uint16_t lanes;
	int32_t ndim;
	int32_t device_type; /* DLDeviceType: kDLCPU or kDLCUDA */
	int32_t device_id;
	int64_t shape[];
};
_Static_assert(sizeof(struct tensor_wire) == 32, "tensor_wire is part of the wire format: no padding");

struct tensor_wire_cuda {
	uint32_t producer; /* rank of the worker whose allocation it is */
	uint32_t reserved; /* 0 */
	struct cuda_ipc_desc ipc;
};
_Static_assert(sizeof(struct tensor_wire_cuda) == 8 + sizeof(struct cuda_ipc_desc),
	       "tensor_wire_cuda is part of the wire format: no padding");

/* A device tensor's bytes, shared by the handles of this process (see
 * tensor.h for the lifetime). */
struct tensor_dev {
	_Atomic uint32_t refs;     /* handles, pins and the export registry */
	_Atomic uintptr_t stream;  /* the CUstream that wrote it (0: legacy default) */
	/* Receiver: the stream a consumer ordered last (shmrpc_tensor_cuda_wait)
	 * besides the legacy default one the import ordered; 0: none. */
	_Atomic uintptr_t consumer;
	DLManagedTensor *owner;    /* producer: what shmrpc_tensor_from_dlpack took */
	/* Producer, under exports.lock: the token block (0: never sent, or
	 * released) and the registry's link. */
	uint64_t token;
	struct tensor_dev *next;
	/* Receiver, under idle_cache.lock: the idle cache's link. */
	struct tensor_dev *idle_next;
	/* Receiver (imported): what was mapped, and from whom; device: our
	 * ordinal of its device (the descriptor's is the producer's). */
	bool imported;
	int32_t device;
	/* Its consumers' streams were waited for (dev_drain): by the thread
	 * that dropped the last handle, or at its release. */
	bool drained;
	uint32_t producer;         /* its rank */
	struct tensor_view *view;  /* the job's pool the token is in (one reference) */
	struct cuda_ipc_desc ipc;
	/* A copy that a device map landed here (tensor_unpack): our memory
	 * (cuda_import_copy's) on copy_device, freed at release, and the
	 * received tensor it was copied from, held until then (the copy was
	 * queued on the GPU, which may still read the source). Else NULL. */
	struct tensor_dev *source;
	void *copy;
	int32_t copy_device;
};

/* A small CPU tensor's bytes in this process's memory (tensor.h: sent
 * inline), shared by its handles. */
struct tensor_heap {
	_Atomic uint32_t refs;
	/* As a pool block's: what vectorised readers (torch) expect. */
	alignas(64) unsigned char bytes[];
};


/* tensor.c: handles. */
/* *p = the running agent's tensor pool: 0, -ENOTCONN or -ENOTSUP. */
SHMRPC_HIDDEN int tensor_pool_get(struct shm_pool **p);
/* A handle that never got its pool reference (or whose reference is gone). */
SHMRPC_HIDDEN void tensor_handle_discard(shmrpc_tensor *t);
/* A handle for a tensor of this dtype and shape, checked, with its size;
 * data, device and the rest are the caller's to fill. */
SHMRPC_HIDDEN int tensor_new_handle(DLDataType dtype, int32_t ndim, const int64_t *shape,
				    shmrpc_tensor **out);
/* Points t, a new handle, at the pool block at off. */
SHMRPC_HIDDEN void tensor_handle_at(struct shm_pool *p, shmrpc_tensor *t, uint64_t off);
/* Fills a handle for the block at off; checks shape and size. */
SHMRPC_HIDDEN int tensor_make_handle(struct shm_pool *p, uint64_t off, DLDataType dtype,
				     int32_t ndim, const int64_t *shape, shmrpc_tensor **out);
/* Gives t, a new handle, bytes of its own: a copy of src (nbytes of it). */
SHMRPC_HIDDEN int tensor_heap_fill(shmrpc_tensor *t, const void *src);
SHMRPC_HIDDEN void tensor_heap_put(struct tensor_heap *h);
/* A handle of dev (given one reference) with the dtype and shape. */
SHMRPC_HIDDEN int tensor_dev_handle(struct tensor_dev *d, void *data, DLDevice device,
				    DLDataType dtype, int32_t ndim, const int64_t *shape,
				    shmrpc_tensor **out);

/* tensor_dev.c: device tensors' bytes. */
/* Drops one reference of dev; the last one parks a received tensor in
 * the idle cache, or releases what it holds. */
SHMRPC_HIDDEN void tensor_dev_put(struct tensor_dev *d);
/* 0 when dev's bytes may be used here: a received tensor whose producer
 * exited or died (or of a job this process left) is an error. */
SHMRPC_HIDDEN int tensor_dev_check(const struct tensor_dev *d);
enum idle_which { IDLE_ALL, IDLE_OF_PID, IDLE_STALE_OF_PID };
/* Takes the entries that match out of the idle cache and releases them. */
SHMRPC_HIDDEN void tensor_idle_drop(enum idle_which which, uint32_t pid);
/* Releases the exports no receiver holds (final: the agent stops). */
SHMRPC_HIDDEN void tensor_exports_reap(bool final);
/* The lifetime token of d, a source of ours, made at its first send (the
 * registry then holds a reference to d). */
SHMRPC_HIDDEN int tensor_dev_token(struct tensor_dev *d, uint64_t *token);

#endif
