/*
 * Tensor descriptors (docs/PROTOCOL.md): a handle packed into a message
 * (by reference into the pool or a CUDA allocation, or inline), and
 * received as a handle of our own.
 */
#include <errno.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/error.h"
#include "shm/pool.h"
#include "worker/cuda.h"
#include "worker/devmap.h"
#include "worker/carry.h"
#include "worker/link.h"
#include "worker/tensor_impl.h"
#include "worker/value.h"

/* The CUDA part of d's descriptor, for a new receiver; *token: its
 * lifetime token. Its event goes to sent, busy until sent's holder goes. */
static int dev_describe(const shmrpc_tensor *t, struct tensor_wire_cuda *wc, uint64_t *token,
			struct tensor_list *sent)
{
	struct tensor_dev *d = t->dev;
	struct agent *ag = worker_agent;
	/* Relaxed: see shmrpc_tensor_set_cuda_stream. */
	uintptr_t stream = atomic_load_explicit(&d->stream, memory_order_relaxed);
	struct shm_pool *p;
	int rc;

	if ((rc = tensor_pool_get(&p)))
		return rc; /* the token lives in the pool */
	memset(wc, 0, sizeof(*wc));
	if (d->imported) {
		/* Passed on: the producer's allocation and token, our event. */
		rc = tensor_dev_check(d);
		if (rc)
			return rc;
		if (ag->view != d->view)
			return shmrpc__fail(-EINVAL, "a CUDA tensor of another job cannot be sent");
		wc->producer = d->producer;
		*token = d->token;
		rc = cuda_export_forward(&d->ipc, stream, &wc->ipc);
	} else {
		tensor_exports_reap(false);
		wc->producer = ag->rank;
		rc = tensor_dev_token(d, token) ?: cuda_export(t->dl.data, t->nbytes, stream, &wc->ipc);
	}
	if (rc == 0 && (rc = tensor_list_add_event(sent, &wc->ipc)))
		cuda_export_done(&wc->ipc);
	return rc;
}

/* t's descriptor and, for an inline one, its bytes (ext type). */
static int pack_ext(msgpack_packer *pk, const shmrpc_tensor *t, int8_t type,
		    const struct tensor_wire *w, const struct tensor_wire_cuda *wc)
{
	size_t shape = (size_t)t->dl.ndim * sizeof(int64_t);
	size_t bytes = type == VALUE_EXT_TENSOR_INLINE ? t->nbytes : 0;

	if (msgpack_pack_ext(pk, sizeof(*w) + shape + (wc ? sizeof(*wc) : 0) + bytes, type) ||
	    msgpack_pack_ext_body(pk, w, sizeof(*w)) ||
	    msgpack_pack_ext_body(pk, t->shape, shape) ||
	    (wc && msgpack_pack_ext_body(pk, wc, sizeof(*wc))) ||
	    (bytes && msgpack_pack_ext_body(pk, t->dl.data, bytes)))
		return shmrpc__fail(-ENOMEM, "out of memory encoding a tensor");
	return 0;
}

/* A pool copy of t (a heap tensor past its message's inline budget),
 * kept by sent until the message's pins hold it. */
static int heap_to_pool(const shmrpc_tensor *t, struct tensor_list *sent, shmrpc_tensor **out)
{
	int rc = shmrpc_tensor_alloc(t->dl.dtype, t->dl.ndim, t->shape, out);

	if (rc)
		return rc;
	memcpy((*out)->dl.data, t->dl.data, t->nbytes);
	if ((rc = tensor_list_add_made(sent, *out))) {
		shmrpc_tensor_free(*out);
		*out = NULL;
	}
	return rc;
}

/* The bytes of the message packed so far: pk packs into an sbuffer
 * (value_pack's contract; msgpack_sbuffer_write is static inline, so its
 * address cannot tell). */
static size_t packed_so_far(const msgpack_packer *pk)
{
	return ((const msgpack_sbuffer *)pk->data)->size;
}

