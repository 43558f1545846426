/*
 * Device tensors in tests without a GPU: the stand-in driver of
 * tests/fake_cuda (host memory that plays device memory, shared between
 * processes through memfds), loaded by the library through SHMRPC_LIBCUDA.
 */
#ifndef SHMRPC_TESTS_FAKECUDA_H
#define SHMRPC_TESTS_FAKECUDA_H

#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"

/* In the test's main process, before the job starts: points SHMRPC_LIBCUDA
 * at $SHMRPC_BUILD/tests/fake_cuda/libcuda.so.1 for the workers. False
 * (the test skips) when it is not built. */
bool tl_fake_cuda_use(void);
/* In a worker: makes device 0's primary context current on this thread
 * (allocating needs one); tl_fake_cuda_device: device's (the fake driver
 * has FAKE_CUDA_DEVICES devices). */
void tl_fake_cuda_thread(void);
void tl_fake_cuda_device(int device);
/* A CUDA tensor of n bytes (uint8) filled with fill, on device 0 (_on:
 * on device), through DLPack: its deleter frees the memory and counts in
 * tl_fake_cuda_deleted. */
shmrpc_tensor *tl_fake_cuda_tensor(uint64_t n, uint8_t fill);
shmrpc_tensor *tl_fake_cuda_tensor_on(int device, uint64_t n, uint8_t fill);
/* Waits until the work queued on device's streams is done: the fake's
 * streams run later, as a GPU's, so a test reads on the host only after
 * this (as a real consumer synchronizes before a host read). */
void tl_fake_cuda_sync(int device);
/* Deleters run so far in this process. */
int tl_fake_cuda_deleted(void);
/* Allocations of this process not yet freed (the fake driver's count). */
int tl_fake_cuda_allocs(void);
/* A new stream, as an integer for shmrpc_tensor_set_cuda_stream. */
uintptr_t tl_fake_cuda_stream(void);
/* cuStreamSynchronize calls on stream s in this process (0: the legacy
 * default stream). */
int tl_fake_cuda_syncs(uintptr_t s);

/* What a worker of a CUDA test tells about itself ("stats"). */
enum tl_cuda_stat {
	TL_CUDA_OPENS,      /* mappings opened (cuda_stats) */
	TL_CUDA_CACHE_HITS, /* imports of an allocation already mapped */
	TL_CUDA_MAPS_OPEN,  /* mappings open now, idle cached ones too */
	TL_CUDA_DELETED,    /* tl_fake_cuda_deleted */
	TL_CUDA_ALLOCS,     /* tl_fake_cuda_allocs */
	TL_CUDA_SYNCS,      /* tl_fake_cuda_syncs(0) */
	TL_CUDA_NSTATS
};
/* In a worker, before shmrpc_init: registers "stats" (the list above) and
 * "forget" (drops the worker's idle CUDA mappings). */
void tl_fake_cuda_register(void);
/* rank's stat i, by a call. */
int64_t tl_fake_cuda_stat(int rank, enum tl_cuda_stat i);
/* Waits (5 s at most) until rank's stat i is want: a callee frees a call's
 * arguments after its reply, and producers reap their exports every few
 * ms. Fails the test with what otherwise. */
void tl_fake_cuda_wait_stat(int rank, enum tl_cuda_stat i, int64_t want, const char *what);
/* rank's fn(args), its result dropped; fails the test on an error. */
void tl_call(int rank, const char *fn, const shmrpc_value *args, uint32_t n);

#endif
