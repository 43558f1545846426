/* Tensor handles, descriptors and pins; see tensor.h. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/error.h"
#include "shm/pool.h"
#include "worker/agent.h"
#include "worker/tensor.h"
#include "worker/trace.h"
#include "worker/value.h"

/* The descriptor on the wire (little endian, as the machine). */
struct tensor_wire {
	uint64_t off;
	uint64_t nbytes;
	uint8_t code;
	uint8_t bits;
	uint16_t lanes;
	int32_t ndim;
	int64_t shape[];
};

static struct shm_pool *pool_or_fail(void)
{
	struct agent *ag = worker_agent;

	if (!ag)
		return shmrpc__fail(-ENOTCONN, "the RPC agent is not running: call shmrpc_init first"),
		       NULL;
	if (!ag->has_pool)
		return shmrpc__fail(-ENOTSUP, "this job has no tensor pool: start it with shmrun "
				    "(--pool-size sets its size)"),
		       NULL;
	return &ag->pool;
}

int tensor_view_open(struct shm_pool *p, struct tensor_view **out)
{
	struct tensor_view *v = malloc(sizeof(*v));

	if (!v)
		return shmrpc__fail(-ENOMEM, "out of memory attaching the tensor pool");
	v->base = p->base;
	v->size = p->size;
	atomic_init(&v->refs, 1);
	*out = v;
	return 0;
}

void tensor_view_put(struct tensor_view *v)
{
	/* acq_rel: the last one out sees every other holder's use of the bytes done. */
	if (v && atomic_fetch_sub_explicit(&v->refs, 1, memory_order_acq_rel) == 1) {
		munmap(v->base, v->size);
		free(v);
	}
}

/* A handle that never got its pool reference (or whose reference is gone). */
static void handle_discard(shmrpc_tensor *t)
{
	tensor_view_put(t->view);
	free(t);
}

static uint64_t dtype_bytes(DLDataType d)
{
	return ((uint64_t)d.bits * d.lanes + 7) / 8;
}

/* Fills a handle for the block at off; checks shape and size. */
static int make_handle(struct shm_pool *p, uint64_t off, DLDataType dtype, int32_t ndim,
		       const int64_t *shape, shmrpc_tensor **out)
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
	if (!(t = calloc(1, sizeof(*t))))
		return shmrpc__fail(-ENOMEM, "out of memory making a tensor handle");
	t->view = worker_agent->view;
	/* Relaxed: the agent's own reference keeps the count above zero here. */
	atomic_fetch_add_explicit(&t->view->refs, 1, memory_order_relaxed);
	t->off = off;
	t->nbytes = n;
	memcpy(t->shape, shape, (size_t)ndim * sizeof(*shape));
	t->dl = (DLTensor){
		.data = pool_at(p, off, n),
		.device = { kDLCPU, 0 },
		.ndim = ndim,
		.dtype = dtype,
		.shape = t->shape,
		.strides = NULL, /* contiguous */
	};
	*out = t;
	return 0;
}

int shmrpc_tensor_alloc(DLDataType dtype, int32_t ndim, const int64_t *shape, shmrpc_tensor **out)
{
	struct shm_pool *p = pool_or_fail();
	shmrpc_tensor *t;
	uint64_t off;
	int rc;

	if (!p)
		return -ENOTSUP;
	if (!out || (ndim && !shape))
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_alloc: shape and out must be given");
	rc = make_handle(p, 0, dtype, ndim, shape, &t);
	if (rc)
		return rc;
	rc = pool_alloc(p, worker_agent->rank, t->nbytes ? t->nbytes : 1, &off);
	if (rc) {
		handle_discard(t);
		return rc;
	}
	t->off = off;
	t->dl.data = pool_at(p, off, t->nbytes);
	*out = t;
	return 0;
}

