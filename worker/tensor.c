/* Tensor handles, descriptors and pins; see tensor.h. */
#include <errno.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/error.h"
#include "shm/pool.h"
#include "worker/link.h"
#include "worker/cuda.h"
#include "worker/devmap.h"
#include "worker/executor.h"
#include "worker/tensor.h"
#include "worker/trace.h"
#include "worker/value.h"

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

/* The producer's sources that receivers may hold (a reference each). */
static struct {
	pthread_mutex_t lock;
	struct tensor_dev *head;
	/* Those a shutdown left held by receivers: kept (never released)
	 * until the process exits. */
	struct tensor_dev *kept;
	_Atomic uint32_t n;         /* entries; read without the lock by the loop thread */
	_Atomic bool reap_queued;   /* a reap job is queued on the executors */
	uint64_t next_tick;         /* loop thread only */
} exports = { .lock = PTHREAD_MUTEX_INITIALIZER };

/*
 * Receiver: the idle cache (tensor.h). Received tensors with no handle
 * left, each still holding its mapping and its token reference; one per
 * allocation, the most recently parked first.
 */
static struct {
	pthread_mutex_t lock;
	struct tensor_dev *head;
	bool open; /* from tensor_idle_open to tensor_idle_close */
} idle_cache = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* *p = the running agent's tensor pool: 0, -ENOTCONN or -ENOTSUP. */
static int pool_get(struct shm_pool **p)
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

/* A handle for a tensor of this dtype and shape, checked, with its size;
 * data, device and the rest are the caller's to fill. */
static int new_handle(DLDataType dtype, int32_t ndim, const int64_t *shape, shmrpc_tensor **out)
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
	t->nbytes = n;
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
static void handle_at(struct shm_pool *p, shmrpc_tensor *t, uint64_t off)
{
	t->view = worker_agent->view;
	/* Relaxed: the agent's own reference keeps the count above zero. */
	atomic_fetch_add_explicit(&t->view->refs, 1, memory_order_relaxed);
	t->off = off;
	t->dl.data = pool_at(p, off, t->nbytes);
	t->dl.device = (DLDevice){ kDLCPU, 0 };
}

/* Fills a handle for the block at off; checks shape and size. */
static int make_handle(struct shm_pool *p, uint64_t off, DLDataType dtype, int32_t ndim,
		       const int64_t *shape, shmrpc_tensor **out)
{
	int rc = new_handle(dtype, ndim, shape, out);

	if (rc == 0)
		handle_at(p, *out, off);
	return rc;
}

/* ---- tensors in our memory (sent inline) ---- */

/* Gives t, a new handle, bytes of its own: a copy of src (nbytes of it). */
static int heap_fill(shmrpc_tensor *t, const void *src)
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

static void heap_put(struct tensor_heap *h)
{
	/* acq_rel: the last one out sees every other holder's use of the bytes done. */
	if (atomic_fetch_sub_explicit(&h->refs, 1, memory_order_acq_rel) == 1)
		free(h);
}

/* ---- device tensors ---- */

/* Waiting for the GPU is never done while handling frames (a pin's
 * release runs there, on the loop thread or a polling one): every frame
 * behind would wait too. */
static bool must_not_block(void)
{
	return worker_agent && agent_must_not_block(worker_agent);
}



/*
 * The last handle of a received tensor goes: the work its consumers queued
 * on the streams they read it on must finish before the producer may free
 * or reuse the memory (torch's receiver synchronizes its stream there too),
 * as a stream's order says nothing to another process's allocator. Blocks
 * the thread until that work is done; a failure (a consumer's stream
 * destroyed meanwhile) is said, and the release goes on.
 */
static void dev_drain(struct tensor_dev *d)
{
	/* Relaxed: the acq_rel drops of the handles order the consumer's
	 * store (shmrpc_tensor_cuda_wait) before this last one. */
	uintptr_t consumer = atomic_load_explicit(&d->consumer, memory_order_relaxed);
	int rc;

	if (d->drained)
		return;
	rc = cuda_stream_sync(d->device, 0);
	if (rc == 0 && consumer)
		rc = cuda_stream_sync(d->device, consumer);
	if (rc)
		fprintf(stderr, "shmrpc: releasing a received CUDA tensor: %s\n", shmrpc_errmsg());
	d->drained = true;
}

