/* Tensor handles: made, shared, freed, and as DLPack; see tensor.h. */
#include <errno.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/error.h"
#include "common/spare.h"
#include "common/zalloc.h"
#include "shm/pool.h"
#include "worker/cuda.h"
#include "worker/link.h"
#include "worker/tensor_impl.h"

/* *p = the running agent's tensor pool: 0, -ENOTCONN or -ENOTSUP. */
int tensor_pool_get(struct shm_pool **p)
{
	struct agent *ag;
	int rc = agent_running(&ag);

	*p = NULL;
	if (rc)
		return rc;
	if (!ag->has_pool)
		return shmrpc__fail(-ENOTSUP, "this job has no tensor pool: start it with shmrun "
				    "(--pool-size sets its size)");
	*p = &ag->pool;
	return 0;
}

/* Handles and DLPack exports are made on one thread and dropped on another
 * (a tensor echo: seven handles a call, on three threads). */
static struct spare spare_handles, spare_exports;

/* A handle that never got its pool reference (or whose reference is gone). */
void tensor_handle_discard(shmrpc_tensor *t)
{
	tensor_view_put(t->view);
	spare_put(&spare_handles, t);
}

static uint64_t dtype_bytes(DLDataType d)
{
	return ((uint64_t)d.bits * d.lanes + 7) / 8;
}

/* A handle for a tensor of this dtype and shape, checked, with its size;
 * data, device and the rest are the caller's to fill. */
int tensor_new_handle(DLDataType dtype, int32_t ndim, const int64_t *shape, shmrpc_tensor **out)
{
	uint64_t n = dtype_bytes(dtype);
	shmrpc_tensor *t;

	if (ndim < 0 || ndim > SHMRPC_TENSOR_MAX_DIMS || n == 0)
		return shmrpc__fail(-EINVAL, "a tensor has 0 to %d dimensions and a dtype of at "
				    "least one bit (got %d dimensions, %u bits x %u lanes)",
				    SHMRPC_TENSOR_MAX_DIMS, ndim, dtype.bits, dtype.lanes);
	for (int32_t i = 0; i < ndim; i++) {
		if (shape[i] < 0 || (shape[i] && n > UINT64_MAX / (uint64_t)shape[i]))
			return shmrpc__fail(-EINVAL, "tensor dimension %d is %lld", i,
					    (long long)shape[i]);
		n *= (uint64_t)shape[i];
	}
	if (!(t = spare_take(&spare_handles, sizeof(*t))))
		return shmrpc__fail(-ENOMEM, "out of memory making a tensor handle");
	*t = (shmrpc_tensor){ .nbytes = n };
	memcpy(t->shape, shape, (size_t)ndim * sizeof(*shape));
	t->dl = (DLTensor){
		.ndim = ndim,
		.dtype = dtype,
		.shape = t->shape,
		.strides = NULL, /* contiguous */
	};
	*out = t;
	return 0;
}

/* Points t, a new handle, at the pool block at off. */
void tensor_handle_at(struct shm_pool *p, shmrpc_tensor *t, uint64_t off)
{
	t->view = worker_agent->view;
	/* Relaxed: the agent's own reference keeps the count above zero. */
	atomic_fetch_add_explicit(&t->view->refs, 1, memory_order_relaxed);
	t->off = off;
	t->dl.data = pool_at(p, off, t->nbytes);
	t->dl.device = (DLDevice){ kDLCPU, 0 };
}

/* Fills a handle for the block at off; checks shape and size. */
int tensor_make_handle(struct shm_pool *p, uint64_t off, DLDataType dtype, int32_t ndim,
		       const int64_t *shape, shmrpc_tensor **out)
{
	int rc = tensor_new_handle(dtype, ndim, shape, out);

	if (rc == 0)
		tensor_handle_at(p, *out, off);
	return rc;
}

/* ---- tensors in our memory (sent inline) ---- */

/* Gives t, a new handle, bytes of its own: a copy of src (nbytes of it). */
int tensor_heap_fill(shmrpc_tensor *t, const void *src)
{
	size_t size = (sizeof(struct tensor_heap) + t->nbytes + 63) & ~(size_t)63;
	struct tensor_heap *h = aligned_alloc(64, size);

	if (!h)
		return shmrpc__fail(-ENOMEM, "out of memory for a tensor of %llu bytes",
				    (unsigned long long)t->nbytes);
	atomic_init(&h->refs, 1);
	if (t->nbytes)
		memcpy(h->bytes, src, t->nbytes);
	t->heap = h;
	t->dl.data = h->bytes;
	t->dl.device = (DLDevice){ kDLCPU, 0 };
	return 0;
}