int tensor_pack(msgpack_packer *pk, shmrpc_tensor *t, struct tensor_list *sent)
{
	const shmrpc_tensor *d = t; /* whose bytes the descriptor names */
	shmrpc_tensor *copy;
	struct tensor_wire w;
	struct tensor_wire_cuda wc;
	int rc;

	if (t->heap) {
		/* Inline while the message, these bytes included, stays within
		 * half a frame: what follows (more descriptors, the rest of the
		 * arguments) has the other half, and a message that starts with
		 * half a frame or more (a Python message's large pickle) takes
		 * none, as before. */
		size_t half = worker_agent ? ipc_port_max_payload(&worker_agent->port) / 2 : 0;
		size_t so_far = packed_so_far(pk);

		if (so_far <= half && t->nbytes <= half - so_far) {
			w = (struct tensor_wire){ 0, t->nbytes, t->dl.dtype.code, t->dl.dtype.bits,
						  t->dl.dtype.lanes, t->dl.ndim, kDLCPU, 0 };
			return pack_ext(pk, t, VALUE_EXT_TENSOR_INLINE, &w, NULL) ?:
			       tensor_list_add(sent, t);
		}
		rc = heap_to_pool(t, sent, &copy);
		if (rc)
			return rc;
		d = copy;
	}
	w = (struct tensor_wire){ d->off, d->nbytes, d->dl.dtype.code, d->dl.dtype.bits,
				  d->dl.dtype.lanes, d->dl.ndim, d->dl.device.device_type,
				  d->dl.device.device_id };
	if (d->dev && (rc = dev_describe(d, &wc, &w.off, sent)))
		return rc;
	return pack_ext(pk, d, d == t && sent->covers && tensor_list_covers(sent->covers, t)
				       ? VALUE_EXT_TENSOR_COVERED : VALUE_EXT_TENSOR,
			&w, d->dev ? &wc : NULL) ?:
	       tensor_list_add(sent, t);
}

/* A CUDA descriptor received (w and its shape checked): a handle mapping
 * the producer's bytes, holding a reference on the token; or, when land
 * puts it on another device, a handle of a copy there that holds the
 * mapped tensor. */
