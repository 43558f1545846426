/* Futures; see future.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/spin.h"
#include "common/zalloc.h"
#include "worker/executor.h"
#include "worker/future.h"
#include "worker/link.h"
#include "worker/pins.h"
#include "worker/profile.h"
#include "worker/value.h"

shmrpc_future *future_new(void)
{
	shmrpc_future *f = zalloc(sizeof(*f));
	pthread_condattr_t ca;

	if (!f)
		return NULL;
	pthread_mutex_init(&f->lock, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&f->cond, &ca);
	pthread_condattr_destroy(&ca);
	atomic_init(&f->refs, 1);
	arena_init(&f->arena, &f->first);
	return f;
}

void future_ref(shmrpc_future *f)
{
	/* Relaxed: taking a reference needs no ordering; dropping one does. */
	atomic_fetch_add_explicit(&f->refs, 1, memory_order_relaxed);
}

static void free_cbs(struct future_cb *c)
{
	while (c) {
		struct future_cb *next = c->next;

		free(c);
		c = next;
	}
}

void future_unref(shmrpc_future *f)
{
	/* acq_rel: the last holder sees every write of the others before freeing. */
	if (atomic_fetch_sub_explicit(&f->refs, 1, memory_order_acq_rel) != 1)
		return;
	free_cbs(f->cbs);
	free_cbs(f->for_waiter);
	arena_free(&f->arena);
	tensor_list_free(&f->tensors);
	free(f->errmsg);
	free(f->errtype);
	free(f->backtrace);
	free(f->profile_key);
	if (f->callee_events) {
		profile_events_free(f->callee_events);
		free(f->callee_events);
	}
	pthread_mutex_destroy(&f->lock);
	pthread_cond_destroy(&f->cond);
	free(f);
}

struct callback_job {
	struct job base;
	shmrpc_future *f;
	void (*fn)(shmrpc_future *, void *);
	void *arg;
};

static void run_callback(struct job *j)
{
	struct callback_job *c = (struct callback_job *)j;

	c->fn(c->f, c->arg);
	future_unref(c->f);
	free(c);
}

/* Runs fn(f, arg) on an executor thread, f held until then. */
static int submit_callback(shmrpc_future *f, void (*fn)(shmrpc_future *, void *), void *arg)
{
	struct callback_job *c = malloc(sizeof(*c));

	if (!c)
		return shmrpc__fail(-ENOMEM, "out of memory queueing a future callback");
	future_ref(f);
	*c = (struct callback_job){ { .run = run_callback }, f, fn, arg };
	executor_submit(&c->base);
	return 0;
}

/* Marks f done, wakes its waiters and queues its callbacks, but leaves
 * future_hook's to a waiter if one is in; f->lock held on entry. */
static void finish(shmrpc_future *f)
{
	struct future_cb *cbs = f->cbs, **at = &cbs;

	f->cbs = NULL;
	/* Relaxed: under the lock, where a waiter's decrement is made. */
	if (atomic_load_explicit(&f->waiters, memory_order_relaxed))
		while (*at) {
			struct future_cb *c = *at;

			if (!c->by_waiter) {
				at = &c->next;
				continue;
			}
			*at = c->next;
			c->next = f->for_waiter;
			f->for_waiter = c;
		}
	if (f->profile_key)
		f->done_ns = shmrpc_now_ns();
	/* Release pairs with the acquire in shmrpc_future_done and the waits. */
	atomic_store_explicit(&f->done, 1, memory_order_release);
	pthread_cond_broadcast(&f->cond);
	pthread_mutex_unlock(&f->lock);
	executor_kick(f->msg_id, &f->done);
	agent_future_done();
	while (cbs) {
		struct future_cb *next = cbs->next;

		submit_callback(f, cbs->fn, cbs->arg);
		free(cbs);
		cbs = next;
	}
}