int shmrpc_tensor_retain(shmrpc_tensor *t, shmrpc_tensor **out)
{
	struct shm_pool *p = pool_or_fail();
	int rc;

	if (!p)
		return -ENOTSUP;
	rc = make_handle(p, t->off, t->dl.dtype, t->dl.ndim, t->shape, out);
	if (rc)
		return rc;
	rc = pool_ref(p, worker_agent->rank, t->off);
	if (rc) {
		handle_discard(*out);
		*out = NULL;
	}
	return rc;
}

void shmrpc_tensor_free(shmrpc_tensor *t)
{
	struct agent *ag = worker_agent;

	if (!t)
		return;
	/* A handle of a job this process has left (its agent shut down, or
	 * another agent since) has no reference any more: pool_leave dropped
	 * them all. Its view still keeps the bytes mapped until now. */
	if (ag && ag->has_pool && ag->view == t->view && pool_unref(&ag->pool, ag->rank, t->off))
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
	handle_discard(t);
}

void *shmrpc_tensor_data(const shmrpc_tensor *t)
{
	return t->dl.data;
}

uint64_t shmrpc_tensor_nbytes(const shmrpc_tensor *t)
{
	return t->nbytes;
}

const DLTensor *shmrpc_tensor_dl(const shmrpc_tensor *t)
{
	return &t->dl;
}

uint64_t shmrpc_tensor_pool_offset(const shmrpc_tensor *t)
{
	return t->off;
}

/* ---- lists ---- */

int tensor_list_add(struct tensor_list *l, shmrpc_tensor *t)
{
	if (l->n == l->cap) {
		uint32_t cap = l->cap ? 2 * l->cap : 4;
		shmrpc_tensor **n = realloc(l->t, cap * sizeof(*n));

		if (!n)
			return shmrpc__fail(-ENOMEM, "out of memory listing tensors");
		l->t = n;
		l->cap = cap;
	}
	l->t[l->n++] = t;
	return 0;
}

int tensor_list_add_rref(struct tensor_list *l, shmrpc_rref *r)
{
	if (l->nr == l->rcap) {
		uint32_t cap = l->rcap ? 2 * l->rcap : 4;
		shmrpc_rref **n = realloc(l->r, cap * sizeof(*n));

		if (!n)
			return shmrpc__fail(-ENOMEM, "out of memory listing RRefs");
		l->r = n;
		l->rcap = cap;
	}
	l->r[l->nr++] = r;
	return 0;
}

void tensor_list_free(struct tensor_list *l)
{
	for (uint32_t i = 0; i < l->n; i++)
		shmrpc_tensor_free(l->t[i]);
	for (uint32_t i = 0; i < l->nr; i++)
		shmrpc_rref_free(l->r[i]);
	tensor_list_forget(l);
}

void tensor_list_forget(struct tensor_list *l)
{
	free(l->t);
	free(l->r);
	*l = (struct tensor_list){ 0 };
}

bool tensor_list_has_before(const struct tensor_list *l, uint32_t n, const shmrpc_tensor *t)
{
	for (uint32_t i = 0; i < n && i < l->n; i++)
		if (l->t[i] == t)
			return true;
	return false;
}

bool tensor_list_has(const struct tensor_list *l, const shmrpc_tensor *t)
{
	return tensor_list_has_before(l, l->n, t);
}

/* ---- descriptors ---- */

int tensor_pack(msgpack_packer *pk, const shmrpc_tensor *t)
{
	size_t len = sizeof(struct tensor_wire) + (size_t)t->dl.ndim * sizeof(int64_t);
	struct tensor_wire w = { t->off, t->nbytes, t->dl.dtype.code, t->dl.dtype.bits,
				 t->dl.dtype.lanes, t->dl.ndim };

	if (msgpack_pack_ext(pk, len, VALUE_EXT_TENSOR) ||
	    msgpack_pack_ext_body(pk, &w, sizeof(w)) ||
	    msgpack_pack_ext_body(pk, t->shape, (size_t)t->dl.ndim * sizeof(int64_t)))
		return shmrpc__fail(-ENOMEM, "out of memory encoding a tensor");
	return 0;
}

