/* Device tensors over the fake CUDA driver; see fakecuda.h. */
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/cuda.h"
#include "tests/lib/fakecuda.h"
#include "tests/lib/testlib.h"

struct fake_tensor {
	DLManagedTensor m;
	int64_t shape[1];
};

static atomic_int deleted;

bool tl_fake_cuda_use(void)
{
	const char *build = getenv("SHMRPC_BUILD");
	char path[PATH_MAX], abs[PATH_MAX];

	snprintf(path, sizeof(path), "%s/tests/fake_cuda/libcuda.so.1",
		 build && *build ? build : "build");
	if (!realpath(path, abs))
		return false;
	return setenv("SHMRPC_LIBCUDA", abs, 1) == 0;
}

static void *sym(const char *name)
{
	void *f = cuda_sym(name);

	CHECK(f, "the fake CUDA driver has no %s: %s", name, shmrpc_errmsg());
	return f;
}

void tl_fake_cuda_device(int device)
{
	int (*retain)(void **ctx, int dev) = sym("cuDevicePrimaryCtxRetain");
	int (*set)(void *ctx) = sym("cuCtxSetCurrent");
	void *ctx;

	CHECK(retain(&ctx, device) == 0 && set(ctx) == 0, "no CUDA context on device %d", device);
}

void tl_fake_cuda_thread(void)
{
	tl_fake_cuda_device(0);
}

static void fake_delete(DLManagedTensor *m)
{
	int (*mem_free)(uint64_t p) = sym("cuMemFree_v2");

	CHECK(mem_free((uint64_t)(uintptr_t)m->dl_tensor.data) == 0, "cuMemFree");
	free(m);
	/* Relaxed: a counter the test polls. */
	atomic_fetch_add_explicit(&deleted, 1, memory_order_relaxed);
}

shmrpc_tensor *tl_fake_cuda_tensor(uint64_t n, uint8_t fill)
{
	return tl_fake_cuda_tensor_on(0, n, fill);
}

shmrpc_tensor *tl_fake_cuda_tensor_on(int device, uint64_t n, uint8_t fill)
{
	int (*mem_alloc)(uint64_t *p, size_t n) = sym("cuMemAlloc_v2");
	struct fake_tensor *f = calloc(1, sizeof(*f));
	shmrpc_tensor *t;
	uint64_t p;

	CHECK(f, "out of memory");
	tl_fake_cuda_device(device);
	CHECK(mem_alloc(&p, n) == 0, "cuMemAlloc of %llu bytes", (unsigned long long)n);
	memset((void *)(uintptr_t)p, fill, n);
	f->shape[0] = (int64_t)n;
	f->m.dl_tensor = (DLTensor){ .data = (void *)(uintptr_t)p,
				     .device = { kDLCUDA, device },
				     .ndim = 1,
				     .dtype = { kDLUInt, 8, 1 },
				     .shape = f->shape };
	f->m.deleter = fake_delete;
	CHECK_OK(shmrpc_tensor_from_dlpack(&f->m, &t));
	return t;
}

int tl_fake_cuda_deleted(void)
{
	return atomic_load_explicit(&deleted, memory_order_relaxed);
}

int tl_fake_cuda_allocs(void)
{
	int (*count)(void) = sym("fakeCuAllocCount");

	return count();
}

uintptr_t tl_fake_cuda_stream(void)
{
	int (*create)(void **s, unsigned flags) = sym("cuStreamCreate");
	void *s;

	tl_fake_cuda_thread();
	CHECK(create(&s, 0) == 0, "cuStreamCreate");
	return (uintptr_t)s;
}
