/* Device tensors over the fake CUDA driver; see fakecuda.h. */
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "worker/cuda.h"
#include "worker/tensor.h"
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

	/* The driver frees in a current context only; a deleter may run on
	 * any thread. */
	tl_fake_cuda_device(m->dl_tensor.device.device_id);
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

void tl_fake_cuda_sync(int device)
{
	int (*sync)(void) = sym("cuCtxSynchronize");

	tl_fake_cuda_device(device);
	CHECK(sync() == 0, "cuCtxSynchronize on device %d", device);
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

int tl_fake_cuda_syncs(uintptr_t s)
{
	int (*syncs)(void *s) = sym("fakeCuStreamSyncs");

	return syncs((void *)s);
}

static int fn_stats(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value *v = shmrpc_call_alloc(c, TL_CUDA_NSTATS * sizeof(*v));
	struct cuda_stats st;

	(void)a, (void)n, (void)u;
	cuda_stats_get(&st);
	v[TL_CUDA_OPENS] = shmrpc_int((int64_t)st.opens);
	v[TL_CUDA_CACHE_HITS] = shmrpc_int((int64_t)st.cache_hits);
	v[TL_CUDA_MAPS_OPEN] = shmrpc_int(st.maps_open);
	v[TL_CUDA_DELETED] = shmrpc_int(tl_fake_cuda_deleted());
	v[TL_CUDA_ALLOCS] = shmrpc_int(tl_fake_cuda_allocs());
	v[TL_CUDA_SYNCS] = shmrpc_int(tl_fake_cuda_syncs(0));
	*r = shmrpc_list(v, TL_CUDA_NSTATS);
	return 0;
}

static int fn_forget(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	tensor_idle_forget(0);
	*r = shmrpc_nil();
	return 0;
}

void tl_fake_cuda_register(void)
{
	CHECK_OK(shmrpc_register("stats", "", fn_stats, NULL));
	CHECK_OK(shmrpc_register("forget", "", fn_forget, NULL));
}

int64_t tl_fake_cuda_stat(int rank, enum tl_cuda_stat i)
{
	shmrpc_future *f;
	int64_t v;

	CHECK_OK(shmrpc_rpc_sync(rank, "stats", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	v = shmrpc_future_value(f)->u.items[i].u.i;
	shmrpc_future_free(f);
	return v;
}

void tl_fake_cuda_wait_stat(int rank, enum tl_cuda_stat i, int64_t want, const char *what)
{
	int64_t v = -1;

	for (int k = 0; k < 500 && (v = tl_fake_cuda_stat(rank, i)) != want; k++)
		usleep(10000);
	CHECK(v == want, "rank %d: %s is %lld, want %lld", rank, what, (long long)v, (long long)want);
}

void tl_call(int rank, const char *fn, const shmrpc_value *args, uint32_t n)
{
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_sync(rank, fn, args, n, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
}