void tensor_heap_put(struct tensor_heap *h)
{
	/* acq_rel: the last one out sees every other holder's use of the bytes done. */
	if (atomic_fetch_sub_explicit(&h->refs, 1, memory_order_acq_rel) == 1)
		free(h);
}

/* A handle of dev (given one reference) with the dtype and shape. */
int tensor_dev_handle(struct tensor_dev *d, void *data, DLDevice device, DLDataType dtype,
		      int32_t ndim, const int64_t *shape, shmrpc_tensor **out)
{
	int rc = tensor_new_handle(dtype, ndim, shape, out);

	if (rc)
		return rc;
	(*out)->dev = d;
	(*out)->dl.data = data;
	(*out)->dl.device = device;
	return 0;
}

int shmrpc_tensor_alloc(DLDataType dtype, int32_t ndim, const int64_t *shape, shmrpc_tensor **out)
{
	struct shm_pool *p;
	shmrpc_tensor *t;
	uint64_t off;
	int rc = tensor_pool_get(&p);

	if (rc)
		return rc;
	if (!out || (ndim && !shape))
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_alloc: shape and out must be given");
	rc = tensor_make_handle(p, 0, dtype, ndim, shape, &t);
	if (rc)
		return rc;
	rc = pool_alloc(p, worker_agent->rank, t->nbytes ? t->nbytes : 1, &off);
	if (rc) {
		tensor_handle_discard(t);
		return rc;
	}
	t->off = off;
	t->dl.data = pool_at(p, off, t->nbytes);
	*out = t;
	return 0;
}

int shmrpc_tensor_retain(shmrpc_tensor *t, shmrpc_tensor **out)
{
	struct shm_pool *p;
	int rc;

	if (t->dev) {
		rc = tensor_dev_handle(t->dev, t->dl.data, t->dl.device, t->dl.dtype, t->dl.ndim, t->shape,
				out);
		if (rc == 0)
			/* Relaxed: t's own reference keeps the count above zero. */
			atomic_fetch_add_explicit(&t->dev->refs, 1, memory_order_relaxed);
		return rc;
	}
	if (t->heap) {
		rc = tensor_new_handle(t->dl.dtype, t->dl.ndim, t->shape, out);
		if (rc == 0) {
			(*out)->heap = t->heap;
			(*out)->dl.data = t->dl.data;
			(*out)->dl.device = t->dl.device;
			/* Relaxed: t's own reference keeps the count above zero. */
			atomic_fetch_add_explicit(&t->heap->refs, 1, memory_order_relaxed);
		}
		return rc;
	}
	if (t->spent)
		return shmrpc__fail(-EINVAL, "this tensor handle gave its reference to another "
				    "(a received message's, read once): retain that one");
	if ((rc = tensor_pool_get(&p)))
		return rc;
	rc = tensor_make_handle(p, t->off, t->dl.dtype, t->dl.ndim, t->shape, out);
	if (rc)
		return rc;
	rc = pool_ref(p, worker_agent->rank, t->off);
	if (rc) {
		tensor_handle_discard(*out);
		*out = NULL;
	}
	return rc;
}

/* A new handle of pool tensor t's bytes, without a pool reference. */
static int same_bytes(const shmrpc_tensor *t, shmrpc_tensor **out)
{
	int rc = tensor_new_handle(t->dl.dtype, t->dl.ndim, t->shape, out);

	if (rc)
		return rc;
	(*out)->view = t->view;
	/* Relaxed: t's own reference keeps the count above zero. */
	atomic_fetch_add_explicit(&t->view->refs, 1, memory_order_relaxed);
	(*out)->off = t->off;
	(*out)->dl.data = t->dl.data;
	(*out)->dl.device = t->dl.device;
	return 0;
}

int tensor_take_over(shmrpc_tensor *t, shmrpc_tensor **out)
{
	int rc;

	/* A device or heap tensor's reference is a count in this process:
	 * a retain costs what a take-over would. */
	if (t->dev || t->heap || t->spent)
		return shmrpc_tensor_retain(t, out);
	if ((rc = same_bytes(t, out)) == 0)
		t->spent = true;
	return rc;
}

