/*
 * Device tensors' bytes (struct tensor_dev, tensor.h): their release once
 * their consumers' streams are done, the receiver's idle cache of
 * mappings, and the producer's exports that receivers may hold.
 */
#include <errno.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/error.h"
#include "shm/pool.h"
#include "worker/cuda.h"
#include "worker/executor.h"
#include "worker/link.h"
#include "worker/tensor_impl.h"

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
		tensor_dev_put(d->source);
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

/* Takes the entries that match out of the cache and releases them. */
void tensor_idle_drop(enum idle_which which, uint32_t pid)
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
	tensor_idle_drop(IDLE_ALL, 0);
}

void tensor_idle_forget(uint32_t pid)
{
	tensor_idle_drop(pid ? IDLE_OF_PID : IDLE_ALL, pid);
}

/* Drops one reference of dev; the last one parks a received tensor in
 * the idle cache, or releases what it holds (dev_release). */
void tensor_dev_put(struct tensor_dev *d)
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
int tensor_dev_check(const struct tensor_dev *d)
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

/* The loop thread's check, on an executor: the deleters are user code. */
static void run_reap(struct job *j)
{
	free(j);
	/* Release: a tick that sees false may queue another. */
	atomic_store_explicit(&exports.reap_queued, false, memory_order_release);
	tensor_exports_reap(false);
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
void tensor_exports_reap(bool final)
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
		tensor_dev_put(d);
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

	tensor_exports_reap(true);
	/* The peers that passed the barrier with us empty their idle caches
	 * before they go GONE: their pins on our tensors are about to go.
	 * Relaxed: the loop thread and the executors are stopped, so only
	 * this thread changes the count now. */
	for (uint32_t i = 0; wait && i < TENSOR_SHUTDOWN_WAIT_MS &&
			     atomic_load_explicit(&exports.n, memory_order_relaxed); i++) {
		bool gone = peers_gone(ag);

		tensor_exports_reap(true);
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
int tensor_dev_token(struct tensor_dev *d, uint64_t *token)
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