int tensor_unpack(const char *data, uint32_t len, shmrpc_tensor **out)
{
	struct shm_pool *p = pool_or_fail();
	struct tensor_wire w;
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
	int64_t block;
	int rc;

	if (!p)
		return -ENOTSUP;
	if (len < sizeof(w))
		return shmrpc__fail(-EBADMSG, "a tensor descriptor of %u bytes is too short", len);
	memcpy(&w, data, sizeof(w));
	if (w.ndim < 0 || w.ndim > SHMRPC_TENSOR_MAX_DIMS ||
	    len != sizeof(w) + (size_t)w.ndim * sizeof(int64_t))
		return shmrpc__fail(-EBADMSG, "a tensor descriptor with %d dimensions in %u bytes",
				    w.ndim, len);
	memcpy(shape, data + sizeof(w), (size_t)w.ndim * sizeof(int64_t));
	/* Nothing from another process is trusted: the block must exist and hold the bytes. */
	block = pool_block_size(p, w.off);
	if (block < 0)
		return (int)block;
	rc = make_handle(p, w.off, (DLDataType){ w.code, w.bits, w.lanes }, w.ndim, shape, out);
	if (rc)
		return rc;
	if ((*out)->nbytes != w.nbytes || w.nbytes > (uint64_t)block) {
		handle_discard(*out);
		return shmrpc__fail(-EBADMSG, "a tensor descriptor says %llu bytes for a shape of %llu "
				    "bytes in a block of %lld", (unsigned long long)w.nbytes,
				    (unsigned long long)(*out)->nbytes, (long long)block);
	}
	rc = pool_ref(p, worker_agent->rank, w.off);
	if (rc)
		handle_discard(*out);
	return rc;
}

/* ---- pins ---- */

struct pin {
	struct pin *next;
	uint32_t peer;
	enum pin_kind kind;
	uint64_t msg_id;
	struct tensor_list held;
};

static struct {
	pthread_mutex_t lock;
	struct pin *head;
} pins = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* The pin's handoff as the flight recorder shows it: kind PINNED or
 * UNPINNED, with its tensors and their bytes. */
static void trace_pin(const struct pin *pin, uint32_t kind, uint32_t status)
{
	uint64_t bytes = 0;

	if (!trace_self.ctl)
		return;
	for (uint32_t i = 0; i < pin->held.n; i++)
		bytes += pin->held.t[i]->nbytes;
	trace_pins(kind, pin->peer, pin->kind == PIN_REPLY, pin->msg_id, pin->held.n, bytes, status);
}

int pins_add(uint32_t peer, uint64_t msg_id, enum pin_kind kind, const struct tensor_list *sent)
{
	struct pin *pin = calloc(1, sizeof(*pin));
	int rc = 0;

	if (!pin)
		return shmrpc__fail(-ENOMEM, "out of memory pinning tensors");
	*pin = (struct pin){ .peer = peer, .kind = kind, .msg_id = msg_id };
	for (uint32_t i = 0; i < sent->n && rc == 0; i++) {
		shmrpc_tensor *t;

		rc = shmrpc_tensor_retain(sent->t[i], &t);
		if (rc == 0 && (rc = tensor_list_add(&pin->held, t)))
			shmrpc_tensor_free(t);
	}
	if (rc) {
		tensor_list_free(&pin->held);
		free(pin);
		return rc;
	}
	/* Before the pin is listed: its release, and so its UNPINNED, cannot
	 * come first. */
	trace_pin(pin, SHM_TRACE_PINNED, SHM_TRACE_OK);
	pthread_mutex_lock(&pins.lock);
	pin->next = pins.head;
	pins.head = pin;
	pthread_mutex_unlock(&pins.lock);
	return 0;
}

enum pin_match { MATCH_ONE, MATCH_PEER, MATCH_ALL };

