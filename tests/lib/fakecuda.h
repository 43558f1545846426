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
/* Deleters run so far in this process. */
int tl_fake_cuda_deleted(void);
/* Allocations of this process not yet freed (the fake driver's count). */
int tl_fake_cuda_allocs(void);
/* A new stream, as an integer for shmrpc_tensor_set_cuda_stream. */
uintptr_t tl_fake_cuda_stream(void);

#endif
