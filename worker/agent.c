/*
 * The agent's life: shmrpc_init (attach, start the threads, the startup
 * barrier), the loop thread, and shmrpc_shutdown (the shutdown barrier).
 *
 * Both barriers live in the worker slots: each worker publishes its
 * agent_state (READY, then LEAVING, then GONE) with release, and reads the
 * others' with acquire. A graceful shutdown first waits until this
 * worker's own calls are answered, then says LEAVING and keeps serving
 * until every worker has said LEAVING (or died): at that point nobody has a
 * call in flight, so nobody can send another request, and all leave.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "ipc/doorbell.h"
#include "shm/corrupt.h"
#include "shm/exit_info.h"
#include "worker/carry.h"
#include "worker/client.h"
#include "worker/cuda.h"
#include "worker/devmap.h"
#include "worker/executor.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/pins.h"
#include "worker/rref.h"
#include "worker/server.h"
#include "worker/tensor.h"
#include "worker/trace.h"

#define DEFAULT_THREADS 4
#define DEFAULT_TIMEOUT_MS 60000
/* Waiting for the launcher's cause of death: it comes within a millisecond
 * as a rule, so the grace costs only when no launcher records it; 50 ms
 * ran out now and then under heavy load (rpc_death under TSAN). */
#define DEATH_GRACE_NS (250u * 1000u * 1000u)
#define LOOP_MAX_SLEEP_NS (100u * 1000u * 1000u)
#define BARRIER_POLL_US 200

/* Agents this process started (struct agent.job); shmrpc_init's thread only. */
static uint64_t agents_started;

/* ---- what a frame means (link.h's hooks) ---- */

/* A frame from src (a ring's, or one we sent ourselves): the ack of a
 * reply's tensors, a request to serve, or a reply to one of our calls. */
static void deliver(struct agent *ag, uint32_t src, uint16_t type, uint64_t msg_id,
		    uint64_t needed_by, uint32_t depth, const void *help, uint32_t help_n,
		    const void *payload, size_t len)
{
	if (type == MSG_TENSOR_ACK)
		pins_release(src, msg_id, PIN_REPLY);
	else if (worker_msg_is_request(type) || !worker_msg_name(type))
		server_submit(ag, src, type, msg_id, needed_by, depth, help, help_n, payload, len);
	else
		client_complete(ag, src, type, msg_id, payload, len);
}

static void on_frame(struct agent *ag, const struct ipc_frame *f)
{
	/* ipc_frame_decode checked that the help entries fit. */
	deliver(ag, f->hdr.src, f->hdr.type, f->hdr.msg_id, f->hdr.needed_by, f->hdr.depth,
		f->payload, f->hdr.help_n, f->payload + f->hdr.help_n * sizeof(struct ipc_help),
		f->hdr.payload_len - f->hdr.help_n * sizeof(struct ipc_help));
}

static void on_local(struct agent *ag, uint16_t type, uint64_t msg_id, uint64_t needed_by,
		     uint32_t depth, const struct help_chain *help, const void *payload, size_t len)
{
	deliver(ag, ag->rank, type, msg_id, needed_by, depth, help ? help->e : NULL,
		help ? help->n : 0, payload, len);
}

static void collect_if_due(struct agent *ag);

static void polled(struct agent *ag);

static const struct link_hooks hooks = {
	.frame = on_frame,
	.local = on_local,
	.poll_begin = executor_batch_begin,
	.polled = polled,
	.poll_end = executor_batch_end,
};

struct collect_job {
	struct job base;
	struct agent *ag;
	bool after_death;
};

static void run_collect(struct job *j)
{
	struct collect_job *c = (struct collect_job *)j;

	if (c->after_death) {
		rref_owner_collect_all(c->ag);
	} else {
		/* Cleared before the take, seq_cst: the clear, the take, a
		 * push after it and collect_due's two loads are in one order,
		 * so a loop thread that sees that push sees the flag clear. */
		atomic_store_explicit(&c->ag->collect_queued, false, memory_order_seq_cst);
		rref_owner_collect_listed(c->ag);
	}
	free(c);
}

/* Frees RRefs of ours on an executor thread (a list can be long, and
 * freeing values may free RRefs they hold): after a peer's death, or for
 * what users' last drops put on our collect list. */