static void dev_put(struct tensor_dev *d);

/* What dev holds, its last reference gone: a receiver's mapping, then
 * its token (so the producer keeps the memory until the mapping is
 * closed), a landed copy and its source, a producer's DLPack tensor. */
static void dev_release(struct tensor_dev *d)
{
	struct agent *ag = worker_agent;

	if (d->imported) {
		dev_drain(d);
		cuda_import_release(&d->ipc, false);
		/* The token reference is of the job we received it in; after
		 * that job, pool_leave dropped it already. */
		if (ag && ag->has_pool && ag->view == d->view &&
		    pool_unref(&ag->pool, ag->rank, d->token))
			fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
		tensor_view_put(d->view);
	} else if (d->source) {
		/* The copy was queued on the landing device's stream: done
		 * before its memory and its source (whose producer may then
		 * free it) go. */
		if (cuda_stream_sync(d->copy_device, 0))
			fprintf(stderr, "shmrpc: releasing a CUDA tensor a device map landed: %s\n",
				shmrpc_errmsg());
		cuda_free(d->copy_device, d->copy);
		dev_put(d->source);
	} else if (d->owner && d->owner->deleter) {
		d->owner->deleter(d->owner);
	}
	free(d);
}

/* True while the producer of d, received in ag's job, runs. */
static bool producer_running(const struct agent *ag, const struct tensor_dev *d)
{
	const struct shm_worker *w = shm_worker(&ag->seg, d->producer);

	/* Acquire pairs with the launcher's release of EXITED/DEAD, and with
	 * the worker's release of its pid before RUNNING. */
	return atomic_load_explicit(&w->state, memory_order_acquire) == SHM_WORKER_RUNNING &&
	       atomic_load_explicit(&w->pid, memory_order_acquire) == d->ipc.pid;
}

struct dev_job {
	struct job j;
	struct tensor_dev *d;
};

static void run_dev_release(struct job *j)
{
	struct tensor_dev *d = ((struct dev_job *)j)->d;

	free(j);
	dev_release(d);
}

/* dev_release, on an executor when it would wait for the GPU here on the
 * loop thread. */
static void dev_release_soon(struct tensor_dev *d)
{
	struct dev_job *j;

	if (((d->imported && !d->drained) || d->source) && must_not_block()) {
		j = calloc(1, sizeof(*j));
		if (j) {
			j->j.run = run_dev_release;
			j->d = d;
			executor_submit(&j->j);
			return;
		}
		/* Out of memory for the job: done here, the loop waiting once. */
	}
	dev_release(d);
}

/* Releases a list of idle entries (linked by idle_next), taken out of the
 * cache: their mappings close unless a handle still holds them. */
static void idle_release(struct tensor_dev *gone)
{
	struct tensor_dev *d;

	while ((d = gone)) {
		gone = d->idle_next;
		dev_release_soon(d);
	}
}

/*
 * d, a received tensor whose last handle went, kept in the idle cache
 * with its mapping and token reference; false when it is not worth
 * keeping (the caller releases it): a tensor of our own allocation maps
 * nothing, and one of another job, of a producer gone, or whose
 * allocation the producer freed has nothing left to cache.
 */
static bool idle_park(struct tensor_dev *d)
{
	struct agent *ag = worker_agent;
	struct tensor_dev **pp, *p, *gone = NULL;
	uint32_t kept = 0;
	bool parked = false;

	if (!d->imported || d->ipc.pid == (uint32_t)getpid() || !ag || !ag->has_pool ||
	    ag->view != d->view)
		return false;
	pthread_mutex_lock(&idle_cache.lock);
	/* Checked under the lock: whoever makes it stale or forgets the
	 * producer drops the entries after, under the lock too, so that it
	 * sees d if d went in. */
	if (idle_cache.open && producer_running(ag, d) && !cuda_import_stale(&d->ipc)) {
		/* One entry per allocation: the latest replaces the one before
		 * (whose pin goes; d's keeps the allocation). The least
		 * recently parked beyond the cap go. */
		for (pp = &idle_cache.head; (p = *pp);) {
			if (kept == TENSOR_IDLE_MAPS - 1 ||
			    (p->ipc.pid == d->ipc.pid && p->ipc.alloc_id == d->ipc.alloc_id)) {
				*pp = p->idle_next;
				p->idle_next = gone;
				gone = p;
			} else {
				kept++;
				pp = &p->idle_next;
			}
		}
		d->idle_next = idle_cache.head;
		idle_cache.head = d;
		parked = true;
	}
	pthread_mutex_unlock(&idle_cache.lock);
	/* After d is in: a replaced entry's release leaves the mapping to d. */
	idle_release(gone);
	return parked;
}

