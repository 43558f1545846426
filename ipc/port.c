/* A worker's port: sending into and polling the rings; see port.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "ipc/doorbell.h"
#include "ipc/port.h"
#include "shm/corrupt.h"
#include "shm/slot.h"

/* A blocked sender re-checks its peer this often even without a wake-up. */
#define SEND_SLICE_NS (20u * 1000u * 1000u)

int ipc_port_open(struct ipc_port *p, struct shm_seg *seg, uint32_t rank, enum ipc_wait_mode mode)
{
	uint32_t world = seg->world;
	int err;

	memset(p, 0, sizeof(*p));
	if (rank >= world)
		return shmrpc__fail(-EINVAL, "rank %u out of range: the job has %u workers", rank, world);
	p->seg = seg;
	p->rank = rank;
	p->world = world;
	p->self = shm_worker(seg, rank);
	p->payload_csum = !(seg->hdr->flags & SHM_F_NO_PAYLOAD_CSUM);
	p->out = calloc(world, sizeof(*p->out));
	p->in = calloc(world, sizeof(*p->in));
	p->out_lock = calloc(world, sizeof(*p->out_lock));
	p->in_broken = calloc(world, sizeof(*p->in_broken));
	p->quiet_due = calloc(world, sizeof(*p->quiet_due));
	if (!p->out || !p->in || !p->out_lock || !p->in_broken || !p->quiet_due) {
		err = shmrpc__fail(-ENOMEM, "out of memory opening the port of rank %u", rank);
		goto fail;
	}
	for (uint32_t peer = 0; peer < world; peer++) {
		pthread_mutex_init(&p->out_lock[peer], NULL);
		if (peer == rank)
			continue;
		ipc_ring_open(&p->out[peer], seg, rank, peer, true);
		ipc_ring_open(&p->in[peer], seg, peer, rank, false);
	}
	err = ipc_waiter_init(&p->waiter, p->self, world, mode);
	if (err)
		goto fail_locks;
	/* Acquire pairs with the launcher's release when it set up the slot. */
	p->generation = atomic_load_explicit(&p->self->generation, memory_order_acquire);
	/* Release: a peer that reads our pid (acquire) may watch it at once. */
	atomic_store_explicit(&p->self->pid, (uint32_t)getpid(), memory_order_release);
	return 0;

fail_locks:
	for (uint32_t peer = 0; peer < world; peer++)
		pthread_mutex_destroy(&p->out_lock[peer]);
fail:
	free(p->out);
	free(p->in);
	free(p->out_lock);
	free(p->in_broken);
	free(p->quiet_due);
	return err;
}

void ipc_port_close(struct ipc_port *p)
{
	ipc_waiter_destroy(&p->waiter);
	for (uint32_t peer = 0; peer < p->world; peer++)
		pthread_mutex_destroy(&p->out_lock[peer]);
	free(p->out);
	free(p->in);
	free(p->out_lock);
	free(p->in_broken);
	free(p->quiet_due);
	memset(p, 0, sizeof(*p));
}

uint32_t ipc_port_max_payload(const struct ipc_port *p)
{
	return p->seg->ring_size / 2 - IPC_REC_PREFIX - (uint32_t)sizeof(struct ipc_frame_hdr);
}

bool ipc_port_peer_alive(struct ipc_port *p, uint32_t peer)
{
	/* Acquire pairs with the launcher's release store of DEAD. */
	uint32_t st = atomic_load_explicit(&shm_worker(p->seg, peer)->state, memory_order_acquire);

	/* A state out of range was written outside shmrpc: the peer is not
	 * known dead by it (its pidfd and the launcher still tell), and
	 * shmrun names the slot. Relaxed: a flag (shm/corrupt.h). */
	if (st > SHM_WORKER_DEAD)
		atomic_fetch_or_explicit(&p->self->corrupt_found, SHM_CORRUPT_SLOTS,
					 memory_order_relaxed);
	return st != SHM_WORKER_DEAD && !ipc_waiter_is_dead(&p->waiter, peer) &&
	       !ipc_port_ring_broken(p, peer) && !ipc_port_ring_abandoned(p, peer);
}