static int dev_unpack(const struct tensor_wire *w, const int64_t *shape,
		      const struct tensor_wire_cuda *wc, const struct devmap_landing *land,
		      shmrpc_tensor **out)
{
	struct agent *ag = worker_agent;
	struct tensor_dev *d, *held;
	int32_t here, at;
	void *data = NULL;
	bool stale = false;
	int rc;

	if (wc->producer >= ag->world || wc->ipc.len != w->nbytes || wc->ipc.len > wc->ipc.size)
		return shmrpc__fail(-EBADMSG, "a CUDA tensor descriptor that does not hold together "
				    "(producer %u of %u workers, %llu and %llu bytes of an allocation "
				    "of %llu)", wc->producer, ag->world, (unsigned long long)wc->ipc.len,
				    (unsigned long long)w->nbytes, (unsigned long long)wc->ipc.size);
	/* Ordinals are each process's own (CUDA_VISIBLE_DEVICES): the device
	 * is found here by its UUID; a device map maps the sender's ordinal
	 * (w->device_id) to ours, as torch's. */
	rc = cuda_local_device(&wc->ipc, &here);
	if (rc)
		return rc;
	at = here;
	if (land && (rc = devmap_land(ag, land, w->device_id, &at)))
		return rc;
	if (!(d = calloc(1, sizeof(*d))))
		return shmrpc__fail(-ENOMEM, "out of memory receiving a CUDA tensor");
	atomic_init(&d->refs, 1);
	d->imported = true;
	d->device = here;
	d->producer = wc->producer;
	d->ipc = wc->ipc;
	d->token = w->off;
	d->view = ag->view;
	/* The token first: from then on the producer keeps the memory. The
	 * producer must still be there (its memory goes with it), checked
	 * after, so that it cannot have left in between unseen. */
	rc = pool_ref(&ag->pool, ag->rank, d->token);
	if (rc) {
		free(d);
		return rc;
	}
	/* Relaxed: the agent's own reference keeps the count above zero. */
	atomic_fetch_add_explicit(&d->view->refs, 1, memory_order_relaxed);
	rc = tensor_dev_check(d);
	held = d;
	if (rc == 0 && at != here) {
		/* Mapped to another device: copied there once (torch copies
		 * too), on the landing device's legacy default stream. */
		if (!(held = calloc(1, sizeof(*held))))
			rc = shmrpc__fail(-ENOMEM, "out of memory receiving a CUDA tensor");
		else if ((rc = cuda_import_copy(&d->ipc, at, &data, &stale)) == 0)
			*held = (struct tensor_dev){ .refs = 1, .source = d, .copy = data,
						     .copy_device = at };
	} else if (rc == 0) {
		/* The legacy default stream of the receiver waits for the
		 * producer's event (shmrpc.h): what it queues after reads the
		 * producer's writes. */
		rc = cuda_import(&d->ipc, 0, &data, &stale);
	}
	if (rc == 0 &&
	    (rc = tensor_dev_handle(held, data, (DLDevice){ kDLCUDA, at },
			     (DLDataType){ w->code, w->bits, w->lanes }, w->ndim, shape, out)) == 0 &&
	    (*out)->nbytes != w->nbytes) {
		rc = shmrpc__fail(-EBADMSG, "a CUDA tensor descriptor says %llu bytes for a shape of "
				  "%llu bytes", (unsigned long long)w->nbytes,
				  (unsigned long long)(*out)->nbytes);
		tensor_handle_discard(*out);
	}
	/* The producer reused the addresses of an allocation of its tensors
	 * parked here, so it freed that one: their entries go. */
	if (stale)
		tensor_idle_drop(IDLE_STALE_OF_PID, d->ipc.pid);
	if (rc == 0)
		return 0;
	if (data)
		cuda_import_release(&d->ipc, false);
	if (held != d) {
		if (held && data)
			cuda_free(at, data);
		free(held);
	}
	pool_unref(&ag->pool, ag->rank, d->token);
	tensor_view_put(d->view);
	free(d);
	return rc;
}

/* The handle of pinned (a request's pin) of the CPU tensor w describes
 * (shape: its sizes), that still holds its reference; NULL if none. */
static shmrpc_tensor *pinned_of(struct tensor_list *pinned, const struct tensor_wire *w,
				const int64_t *shape)
{
	for (uint32_t i = 0; pinned && i < pinned->n; i++) {
		shmrpc_tensor *t = pinned->t[i];

		if (!t->heap && !t->dev && !t->spent && t->off == w->off && t->nbytes == w->nbytes &&
		    t->dl.dtype.code == w->code && t->dl.dtype.bits == w->bits &&
		    t->dl.dtype.lanes == w->lanes && t->dl.ndim == w->ndim &&
		    !memcmp(t->shape, shape, (size_t)w->ndim * sizeof(*shape)))
			return t;
	}
	return NULL;
}

int tensor_unpack(const char *data, uint32_t len, const struct devmap_landing *land,
		  struct tensor_list *pinned, shmrpc_tensor **out)
{
	shmrpc_tensor *mine;
	struct shm_pool *p;
	struct tensor_wire w;
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
	int64_t block;
	int rc = tensor_pool_get(&p);