int tensor_described(const shmrpc_tensor *t, shmrpc_tensor **out)
{
	int rc;

	if (t->dev || t->heap)
		return shmrpc__fail(-EINVAL, "only a pool tensor's handle can be described "
				    "without a reference");
	if ((rc = same_bytes(t, out)) == 0)
		(*out)->spent = true;
	return rc;
}

void shmrpc_tensor_free(shmrpc_tensor *t)
{
	struct agent *ag = worker_agent;

	if (!t)
		return;
	if (t->spent) {
		tensor_handle_discard(t);
		return;
	}
	if (t->dev || t->heap) {
		if (t->dev)
			tensor_dev_put(t->dev);
		else
			tensor_heap_put(t->heap);
		spare_put(&spare_handles, t);
		return;
	}
	/* A handle of a job this process has left (its agent shut down, or
	 * another agent since) has no reference any more: pool_leave dropped
	 * them all. Its view still keeps the bytes mapped until now. */
	if (ag && ag->has_pool && ag->view == t->view && pool_unref(&ag->pool, ag->rank, t->off))
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
	tensor_handle_discard(t);
}

void *shmrpc_tensor_data(const shmrpc_tensor *t)
{
	return t->dev && tensor_dev_check(t->dev) ? NULL : t->dl.data;
}

uint64_t shmrpc_tensor_nbytes(const shmrpc_tensor *t)
{
	return t->nbytes;
}

const DLTensor *shmrpc_tensor_dl(const shmrpc_tensor *t)
{
	return t->dev && tensor_dev_check(t->dev) ? NULL : &t->dl;
}

uint64_t shmrpc_tensor_pool_offset(const shmrpc_tensor *t)
{
	if (t->dev || t->heap)
		return shmrpc__fail(-EINVAL, "%s is not in the pool: it has no pool offset",
				    t->dev ? "a CUDA tensor"
					   : "a small tensor sent inside the frame (SHMRPC_INLINE_MAX)"),
		       UINT64_MAX;
	return t->off;
}

int shmrpc_tensor_set_cuda_stream(shmrpc_tensor *t, uintptr_t stream)
{
	if (!t || !t->dev)
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_set_cuda_stream: not a CUDA tensor");
	/* Relaxed: which stream is the user's to order with its sends. */
	atomic_store_explicit(&t->dev->stream, stream, memory_order_relaxed);
	return 0;
}

int shmrpc_tensor_cuda_wait(shmrpc_tensor *t, uintptr_t stream)
{
	struct tensor_dev *d = t ? t->dev : NULL;
	uintptr_t wrote;

	if (!d)
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_cuda_wait: not a CUDA tensor");
	if (d->imported) {
		/* Relaxed: read by the release of the last handle (dev_drain),
		 * after the acq_rel drop of this handle. */
		if (stream)
			atomic_store_explicit(&d->consumer, stream, memory_order_relaxed);
		/* After the legacy default stream, which the import made wait
		 * for the producer's writes. */
		return tensor_dev_check(d) ?: cuda_order(d->device, 0, stream);
	}
	/* Of this process: its writes were queued on the stream set for it.
	 * Relaxed: see shmrpc_tensor_set_cuda_stream. */
	wrote = atomic_load_explicit(&d->stream, memory_order_relaxed);
	return cuda_order(t->dl.device.device_id, wrote, stream);
}

/* ---- DLPack ---- */

struct exported {
	DLManagedTensor m;
	shmrpc_tensor *t;
};

static void exported_delete(DLManagedTensor *m)
{
	struct exported *e = m->manager_ctx;

	shmrpc_tensor_free(e->t);
	spare_put(&spare_exports, e);
}

int shmrpc_tensor_to_dlpack(shmrpc_tensor *t, DLManagedTensor **out)
{
	struct exported *e;

	if (!t || !out)
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_to_dlpack: a tensor and out must be given");
	if (t->dev && tensor_dev_check(t->dev))
		return -SHMRPC_EPEERDEAD;
	if (!(e = spare_take(&spare_exports, sizeof(*e))))
		return shmrpc__fail(-ENOMEM, "out of memory exporting a tensor");
	*e = (struct exported){ .t = t,
				.m = { .dl_tensor = t->dl, .manager_ctx = e,
				       .deleter = exported_delete } };
	*out = &e->m;
	return 0;
}

static bool contiguous(const DLTensor *d)
{
	int64_t want = 1;

	if (!d->strides)
		return true;
	/* No element: any strides will do. */
	for (int32_t i = 0; i < d->ndim; i++)
		if (d->shape[i] == 0)
			return true;
	for (int32_t i = d->ndim - 1; i >= 0; i--) {
		if (d->shape[i] != 1 && d->strides[i] != want)
			return false;
		want *= d->shape[i];
	}
	return true;
}