bool ipc_port_ring_abandoned(const struct ipc_port *p, uint32_t peer)
{
	/* Acquire pairs with the consumer's release store (ipc_port_poll). */
	return peer != p->rank &&
	       atomic_load_explicit(&p->out[peer].ctl->abandoned, memory_order_acquire);
}

bool ipc_port_ring_broken(const struct ipc_port *p, uint32_t peer)
{
	/* Relaxed: set once by the poller; a sender that misses it fails
	 * with the peer's other calls (the agent's loop reads it too). */
	return atomic_load_explicit(&p->in_broken[peer], memory_order_relaxed);
}

static size_t iov_bytes(const struct ipc_msg *m)
{
	size_t n = 0;

	for (int i = 0; i < m->iovcnt; i++)
		n += m->iov[i].iov_len;
	return n;
}

static int check_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m, size_t len)
{
	if (dst >= p->world || dst == p->rank)
		return shmrpc__fail(-EINVAL, "worker %u cannot send to rank %u: %s", p->rank, dst,
				    dst == p->rank ? "that is itself" : "no such rank");
	if (len > ipc_port_max_payload(p))
		return shmrpc__fail(-EMSGSIZE,
				    "a %zu-byte payload does not fit in a frame: rings of %u bytes "
				    "carry at most %u bytes per frame (raise --ring-size, or send "
				    "large data as tensors)",
				    len, p->seg->ring_size, ipc_port_max_payload(p));
	if (m->type == 0 || (m->flags & ~IPC_FRAME_F_MORE))
		return shmrpc__fail(-EINVAL, "frame type 0 or unknown flags 0x%x", m->flags);
	if (m->help_n > IPC_HELP_MAX || m->help_n * sizeof(struct ipc_help) > len)
		return shmrpc__fail(-EINVAL, "a frame of %zu bytes cannot start with %u help entries",
				    len, m->help_n);
	return 0;
}

/* Writes the frame into dst's ring if it fits now; caller holds the lock. */
static bool put_frame(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m, uint32_t len)
{
	struct ipc_ring *r = &p->out[dst];
	struct ipc_frame_hdr *h = ipc_ring_reserve(r, (uint32_t)sizeof(*h) + len);
	uint8_t *at;

	if (!h)
		return false;
	*h = (struct ipc_frame_hdr){
		.type = m->type,
		.flags = m->flags,
		.payload_len = len,
		.msg_id = m->msg_id,
		.src = (uint16_t)p->rank,
		.dst = (uint16_t)dst,
		.src_gen = p->generation,
		.needed_by = m->needed_by,
		.depth = m->depth,
		.help_n = m->help_n,
	};
	at = (uint8_t *)(h + 1);
	for (int i = 0; i < m->iovcnt; i++) {
		if (!m->iov[i].iov_len) /* an empty iovec may have no base */
			continue;
		memcpy(at, m->iov[i].iov_base, m->iov[i].iov_len);
		at += m->iov[i].iov_len;
	}
	ipc_frame_seal(h, h + 1, p->payload_csum);
	ipc_ring_commit(r);
	return true;
}

/* After put_frame, out_lock still held. A loud frame's doorbell (in sent)
 * covers the quiet frames before it in the ring, so none is owed after it;
 * a quiet one (due: when, else 0) owes one unless an older debt, due
 * sooner, stands. True when a loud frame settled a debt: its notice then
 * takes no shortcut that rings nothing (ipc_doorbell_notify's after_quiet):
 * the receiver's busy executors or waiting thread would take the quiet
 * frames only when they next poll. */