static void collect_rrefs(struct agent *ag, bool after_death)
{
	struct collect_job *c = malloc(sizeof(*c));

	if (!c) {
		if (!after_death)
			atomic_store_explicit(&ag->collect_queued, false, memory_order_relaxed);
		fprintf(stderr, "shmrpc: worker %u: out of memory; unreferenced RRefs of ours are "
			"freed later\n", ag->rank);
		return;
	}
	*c = (struct collect_job){ { .run = run_collect }, ag, after_death };
	executor_submit(&c->base);
}

/* Our collect list holds RRefs and no job has been queued to take it
 * (ipc_port.news: the loop thread must not sleep through it). */
static bool collect_due(void *arg)
{
	struct agent *ag = arg;

	/* seq_cst: see run_collect. */
	return rref_collect_pending(&ag->rrefs, ag->rank) &&
	       !atomic_load_explicit(&ag->collect_queued, memory_order_seq_cst);
}

/* Queues the collection of our collect list when it is due; any thread
 * that polls the rings (the loop thread, an executor thread: a user's
 * last drop wakes the owner's servers as a request does, rref.c). seq_cst:
 * see run_collect; the exchange lets one of them queue it. */
static void collect_if_due(struct agent *ag)
{
	if (ag->has_rrefs && collect_due(ag) &&
	    !atomic_exchange_explicit(&ag->collect_queued, true, memory_order_seq_cst))
		collect_rrefs(ag, false);
}

/* At each poll of the rings: a server looks at the collect list (the loop
 * thread does before each of its polls). Not a user thread spinning at a wait:
 * no wake-up relies on it (rref.c), and its every poll would read the
 * list heads' line that pushers write. */
static void polled(struct agent *ag)
{
	if (executor_on_worker_thread())
		collect_if_due(ag);
}

/* A peer's pidfd fired: fail its calls once the launcher has said how it
 * died (or after a short grace, if no launcher records it); collect the
 * RRefs of ours it held once the launcher has swept it. */
static void settle_deaths(struct agent *ag, uint64_t now)
{
	uint32_t peer;

	while (ipc_port_take_dead(&ag->port, &peer))
		if (!ag->gone[peer] && !ag->dying_since[peer])
			ag->dying_since[peer] = now;
	/* A peer whose ring to us broke, or that abandoned ours to it: no
	 * reply of its will come. */
	for (peer = 0; peer < ag->world; peer++) {
		char why[200];

		if (ag->gone[peer] || (!ipc_port_ring_broken(&ag->port, peer) &&
				       !ipc_port_ring_abandoned(&ag->port, peer)))
			continue;
		agent_peer_gone_text(ag, peer, why, sizeof(why));
		client_fail_peer(ag, peer, why);
		ag->gone[peer] = true;
	}
	/* A peer without a pidfd: the launcher's word in its slot (it rings
	 * our doorbell with it) is the news of its end. */
	for (peer = 0; peer < ag->world; peer++)
		if (ag->unwatched[peer] && !ag->gone[peer] && !ag->dying_since[peer] &&
		    (link_worker_state(ag, peer) == SHM_WORKER_DEAD ||
		     link_worker_state(ag, peer) == SHM_WORKER_EXITED))
			ag->dying_since[peer] = now;
	for (peer = 0; peer < ag->world; peer++) {
		char why[160];
		uint32_t st, pid;
		bool swept;

		if (!ag->dying_since[peer])
			continue;
		st = link_worker_state(ag, peer);
		swept = st == SHM_WORKER_DEAD || st == SHM_WORKER_EXITED;
		if (!swept && now - ag->dying_since[peer] < DEATH_GRACE_NS)
			continue;
		if (!ag->gone[peer]) {
			agent_peer_gone_text(ag, peer, why, sizeof(why));
			client_fail_peer(ag, peer, why);
			pins_release_peer(peer);
			/* Its CUDA memory went with it: close our mappings of it
			 * (tensors of it fail from now on, tensor.c), then
			 * release its idle tensors (none is parked once its
			 * mappings are closed). Acquire pairs with the peer's
			 * release of its pid. */
			pid = atomic_load_explicit(&shm_worker(&ag->seg, peer)->pid,
						   memory_order_acquire);
			cuda_forget_peer(pid);
			tensor_idle_forget(pid);
			ag->gone[peer] = true;
		}
		/* The launcher drops the dead peer's RRef references before it
		 * marks it DEAD or EXITED: collect what that left unreferenced
		 * only then. */
		if (!swept)
			continue;
		if (ag->has_rrefs)
			collect_rrefs(ag, true);
		ag->dying_since[peer] = 0;
	}
}