enum idle_which { IDLE_ALL, IDLE_OF_PID, IDLE_STALE_OF_PID };

/* Takes the entries that match out of the cache and releases them. */
static void idle_drop(enum idle_which which, uint32_t pid)
{
	struct tensor_dev **pp, *p, *gone = NULL;

	pthread_mutex_lock(&idle_cache.lock);
	for (pp = &idle_cache.head; (p = *pp);) {
		if (which == IDLE_ALL || (p->ipc.pid == pid && (which == IDLE_OF_PID ||
								cuda_import_stale(&p->ipc)))) {
			*pp = p->idle_next;
			p->idle_next = gone;
			gone = p;
		} else {
			pp = &p->idle_next;
		}
	}
	pthread_mutex_unlock(&idle_cache.lock);
	idle_release(gone);
}

void tensor_idle_open(void)
{
	pthread_mutex_lock(&idle_cache.lock);
	idle_cache.open = true;
	pthread_mutex_unlock(&idle_cache.lock);
}

void tensor_idle_close(void)
{
	pthread_mutex_lock(&idle_cache.lock);
	idle_cache.open = false;
	pthread_mutex_unlock(&idle_cache.lock);
	idle_drop(IDLE_ALL, 0);
}

void tensor_idle_forget(uint32_t pid)
{
	idle_drop(pid ? IDLE_OF_PID : IDLE_ALL, pid);
}


/* Drops one reference of dev; the last one parks a received tensor in
 * the idle cache, or releases what it holds (dev_release). */
static void dev_put(struct tensor_dev *d)
{
	uint32_t was;

	/* acq_rel: the last one out sees every other holder's use of the bytes done. */
	/* A source the export registry still holds is released by the
	 * registry's reap, on an executor or a sending thread: never here,
	 * where the thread may be the loop thread (a pin's release) and the
	 * deleter is user code. */
	was = atomic_fetch_sub_explicit(&d->refs, 1, memory_order_acq_rel);
	if (was != 1)
		return;
	/* Drained now, as its user let go; while handling a frame, at its
	 * release instead (parked, its token keeps the memory in the
	 * producer; a release there goes to an executor). */
	if (d->imported && !must_not_block())
		dev_drain(d);
	if (!idle_park(d))
		dev_release_soon(d);
}

/* 0 when dev's bytes may be used here: a received tensor whose producer
 * exited or died (or of a job this process left) is an error. */
static int dev_check(const struct tensor_dev *d)
{
	struct agent *ag = worker_agent;
	char why[160];

	if (!d->imported || d->ipc.pid == (uint32_t)getpid())
		return 0;
	if (!ag || ag->view != d->view)
		return shmrpc__fail(-SHMRPC_EPEERDEAD, "a CUDA tensor received in a job this process "
				    "has left: its producer may have freed it");
	if (producer_running(ag, d))
		return 0;
	agent_peer_gone_text(ag, d->producer, why, sizeof(why));
	return shmrpc__fail(-SHMRPC_EPEERDEAD, "a CUDA tensor from %s: its memory went with it",
			    why);
}

/* A handle of dev (given one reference) with the dtype and shape. */
static int dev_handle(struct tensor_dev *d, void *data, DLDevice device, DLDataType dtype,
		      int32_t ndim, const int64_t *shape, shmrpc_tensor **out)
{
	int rc = new_handle(dtype, ndim, shape, out);

	if (rc)
		return rc;
	(*out)->dev = d;
	(*out)->dl.data = data;
	(*out)->dl.device = device;
	return 0;
}