	if (rc)
		return rc;
	if (len < sizeof(w))
		return shmrpc__fail(-EBADMSG, "a tensor descriptor of %u bytes is too short", len);
	memcpy(&w, data, sizeof(w));
	if (w.device_type != kDLCPU && w.device_type != kDLCUDA)
		return shmrpc__fail(-ENOTSUP, "a tensor on DLPack device type %d came in: this build "
				    "takes CPU (%d) and CUDA (%d) tensors only", (int)w.device_type,
				    kDLCPU, kDLCUDA);
	if (w.ndim < 0 || w.ndim > SHMRPC_TENSOR_MAX_DIMS ||
	    len != sizeof(w) + (size_t)w.ndim * sizeof(int64_t) +
			   (w.device_type == kDLCUDA ? sizeof(struct tensor_wire_cuda) : 0))
		return shmrpc__fail(-EBADMSG, "a tensor descriptor with %d dimensions in %u bytes",
				    w.ndim, len);
	memcpy(shape, data + sizeof(w), (size_t)w.ndim * sizeof(int64_t));
	if (w.device_type == kDLCUDA) {
		struct tensor_wire_cuda wc;

		memcpy(&wc, data + sizeof(w) + (size_t)w.ndim * sizeof(int64_t), sizeof(wc));
		return dev_unpack(&w, shape, &wc, land, out);
	}
	if (w.device_id != 0)
		return shmrpc__fail(-EBADMSG, "a CPU tensor descriptor names device %d",
				    (int)w.device_id);
	/* Our own handle of these bytes, which is all the descriptor can
	 * name: its reference is ours to take. */
	if ((mine = pinned_of(pinned, &w, shape)))
		return tensor_take_over(mine, out);
	/* Nothing from another process is trusted: the block must exist and hold the bytes. */
	block = pool_block_size(p, w.off);
	if (block < 0)
		return (int)block;
	rc = tensor_make_handle(p, w.off, (DLDataType){ w.code, w.bits, w.lanes }, w.ndim, shape, out);
	if (rc)
		return rc;
	if ((*out)->nbytes != w.nbytes || w.nbytes > (uint64_t)block) {
		tensor_handle_discard(*out);
		return shmrpc__fail(-EBADMSG, "a tensor descriptor says %llu bytes for a shape of %llu "
				    "bytes in a block of %lld", (unsigned long long)w.nbytes,
				    (unsigned long long)(*out)->nbytes, (long long)block);
	}
	rc = pool_ref(p, worker_agent->rank, w.off);
	if (rc)
		tensor_handle_discard(*out);
	return rc;
}

int tensor_unpack_inline(const char *data, uint32_t len, shmrpc_tensor **out)
{
	struct tensor_wire w;
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
	size_t head;
	int rc;

	if (len < sizeof(w))
		return shmrpc__fail(-EBADMSG, "an inline tensor of %u bytes is too short for its "
				    "descriptor", len);
	memcpy(&w, data, sizeof(w));
	if (w.off != 0 || w.device_type != kDLCPU || w.device_id != 0)
		return shmrpc__fail(-EBADMSG, "an inline tensor names pool offset %llu on DLPack "
				    "device %d:%d: it can only be a CPU tensor without a block",
				    (unsigned long long)w.off, (int)w.device_type, (int)w.device_id);
	if (w.ndim < 0 || w.ndim > SHMRPC_TENSOR_MAX_DIMS)
		return shmrpc__fail(-EBADMSG, "an inline tensor with %d dimensions", w.ndim);
	head = sizeof(w) + (size_t)w.ndim * sizeof(int64_t);
	/* Nothing from another process is trusted: the length it claims must
	 * be the bytes that follow in the frame, and the shape's. */
	if (len < head || w.nbytes != len - head)
		return shmrpc__fail(-EBADMSG, "an inline tensor says it holds %llu bytes, and %lld "
				    "follow its descriptor in the frame", (unsigned long long)w.nbytes,
				    (long long)len - (long long)head);
	memcpy(shape, data + sizeof(w), (size_t)w.ndim * sizeof(int64_t));
	rc = tensor_new_handle((DLDataType){ w.code, w.bits, w.lanes }, w.ndim, shape, out);
	if (rc)
		return rc;
	if ((*out)->nbytes != w.nbytes)
		rc = shmrpc__fail(-EBADMSG, "an inline tensor of %llu bytes has a shape of %llu "
				  "bytes", (unsigned long long)w.nbytes,
				  (unsigned long long)(*out)->nbytes);
	else
		rc = tensor_heap_fill(*out, data + head);
	if (rc) {
		tensor_handle_discard(*out);
		*out = NULL;
	}
	return rc;
}