static bool any_dying(const struct agent *ag)
{
	for (uint32_t r = 0; r < ag->world; r++)
		if (ag->dying_since[r])
			return true;
	return false;
}

/* A pidfd per peer; one without (fd exhaustion) is watched through its
 * slot instead (settle_deaths), and said once. */
static void watch_peers(struct agent *ag)
{
	uint32_t unwatched = 0, first = 0;
	char why[160] = "";

	for (uint32_t r = 0; r < ag->world; r++) {
		/* Acquire pairs with the peer's release of its pid, before its READY. */
		if (r == ag->rank ||
		    !ipc_port_watch(&ag->port, r,
				    (pid_t)atomic_load_explicit(&shm_worker(&ag->seg, r)->pid,
								memory_order_acquire)))
			continue;
		if (!unwatched++) {
			first = r;
			snprintf(why, sizeof(why), "%s", shmrpc_errmsg());
		}
		ag->unwatched[r] = true;
	}
	if (unwatched)
		fprintf(stderr, "shmrpc: worker %u: cannot watch %u worker%s (worker %u: %s): their "
			"ends are noticed by the launcher's word instead, up to 100 ms later (raise "
			"ulimit -n for pidfds)\n", ag->rank, unwatched, unwatched == 1 ? "" : "s",
			first, why);
}

/* Before the loop thread sleeps: the words of our slot that let peers'
 * frames ring nothing are ours alone, but any process of the user can
 * write them; one that says more than we did would leave frames waiting
 * for our next round. Restored, said once, and reported as the slots'
 * corruption (which fails the job at its end). True: poll again. */
static bool slot_promises_restored(struct agent *ag)
{
	static bool said;
	const char *word = executor_check_busy_word()   ? "servers_busy"
			   : executor_check_watch_word()  ? "servers_watched"
			   : agent_check_replies_word(ag) ? "replies_taken"
			   : agent_check_watch_word(ag)   ? "replies_watched"
							   : NULL;

	if (!word)
		return false;
	shm_corrupt(&ag->self->corrupt_found, NULL, SHM_CORRUPT_SLOTS,
		    "worker slot %u is corrupt: its %s is not what worker %u stored "
		    "(the job's memory was written outside shmrpc); restored", ag->rank, word,
		    ag->rank);
	if (!said)
		fprintf(stderr, "shmrpc: worker %u: %s\n", ag->rank, shmrpc_errmsg());
	said = true;
	return true;
}

static void *loop_main(void *arg)
{
	struct agent *ag = arg;

	watch_peers(ag);
	/* Relaxed: the flag is set before the doorbell that wakes us to see it. */
	while (!atomic_load_explicit(&ag->stop, memory_order_relaxed)) {
		uint64_t now, next, next_reap, sleep_ns;
		int n;

		collect_if_due(ag); /* before the frames, as the servers (polled) */
		n = agent_poll(ag, false);
		now = shmrpc_now_ns();

		settle_deaths(ag, now);
		next = client_expire(ag, now);
		next_reap = tensor_exports_tick(now);
		if (next_reap < next)
			next = next_reap;
		next_reap = ipc_port_flush_quiet(&ag->port, now); /* quiet TENSOR_ACKs */
		if (next_reap < next)
			next = next_reap;
		if (n > 0 || slot_promises_restored(ag))
			continue;
		sleep_ns = any_dying(ag) ? 2000000u : LOOP_MAX_SLEEP_NS;
		if (next != UINT64_MAX && next - now < sleep_ns)
			sleep_ns = next > now ? next - now : 1;
		/* Relaxed: a liveness stamp for inspectors. */
		atomic_store_explicit(&ag->self->heartbeat_ns, now, memory_order_relaxed);
		ipc_port_wait(&ag->port, sleep_ns);
	}
	return NULL;
}

/* ---- init ---- */

static long env_long(const char *name, long dflt)
{
	const char *s = getenv(name);
	char *end;
	long v;

	if (!s || !*s)
		return dflt;
	v = strtol(s, &end, 10);
	return *end ? -1 : v;
}