static bool owe(struct ipc_port *p, uint32_t dst, uint64_t due)
{
	/* Relaxed: senders change it under out_lock; flush_quiet's CAS fails
	 * on a clear (the sender's own doorbell is then the one owed), and
	 * the exchange fails to see a debt flush_quiet took (it rang). */
	if (!due)
		return atomic_exchange_explicit(&p->quiet_due[dst], 0, memory_order_relaxed) != 0;
	/* Release: the frame's tail store comes before the debt that
	 * flush_quiet acquires, so the doorbell it rings covers the frame. */
	if (!atomic_load_explicit(&p->quiet_due[dst], memory_order_relaxed))
		atomic_store_explicit(&p->quiet_due[dst], due, memory_order_release);
	return false;
}

/* quiet: rings nothing; settled: owe() said so. */
static void sent(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m, uint32_t len,
		 bool quiet, bool settled)
{
	if (!quiet)
		ipc_doorbell_notify(shm_worker(p->seg, dst), p->self, m->kind, settled);
	/* Relaxed: statistics, read by inspectors only. */
	atomic_fetch_add_explicit(&p->self->frames_sent, 1, memory_order_relaxed);
	atomic_fetch_add_explicit(&p->self->bytes_sent, len, memory_order_relaxed);
}

/* quiet: a try_send_quiet due then (ns), else 0. */
static int try_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m, bool wait_lock,
		    uint64_t quiet)
{
	size_t len = iov_bytes(m);
	int err = check_send(p, dst, m, len);
	bool ok, settled;

	if (err)
		return err;
	if (!ipc_port_peer_alive(p, dst))
		return -SHMRPC_EPEERDEAD;
	if (wait_lock)
		pthread_mutex_lock(&p->out_lock[dst]);
	else if (pthread_mutex_trylock(&p->out_lock[dst]))
		return -EAGAIN;
	ok = put_frame(p, dst, m, (uint32_t)len);
	settled = ok && owe(p, dst, quiet);
	pthread_mutex_unlock(&p->out_lock[dst]);
	if (!ok)
		return -EAGAIN;
	sent(p, dst, m, (uint32_t)len, quiet != 0, settled);
	return 0;
}

int ipc_port_try_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m)
{
	return try_send(p, dst, m, true, 0);
}

int ipc_port_try_send_quiet(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m,
			    uint64_t delay_ns)
{
	return try_send(p, dst, m, false, shmrpc_now_ns() + delay_ns);
}

uint64_t ipc_port_flush_quiet(struct ipc_port *p, uint64_t now)
{
	uint64_t next = UINT64_MAX;

	for (uint32_t dst = 0; dst < p->world; dst++) {
		/* Acquire pairs with try_send's release: the frame is published. */
		uint64_t due = atomic_load_explicit(&p->quiet_due[dst], memory_order_acquire);

		if (!due)
			continue;
		if (due > now) {
			next = due < next ? due : next;
			continue;
		}
		/* Relaxed on failure: a sender cleared it, and rings for it. */
		if (atomic_compare_exchange_strong_explicit(&p->quiet_due[dst], &due, 0,
							    memory_order_relaxed,
							    memory_order_relaxed))
			ipc_doorbell_notify(shm_worker(p->seg, dst), p->self, IPC_FRAME_OTHER, false);
	}
	return next;
}

