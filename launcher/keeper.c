/*
 * The keeper: see keeper.h. One thread, one poll() over the listening
 * socket and, per worker in the job, its connection and its pidfd.
 *
 * The keeper is not the workers' parent, so it cannot reap them: how a
 * worker ended is read from /proc/PID/stat while it is a zombie (its
 * parent has not collected it yet), checked against the pidfd (a pid
 * still unreaped cannot have been reused), and is "cause unknown" when its
 * parent was faster.
 *
 * Like shmrun's watch loop (integrity.c), it looks at the segment header
 * and the slots a few times a second (seg_watch.h): a header changed
 * stops the job (SIGTERM to each worker in it, through its pidfd); a slot
 * found corrupt is said once; either makes the keeper exit 1.
 */
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/proc_stat.h"
#include "launcher/job_shm.h"
#include "launcher/keeper.h"
#include "launcher/seg_watch.h"
#include "shm/exit_info.h"

/* Nobody joined (and the starter's end went unseen: no pidfd of it), or a
 * refused job's ranks stopped coming. */
#define KEEPER_IDLE_NS (60ull * 1000000000ull)
#define REQ_WAIT_MS 2000  /* a connected worker sends its request at once */
#define DYING_WAIT_MS 100 /* a closed connection, the pidfd not fired yet */

struct member {
	pid_t pid;
	int pidfd; /* -1: not in the job */
	int conn;  /* -1: closed */
	struct seg_watch_rank watch; /* what its slot must say */
};

struct keeper {
	struct job_shm shm;
	uint32_t world;
	struct member *m;
	int lfd;          /* -1 once the door is closed */
	/* The worker that started the keeper (a pidfd, -1: none). It knocks
	 * right after, but may be killed first, or its init_rpc time out:
	 * then nobody is coming whom the job could be for (the other ranks
	 * may be knocking, and wait for it), and the keeper ends at once, its
	 * door with it, rather than after KEEPER_IDLE_NS (a later knock starts
	 * a new keeper). Only watched until the first join. */
	int starter;
	uint32_t present; /* joined and not gone */
	uint32_t joined;  /* ever */
	uint32_t knocked; /* ranks that came, joined or refused */
	/* Why the job cannot start (a name not unique), "" while it can: the
	 * door stays open to tell each rank that comes, until every rank came
	 * or KEEPER_IDLE_NS passed since (refused_at). */
	char refusal[JOIN_MSG_MAX];
	uint64_t refused_at;
	struct seg_watch watch; /* the header as the keeper wrote it */
	uint64_t check_at;      /* when keeper_check runs next */
};

size_t join_sockaddr(const char *key, void *sockaddr_un)
{
	struct sockaddr_un *a = sockaddr_un;
	uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
	int n;

	for (const unsigned char *p = (const unsigned char *)key; *p; p++)
		h = (h ^ *p) * 0x100000001b3ull;
	memset(a, 0, sizeof(*a));
	a->sun_family = AF_UNIX;
	n = snprintf(a->sun_path + 1, sizeof(a->sun_path) - 1, "shmrpc-%u-%016llx",
		     (unsigned)getuid(), (unsigned long long)h);
	return offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n;
}

static void say(const struct keeper *k, uint32_t rank, const char *what)
{
	const char *name = shm_worker(&k->shm.seg, rank)->name;

	fprintf(stderr, "shmrpc keeper: worker %u (%.*s) %s\n", rank,
		(int)strnlen(name, SHM_NAME_MAX), name, what);
}

/* How pid ended, from its zombie's /proc/PID/stat (field 52, exit_code,
 * as waitpid's status); false when it is gone already. */
static bool zombie_exit_info(const struct member *mb, uint32_t *info)
{
	char buf[1024];
	const char *p = proc_stat_fields(mb->pid, buf, sizeof(buf), NULL);
	int status = -1;

	/* From field 3, where p is, to field 52 (exit_code, waitpid's status). */
	for (int field = 3; p && field < 52; field++)
		if ((p = strchr(p, ' ')))
			p++;
	if (!p || sscanf(p, "%d", &status) != 1 || status < 0)
		return false;
	/* Still unreaped after the read: the stat was our worker's. */
	if (syscall(SYS_pidfd_send_signal, mb->pidfd, 0, NULL, 0) < 0)
		return false;
	*info = (status & 0x7f) ? SHM_EXIT_SIGNAL(status & 0x7f)
		: (status >> 8) & 0xff ? SHM_EXIT_CODE((status >> 8) & 0xff) : 0;
	return true;
}