static bool joined(const struct agent *ag, uint32_t r)
{
	return link_agent_state(ag, r) >= SHM_AGENT_READY;
}

static int check_names(struct agent *ag)
{
	char a[SHM_NAME_MAX], b[SHM_NAME_MAX];

	agent_peer_name(ag, ag->rank, a, sizeof(a));
	for (uint32_t r = 0; r < ag->world; r++) {
		if (r == ag->rank)
			continue;
		agent_peer_name(ag, r, b, sizeof(b));
		if (strcmp(a, b) == 0)
			return shmrpc__fail(-EEXIST, "workers %u and %u are both named \"%s\": "
					    "worker names must be unique", ag->rank < r ? ag->rank : r,
					    ag->rank < r ? r : ag->rank, a);
	}
	return 0;
}

/* The job's tensor pool, when shmrun made one: mapped, and this process
 * its holder for our rank, as the generation the launcher gave the slot. */
static int attach_pool(struct agent *ag)
{
	long fd = env_long(SHMRPC_ENV_POOL_FD, -1);
	long inline_max = env_long("SHMRPC_INLINE_MAX", TENSOR_INLINE_MAX_DEFAULT);
	int rc;

	if (inline_max < 0 || inline_max > UINT32_MAX)
		return shmrpc__fail(-EINVAL, "SHMRPC_INLINE_MAX=%s: give the largest tensor, in "
				    "bytes, to send inside the frame (0: none)",
				    getenv("SHMRPC_INLINE_MAX"));
	ag->inline_max = (uint32_t)inline_max;
	if (fd < 0)
		return 0;
	rc = pool_attach_fd(&ag->pool, (int)fd, false);
	if (rc)
		return rc;
	/* What we find corrupt there, for shmrun's report (shm/corrupt.h). */
	ag->pool.corrupt_note = &ag->self->corrupt_found;
	(void)fcntl((int)fd, F_SETFD, FD_CLOEXEC); /* programs we exec need not inherit it */
	/* Acquire pairs with the launcher's release when it set up the slot. */
	rc = pool_join(&ag->pool, ag->rank,
		       atomic_load_explicit(&ag->self->generation, memory_order_acquire)) ?:
	     tensor_view_open(&ag->pool, &ag->view);
	if (rc) {
		pool_detach(&ag->pool);
		return rc;
	}
	ag->has_pool = true;
	return 0;
}

/* The job's RRef table, when shmrun made one. */
static int attach_rrefs(struct agent *ag)
{
	long fd = env_long(SHMRPC_ENV_RREF_FD, -1);
	const char *fetch = getenv("SHMRPC_RREF_FETCH");
	int rc;

	if (fetch && strcmp(fetch, "message") && strcmp(fetch, "table"))
		return shmrpc__fail(-EINVAL, "SHMRPC_RREF_FETCH=%s: expected table or message",
				    fetch);
	ag->rref_fetch_by_message = fetch && !strcmp(fetch, "message");
	if (fd < 0)
		return 0;
	rc = rref_table_attach_fd(&ag->rrefs, (int)fd, false);
	if (rc == 0) {
		(void)fcntl((int)fd, F_SETFD, FD_CLOEXEC); /* as the segment's and the pool's */
		ag->rrefs.corrupt_note = &ag->self->corrupt_found;
	}
	if (rc == 0 && ag->rrefs.world != ag->world) {
		rref_table_detach(&ag->rrefs);
		rc = shmrpc__fail(-SHMRPC_EBADSEG, "the RRef table is for %u workers, the job has %u",
				  ag->rrefs.world, ag->world);
	}
	ag->has_rrefs = rc == 0;
	return rc;
}

static void agent_free(struct agent *ag)
{
	if (ag->has_rrefs) {
		/* Our values go; what we still hold is swept by the launcher
		 * when we end (it knows the order the table needs). */
		if (ag->has_pool)
			rref_owner_free_all(ag);
		rref_table_detach(&ag->rrefs);
	}
	if (ag->has_pool) {
		pool_leave(&ag->pool, ag->rank);
		/* The mapping is the view's now: unmapped when the last tensor
		 * handle into it goes, so that pool_detach only closes the fd. */
		ag->pool.base = NULL;
		pool_detach(&ag->pool);
		tensor_view_put(ag->view);
	}
	if (ag->port.seg)
		ipc_port_close(&ag->port);
	trace_close();
	if (ag->seg.base)
		shm_seg_detach(&ag->seg);
	devmap_free(ag);
	free(ag->dying_since);
	free(ag->gone);
	free(ag->unwatched);
	pthread_mutex_destroy(&ag->poll_lock);
	free(ag);
}

