/*
 * The link (link.h): the agent pointer, peers, sending, taking what the
 * rings hold (by whoever polls, or by the threads that wait for their
 * replies), the startup wait and the hand-off spin.
 */
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/spin.h"
#include "ipc/doorbell.h"
#include "shm/exit_info.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/trace.h"

#define BARRIER_POLL_US 200

/* Set once by agent.c before the first frame (link_set_hooks). */
static struct link_hooks hooks;

void link_set_hooks(const struct link_hooks *h)
{
	hooks = *h;
}

/* The request this thread serves (link_serving). */
static _Thread_local const struct link_served *serving;

const struct link_served *link_serving_swap(const struct link_served *s)
{
	const struct link_served *outer = serving;

	serving = s;
	return outer;
}

const struct link_served *link_serving(void)
{
	return serving;
}

struct agent *worker_agent;

/* The hand-off spin (link.h), set by shmrpc_init, 0 again at shutdown:
 * a fixed budget, or HANDOFF_ADAPTIVE for each thread's own. Relaxed: set
 * before the threads that read it start, or read by a waiter whose
 * future shutdown completes either way. */
#define HANDOFF_ADAPTIVE (UINT64_MAX - 1)
static _Atomic uint64_t handoff_spin_ns;
static _Thread_local struct shmrpc_spin_budget handoff_budget;
/* This thread's hand-off spins that met the work, and that ran out (the
 * thread then slept): plain per-thread counters, no shared line. */
static _Thread_local uint64_t handoff_met, handoff_missed;

uint64_t worker_handoff_spin(uint64_t deadline_ns)
{
	uint64_t mode = atomic_load_explicit(&handoff_spin_ns, memory_order_relaxed);
	uint64_t now, limit = UINT64_MAX;

	if (deadline_ns) {
		now = shmrpc_now_ns();
		limit = deadline_ns > now ? deadline_ns - now : 0;
	}
	if (mode == HANDOFF_ADAPTIVE)
		return shmrpc_spin_budget_ns(&handoff_budget, limit);
	return mode < limit ? mode : limit;
}

void worker_handoff_spun(bool came)
{
	if (came)
		handoff_met++;
	else
		handoff_missed++;
	if (atomic_load_explicit(&handoff_spin_ns, memory_order_relaxed) == HANDOFF_ADAPTIVE)
		shmrpc_spin_budget_update(&handoff_budget, came);
}

void worker_handoff_counts(uint64_t *met, uint64_t *missed)
{
	*met = handoff_met;
	*missed = handoff_missed;
}

void link_handoff_open(const struct agent *ag)
{
	atomic_store_explicit(&handoff_spin_ns,
			      ag->port.waiter.mode == IPC_WAIT_SPIN ? UINT64_MAX
			      : ag->port.waiter.fixed_spin_ns >= 0
				      ? (uint64_t)ag->port.waiter.fixed_spin_ns
				      : HANDOFF_ADAPTIVE,
			      memory_order_relaxed);
}

void link_handoff_close(void)
{
	atomic_store_explicit(&handoff_spin_ns, 0, memory_order_relaxed);
}

void link_set_agent_state(struct agent *ag, uint32_t st)
{
	/* Release: what we did before (names, threads) is visible with the state. */
	atomic_store_explicit(&ag->self->agent_state, st, memory_order_release);
	for (uint32_t r = 0; r < ag->world; r++)
		if (r != ag->rank)
			ipc_doorbell_ring(shm_worker(&ag->seg, r), ag->self);
}

void agent_peer_name(const struct agent *ag, uint32_t r, char *buf, size_t len)
{
	char name[SHM_NAME_MAX];
	size_t n;

	/* The slot is shared: read it once, and never trust a terminator.
	 * Copied, not printed: a call by name and each new RRef handle ask
	 * for names (glibc prints "%.*s" the slow way, positionally). */
	memcpy(name, shm_worker(&ag->seg, r)->name, sizeof(name));
	n = strnlen(name, sizeof(name));
	if (n == 0 || n == sizeof(name)) {
		snprintf(buf, len, "worker%u", r);
		return;
	}
	if (len == 0)
		return;
	n = n < len - 1 ? n : len - 1;
	memcpy(buf, name, n);
	buf[n] = '\0';
}