int ipc_port_send(struct ipc_port *p, uint32_t dst, const struct ipc_msg *m, uint64_t timeout_ns)
{
	uint64_t deadline = timeout_ns ? shmrpc_now_ns() + timeout_ns : UINT64_MAX;
	size_t len = iov_bytes(m);
	int err = check_send(p, dst, m, len);
	bool settled = false;

	if (err)
		return err;
	pthread_mutex_lock(&p->out_lock[dst]);
	for (;;) {
		uint64_t now, slice;
		uint32_t seq;

		if (!ipc_port_peer_alive(p, dst)) {
			err = -SHMRPC_EPEERDEAD;
			break;
		}
		if (put_frame(p, dst, m, (uint32_t)len)) {
			settled = owe(p, dst, 0);
			break;
		}
		now = shmrpc_now_ns();
		if (now >= deadline) {
			err = -ETIMEDOUT;
			break;
		}
		/* Read seq before announcing: a consumer freeing space after this
		 * bumps our doorbell and the futex wait returns at once. */
		seq = ipc_doorbell_seq(p->self);
		if (ipc_ring_wait_space_prepare(&p->out[dst], (uint32_t)(sizeof(struct ipc_frame_hdr) + len)))
			continue;
		/* Relaxed: a statistic. */
		atomic_fetch_add_explicit(&p->self->send_waits, 1, memory_order_relaxed);
		/* A full ring: its receiver may not poll soon (its executors all
		 * busy, or its replies taken by a thread waiting for another;
		 * such frames ring nothing, doorbell.h): its loop thread drains it. */
		ipc_doorbell_ring(shm_worker(p->seg, dst), p->self);
		slice = deadline - now < SEND_SLICE_NS ? deadline - now : SEND_SLICE_NS;
		/* seq_cst: pairs with the waker's bump-then-load (doorbell.h). */
		atomic_fetch_add_explicit(&p->self->sleepers, 1, memory_order_seq_cst);
		ipc_futex_wait(&p->self->doorbell, seq, slice);
		atomic_fetch_sub_explicit(&p->self->sleepers, 1, memory_order_seq_cst);
	}
	ipc_ring_wait_space_done(&p->out[dst]);
	pthread_mutex_unlock(&p->out_lock[dst]);
	if (err)
		return err == -SHMRPC_EPEERDEAD
			       ? shmrpc__fail(err, "worker %u cannot send to worker %u: it died", p->rank, dst)
			       : shmrpc__fail(err, "worker %u: no room towards worker %u before the timeout",
					      p->rank, dst);
	sent(p, dst, m, (uint32_t)len, false, settled);
	return 0;
}

bool ipc_port_want_space(struct ipc_port *p, uint32_t dst, uint32_t len)
{
	/* Read before the flag goes up, as ipc_port_send does: a consumer that
	 * frees space after this bumps the doorbell past seq. */
	uint32_t seq = ipc_doorbell_seq(p->self);

	if (ipc_ring_wait_space_prepare(&p->out[dst], (uint32_t)sizeof(struct ipc_frame_hdr) + len))
		return true;
	if (!p->space_seq_set) {
		p->space_seq = seq;
		p->space_seq_set = true;
	}
	return false;
}

/*
 * The ring from src holds a record that fails its checks: its control
 * words (rc of ipc_ring_peek), or a frame's header or payload (its
 * checksum, its ranks). Either way the ring is no longer read: a frame
 * dropped would leave the call it carried waiting for its timeout, or
 * forever without one, and what follows a damaged frame is not to be
 * trusted more. The calls of both sides on this link fail at once instead;
 * shmrpc_errmsg and stderr say why.
 */
static void break_ring(struct ipc_port *p, struct ipc_ring *r, uint32_t src, int err,
		       const char *why)
{
	shmrpc__fail(err, "the ring from worker %u is no longer read: %s", src, why);
	/* Relaxed: has_input only skips the ring sooner or later. */
	atomic_store_explicit(&p->in_broken[src], true, memory_order_relaxed);
	/* Relaxed: a statistic. */
	atomic_fetch_add_explicit(&p->self->corrupt_frames, 1, memory_order_relaxed);
	fprintf(stderr, "shmrpc: worker %u: %s\n", p->rank, shmrpc_errmsg());
	/* Release, pairs with ipc_port_ring_abandoned's acquire: the producer
	 * fails its calls to us, woken to see it. */
	atomic_store_explicit(&r->ctl->abandoned, 1, memory_order_release);
	ipc_doorbell_ring(shm_worker(p->seg, src), p->self);
}