/* A child forked from a worker (torch's DataLoader forks its workers so)
 * is not that worker: when it frees its copies of our handles, nothing of
 * the job's shared counts may change, and it cannot call. */
static bool forked_from_agent; /* this process was forked while an agent ran */

static void forget_agent_in_child(void)
{
	forked_from_agent = forked_from_agent || worker_agent;
	worker_agent = NULL;
	link_forget_in_child();
	executor_poll_rings(NULL); /* a pool it starts must not poll ours */
}

/* Once per process: what a fork leaves, and what frames mean. */
static void process_once(void)
{
	pthread_atfork(NULL, NULL, forget_agent_in_child);
	link_set_hooks(&hooks);
	carry_set_rref_ops(&(struct rref_ops){ .pack = rref_pack, .unpack = rref_unpack,
						.free = shmrpc_rref_free, .charge = rref_charge,
						.uncharge = rref_uncharge });
	rref_set_collect(rref_owner_collect_listed);
}

/* *o = the caller's options, NULL the defaults, after checking what keeps
 * the struct's ABI (include/shmrpc.h): its size is the one this library
 * has (only the first field is read before), its reserved fields zero. */
static int options_take(const struct shmrpc_options *opts, struct shmrpc_options *o)
{
	static const struct shmrpc_options zero;

	*o = (struct shmrpc_options)SHMRPC_OPTIONS();
	if (!opts)
		return 0;
	if (opts->size < sizeof(*opts))
		return shmrpc__fail(-EINVAL, "shmrpc_init: shmrpc_options.size is %u, smaller than "
				    "the %zu bytes of its struct in this library: make the options "
				    "with SHMRPC_OPTIONS(...) (shmrpc.h), which sets it", opts->size,
				    sizeof(*opts));
	if (opts->size > sizeof(*opts))
		return shmrpc__fail(-EINVAL, "shmrpc_init: shmrpc_options.size is %u, a struct this "
				    "library (shmrpc %s, %zu bytes) does not know: the program was "
				    "built against a newer shmrpc.h; run it with that version's "
				    "library", opts->size, SHMRPC_VERSION_STRING, sizeof(*opts));
	if (opts->reserved32 || memcmp(opts->reserved, zero.reserved, sizeof(zero.reserved)))
		return shmrpc__fail(-EINVAL, "shmrpc_init: shmrpc_options has reserved fields set: "
				    "make the options with SHMRPC_OPTIONS(...) (shmrpc.h), which "
				    "leaves them zero");
	*o = *opts;
	return 0;
}