/* Takes out the pins that match; frees them after the lock is dropped. */
static void release_if(enum pin_match how, uint32_t peer, uint64_t msg_id, enum pin_kind kind)
{
	static const uint32_t status[] = { [MATCH_ONE] = SHM_TRACE_OK,
					   [MATCH_PEER] = SHM_TRACE_PEER_DEAD,
					   [MATCH_ALL] = SHM_TRACE_SHUTDOWN };
	struct pin **at, *pin, *gone = NULL;

	pthread_mutex_lock(&pins.lock);
	for (at = &pins.head; (pin = *at);) {
		if (how == MATCH_ALL || (pin->peer == peer && (how == MATCH_PEER ||
			(pin->msg_id == msg_id && pin->kind == kind)))) {
			*at = pin->next;
			pin->next = gone;
			gone = pin;
		} else {
			at = &pin->next;
		}
	}
	pthread_mutex_unlock(&pins.lock);
	while ((pin = gone)) {
		gone = pin->next;
		trace_pin(pin, SHM_TRACE_UNPINNED, status[how]);
		tensor_list_free(&pin->held);
		free(pin);
	}
}

void pins_release(uint32_t peer, uint64_t msg_id, enum pin_kind kind)
{
	release_if(MATCH_ONE, peer, msg_id, kind);
}

void pins_release_peer(uint32_t peer)
{
	release_if(MATCH_PEER, peer, 0, PIN_REQUEST);
}

void pins_release_all(void)
{
	release_if(MATCH_ALL, 0, 0, PIN_REQUEST);
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
	free(e);
}

int shmrpc_tensor_to_dlpack(shmrpc_tensor *t, DLManagedTensor **out)
{
	struct exported *e;

	if (!t || !out)
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_to_dlpack: a tensor and out must be given");
	if (!(e = calloc(1, sizeof(*e))))
		return shmrpc__fail(-ENOMEM, "out of memory exporting a tensor");
	e->t = t;
	e->m.dl_tensor = t->dl;
	e->m.manager_ctx = e;
	e->m.deleter = exported_delete;
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

int shmrpc_tensor_from_dlpack(DLManagedTensor *m, shmrpc_tensor **out)
{
	struct shm_pool *p = pool_or_fail();
	const DLTensor *d;
	const uint8_t *src;
	uint64_t off;
	int rc;

	if (!m || !out)
		return shmrpc__fail(-EINVAL, "shmrpc_tensor_from_dlpack: a tensor and out must be given");
	d = &m->dl_tensor;
	if (!p)
		rc = -ENOTSUP;
	else if (d->device.device_type != kDLCPU && d->device.device_type != kDLCUDAHost)
		rc = shmrpc__fail(-ENOTSUP, "DLPack tensors on device type %d are not supported yet "
				  "(CPU memory only)", (int)d->device.device_type);
	else if (!contiguous(d))
		rc = shmrpc__fail(-ENOTSUP, "strided DLPack tensors are not supported yet: make it "
				  "contiguous first");
	else
		rc = make_handle(p, 0, d->dtype, d->ndim, d->shape, out);
	if (rc)
		return rc; /* m stays the caller's */
	src = (const uint8_t *)d->data + d->byte_offset;
	if (pool_block_at(p, src, (*out)->nbytes, &off)) {
		rc = pool_ref(p, worker_agent->rank, off);
	} else {
		rc = pool_alloc(p, worker_agent->rank, (*out)->nbytes ? (*out)->nbytes : 1, &off);
		if (rc == 0) {
			memcpy(pool_at(p, off, (*out)->nbytes), src, (*out)->nbytes);
			/* Relaxed: a counter for inspectors and tests. */
			atomic_fetch_add_explicit(&worker_agent->self->dlpack_copies, 1,
						  memory_order_relaxed);
		}
	}
	if (rc) {
		handle_discard(*out);
		*out = NULL;
		return rc;
	}
	(*out)->off = off;
	(*out)->dl.data = pool_at(p, off, (*out)->nbytes);
	if (m->deleter)
		m->deleter(m);
	return 0;
}