uint32_t future_complete_packed(shmrpc_future *f, const void *buf, size_t len)
{
	struct pin *pin;
	uint32_t ntensors;
	size_t used;
	int rc;

	pthread_mutex_lock(&f->lock);
	if (atomic_load_explicit(&f->done, memory_order_relaxed)) {
		pthread_mutex_unlock(&f->lock);
		if (f->sent_tensors)
			pins_release(f->dst, f->msg_id, PIN_REQUEST);
		return 0;
	}
	/* The request's pin kept the blocks of the reply's covered tensors
	 * (VALUE_EXT_TENSOR_COVERED) until now: its handles give them their
	 * references (an echo's block changes no count), and we hold our own
	 * to them, as the callee does to the request's. Released before
	 * finish(), as it was before the unpack: a caller woken by its reply
	 * finds the pool as the call left it. */
	pin = f->sent_tensors ? pins_take(f->dst, f->msg_id, PIN_REQUEST) : NULL;
	f->tensors.pinned = pins_held(pin);
	rc = value_unpack(buf, len, &f->arena, &f->value, &used, &f->tensors);
	f->tensors.pinned = NULL;
	pins_drop(pin);
	if (rc == 0 && used != len)
		rc = shmrpc__fail(-EBADMSG, "a reply of %zu bytes holds %zu bytes after its value",
				  len, len - used);
	if (rc) {
		f->err = rc;
		f->errmsg = strdup(shmrpc_errmsg());
	}
	/* Counted now: after finish() the future may be freed by its owner. */
	ntensors = tensor_list_by_ref(&f->tensors);
	finish(f);
	return ntensors;
}

void future_fail(shmrpc_future *f, int err, const char *type, const char *msg, const char *backtrace)
{
	pthread_mutex_lock(&f->lock);
	if (atomic_load_explicit(&f->done, memory_order_relaxed)) {
		pthread_mutex_unlock(&f->lock);
		return;
	}
	f->err = err;
	f->errmsg = strdup(msg);
	f->errtype = type ? strdup(type) : NULL;
	f->backtrace = backtrace ? strdup(backtrace) : NULL;
	finish(f);
}

static bool is_done(shmrpc_future *f)
{
	/* Acquire pairs with the release in finish(): the result is visible. */
	return atomic_load_explicit(&f->done, memory_order_acquire);
}

/* is_done for agent_wait_reply. */
static bool done_of(void *f)
{
	return is_done(f);
}

struct spin_wait {
	shmrpc_future *f;
	struct agent *ag;
};

/* A spinning waiter takes its reply itself (link.h); it stops when the
 * agent is going. */
static bool spin_done(void *arg)
{
	struct spin_wait *w = arg;

	if (is_done(w->f))
		return true;
	return !agent_spin_poll(w->ag) || is_done(w->f);
}

/* Spins a hand-off's budget (link.h) for f; whether f is done. */
static bool spin_wait(shmrpc_future *f, uint64_t deadline_ns)
{
	struct spin_wait w = { f, agent_spin_begin() };
	bool came = false;

	if (w.ag) {
		bool watch = agent_watch_begin(w.ag); /* its replies ring no one meanwhile */

		came = shmrpc_spin_until(spin_done, &w, worker_handoff_spin(deadline_ns)) &&
		       is_done(f);
		if (watch)
			agent_watch_end(w.ag);
		worker_handoff_spun(came);
	}
	agent_spin_end();
	return came;
}

int future_wait_until(shmrpc_future *f, uint64_t deadline_ns)
{
	/* An executor thread runs what the call needs rather than spin: the
	 * reply it waits for may depend on it (executor.h). */
	if (executor_on_worker_thread())
		return executor_help_until(f->msg_id, &f->done, deadline_ns);
	if (is_done(f) || spin_wait(f, deadline_ns)) /* done before: nothing to learn */
		return 0;
	return future_sleep_until(f, deadline_ns);
}

int future_sleep_until(shmrpc_future *f, uint64_t deadline_ns)
{
	struct timespec ts;
	int rc = 0;

	if (is_done(f))
		return 0;
	ts.tv_sec = (time_t)(deadline_ns / 1000000000u);
	ts.tv_nsec = (long)(deadline_ns % 1000000000u);
	/* We take our replies (link.h): all of them, or, alone, our own. */
	if (agent_wait_reply(done_of, f, deadline_ns) || agent_wait_alone(done_of, f, deadline_ns))
		return is_done(f) ? 0 : -ETIMEDOUT;
	pthread_mutex_lock(&f->lock);
	while (!atomic_load_explicit(&f->done, memory_order_relaxed) && rc == 0)
		rc = deadline_ns ? pthread_cond_timedwait(&f->cond, &f->lock, &ts)
				 : pthread_cond_wait(&f->cond, &f->lock);
	pthread_mutex_unlock(&f->lock);
	return is_done(f) ? 0 : -ETIMEDOUT;
}