int shmrpc_init(const struct shmrpc_options *opts)
{
	static pthread_once_t process_once_done = PTHREAD_ONCE_INIT;
	struct shmrpc_options o;
	long rank = env_long("SHMRPC_RANK", -1), world = env_long("SHMRPC_WORLD_SIZE", -1);
	const char *name;
	struct agent *ag;
	uint64_t deadline;
	int rc = options_take(opts, &o);

	if (rc)
		return rc;
	name = o.name ? o.name : getenv("SHMRPC_NAME");
	if (worker_agent)
		return shmrpc__fail(-EALREADY, "shmrpc_init: the RPC agent is already running");
	pthread_once(&process_once_done, process_once);
	/* The executor's threads, and the state they kept, did not come along. */
	if (forked_from_agent)
		return shmrpc__fail(-ENOTSUP, "shmrpc_init: this process was forked from a worker "
				    "whose RPC agent was running, and cannot start one: start it with "
				    "multiprocessing's spawn or forkserver method (as "
				    "torch.multiprocessing.spawn does), or fork before init_rpc");
	if (rank < 0 || world <= 0 || !getenv(SHMRPC_ENV_JOB_FD))
		return shmrpc__fail(-EINVAL, "shmrpc_init: SHMRPC_RANK, SHMRPC_WORLD_SIZE and %s are "
				    "not set: start the program with shmrun -n N -- PROG",
				    SHMRPC_ENV_JOB_FD);
	if (o.num_threads < 0 || o.num_threads > 1024)
		return shmrpc__fail(-EINVAL, "shmrpc_init: num_threads %d (give 1 to 1024, or 0 for %d)",
				    o.num_threads, DEFAULT_THREADS);
	if (name && (!*name || strlen(name) >= SHM_NAME_MAX))
		return shmrpc__fail(-EINVAL, "shmrpc_init: a worker name has 1 to %u bytes",
				    SHM_NAME_MAX - 1);
	if (!(ag = calloc(1, sizeof(*ag))))
		return shmrpc__fail(-ENOMEM, "out of memory starting the RPC agent");
	pthread_mutex_init(&ag->poll_lock, NULL);
	rc = shm_seg_attach_env(&ag->seg);
	if (rc)
		goto fail;
	if ((uint32_t)world != ag->seg.world || (uint32_t)rank >= ag->seg.world) {
		rc = shmrpc__fail(-EINVAL, "shmrpc_init: SHMRPC_RANK %ld / SHMRPC_WORLD_SIZE %ld do not "
				  "match the job segment (%u workers)", rank, world, ag->seg.world);
		goto fail;
	}
	ag->rank = (uint32_t)rank;
	ag->world = (uint32_t)world;
	ag->self = shm_worker(&ag->seg, ag->rank);
	/* Acquire: pairs with set_agent_state's release; a process the worker
	 * started (forked before either joined) inherited its variables. */
	if (link_agent_state(ag, ag->rank) != SHM_AGENT_NONE) {
		rc = shmrpc__fail(-EEXIST, "shmrpc_init: worker %ld of this job has joined already "
				  "(pid %u): a process that a worker started is not that worker; "
				  "start it with shmrun, or have it meet others at an init_method",
				  rank, atomic_load_explicit(&ag->self->pid, memory_order_relaxed));
		goto fail;
	}
	trace_open(&ag->seg, ag->rank);
	ag->default_timeout_ns = o.timeout_ms < 0 ? 0
				 : (uint64_t)(o.timeout_ms ? o.timeout_ms : DEFAULT_TIMEOUT_MS) * 1000000u;
	ag->dying_since = calloc(ag->world, sizeof(*ag->dying_since));
	ag->gone = calloc(ag->world, sizeof(*ag->gone));
	ag->unwatched = calloc(ag->world, sizeof(*ag->unwatched));
	if (!ag->dying_since || !ag->gone || !ag->unwatched) {
		rc = shmrpc__fail(-ENOMEM, "out of memory starting the RPC agent");
		goto fail;
	}
	rc = attach_pool(ag) ?: attach_rrefs(ag);
	if (rc)
		goto fail;
	if (name) {
		/* Our own slot: peers read it only after our READY (release). */
		memset(ag->self->name, 0, SHM_NAME_MAX);
		memcpy(ag->self->name, name, strlen(name));
	}
	rc = ipc_port_open(&ag->port, &ag->seg, ag->rank, IPC_WAIT_AUTO);
	if (rc)
		goto fail;
	link_handoff_open(ag);
	/* Release: the pid is visible to whoever sees RUNNING. */
	atomic_store_explicit(&ag->self->state, SHM_WORKER_RUNNING, memory_order_release);
	rc = devmap_join_begin(ag, &o) ?:
	     executor_start(o.num_threads ? o.num_threads : DEFAULT_THREADS, ag->self);
	if (rc)
		goto fail;
	link_set_agent_state(ag, SHM_AGENT_READY);
	ag->startup_timeout_ms = (uint64_t)(o.startup_timeout_ms > 0 ? o.startup_timeout_ms
								   : DEFAULT_TIMEOUT_MS);
	deadline = shmrpc_now_ns() + ag->startup_timeout_ms * 1000000u;
	rc = agent_wait_all(ag, deadline, joined, "join") ?: check_names(ag) ?:
	     devmap_join(ag, &o, deadline);
	if (rc)
		goto fail_exec;
	ag->job = ++agents_started;
	worker_agent = ag;
	/* Before the executors may poll: their spin reads it (agent_poll_any),
	 * published by executor_poll_rings' release. */
	if (ag->has_rrefs) {
		ag->port.news = collect_due;
		ag->port.news_arg = ag;
	}
	executor_poll_rings(ag);
	rc = pthread_create(&ag->loop, NULL, loop_main, ag);
	if (rc) {
		worker_agent = NULL;
		rc = shmrpc__fail(-rc, "cannot start the RPC agent's loop thread");
		goto fail_exec;
	}
	tensor_idle_open();
	link_spin_agent(ag);
	return 0;

fail_exec:
	executor_stop();
	link_set_agent_state(ag, SHM_AGENT_GONE);
fail:
	agent_free(ag);
	return rc;
}