bool agent_peer_gone(struct agent *ag, uint32_t r)
{
	return r != ag->rank && (!ipc_port_peer_alive(&ag->port, r) ||
				 link_worker_state(ag, r) == SHM_WORKER_EXITED ||
				 link_agent_state(ag, r) == SHM_AGENT_GONE);
}

void agent_peer_gone_text(const struct agent *ag, uint32_t r, char *buf, size_t len)
{
	char name[SHM_NAME_MAX], cause[96];
	uint32_t st = link_worker_state(ag, r);

	agent_peer_name(ag, r, name, sizeof(name));
	if (st == SHM_WORKER_DEAD) {
		shm_exit_info_format(link_exit_info(ag, r), cause, sizeof(cause));
		snprintf(buf, len, "worker %u (%s) died: %s", r, name, cause);
	} else if (st == SHM_WORKER_EXITED || link_agent_state(ag, r) == SHM_AGENT_GONE) {
		snprintf(buf, len, "worker %u (%s) has left the job", r, name);
	} else if (ipc_port_ring_broken(&ag->port, r)) {
		snprintf(buf, len, "the ring from worker %u (%s) is corrupt and is no longer read: "
			 "its replies are lost (the job's memory was written outside shmrpc)", r,
			 name);
	} else if (ipc_port_ring_abandoned(&ag->port, r)) {
		snprintf(buf, len, "worker %u (%s) found the ring from this worker corrupt and no "
			 "longer reads it: requests to it are lost (the job's memory was written "
			 "outside shmrpc)", r, name);
	} else {
		snprintf(buf, len, "worker %u (%s) died: its process ended, and its launcher has "
			 "not recorded how", r, name);
	}
}

int agent_send(struct agent *ag, uint32_t dst, uint16_t type, uint64_t msg_id, uint64_t needed_by,
	       uint32_t depth, const struct help_chain *help, const void *payload, size_t len)
{
	uint32_t help_n = help ? help->n : 0;
	struct iovec iov[2] = { { help ? (void *)help->e : NULL, help_n * sizeof(*help->e) },
				{ (void *)payload, len } };
	struct ipc_msg m = { .type = type, .msg_id = msg_id, .needed_by = needed_by,
			     .depth = depth, .help_n = help_n, .iov = iov, .iovcnt = 2,
			     .kind = worker_msg_is_request(type) ? IPC_FRAME_REQUEST
				     : type == MSG_TENSOR_ACK    ? IPC_FRAME_OTHER
								 : IPC_FRAME_REPLY };
	int rc;

	if (dst == ag->rank) {
		hooks.local(ag, type, msg_id, needed_by, depth, help, payload, len);
		return 0;
	}
	rc = trace_send(&ag->port, dst, &m); /* ipc_port_send, its waits recorded */
	if (rc == -SHMRPC_EPEERDEAD) {
		char why[160];

		agent_peer_gone_text(ag, dst, why, sizeof(why));
		return shmrpc__fail(rc, "%s", why);
	}
	return rc;
}

/* ---- the loop thread ---- */

/* Set while this thread handles a frame (whichever thread polls): what it
 * does there holds up every frame behind it. */
static _Thread_local bool in_frame;

bool agent_must_not_block(const struct agent *ag)
{
	return in_frame || pthread_equal(pthread_self(), ag->loop);
}

static void on_frame(void *arg, const struct ipc_frame *f)
{
	bool was = in_frame;

	in_frame = true;
	hooks.frame(arg, f);
	in_frame = was;
}

int agent_poll(struct agent *ag, bool wait)
{
	int n;

	if (wait)
		pthread_mutex_lock(&ag->poll_lock);
	else if (pthread_mutex_trylock(&ag->poll_lock))
		return -EBUSY;
	hooks.poll_begin();
	hooks.polled(ag);
	n = ipc_port_poll(&ag->port, on_frame, ag, 256);
	hooks.poll_end();
	pthread_mutex_unlock(&ag->poll_lock);
	return n;
}