static void exports_reap(bool final);

/* The loop thread's check, on an executor: the deleters are user code. */
static void run_reap(struct job *j)
{
	free(j);
	/* Release: a tick that sees false may queue another. */
	atomic_store_explicit(&exports.reap_queued, false, memory_order_release);
	exports_reap(false);
}

uint64_t tensor_exports_tick(uint64_t now)
{
	struct job *j;

	/* Relaxed: a hint; the reap itself reads the registry under its lock. */
	if (!atomic_load_explicit(&exports.n, memory_order_relaxed))
		return UINT64_MAX;
	if (now < exports.next_tick)
		return exports.next_tick;
	exports.next_tick = now + TENSOR_REAP_NS;
	/* Acquire pairs with run_reap's release: one job queued at a time. */
	if (!atomic_exchange_explicit(&exports.reap_queued, true, memory_order_acquire)) {
		if ((j = calloc(1, sizeof(*j)))) {
			j->run = run_reap;
			executor_submit(j);
		} else {
			atomic_store_explicit(&exports.reap_queued, false, memory_order_relaxed);
		}
	}
	return exports.next_tick;
}

/*
 * Releases each source that no receiver holds any more: the token counts
 * only us, and (unless final: the agent is stopping and nothing can be
 * sent) no handle, pin or message of ours names it, so that no send of it
 * can be in flight. Runs the deleters of those whose last reference goes.
 */
static void exports_reap(bool final)
{
	struct agent *ag = worker_agent;
	struct tensor_dev **pp, *d, *gone = NULL;

	if (!ag || !ag->has_pool)
		return;
	pthread_mutex_lock(&exports.lock);
	for (pp = &exports.head; (d = *pp);) {
		/* Acquire pairs with the release of the handle that dropped the
		 * count to the registry's; with one left, no other thread can
		 * raise it (a retain needs a handle). */
		bool idle = final || atomic_load_explicit(&d->refs, memory_order_acquire) == 1;

		if (idle && pool_block_refs(&ag->pool, d->token) == 1) {
			*pp = d->next;
			d->next = gone;
			gone = d;
			/* Relaxed: a hint for the loop thread (tensor_exports_tick). */
			atomic_fetch_sub_explicit(&exports.n, 1, memory_order_relaxed);
		} else {
			pp = &d->next;
		}
	}
	pthread_mutex_unlock(&exports.lock);
	while ((d = gone)) {
		gone = d->next;
		if (pool_unref(&ag->pool, ag->rank, d->token))
			fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
		d->token = 0; /* sent again (in a later job): a new token */
		dev_put(d);
	}
}

/* True when no peer of ag will let go of a tensor of ours by leaving: each
 * went GONE (its idle cache emptied before) or does not run. */
static bool peers_gone(const struct agent *ag)
{
	for (uint32_t r = 0; r < ag->world; r++) {
		const struct shm_worker *w = shm_worker(&ag->seg, r);

		/* Acquire pairs with the peer's release of GONE (its cache's
		 * unrefs before it) and the launcher's of EXITED/DEAD (after its
		 * sweep of the peer's references). */
		if (r != ag->rank &&
		    atomic_load_explicit(&w->state, memory_order_acquire) == SHM_WORKER_RUNNING &&
		    atomic_load_explicit(&w->agent_state, memory_order_acquire) != SHM_AGENT_GONE)
			return false;
	}
	return true;
}