/* ---- public API ---- */

/* A waiter's way out: it runs the hooks finish() left to waiters. */
static void waiter_leave(shmrpc_future *f)
{
	struct future_cb *c;

	pthread_mutex_lock(&f->lock);
	atomic_fetch_sub_explicit(&f->waiters, 1, memory_order_relaxed);
	c = f->for_waiter;
	f->for_waiter = NULL;
	pthread_mutex_unlock(&f->lock);
	while (c) {
		struct future_cb *next = c->next;

		c->fn(f, c->arg);
		free(c);
		c = next;
	}
}

int shmrpc_future_wait(shmrpc_future *f, int64_t timeout_ms)
{
	int rc;

	atomic_fetch_add_explicit(&f->waiters, 1, memory_order_relaxed);
	rc = future_wait_until(f, timeout_ms < 0 ? 0 : shmrpc_now_ns() + (uint64_t)timeout_ms * 1000000u);
	waiter_leave(f);
	if (rc)
		return shmrpc__fail(rc, "the call has not completed within %lld ms",
				    (long long)timeout_ms);
	if (f->err)
		return shmrpc__fail(f->err, "%s", f->errmsg ? f->errmsg : "unknown error");
	return 0;
}

int shmrpc_future_done(shmrpc_future *f)
{
	return is_done(f);
}

const shmrpc_value *shmrpc_future_value(shmrpc_future *f)
{
	return is_done(f) && !f->err ? &f->value : NULL;
}

int shmrpc_future_error(shmrpc_future *f, const char **msg)
{
	if (!is_done(f)) {
		if (msg)
			*msg = "the call has not completed";
		return -EINPROGRESS;
	}
	if (msg)
		*msg = f->err ? f->errmsg : NULL;
	return f->err;
}

const char *shmrpc_future_error_type(shmrpc_future *f)
{
	return is_done(f) ? f->errtype : NULL;
}

const char *shmrpc_future_remote_backtrace(shmrpc_future *f)
{
	return is_done(f) ? f->backtrace : NULL;
}

static int add_cb(shmrpc_future *f, void (*cb)(shmrpc_future *f, void *arg), void *arg,
		  bool by_waiter)
{
	struct future_cb *c;

	pthread_mutex_lock(&f->lock);
	if (atomic_load_explicit(&f->done, memory_order_relaxed)) {
		pthread_mutex_unlock(&f->lock);
		if (!by_waiter)
			return submit_callback(f, cb, arg);
		cb(f, arg); /* the caller is as good a waiter as any */
		return 0;
	}
	c = malloc(sizeof(*c));
	if (!c) {
		pthread_mutex_unlock(&f->lock);
		return shmrpc__fail(-ENOMEM, "out of memory adding a callback");
	}
	*c = (struct future_cb){ f->cbs, cb, arg, by_waiter };
	f->cbs = c;
	pthread_mutex_unlock(&f->lock);
	return 0;
}

int future_hook(shmrpc_future *f, void (*cb)(shmrpc_future *f, void *arg), void *arg)
{
	return add_cb(f, cb, arg, true);
}

int shmrpc_future_then(shmrpc_future *f, void (*cb)(shmrpc_future *f, void *arg), void *arg)
{
	if (!cb)
		return shmrpc__fail(-EINVAL, "shmrpc_future_then: no callback given");
	/* Not a waiter's: shmrpc.h promises an executor thread, where cb may
	 * call rpc_sync or take a lock its registering or waiting thread holds. */
	return add_cb(f, cb, arg, false);
}

void shmrpc_future_free(shmrpc_future *f)
{
	if (f)
		future_unref(f);
}