/* ---- shutdown ---- */

/* True when every worker has arrived at the barrier, left, or died. */
static bool all_leaving(struct agent *ag, char *busy, size_t len)
{
	bool all = true;
	size_t at = 0;

	for (uint32_t r = 0; r < ag->world; r++) {
		const struct shm_worker *w = shm_worker(&ag->seg, r);
		uint32_t st = link_worker_state(ag, r);
		char name[SHM_NAME_MAX];

		if (st == SHM_WORKER_DEAD || st == SHM_WORKER_EXITED ||
		    link_agent_state(ag, r) >= SHM_AGENT_LEAVING)
			continue;
		all = false;
		if (!busy || at >= len)
			continue;
		agent_peer_name(ag, r, name, sizeof(name));
		/* Relaxed: gauges, for the message only. */
		at += (size_t)snprintf(busy + at, len - at, "%sworker %u (%s): %llu call(s) in flight, "
				       "%llu being served", at ? "; " : "", r, name,
				       (unsigned long long)atomic_load_explicit(&w->client_active_calls,
										memory_order_relaxed),
				       (unsigned long long)atomic_load_explicit(&w->server_active_calls,
										memory_order_relaxed));
	}
	return all;
}

static int graceful_barrier(struct agent *ag, uint64_t deadline)
{
	char busy[1024];

	/* Our own calls first: relaxed, the count is ours and settles under the table's lock. */
	while (atomic_load_explicit(&ag->self->client_active_calls, memory_order_relaxed)) {
		if (deadline && shmrpc_now_ns() >= deadline)
			goto timeout;
		usleep(BARRIER_POLL_US);
	}
	link_set_agent_state(ag, SHM_AGENT_LEAVING);
	while (!all_leaving(ag, NULL, 0)) {
		if (deadline && shmrpc_now_ns() >= deadline)
			goto timeout;
		usleep(BARRIER_POLL_US);
	}
	return 0;
timeout:
	busy[0] = '\0';
	if (all_leaving(ag, busy, sizeof(busy)))
		snprintf(busy, sizeof(busy), "this worker still has calls in flight");
	return shmrpc__fail(-ETIMEDOUT, "shmrpc_shutdown on worker %u timed out: still busy: %s",
			    ag->rank, busy);
}

int shmrpc_shutdown(int graceful, int64_t timeout_ms)
{
	struct agent *ag;
	char err[1024];
	int rc = agent_running(&ag);

	if (rc)
		return rc;
	agent_take_replies(ag, false); /* the loop thread takes every reply again */
	if (graceful) {
		rc = graceful_barrier(ag, timeout_ms > 0 ? shmrpc_now_ns() +
								(uint64_t)timeout_ms * 1000000u
							  : 0);
		snprintf(err, sizeof(err), "%s", shmrpc_errmsg());
	}
	/* After the barrier (the cache served while we waited there), before
	 * GONE: a producer shutting down with us reaps its tensors once it
	 * sees us GONE, and must find no pin of our cache on them. */
	tensor_idle_close();
	link_set_agent_state(ag, SHM_AGENT_GONE);
	/* Relaxed store; the doorbell (seq_cst) that follows wakes the loop to see it. */
	atomic_store_explicit(&ag->stop, true, memory_order_relaxed);
	ipc_doorbell_ring(ag->self, ag->self);
	pthread_join(ag->loop, NULL);
	client_fail_all(ag, "the RPC agent was shut down before the reply came");
	executor_stop();
	pins_release_all();
	tensor_exports_shutdown(ag, graceful && !rc);
	link_spin_agent(NULL);
	link_handoff_close();
	worker_agent = NULL;
	agent_free(ag);
	return rc ? shmrpc__fail(rc, "%s", err) : 0;
}