void tensor_exports_shutdown(struct agent *ag, bool wait)
{
	struct tensor_dev *d;
	uint32_t n = 0;
	char held[512];
	size_t at = 0;

	exports_reap(true);
	/* The peers that passed the barrier with us empty their idle caches
	 * before they go GONE: their pins on our tensors are about to go.
	 * Relaxed: the loop thread and the executors are stopped, so only
	 * this thread changes the count now. */
	for (uint32_t i = 0; wait && i < TENSOR_SHUTDOWN_WAIT_MS &&
			     atomic_load_explicit(&exports.n, memory_order_relaxed); i++) {
		bool gone = peers_gone(ag);

		exports_reap(true);
		if (gone)
			break;
		usleep(1000);
	}
	pthread_mutex_lock(&exports.lock);
	for (d = exports.head; d; d = d->next)
		n++;
	for (uint32_t r = 0; n && r < ag->world && at < sizeof(held); r++) {
		char name[SHM_NAME_MAX];
		int64_t k = 0;

		for (d = exports.head; d; d = d->next) {
			/* Ours (the registry's) is not one of theirs. */
			int64_t h = pool_holder_refs(&ag->pool, r, d->token) - (r == ag->rank);

			k += h > 0 ? h : 0;
		}
		if (!k)
			continue;
		agent_peer_name(ag, r, name, sizeof(name));
		at += (size_t)snprintf(held + at, sizeof(held) - at, "%sworker %u (%s) holds %lld",
				       at ? ", " : "", r, name, (long long)k);
	}
	if (n)
		fprintf(stderr, "shmrpc: worker %u: shutting down with %u CUDA tensor(s) still held by "
			"other workers (%s); their memory stays allocated until this process "
			"exits, and those workers get an error when they use them after that\n",
			ag->rank, n, at ? held : "none found in the holder tables");
	/* The registry's references are kept: the memory must outlive every
	 * receiver's use, and this process's end is the last we can see. */
	while ((d = exports.head)) {
		exports.head = d->next;
		d->next = exports.kept;
		exports.kept = d;
	}
	/* Relaxed: the loop thread is stopped. */
	atomic_store_explicit(&exports.n, 0, memory_order_relaxed);
	pthread_mutex_unlock(&exports.lock);
}

/* The lifetime token of d, a source of ours, made at its first send (the
 * registry then holds a reference to d). */
static int dev_token(struct tensor_dev *d, uint64_t *token)
{
	struct agent *ag = worker_agent;
	int rc = 0;

	pthread_mutex_lock(&exports.lock);
	if (!d->token) {
		rc = pool_alloc(&ag->pool, ag->rank, 1, &d->token);
		if (rc == 0) {
			/* Relaxed: the caller's handle keeps the count above zero. */
			atomic_fetch_add_explicit(&d->refs, 1, memory_order_relaxed);
			d->next = exports.head;
			exports.head = d;
			/* Relaxed: a hint for the loop thread. */
			atomic_fetch_add_explicit(&exports.n, 1, memory_order_relaxed);
		}
	}
	*token = d->token;
	pthread_mutex_unlock(&exports.lock);
	return rc;
}

int shmrpc_tensor_alloc(DLDataType dtype, int32_t ndim, const int64_t *shape, shmrpc_tensor **out)
{
	struct shm_pool *p;
	shmrpc_tensor *t;
	uint64_t off;
	int rc = pool_get(&p);

	if (rc)
		return rc;
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
	struct shm_pool *p;
	int rc;

	if (t->dev) {
		rc = dev_handle(t->dev, t->dl.data, t->dl.device, t->dl.dtype, t->dl.ndim, t->shape,
				out);
		if (rc == 0)
			/* Relaxed: t's own reference keeps the count above zero. */
			atomic_fetch_add_explicit(&t->dev->refs, 1, memory_order_relaxed);
		return rc;
	}
	if (t->heap) {
		rc = new_handle(t->dl.dtype, t->dl.ndim, t->shape, out);
		if (rc == 0) {
			(*out)->heap = t->heap;
			(*out)->dl.data = t->dl.data;
			(*out)->dl.device = t->dl.device;
			/* Relaxed: t's own reference keeps the count above zero. */
			atomic_fetch_add_explicit(&t->heap->refs, 1, memory_order_relaxed);
		}
		return rc;
	}
	if ((rc = pool_get(&p)))
		return rc;
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
	if (t->dev || t->heap) {
		if (t->dev)
			dev_put(t->dev);
		else
			heap_put(t->heap);
		free(t);
		return;
	}
	/* A handle of a job this process has left (its agent shut down, or
	 * another agent since) has no reference any more: pool_leave dropped
	 * them all. Its view still keeps the bytes mapped until now. */
	if (ag && ag->has_pool && ag->view == t->view && pool_unref(&ag->pool, ag->rank, t->off))
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
	handle_discard(t);
}