int ipc_port_poll(struct ipc_port *p, ipc_frame_fn fn, void *arg, int max)
{
	uint64_t bytes = 0;
	int n = 0;

	for (uint32_t i = 0; i < p->world && n < max; i++) {
		uint32_t src = (p->next_src + i) % p->world;
		struct ipc_ring *r = &p->in[src];
		int got = 0;

		/* Relaxed: only the poller (poll lock) stores it. */
		if (src == p->rank || atomic_load_explicit(&p->in_broken[src], memory_order_relaxed))
			continue;
		while (n < max) {
			const uint8_t *rec;
			struct ipc_frame f;
			uint32_t len;
			int rc = ipc_ring_peek(r, &rec, &len);

			if (rc == 0)
				break;
			if (rc < 0) {
				break_ring(p, r, src, rc, "its positions or records are impossible");
				break;
			}
			if (ipc_frame_decode(rec, len, src, p->rank, &f)) {
				char why[256];

				snprintf(why, sizeof(why), "%s", shmrpc_errmsg());
				break_ring(p, r, src, -SHMRPC_ECORRUPT, why);
				break;
			}
			fn(arg, &f);
			bytes += f.hdr.payload_len;
			ipc_ring_consume(r, len);
			got++;
			n++;
		}
		if (got && ipc_ring_release(r))
			ipc_doorbell_ring(shm_worker(p->seg, src), p->self);
	}
	p->next_src = (p->next_src + 1) % p->world;
	if (n) {
		/* Relaxed: statistics. */
		atomic_fetch_add_explicit(&p->self->frames_recv, (uint64_t)n, memory_order_relaxed);
		atomic_fetch_add_explicit(&p->self->bytes_recv, bytes, memory_order_relaxed);
	}
	return n;
}

static bool has_input(struct ipc_port *p)
{
	for (uint32_t src = 0; src < p->world; src++) {
		/* Relaxed: set once by the poller; a late sight only delays the skip. */
		if (src == p->rank || atomic_load_explicit(&p->in_broken[src], memory_order_relaxed))
			continue;
		if (ipc_ring_unreleased(&p->in[src]))
			return true;
	}
	return false;
}

/* Frames, or the owner's other news (ipc_port.news). */
bool ipc_port_has_work(struct ipc_port *p)
{
	return has_input(p) || (p->news && p->news(p->news_arg));
}

static bool has_work_cb(void *p)
{
	return ipc_port_has_work(p);
}

int ipc_port_wait(struct ipc_port *p, uint64_t timeout_ns)
{
	uint32_t seq;

	ipc_waiter_poll(&p->waiter);
	/* An older seq only makes the wait return sooner, never later. */
	seq = p->space_seq_set ? p->space_seq : ipc_doorbell_seq(p->self);
	p->space_seq_set = false;
	if (ipc_port_has_work(p) || ipc_waiter_has_news(&p->waiter))
		return 0;
	return ipc_waiter_sleep(&p->waiter, seq, timeout_ns, has_work_cb, p);
}

int ipc_port_watch(struct ipc_port *p, uint32_t peer, pid_t pid)
{
	if (peer >= p->world)
		return shmrpc__fail(-EINVAL, "no rank %u to watch", peer);
	/* The pid comes from its slot: one no process can have is not
	 * watched (its end is then noticed through the slot). */
	if ((uint32_t)pid > SHM_PID_MAX)
		return shm_corrupt(&p->self->corrupt_found, NULL, SHM_CORRUPT_SLOTS,
				   "worker slot %u is corrupt: its pid is %d", peer, (int)pid);
	return ipc_waiter_watch(&p->waiter, peer, pid);
}

bool ipc_port_take_dead(struct ipc_port *p, uint32_t *peer)
{
	return ipc_waiter_take_dead(&p->waiter, peer);
}
