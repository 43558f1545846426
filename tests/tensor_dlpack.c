/*
 * DLPack both ways. Export hands the tensor's reference to the
 * DLManagedTensor (its deleter drops it); importing pool memory takes it
 * without a copy; importing other host memory copies it into the pool once
 * and counts the copy; each deleter runs exactly once; what cannot be taken
 * (strided, no data, another device; CUDA where it is not available) is
 * refused with a clear error and left to its owner.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "worker/link.h"
#include "worker/cuda.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static int deleted;

static void count_delete(DLManagedTensor *m)
{
	deleted++;
	free(m->dl_tensor.data);
	free(m);
}

static DLManagedTensor *foreign(int64_t n)
{
	DLManagedTensor *m = calloc(1, sizeof(*m));
	static int64_t shape[1];

	shape[0] = n;
	m->dl_tensor = (DLTensor){ .data = malloc((size_t)n * 4), .device = { kDLCPU, 0 }, .ndim = 1,
				   .dtype = { kDLFloat, 32, 1 }, .shape = shape };
	for (int64_t i = 0; i < n; i++)
		((float *)m->dl_tensor.data)[i] = (float)i;
	m->deleter = count_delete;
	return m;
}

static uint64_t used(void)
{
	struct pool_stats st;

	pool_stats(&worker_agent->pool, &st);
	return st.used;
}

static uint64_t copies(void)
{
	return atomic_load(&worker_agent->self->dlpack_copies);
}

static int worker(void)
{
	const DLDataType f32 = { kDLFloat, 32, 1 };
	int64_t shape[2] = { 16, 64 }, strides[1] = { 2 };
	shmrpc_tensor *t, *back;
	DLManagedTensor *m;
	int probe;
	uint64_t off;

	CHECK_OK(shmrpc_init(NULL));
	CHECK_OK(shmrpc_tensor_alloc(f32, 2, shape, &t));
	off = shmrpc_tensor_pool_offset(t);
	((float *)shmrpc_tensor_data(t))[1023] = 3.5f;

	/* Out and back in: the same block, no copy, one reference in the end. */
	CHECK_OK(shmrpc_tensor_to_dlpack(t, &m));
	CHECK(m->dl_tensor.data == shmrpc_tensor_data(t) && m->dl_tensor.ndim == 2 &&
	      m->dl_tensor.shape[1] == 64 && m->dl_tensor.device.device_type == kDLCPU, "export");
	CHECK_OK(shmrpc_tensor_from_dlpack(m, &back));
	CHECK(shmrpc_tensor_pool_offset(back) == off && copies() == 0, "pool memory was copied");
	CHECK(((float *)shmrpc_tensor_data(back))[1023] == 3.5f, "bytes");
	shmrpc_tensor_free(back);
	CHECK(used() == 0, "the exported reference was not dropped once: %llu bytes used",
	      (unsigned long long)used());

	/* Foreign host memory: copied once, counted, its deleter run once. */
	m = foreign(1000);
	CHECK_OK(shmrpc_tensor_from_dlpack(m, &back));
	CHECK(deleted == 1 && copies() == 1, "deleter ran %d times, %llu copies", deleted,
	      (unsigned long long)copies());
	CHECK(((float *)shmrpc_tensor_data(back))[999] == 999.0f, "copied bytes");
	shmrpc_tensor_free(back);

	/* Refused, and left to the caller. */
	m = foreign(8);
	m->dl_tensor.strides = strides;
	CHECK(shmrpc_tensor_from_dlpack(m, &back) == -ENOTSUP && strstr(shmrpc_errmsg(), "strided"),
	      "strided: %s", shmrpc_errmsg());
	m->dl_tensor.strides = NULL;
	{
		void *data = m->dl_tensor.data;

		/* No storage (torch's ZeroTensor): an error, never a read of
		 * address 0. */
		m->dl_tensor.data = NULL;
		CHECK(shmrpc_tensor_from_dlpack(m, &back) == -EINVAL &&
		      strstr(shmrpc_errmsg(), "no data"), "no data: %s", shmrpc_errmsg());
		m->dl_tensor.data = data;
	}
	m->dl_tensor.device.device_type = kDLVulkan;
	CHECK(shmrpc_tensor_from_dlpack(m, &back) == -ENOTSUP &&
	      strstr(shmrpc_errmsg(), "not supported yet"), "vulkan: %s", shmrpc_errmsg());
	/* CUDA memory is taken as it is where CUDA is (tensor_cuda), and
	 * refused with the reason where it is not. */
	m->dl_tensor.device.device_type = kDLCUDA;
	probe = cuda_probe();
	if (probe)
		CHECK(shmrpc_tensor_from_dlpack(m, &back) == probe &&
		      strstr(shmrpc_errmsg(), "CUDA is not available"), "cuda: %s", shmrpc_errmsg());
	CHECK(deleted == 1, "a refused import ran the deleter");
	m->deleter(m);
	CHECK(used() == 0, "%llu bytes left in the pool", (unsigned long long)used());
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "1", NULL);
}