void *shmrpc_tensor_data(const shmrpc_tensor *t)
{
	return t->dev && dev_check(t->dev) ? NULL : t->dl.data;
}

uint64_t shmrpc_tensor_nbytes(const shmrpc_tensor *t)
{
	return t->nbytes;
}

const DLTensor *shmrpc_tensor_dl(const shmrpc_tensor *t)
{
	return t->dev && dev_check(t->dev) ? NULL : &t->dl;
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
		return dev_check(d) ?: cuda_order(d->device, 0, stream);
	}
	/* Of this process: its writes were queued on the stream set for it.
	 * Relaxed: see shmrpc_tensor_set_cuda_stream. */
	wrote = atomic_load_explicit(&d->stream, memory_order_relaxed);
	return cuda_order(t->dl.device.device_id, wrote, stream);
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
	for (uint32_t i = 0; i < l->nmade; i++)
		shmrpc_tensor_free(l->made[i]);
	for (uint32_t i = 0; i < l->nev; i++)
		cuda_export_done(&l->ev[i]);
	free(l->ev);
	free(l->made);
	free(l->t);
	free(l->r);
	*l = (struct tensor_list){ 0 };
}

/* d's event to give back when l goes. */
static int list_add_event(struct tensor_list *l, const struct cuda_ipc_desc *d)
{
	if (l->nev == l->evcap) {
		uint32_t cap = l->evcap ? 2 * l->evcap : 4;
		struct cuda_ipc_desc *n = realloc(l->ev, cap * sizeof(*n));

		if (!n)
			return shmrpc__fail(-ENOMEM, "out of memory listing CUDA events");
		l->ev = n;
		l->evcap = cap;
	}
	l->ev[l->nev++] = *d;
	return 0;
}

int tensor_list_hold(struct tensor_list *sent, struct tensor_list *held)
{
	uint32_t had = held->nev;
	int rc = 0;

	/* The events first, moved: whatever fails after, held gives them back. */
	for (uint32_t i = 0; i < sent->nev && rc == 0; i++)
		rc = list_add_event(held, &sent->ev[i]);
	if (rc) {
		held->nev = had; /* still sent's alone */
		return rc;
	}
	free(sent->ev);
	sent->ev = NULL;
	sent->nev = sent->evcap = 0;

	for (uint32_t i = 0; i < sent->n + sent->nmade && rc == 0; i++) {
		shmrpc_tensor *s = i < sent->n ? sent->t[i] : sent->made[i - sent->n], *t;

		if (s->heap)
			continue; /* went inline: its bytes are in the message */
		rc = shmrpc_tensor_retain(s, &t);
		if (rc == 0 && (rc = tensor_list_add(held, t)))
			shmrpc_tensor_free(t);
	}
	return rc;
}