static void forget(struct keeper *k, uint32_t rank)
{
	struct member *mb = &k->m[rank];

	if (mb->conn >= 0)
		close(mb->conn);
	if (mb->pidfd >= 0)
		close(mb->pidfd);
	mb->conn = mb->pidfd = -1;
	k->present--;
	/* The first to go closes the door: the job cannot be completed any
	 * more, and a later init_rpc at this rendezvous (a re-init after
	 * shutdown) makes a new job with a new keeper. A job refused keeps
	 * it open to tell the ranks still to come why. */
	if (k->lfd >= 0 && !k->refusal[0]) {
		close(k->lfd);
		k->lfd = -1;
	}
}

static uint32_t agent_state(const struct keeper *k, uint32_t rank)
{
	/* Acquire pairs with the worker's release of its agent state. */
	return atomic_load_explicit(&shm_worker(&k->shm.seg, rank)->agent_state,
				    memory_order_acquire);
}

/* job_worker_ended, and what its slot and the header must say now. */
static void worker_ended(struct keeper *k, uint32_t rank, uint32_t info)
{
	job_worker_ended(&k->shm, rank, info);
	k->m[rank].watch.ended = true;
	k->m[rank].watch.exit_info = info;
	if (info)
		k->watch.generation++; /* job_worker_ended bumped the header's */
}

/* Its pidfd fired: the worker died (or exited without leaving). */
static void on_death(struct keeper *k, uint32_t rank)
{
	struct member *mb = &k->m[rank];
	uint32_t info;
	char cause[96], what[128];

	if (!zombie_exit_info(mb, &info))
		info = agent_state(k, rank) == SHM_AGENT_GONE ? 0 : 0xffffffffu;
	/* Sweeps its pool blocks and RRefs, marks the slot, rings the bells:
	 * the others fail its pending calls naming it. */
	worker_ended(k, rank, info);
	if (info) {
		shm_exit_info_format(info, cause, sizeof(cause));
		snprintf(what, sizeof(what), "died: %s", cause);
		say(k, rank, what);
	}
	forget(k, rank);
}

/* Its connection closed: a leave after shutdown (or a failed init), or a
 * death whose pidfd has not fired yet (the fds close before the exit is
 * signalled): while its agent still serves, wait a little for the pidfd. */
static void on_close(struct keeper *k, uint32_t rank)
{
	struct member *mb = &k->m[rank];
	uint32_t st = agent_state(k, rank);
	struct pollfd p = { .fd = mb->pidfd, .events = POLLIN };

	if (st == SHM_AGENT_READY || st == SHM_AGENT_LEAVING) {
		if (poll(&p, 1, DYING_WAIT_MS) > 0) {
			on_death(k, rank);
			return;
		}
	}
	worker_ended(k, rank, 0);
	forget(k, rank);
}

static void refuse(int conn, int err, const char *fmt, ...) SHMRPC_PRINTF(3, 4);
static void refuse(int conn, int err, const char *fmt, ...)
{
	struct join_reply rep = { .magic = JOIN_MAGIC, .err = err };
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(rep.msg, sizeof(rep.msg), fmt, ap);
	va_end(ap);
	(void)send(conn, &rep, sizeof(rep), MSG_NOSIGNAL);
	close(conn);
}

static int send_fds(const struct keeper *k, int conn)
{
	struct join_reply rep = { .magic = JOIN_MAGIC };
	int fds[3] = { k->shm.seg.fd, k->shm.pool.fd, k->shm.rrefs.fd };
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(fds))];
	} c;
	struct iovec iov = { &rep, sizeof(rep) };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.buf,
			      .msg_controllen = sizeof(c.buf) };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);

	memset(&c, 0, sizeof(c));
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(fds));
	memcpy(CMSG_DATA(cm), fds, sizeof(fds));
	return sendmsg(conn, &msg, MSG_NOSIGNAL) == (ssize_t)sizeof(rep) ? 0 : -errno;
}