int agent_poll_any(struct agent *ag)
{
	return ipc_port_has_work(&ag->port) ? agent_poll(ag, false) : 0;
}

/* ---- replies taken by the threads that wait for them ---- */

/* Process-wide, outside the agent: a waiter that returns after shutdown
 * freed the agent touches nothing of it (turning it off waits until no
 * waiter is on the slot's bell). */
static struct {
	pthread_mutex_t lock;
	pthread_cond_t left; /* a waiter left the bell */
	struct agent *ag;    /* while on */
	bool on;
	bool published; /* what the slot's replies_taken says */
	int waiters;    /* threads in agent_wait_reply */
} own = { .lock = PTHREAD_MUTEX_INITIALIZER, .left = PTHREAD_COND_INITIALIZER };

/* own.ag while on, for completions, which do not take own.lock. */
static _Atomic(struct agent *) own_live;

/* Whether a thread of this process is in agent_wait_alone. */
static _Atomic bool alone_taken;

/* own.lock held: replies_taken = on and nobody waits. True when it went
 * to 0: replies may wait in the rings unannounced, the caller polls. */
static bool own_publish(void)
{
	bool v = own.on && !own.waiters;

	if (v == own.published)
		return false;
	own.published = v;
	/* seq_cst, and the fence after a store of 0: in one order with the
	 * repliers' fences (ipc/doorbell.h), so a reply either sees 0 and
	 * rings, or the caller's poll finds it. */
	atomic_store_explicit(&own.ag->self->replies_taken, v, memory_order_seq_cst);
	if (v)
		return false;
	atomic_thread_fence(memory_order_seq_cst);
	return true;
}

bool agent_check_replies_word(struct agent *ag)
{
	uint32_t want, have;

	/* Relaxed: a look. Only a stray 1 harms (a stray 0 rings a bell more);
	 * and a 1 we published is checked under own.lock, which orders it. */
	if (atomic_load_explicit(&ag->self->replies_taken, memory_order_relaxed) != 1)
		return false;
	pthread_mutex_lock(&own.lock);
	want = own.ag == ag && own.published;
	have = atomic_load_explicit(&ag->self->replies_taken, memory_order_relaxed);
	if (have != want) /* seq_cst, with own_publish's fence after a 0: as its stores */
		atomic_store_explicit(&ag->self->replies_taken, want, memory_order_seq_cst);
	pthread_mutex_unlock(&own.lock);
	if (have == want)
		return false;
	atomic_thread_fence(memory_order_seq_cst);
	return true;
}


void agent_take_replies(struct agent *ag, bool on)
{
	pthread_mutex_lock(&own.lock);
	/* Off only for the agent it is on for: after that, own.ag is NULL, so
	 * nothing of an agent that shutdown freed (and whose segment's pages
	 * may hold other mappings since) is ever touched again. */
	if (on || own.ag == ag) {
		own.ag = ag;
		own.on = on;
		/* Release: the agent is set up before a completion uses it. */
		atomic_store_explicit(&own_live, on ? ag : NULL, memory_order_release);
		if (own_publish()) {
			agent_poll(ag, true);
			ipc_port_flush_quiet(&ag->port, UINT64_MAX); /* every quiet ack rings now */
		}
	}
	if (!on && own.ag == ag) {
		/* Waiters on the bell go back to their futures' own waits. */
		ipc_bell_wake(&ag->self->replies_bell, NULL, INT_MAX);
		while (own.waiters)
			pthread_cond_wait(&own.left, &own.lock);
		/* Unless another thread turned it on again meanwhile. */
		if (!own.on)
			own.ag = NULL;
	}
	pthread_mutex_unlock(&own.lock);
}

/* A child forked from this process waits for nothing of ours. */
/* Even: no thread promised (agent_watch_begin); odd: one did. Bumped by
 * the watcher as it begins and after it ends, so that a checker that reads
 * it even and unchanged around its look at the slot knows that the 1 it
 * saw was no watcher's (agent_check_watch_word). */
static _Atomic uint32_t watch_turn;

