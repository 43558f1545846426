/* The Python extension's way into worker/ (python_api.h). */
#include <errno.h>

#include "worker/client.h"
#include "worker/executor.h"
#include "worker/future.h"
#include "worker/link.h"
#include "worker/profile.h"
#include "worker/python_api.h"
#include "worker/rref.h"
#include "worker/tensor.h"

void python_call_begin(const char *kind, const char *fn, unsigned torch, bool sync)
{
	profile_name_next(kind, fn);
	if (torch)
		profile_torch_next(PROFILE_TORCH | (torch & (PROFILE_SHAPES | PROFILE_MEMORY)));
	client_sync_next(sync);
}

void python_call_end(void)
{
	profile_forget_next(); /* a request refused before it went */
	client_sync_next(false);
}

bool python_profiled(shmrpc_future *f, struct python_profiled *out)
{
	if (!f || !(f->profile_what & PROFILE_TORCH))
		return false;
	future_wait_until(f, 0);
	*out = (struct python_profiled){ f->profile_key, f->sent_ns, f->done_ns, f->callee_events };
	return true;
}

bool python_rref_profiled(const shmrpc_rref *r, struct python_profiled *out)
{
	return python_profiled(r->created, out);
}

uint64_t python_rref_id(const shmrpc_rref *r)
{
	return r->id;
}

void python_blocking(bool on)
{
	if (on)
		executor_block_begin();
	else
		executor_block_end();
}

bool python_on_executor(void)
{
	return executor_on_worker_thread();
}

int python_take_replies(bool on)
{
	struct agent *ag = worker_agent;

	if (!ag)
		return on ? -ENOTCONN : 0; /* off: shutdown turned it off already */
	agent_take_replies(ag, on);
	return 0;
}

int python_tensor_take(shmrpc_tensor *t, shmrpc_tensor **out)
{
	return tensor_take_over(t, out);
}

int python_future_hook(shmrpc_future *f, void (*cb)(shmrpc_future *f, void *arg), void *arg)
{
	return future_hook(f, cb, arg);
}

int python_tensor_echoed(shmrpc_tensor *t, shmrpc_tensor **out)
{
	return t->dev || t->heap ? shmrpc_tensor_retain(t, out) : tensor_described(t, out);
}

int python_rank_named(const char *name)
{
	struct agent *ag;
	int rc = agent_running(&ag);

	return rc ? rc : agent_rank_named(ag, name);
}

uint64_t python_agent_job(void)
{
	struct agent *ag = worker_agent;

	return ag ? ag->job : 0;
}

int python_peer_gone(int rank, bool *gone, bool *died, char *why, size_t len, uint32_t *world)
{
	struct agent *ag = worker_agent;

	if (!ag)
		return -ENOTCONN;
	*world = ag->world;
	if (rank < 0 || (uint32_t)rank >= ag->world)
		return -EINVAL;
	*gone = agent_peer_gone(ag, (uint32_t)rank);
	if (*gone) {
		agent_peer_gone_text(ag, (uint32_t)rank, why, len);
		*died = !ipc_port_peer_alive(&ag->port, (uint32_t)rank);
	}
	return 0;
}

int python_gauges(struct python_gauges *out)
{
	struct agent *ag = worker_agent;
	const struct shm_worker *w;
	struct rref_debug_counts rc;

	if (!ag)
		return -ENOTCONN;
	w = ag->self;
	rref_debug_counts(ag, &rc);
	/* Relaxed: gauges the owner updates as it goes; a snapshot. */
#define GAUGE(f) atomic_load_explicit(&w->f, memory_order_relaxed)
	*out = (struct python_gauges){
		.thread_pool_size = GAUGE(thread_pool_size),
		.num_idle_threads = GAUGE(num_idle_threads),
		.client_active_calls = GAUGE(client_active_calls),
		.server_active_calls = GAUGE(server_active_calls),
		.server_pending_calls = GAUGE(num_pending_futures),
		.calls_served = GAUGE(calls_served),
		.owner_rrefs = rc.owners,
		.pending_owner_rrefs = rc.pending_owners,
		.forks = rc.forks,
		.pending_users = rc.pending_users,
	};
#undef GAUGE
	return 0;
}

bool python_pool_mapping(void **base, uint64_t *size)
{
	struct agent *ag = worker_agent;

	if (!ag || !ag->has_pool)
		return false;
	*base = ag->view->base;
	*size = ag->view->size;
	return true;
}

int python_rref_drop_users(void)
{
	struct agent *ag = worker_agent;

	if (!ag)
		return -ENOTCONN;
	rref_drop_users(ag);
	return 0;
}

int python_rref_leaks(char *buf, size_t len)
{
	struct agent *ag = worker_agent;

	if (!ag)
		return -ENOTCONN;
	rref_leaks(ag, buf, len);
	return 0;
}

void python_set_live_release(void (*fn)(uint64_t id))
{
	rref_set_live_release(fn);
}