/* A worker knocks: its request, checked, then its slot, its pidfd and the fds. */
static void on_knock(struct keeper *k)
{
	struct join_req req;
	struct ucred cred;
	socklen_t clen = sizeof(cred);
	struct pollfd p;
	struct shm_worker *w;
	int conn = accept4(k->lfd, NULL, NULL, SOCK_CLOEXEC), pidfd;
	ssize_t n;

	if (conn < 0)
		return;
	p = (struct pollfd){ .fd = conn, .events = POLLIN };
	if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &clen) < 0 ||
	    poll(&p, 1, REQ_WAIT_MS) <= 0 ||
	    (n = recv(conn, &req, sizeof(req), MSG_DONTWAIT)) != (ssize_t)sizeof(req) ||
	    req.magic != JOIN_MAGIC) {
		close(conn);
		return;
	}
	if (req.version != JOIN_VERSION) {
		refuse(conn, -EPROTO, "this rendezvous is served by another version of "
		       "shmrpc (protocol %u, this one speaks %u): use one shmrpc build for "
		       "every process of the job", JOIN_VERSION, req.version);
		return;
	}
	if (cred.uid != getuid()) {
		refuse(conn, -EACCES, "this rendezvous belongs to another user (uid %u): "
		       "choose another MASTER_PORT or init_method", (unsigned)getuid());
		return;
	}
	req.name[SHM_NAME_MAX - 1] = '\0';
	if (k->refusal[0]) {
		if (req.rank < k->world && !k->m[req.rank].pid) {
			k->m[req.rank].pid = (pid_t)cred.pid;
			k->knocked++;
		}
		refuse(conn, -EEXIST, "%s", k->refusal);
		return;
	}
	if (req.world != k->world) {
		refuse(conn, -EINVAL, "init_rpc: world_size %u, but the job at this "
		       "rendezvous has %u workers: give every process the same world_size",
		       req.world, k->world);
		return;
	}
	if (req.rank >= k->world) {
		refuse(conn, -EINVAL, "init_rpc: rank %u is out of range for world_size %u",
		       req.rank, k->world);
		return;
	}
	if (k->m[req.rank].pid) {
		refuse(conn, -EEXIST, "init_rpc: rank %u has already joined this rendezvous "
		       "(pid %d): give each process its own rank", req.rank,
		       (int)k->m[req.rank].pid);
		return;
	}
	for (uint32_t r = 0; r < k->world; r++) {
		const char *other = shm_worker(&k->shm.seg, r)->name;

		if (k->m[r].pid && !strncmp(other, req.name, SHM_NAME_MAX)) {
			/* torch's text, to every rank: the job cannot start.
			 * Those in it read the slot's exit_info (agent_wait_all),
			 * those to come get the refusal. */
			w = shm_worker(&k->shm.seg, req.rank);
			memcpy(w->name, req.name, strlen(req.name));
			k->m[req.rank].pid = (pid_t)cred.pid;
			k->knocked++;
			snprintf(k->refusal, sizeof(k->refusal), "RPC worker name %s is not "
				 "unique. Workers %u and %u share the same name.", req.name, r,
				 req.rank);
			k->refused_at = shmrpc_now_ns();
			/* Relaxed: published by the seq_cst store of the state. */
			atomic_store_explicit(&w->exit_info, SHM_EXIT_NAME_TAKEN(r),
					      memory_order_relaxed);
			atomic_store_explicit(&w->state, SHM_WORKER_EXITED, memory_order_seq_cst);
			job_ring_all(&k->shm);
			refuse(conn, -EEXIST, "%s", k->refusal);
			return;
		}
	}
	pidfd = (int)syscall(SYS_pidfd_open, cred.pid, 0);
	if (pidfd < 0) {
		close(conn);
		return;
	}
	w = shm_worker(&k->shm.seg, req.rank);
	memcpy(w->name, req.name, strlen(req.name));
	/* Release: a worker that reads the generation (acquire) sees the name;
	 * one that reads the pid sees both. */
	atomic_store_explicit(&w->generation, 1, memory_order_release);
	atomic_store_explicit(&w->pid, (uint32_t)cred.pid, memory_order_release);
	k->m[req.rank] = (struct member){
		.pid = (pid_t)cred.pid, .pidfd = pidfd, .conn = conn,
		.watch = { .pid = (pid_t)cred.pid, .generation = 1 },
	};
	k->present++;
	k->joined++;
	k->knocked++;
	if (send_fds(k, conn)) {
		/* It went before it was told: a leave before its start. */
		on_close(k, req.rank);
	}
}

/* The header and the slots, as shmrun's watch loop looks at them. The
 * slots only while the job can start: a refused job's slots say so in
 * their own way (a name taken), and nobody uses them. */
static void keeper_check(struct keeper *k)
{
	if (seg_watch_header(&k->watch, &k->shm.seg, false, &k->shm.corrupt,
			     k->present ? ": the job is stopped" : ""))
		for (uint32_t r = 0; r < k->world; r++)
			if (k->m[r].pidfd >= 0)
				syscall(SYS_pidfd_send_signal, k->m[r].pidfd, SIGTERM, NULL, 0);
	for (uint32_t r = 0; r < k->world && !k->refusal[0]; r++)
		seg_watch_slot(&k->watch, &k->shm.seg, r, &k->m[r].watch, &k->shm.corrupt,
			       " (the keeper exits 1)");
}