void link_forget_in_child(void)
{
	/* Another thread may have held them at the fork: the child's are new. */
	own.lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
	own.left = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
	own.ag = NULL;
	own.on = own.published = false;
	own.waiters = 0;
	/* Relaxed: the child has one thread. */
	atomic_store_explicit(&own_live, NULL, memory_order_relaxed);
	atomic_store_explicit(&alone_taken, false, memory_order_relaxed);
	/* A thread that spun with the promise at the fork is not here. */
	atomic_store_explicit(&watch_turn, 0, memory_order_relaxed);
}

/* Says this thread sleeps on the replies' bell, then polls: a reply
 * published before the count is taken by the poll, one after it sees the
 * count and rings the bell (ipc/doorbell.h). Frames taken. Not inlined:
 * GCC 12 rejects an inlined fence under -fsanitize=thread (-Wtsan). */
static __attribute__((noinline)) int announce_wait(struct agent *ag)
{
	/* seq_cst RMW and fence: pairs with the replier's fence before its
	 * load of replies_asleep, and with agent_future_done's. */
	atomic_fetch_add_explicit(&ag->self->replies_asleep, 1, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
	return agent_poll(ag, true);
}

bool agent_wait_reply(bool (*done)(void *arg), void *arg, uint64_t deadline_ns)
{
	struct agent *ag;
	uint64_t now = shmrpc_now_ns();

	pthread_mutex_lock(&own.lock);
	if (!own.on) {
		pthread_mutex_unlock(&own.lock);
		return false;
	}
	ag = own.ag;
	own.waiters++;
	if (own_publish()) {
		agent_poll(ag, true);
		ipc_port_flush_quiet(&ag->port, now);
	}
	pthread_mutex_unlock(&own.lock);
	/* Relaxed for own_live: it only sends us back to the future's own
	 * wait (done acquires the completer's release). */
	while (!done(arg) &&
	       atomic_load_explicit(&own_live, memory_order_relaxed) &&
	       (!deadline_ns || now < deadline_ns)) {
		/* Acquire pairs with the waker's seq_cst bump. */
		uint32_t seq = atomic_load_explicit(&ag->self->replies_bell, memory_order_acquire);
		/* The quiet acks our polls sent come due while we sleep, and
		 * the loop thread, asleep, does not know of them: flushed here. */
		uint64_t until = ipc_port_flush_quiet(&ag->port, now);

		if (deadline_ns && deadline_ns < until)
			until = deadline_ns;
		/* own_live read again after seq: agent_take_replies stores NULL
		 * before its bump of the bell, so a waiter that read the bumped
		 * seq sees NULL here and does not sleep through its reply
		 * (which, the mode off, rings no bell). Acquire: as seq's. */
		if (announce_wait(ag) == 0 && !done(arg) &&
		    atomic_load_explicit(&own_live, memory_order_acquire))
			ipc_futex_wait(&ag->self->replies_bell, seq,
				       until == UINT64_MAX ? 0 : until > now ? until - now : 1);
		/* seq_cst: as the increment. */
		atomic_fetch_sub_explicit(&ag->self->replies_asleep, 1, memory_order_seq_cst);
		now = shmrpc_now_ns();
	}
	pthread_mutex_lock(&own.lock);
	own.waiters--;
	own_publish();
	pthread_cond_broadcast(&own.left);
	pthread_mutex_unlock(&own.lock);
	return done(arg) || (deadline_ns && now >= deadline_ns);
}

/* The agent user threads poll while they spin, and how many are between
 * agent_spin_begin and _end or in agent_wait_alone (link.h). */
static _Atomic(struct agent *) spin_agent;
static _Atomic int spin_pollers;

void agent_future_done(void)
{
	struct agent *ag;

	/* seq_cst fence after the completer's release of done, before the
	 * load of replies_asleep: pairs with announce_wait's fence (a waiter
	 * counted after this load sees done; one counted before is woken),
	 * and alone_announce's. */
	atomic_thread_fence(memory_order_seq_cst);
	/* Acquire pairs with agent_take_replies' release. Else the running
	 * agent, for a lone waiter (agent_wait_alone); seq_cst as every access
	 * of spin_agent. Every completer is a thread that shutdown stops or
	 * waits for before it frees the agent. */
	ag = atomic_load_explicit(&own_live, memory_order_acquire);
	if (!ag)
		ag = atomic_load_explicit(&spin_agent, memory_order_seq_cst);
	if (ag && atomic_load_explicit(&ag->self->replies_asleep, memory_order_relaxed))
		ipc_bell_wake(&ag->self->replies_bell, NULL, INT_MAX);
}

struct agent *agent_spin_begin(void)
{
	struct agent *ag;

	/* seq_cst, the count then the load: against shutdown's store then
	 * load (spin_agent_clear), either it sees us counted or we see NULL. */
	atomic_fetch_add_explicit(&spin_pollers, 1, memory_order_seq_cst);
	ag = atomic_load_explicit(&spin_agent, memory_order_seq_cst);
	/* A thread that takes its replies (a data loader's trainer) waits for
	 * them as agent_wait_reply says, quiet acks and all, unless it never
	 * sleeps. Relaxed: a hint; agent_wait_reply decides under own.lock. */
	if (ag && atomic_load_explicit(&own_live, memory_order_relaxed) &&
	    atomic_load_explicit(&handoff_spin_ns, memory_order_relaxed) != UINT64_MAX)
		ag = NULL;
	return ag;
}

bool agent_spin_poll(struct agent *ag)
{
	/* seq_cst: as in agent_spin_begin; NULL once shutdown has begun to
	 * wait for us. */
	if (!atomic_load_explicit(&spin_agent, memory_order_seq_cst))
		return false;
	agent_poll_any(ag);
	return true;
}

void agent_spin_end(void)
{
	/* Release: our polls come before shutdown's acquire of the count. */
	atomic_fetch_sub_explicit(&spin_pollers, 1, memory_order_release);
}

bool agent_watch_begin(struct agent *ag)
{
	/* Relaxed look, then the RMW: seq_cst, before the store of 1, against
	 * the checker's loads (agent_check_watch_word). */
	uint32_t turn = atomic_load_explicit(&watch_turn, memory_order_relaxed);

	if ((turn & 1) || !atomic_compare_exchange_strong_explicit(&watch_turn, &turn, turn + 1,
								     memory_order_seq_cst,
								     memory_order_relaxed))
		return false;
	/* seq_cst: in one order with the repliers' fences (ipc/doorbell.h);
	 * a reply that does not see it rings as usual. */
	atomic_store_explicit(&ag->self->replies_watched, 1, memory_order_seq_cst);
	return true;
}

void agent_watch_end(struct agent *ag)
{
	/* seq_cst store and fence: pair with the repliers' fence. A reply
	 * whose fence came first saw 1 and rang nothing: the rings' look
	 * after ours sees it; one after sees 0 and rings. */
	atomic_store_explicit(&ag->self->replies_watched, 0, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
	if (ipc_port_has_work(&ag->port)) {
		/* seq_cst: as agent_spin_poll's; NULL once shutdown has begun,
		 * which has failed our calls: the ring is for the record. */
		if (atomic_load_explicit(&spin_agent, memory_order_seq_cst))
			agent_poll(ag, true);
		/* A poll takes a bounded batch: what it left rang no one. */
		if (ipc_port_has_work(&ag->port))
			ipc_doorbell_ring(ag->self, NULL);
	}
	/* seq_cst: after the store of 0, before the checker's loads. */
	atomic_fetch_add_explicit(&watch_turn, 1, memory_order_seq_cst);
}

bool agent_check_watch_word(struct agent *ag)
{
	/* seq_cst loads, the turn around the word: a watcher's store of 1
	 * comes after its bump to odd, its 0 before its bump to even; seeing
	 * the same even turn on both sides of a 1, no watcher wrote it. */
	uint32_t turn = atomic_load_explicit(&watch_turn, memory_order_seq_cst);

	if ((turn & 1) || atomic_load_explicit(&ag->self->replies_watched, memory_order_seq_cst) != 1 ||
	    atomic_load_explicit(&watch_turn, memory_order_seq_cst) != turn)
		return false;
	/* A watcher that began since loses its promise: its replies ring. */
	atomic_store_explicit(&ag->self->replies_watched, 0, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
	return true;
}

void link_spin_agent(struct agent *ag)
{
	/* seq_cst store, then load: see agent_spin_begin. */
	struct agent *was = atomic_exchange_explicit(&spin_agent, ag, memory_order_seq_cst);

	if (ag)
		return;
	/* A lone waiter asleep on the replies' bell sees NULL once woken
	 * (agent_wait_alone reads spin_agent after the bell's word). */
	if (was)
		ipc_bell_wake(&was->self->replies_bell, NULL, INT_MAX);
	/* No user thread polls the rings after this (shutdown). */
	while (atomic_load_explicit(&spin_pollers, memory_order_seq_cst))
		sched_yield(); /* a spinner stops at its next look */
}

int agent_wait_all(struct agent *ag, uint64_t deadline, bool (*arrived)(const struct agent *, uint32_t),
		   const char *what)
{
	for (;;) {
		uint32_t missing = 0, first = 0;

		for (uint32_t r = 0; r < ag->world; r++) {
			uint32_t st = link_worker_state(ag, r);

			/* One that arrived and left since (a worker whose init
			 * failed on what all of them check, such as a bad device
			 * map) does not hide that failure from the others. */
			if (arrived(ag, r))
				continue;
			if (st == SHM_WORKER_EXITED && SHM_EXIT_KIND(link_exit_info(ag, r)) == 3) {
				char name[SHM_NAME_MAX];

				/* Refused at the rendezvous: torch's text, on every rank. */
				agent_peer_name(ag, r, name, sizeof(name));
				return shmrpc__fail(-EEXIST, "RPC worker name %s is not unique. Workers "
						    "%u and %u share the same name.", name,
						    SHM_EXIT_VALUE(link_exit_info(ag, r)), r);
			}
			if (st == SHM_WORKER_DEAD || st == SHM_WORKER_EXITED) {
				char why[160];

				agent_peer_gone_text(ag, r, why, sizeof(why));
				return shmrpc__fail(-SHMRPC_EPEERDEAD, "shmrpc_init on worker %u: %s "
						    "before the job started", ag->rank, why);
			}
			if (!missing++)
				first = r;
		}
		if (!missing)
			return 0;
		if (shmrpc_now_ns() >= deadline) {
			char name[SHM_NAME_MAX];

			agent_peer_name(ag, first, name, sizeof(name));
			return shmrpc__fail(-ETIMEDOUT, "shmrpc_init on worker %u: %u worker(s), "
					    "worker %u (%s) first, did not %s within %llu ms (did "
					    "they call shmrpc_init?)", ag->rank, missing, first, name,
					    what, (unsigned long long)ag->startup_timeout_ms);
		}
		usleep(BARRIER_POLL_US);
	}
}

/* ---- who is who ---- */

int agent_running(struct agent **ag)
{
	*ag = worker_agent;
	return *ag ? 0 : shmrpc__fail(-ENOTCONN, "the RPC agent is not running in this process: "
				      "call shmrpc_init (init_rpc in Python) first");
}

int shmrpc_rank(void)
{
	struct agent *ag;

	return agent_running(&ag) ?: (int)ag->rank;
}

int shmrpc_world_size(void)
{
	struct agent *ag;

	return agent_running(&ag) ?: (int)ag->world;
}

int shmrpc_get_worker_info_by_rank(int rank, struct shmrpc_worker_info *out)
{
	struct agent *ag;
	int rc = agent_running(&ag);

	if (rc)
		return rc;
	if (rank < 0 || (uint32_t)rank >= ag->world)
		return shmrpc__fail(-EINVAL, "no worker of rank %d: the job has %u workers", rank,
				    ag->world);
	out->rank = rank;
	agent_peer_name(ag, (uint32_t)rank, out->name, sizeof(out->name));
	return 0;
}

/* Whether worker r is the one named name. */
static bool peer_named(const struct agent *ag, uint32_t r, const char *name)
{
	char buf[SHM_NAME_MAX];

	agent_peer_name(ag, r, buf, sizeof(buf));
	return strcmp(buf, name) == 0;
}

int agent_rank_named(const struct agent *ag, const char *name)
{
	for (uint32_t r = 0; r < ag->world; r++)
		if (peer_named(ag, r, name))
			return (int)r;
	return shmrpc__fail(-ENOENT, "no worker named \"%s\" in this job", name);
}

int shmrpc_get_worker_info(const char *name, struct shmrpc_worker_info *out)
{
	struct agent *ag;
	int rc = agent_running(&ag);

	if (rc)
		return rc;
	if (!name)
		return shmrpc_get_worker_info_by_rank((int)ag->rank, out);
	rc = agent_rank_named(ag, name);
	return rc < 0 ? rc : shmrpc_get_worker_info_by_rank(rc, out);
}

/* ---- a lone waiter takes its reply itself ---- */

/* Counts this thread on the replies' bell, then polls (announce_wait's
 * argument: a reply published before the count is taken by the poll, one
 * after it sees the count and rings the bell). Not inlined: -Wtsan. */
static __attribute__((noinline)) void alone_announce(struct agent *ag)
{
	/* seq_cst RMW and fence: pair with the replier's fence before its
	 * load of replies_asleep (ipc_doorbell_notify), and agent_future_done's. */
	atomic_fetch_add_explicit(&ag->self->replies_asleep, 1, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
	agent_poll(ag, true);
}

/* Uncounts this thread from the bell. Leaving, it polls once more after
 * this: a reply that saw it counted rang only the bell, not the loop
 * thread, and must not wait in the ring. Either the replier's fence comes
 * first in the seq_cst order (that poll sees its frame) or ours (it sees
 * us uncounted and rings as if we were not there). Not inlined: -Wtsan. */
static __attribute__((noinline)) void alone_uncount(struct agent *ag)
{
	/* seq_cst: as alone_announce's. */
	atomic_fetch_sub_explicit(&ag->self->replies_asleep, 1, memory_order_seq_cst);
	atomic_thread_fence(memory_order_seq_cst);
}

bool agent_wait_alone(bool (*done)(void *arg), void *arg, uint64_t deadline_ns)
{
	struct agent *ag;
	uint64_t now;
	bool expect = false, going = false, counted = false;

	/* One waiter at a time: a reply wakes every thread on the bell,
	 * whoever's it is. Acquire and (below) release: nothing to pass on
	 * but the flag itself (the polls order themselves by poll_lock). */
	if (!atomic_compare_exchange_strong_explicit(&alone_taken, &expect, true,
						     memory_order_acquire, memory_order_relaxed))
		return false;
	/* seq_cst, the count then the load: as agent_spin_begin's. Counted,
	 * the agent stays until we leave (link_spin_agent). */
	atomic_fetch_add_explicit(&spin_pollers, 1, memory_order_seq_cst);
	ag = atomic_load_explicit(&spin_agent, memory_order_seq_cst);
	now = shmrpc_now_ns();
	while (ag && !done(arg) && (!deadline_ns || now < deadline_ns)) {
		/* Acquire pairs with the waker's seq_cst bump. */
		uint32_t seq = atomic_load_explicit(&ag->self->replies_bell, memory_order_acquire);

		/* After seq: shutdown stores NULL before its bump of the bell. */
		if (!atomic_load_explicit(&spin_agent, memory_order_seq_cst)) {
			going = true;
			break;
		}
		alone_announce(ag);
		if (!done(arg))
			ipc_futex_wait(&ag->self->replies_bell, seq,
				       deadline_ns ? (deadline_ns > now ? deadline_ns - now : 1) : 0);
		alone_uncount(ag);
		counted = true;
		now = shmrpc_now_ns();
	}
	if (counted && !going) /* alone_uncount says why */
		agent_poll(ag, true);
	/* Release: our polls come before shutdown's acquire of the count. */
	atomic_fetch_sub_explicit(&spin_pollers, 1, memory_order_release);
	atomic_store_explicit(&alone_taken, false, memory_order_release);
	return ag && !going && (done(arg) || (deadline_ns && now >= deadline_ns));
}