/* The pool offset of p when it starts a live block of this job's pool. */
static bool pool_block_at(struct shm_pool *pool, const void *p, uint64_t nbytes, uint64_t *off)
{
	const uint8_t *b = p;
	int64_t size;

	if (b < pool->base + pool->data_off || b >= pool->base + pool->size)
		return false;
	*off = (uint64_t)(b - pool->base);
	size = pool_block_size(pool, *off);
	return size >= 0 && (uint64_t)size >= nbytes;
}

/* A CUDA tensor: taken as it is, m owned by the handle's bytes. */
static int from_cuda(DLManagedTensor *m, shmrpc_tensor **out)
{
	const DLTensor *dl = &m->dl_tensor;
	struct tensor_dev *d;
	int rc;

	if (!contiguous(dl))
		return shmrpc__fail(-ENOTSUP, "strided DLPack tensors are not supported yet: make it "
				    "contiguous first");
	rc = cuda_probe();
	if (rc)
		return rc;
	if (!(d = zalloc(sizeof(*d))))
		return shmrpc__fail(-ENOMEM, "out of memory taking a CUDA tensor");
	atomic_init(&d->refs, 1);
	d->owner = m;
	rc = tensor_dev_handle(d, (uint8_t *)dl->data + dl->byte_offset, dl->device, dl->dtype, dl->ndim,
			dl->shape, out);
	if (rc)
		free(d);
	return rc;
}

int shmrpc_tensor_from_dlpack(DLManagedTensor *m, shmrpc_tensor **out)
{
	struct shm_pool *p;
	const DLTensor *d;
	const uint8_t *src;
	uint64_t off, n;
	bool copied = false;
	int rc;

	if (!m || !out)
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_from_dlpack: a tensor and out must be given");
	d = &m->dl_tensor;
	if (d->device.device_type == kDLCUDA)
		return from_cuda(m, out);
	if ((rc = tensor_pool_get(&p)))
		return rc; /* m stays the caller's */
	if (d->device.device_type != kDLCPU && d->device.device_type != kDLCUDAHost)
		rc = shmrpc__fail(-ENOTSUP, "DLPack tensors on device type %d are not supported yet "
				  "(CPU and CUDA memory only)", (int)d->device.device_type);
	else if (!contiguous(d))
		rc = shmrpc__fail(-ENOTSUP, "strided DLPack tensors are not supported yet: make it "
				  "contiguous first");
	else
		rc = tensor_new_handle(d->dtype, d->ndim, d->shape, out);
	if (rc)
		return rc; /* m stays the caller's */
	n = (*out)->nbytes;
	if (!d->data && n) {
		/* A tensor without storage (torch's ZeroTensor, data_ptr() 0). */
		tensor_handle_discard(*out);
		*out = NULL;
		return shmrpc__fail(-EINVAL, "a DLPack tensor of %llu bytes has no data (its data "
				    "pointer is NULL): give it memory first (torch: .clone())",
				    (unsigned long long)n);
	}
	/* No arithmetic on a NULL pointer (an empty tensor may have one). */
	src = d->data ? (const uint8_t *)d->data + d->byte_offset : NULL;
	/* Pool memory is handed over by reference whatever its size (the
	 * callee sees these bytes); other memory is copied: a small tensor
	 * into our own, to travel inline, a larger one into a block. */
	if (pool_block_at(p, src, n, &off)) {
		rc = pool_ref(p, worker_agent->rank, off);
		if (rc == 0)
			tensor_handle_at(p, *out, off);
	} else if (worker_agent->inline_max && n <= worker_agent->inline_max) {
		rc = tensor_heap_fill(*out, src);
		copied = rc == 0;
	} else if ((rc = pool_alloc(p, worker_agent->rank, n ? n : 1, &off)) == 0) {
		tensor_handle_at(p, *out, off);
		if (n)
			memcpy((*out)->dl.data, src, n);
		copied = true;
	}
	if (rc) {
		tensor_handle_discard(*out);
		*out = NULL;
		return rc;
	}
	if (copied)
		/* Relaxed: a counter for inspectors and tests. */
		atomic_fetch_add_explicit(&worker_agent->self->dlpack_copies, 1,
					  memory_order_relaxed);
	if (m->deleter)
		m->deleter(m);
	return 0;
}