static bool keeper_round(struct keeper *k, struct pollfd *pfd, uint32_t *who, uint64_t start)
{
	nfds_t n = 0, members;
	int timeout = -1;

	if (k->lfd >= 0)
		pfd[n++] = (struct pollfd){ .fd = k->lfd, .events = POLLIN };
	for (uint32_t r = 0; r < k->world; r++) {
		if (k->m[r].pidfd < 0)
			continue;
		who[n] = r;
		pfd[n++] = (struct pollfd){ .fd = k->m[r].pidfd, .events = POLLIN };
		if (k->m[r].conn >= 0) {
			who[n] = r | 0x80000000u;
			pfd[n++] = (struct pollfd){ .fd = k->m[r].conn, .events = POLLIN };
		}
	}
	members = n;
	if (!k->joined && k->starter >= 0)
		pfd[n++] = (struct pollfd){ .fd = k->starter, .events = POLLIN };
	/* Only waiting for ranks to come: the first, or those a refusal is for. */
	if (!k->joined || (k->refusal[0] && !k->present)) {
		uint64_t since = k->joined ? k->refused_at : start, now = shmrpc_now_ns();

		if (now - since >= KEEPER_IDLE_NS)
			return false;
		timeout = (int)((since + KEEPER_IDLE_NS - now) / 1000000u) + 1;
	} else if (k->present) {
		uint64_t now = shmrpc_now_ns();

		if (now >= k->check_at) {
			keeper_check(k);
			k->check_at = now + SEG_WATCH_EVERY_NS;
		}
		timeout = (int)((k->check_at - now) / 1000000u) + 1;
	}
	if (poll(pfd, n, timeout) < 0)
		return errno == EINTR;
	if (n > members && pfd[members].revents)
		return false; /* the starter ended before anyone joined */
	/* Leaves and deaths before knocks: a worker that left and joins again
	 * (init_rpc after shutdown) has its leave pending when its knock
	 * comes; seen first, the leave closes the door, and the knock finds
	 * a new keeper. */
	for (nfds_t i = k->lfd >= 0 ? 1 : 0; i < members; i++) {
		uint32_t r = who[i] & 0x7fffffffu;

		if (!pfd[i].revents)
			continue;
		if (!(who[i] & 0x80000000u) && k->m[r].pidfd == pfd[i].fd)
			on_death(k, r);
		else if ((who[i] & 0x80000000u) && k->m[r].conn == pfd[i].fd) {
			char b;

			/* Nothing is sent after the request: any readiness is the end. */
			if (recv(k->m[r].conn, &b, 1, MSG_DONTWAIT) < 0 && errno == EAGAIN)
				continue;
			on_close(k, r);
		}
	}
	if (k->lfd >= 0 && pfd[0].fd == k->lfd && pfd[0].revents)
		on_knock(k);
	return true;
}

int keeper_run(int lfd, int starter, uint32_t world, uint64_t pool_size)
{
	struct keeper k = { .world = world, .lfd = lfd, .starter = starter };
	struct job_shm_params jp = { .world = world, .job_name = "shmrpc-join",
				     .pool_size = pool_size };
	/* The door, each member's pidfd and connection, the starter. */
	struct pollfd *pfd = calloc(2 + 2 * (size_t)world, sizeof(*pfd));
	uint32_t *who = calloc(2 + 2 * (size_t)world, sizeof(*who));
	uint64_t start = shmrpc_now_ns();
	int rc = 1;

	k.m = calloc(world, sizeof(*k.m));
	if (!pfd || !who || !k.m) {
		fprintf(stderr, "shmrpc keeper: out of memory\n");
		goto out;
	}
	for (uint32_t r = 0; r < world; r++)
		k.m[r].pidfd = k.m[r].conn = -1;
	if (job_shm_create(&k.shm, &jp)) {
		fprintf(stderr, "shmrpc keeper: %s\n", shmrpc_errmsg());
		goto out;
	}
	seg_watch_init(&k.watch, &k.shm.seg, "shmrpc keeper");
	/* Until every worker that joined has gone (the first to go closed
	 * the door, so none can come after), and, for a job refused, every
	 * rank came to hear why. */
	while ((k.present || !k.joined || (k.refusal[0] && k.knocked < k.world)) &&
	       keeper_round(&k, pfd, who, start))
		;
	keeper_check(&k); /* what changed since its last look */
	for (uint32_t r = 0; r < world; r++)
		if (k.m[r].pidfd >= 0) {
			job_worker_ended(&k.shm, r, 0xffffffffu);
			forget(&k, r);
		}
	/* Relaxed: the keeper's own word. */
	rc = atomic_load_explicit(&k.shm.corrupt, memory_order_relaxed) ? 1 : 0;
	job_shm_close(&k.shm);
out:
	if (k.lfd >= 0)
		close(k.lfd);
	if (k.starter >= 0)
		close(k.starter);
	free(k.m);
	free(pfd);
	free(who);
	return rc;
}