uint32_t tensor_list_by_ref(const struct tensor_list *l)
{
	uint32_t n = l->nmade;

	for (uint32_t i = 0; i < l->n; i++)
		n += !l->t[i]->heap;
	return n;
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

	if ((rc = pool_get(&p)))
		return rc; /* the token lives in the pool */
	memset(wc, 0, sizeof(*wc));
	if (d->imported) {
		/* Passed on: the producer's allocation and token, our event. */
		rc = dev_check(d);
		if (rc)
			return rc;
		if (ag->view != d->view)
			return shmrpc__fail(-EINVAL, "a CUDA tensor of another job cannot be sent");
		wc->producer = d->producer;
		*token = d->token;
		rc = cuda_export_forward(&d->ipc, stream, &wc->ipc);
	} else {
		exports_reap(false);
		wc->producer = ag->rank;
		rc = dev_token(d, token) ?: cuda_export(t->dl.data, t->nbytes, stream, &wc->ipc);
	}
	if (rc == 0 && (rc = list_add_event(sent, &wc->ipc)))
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
	int rc;

	if (sent->nmade == sent->madecap) {
		uint32_t cap = sent->madecap ? 2 * sent->madecap : 4;
		shmrpc_tensor **n = realloc(sent->made, cap * sizeof(*n));

		if (!n)
			return shmrpc__fail(-ENOMEM, "out of memory listing tensors");
		sent->made = n;
		sent->madecap = cap;
	}
	rc = shmrpc_tensor_alloc(t->dl.dtype, t->dl.ndim, t->shape, out);
	if (rc)
		return rc;
	memcpy((*out)->dl.data, t->dl.data, t->nbytes);
	sent->made[sent->nmade++] = *out;
	return 0;
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
	return pack_ext(pk, d, VALUE_EXT_TENSOR, &w, d->dev ? &wc : NULL) ?:
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
	rc = dev_check(d);
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
	    (rc = dev_handle(held, data, (DLDevice){ kDLCUDA, at },
			     (DLDataType){ w->code, w->bits, w->lanes }, w->ndim, shape, out)) == 0 &&
	    (*out)->nbytes != w->nbytes) {
		rc = shmrpc__fail(-EBADMSG, "a CUDA tensor descriptor says %llu bytes for a shape of "
				  "%llu bytes", (unsigned long long)w->nbytes,
				  (unsigned long long)(*out)->nbytes);
		free(*out);
	}
	/* The producer reused the addresses of an allocation of its tensors
	 * parked here, so it freed that one: their entries go. */
	if (stale)
		idle_drop(IDLE_STALE_OF_PID, d->ipc.pid);
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

int tensor_unpack(const char *data, uint32_t len, const struct devmap_landing *land,
		  shmrpc_tensor **out)
{
	struct shm_pool *p;
	struct tensor_wire w;
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
	int64_t block;
	int rc = pool_get(&p);

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
	rc = new_handle((DLDataType){ w.code, w.bits, w.lanes }, w.ndim, shape, out);
	if (rc)
		return rc;
	if ((*out)->nbytes != w.nbytes)
		rc = shmrpc__fail(-EBADMSG, "an inline tensor of %llu bytes has a shape of %llu "
				  "bytes", (unsigned long long)w.nbytes,
				  (unsigned long long)(*out)->nbytes);
	else
		rc = heap_fill(*out, data + head);
	if (rc) {
		free(*out);
		*out = NULL;
	}
	return rc;
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
	if (t->dev && dev_check(t->dev))
		return -SHMRPC_EPEERDEAD;
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
	if (!(d = calloc(1, sizeof(*d))))
		return shmrpc__fail(-ENOMEM, "out of memory taking a CUDA tensor");
	atomic_init(&d->refs, 1);
	d->owner = m;
	rc = dev_handle(d, (uint8_t *)dl->data + dl->byte_offset, dl->device, dl->dtype, dl->ndim,
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
	if ((rc = pool_get(&p)))
		return rc; /* m stays the caller's */
	if (d->device.device_type != kDLCPU && d->device.device_type != kDLCUDAHost)
		rc = shmrpc__fail(-ENOTSUP, "DLPack tensors on device type %d are not supported yet "
				  "(CPU and CUDA memory only)", (int)d->device.device_type);
	else if (!contiguous(d))
		rc = shmrpc__fail(-ENOTSUP, "strided DLPack tensors are not supported yet: make it "
				  "contiguous first");
	else
		rc = new_handle(d->dtype, d->ndim, d->shape, out);
	if (rc)
		return rc; /* m stays the caller's */
	src = (const uint8_t *)d->data + d->byte_offset;
	n = (*out)->nbytes;
	/* Pool memory is handed over by reference whatever its size (the
	 * callee sees these bytes); other memory is copied: a small tensor
	 * into our own, to travel inline, a larger one into a block. */
	if (pool_block_at(p, src, n, &off)) {
		rc = pool_ref(p, worker_agent->rank, off);
		if (rc == 0)
			handle_at(p, *out, off);
	} else if (worker_agent->inline_max && n <= worker_agent->inline_max) {
		rc = heap_fill(*out, src);
		copied = rc == 0;
	} else if ((rc = pool_alloc(p, worker_agent->rank, n ? n : 1, &off)) == 0) {
		handle_at(p, *out, off);
		memcpy((*out)->dl.data, src, n);
		copied = true;
	}
	if (rc) {
		handle_discard(*out);
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
