/*
 * The job segment's format (format 1). Everything here lives in shared
 * memory: fixed-width types, explicit padding, offsets instead of pointers,
 * and _Static_asserts so that a change of layout cannot go unnoticed.
 *
 *   offset 0            struct shm_header            (one page)
 *   worker_off          struct shm_worker[world]     (320 B each)
 *   ring_ctl_off        struct shm_ring_ctl[nrings]  (256 B each)
 *   ring_data_off       ring data, ring_size bytes each, page aligned
 *
 * nrings = world * (world - 1): one single-producer single-consumer ring
 * per ordered pair of workers (docs/ARCHITECTURE.md argues the choice).
 * Who writes which field, and with which memory order, is said at each
 * field and summed up in docs/ARCHITECTURE.md.
 */
#ifndef SHMRPC_SHM_LAYOUT_H
#define SHMRPC_SHM_LAYOUT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"

#define SHM_MAGIC 0x31434d5052484d53ull /* "SHMRPC1" read as little endian */
#define SHM_FORMAT_VERSION 1u
#define SHM_PAGE 4096u
#define SHM_MAX_WORLD 1024u
#define SHM_NAME_MAX 48u
#define SHM_RING_MIN (4u * 1024u)
#define SHM_RING_MAX (64u * 1024u * 1024u)

/* Header flags. */
#define SHM_F_NO_PAYLOAD_CSUM 0x1u /* frames carry no payload checksum */

/* Written once by the creator before any other process can see the segment. */
struct shm_header {
	uint64_t magic;
	uint32_t format_version;
	uint32_t header_size;
	uint64_t total_size;
	uint32_t world_size;
	uint32_t flags;
	uint64_t created_ns; /* CLOCK_REALTIME */
	uint32_t launcher_pid;
	uint32_t ring_size; /* bytes of data per ring, power of two */
	uint64_t worker_off;
	uint64_t ring_ctl_off;
	uint64_t ring_data_off;
	uint32_t worker_size;
	uint32_t ring_ctl_size;
	/* Bumped by the launcher (release) each time a worker slot changes
	 * generation; readers (acquire) use it to notice restarts. */
	_Atomic uint32_t generation;
	/* Set (release) by the launcher when the job is being torn down;
	 * workers read it (acquire) when woken. */
	_Atomic uint32_t shutting_down;
	char job_name[SHM_NAME_MAX];
	uint8_t reserved[SHM_PAGE - 136];
};
_Static_assert(offsetof(struct shm_header, generation) == 80, "header layout");
_Static_assert(offsetof(struct shm_header, job_name) == 88, "header layout");
_Static_assert(sizeof(struct shm_header) == SHM_PAGE, "header is one page");

/* Worker states (shm_worker.state). */
enum shm_worker_state {
	SHM_WORKER_EMPTY = 0,   /* slot not started yet */
	SHM_WORKER_RUNNING = 1, /* process attached and serving */
	SHM_WORKER_EXITED = 2,  /* left cleanly */
	SHM_WORKER_DEAD = 3,    /* died; exit_info says how */
};

/* Agent states (shm_worker.agent_state). */
enum shm_agent_state {
	SHM_AGENT_NONE = 0,    /* no agent yet (or the program does not use one) */
	SHM_AGENT_READY = 1,   /* shmrpc_init done: serving requests */
	SHM_AGENT_LEAVING = 2, /* arrived at the graceful-shutdown barrier, still serving */
	SHM_AGENT_GONE = 3,    /* left the job */
};

/* exit_info encoding: kind in the high byte, code or signal below. */
#define SHM_EXIT_CODE(c) ((1u << 24) | ((uint32_t)(c) & 0xffu))
#define SHM_EXIT_SIGNAL(s) ((2u << 24) | ((uint32_t)(s) & 0xffu))

/*
 * One slot per rank, five cache lines, so that the doorbell (written by
 * every peer) never shares a line with the owner's counters.
 */
struct shm_worker {
	/* line 0: lifecycle. pid/generation written by the worker at attach or
	 * by the launcher at fork (release); state written by the worker
	 * (RUNNING, EXITED) or the launcher (DEAD) with release; every reader
	 * uses acquire so that exit_info is visible once state says DEAD. */
	_Atomic uint32_t state;
	_Atomic uint32_t pid;
	_Atomic uint32_t generation;
	_Atomic uint32_t exit_info;
	char name[SHM_NAME_MAX];

	/* line 1: the doorbell. Peers bump `doorbell` (seq_cst RMW) after
	 * publishing a frame or freeing ring space, then read `sleepers`
	 * (seq_cst) and FUTEX_WAKE only if someone sleeps. The owner adds
	 * itself to `sleepers` (seq_cst) before re-checking its rings. */
	_Atomic uint32_t doorbell;
	_Atomic uint32_t sleepers;
	uint8_t pad1[SHMRPC_CACHELINE - 8];

	/* line 2: transport counters, written only by the owner (relaxed
	 * fetch_add); read by inspectors, which accept slightly stale values. */
	_Atomic uint64_t heartbeat_ns;
	_Atomic uint64_t frames_sent;
	_Atomic uint64_t frames_recv;
	_Atomic uint64_t bytes_sent;
	_Atomic uint64_t bytes_recv;
	_Atomic uint64_t corrupt_frames;
	_Atomic uint64_t send_waits; /* times a send waited for ring space */
	_Atomic uint64_t wakeups_sent; /* FUTEX_WAKE syscalls made */

	/* lines 3-4: the RPC agent (worker/). agent_state is written by the
	 * owner with release and read with acquire (the startup and shutdown
	 * barriers); the rest are gauges and counters written only by the
	 * owner (relaxed), named as torch.distributed.rpc names them where it
	 * does, read by peers and inspectors that accept stale values. */
	_Atomic uint32_t agent_state; /* SHM_AGENT_* */
	_Atomic uint32_t thread_pool_size;
	_Atomic uint32_t num_idle_threads;
	uint32_t pad3;
	_Atomic uint64_t client_active_calls; /* requests sent, reply not yet in */
	_Atomic uint64_t server_active_calls; /* requests being run here now */
	_Atomic uint64_t num_pending_futures; /* requests received, not started */
	_Atomic uint64_t calls_served;
	_Atomic uint64_t errors;       /* requests answered with an EXCEPTION */
	_Atomic uint64_t timeouts;     /* calls of ours that timed out */
	_Atomic uint64_t late_replies; /* replies that came after their timeout */
	_Atomic uint64_t dlpack_copies; /* DLPack imports that had to copy into the pool */
	_Atomic uint64_t agent_reserved[6];
};
_Static_assert(offsetof(struct shm_worker, doorbell) == 64, "doorbell on its own line");
_Static_assert(offsetof(struct shm_worker, heartbeat_ns) == 128, "counters on their own line");
_Static_assert(offsetof(struct shm_worker, agent_state) == 192, "agent on its own lines");
_Static_assert(sizeof(struct shm_worker) == 320, "worker slot is five lines");

/*
 * Control block of one SPSC ring. `tail` and `head` are byte counters that
 * only grow (wrap at 2^64, never in practice); the position in the data
 * area is counter & (ring_size - 1).
 */
struct shm_ring_ctl {
	/* line 0, producer side. tail: written by the producer with release
	 * after the record is complete; read by the consumer with acquire. */
	_Atomic uint64_t tail;
	/* prod_waiting: set by a producer waiting for space (seq_cst, then it
	 * re-checks head); the consumer reads it after a seq_cst fence that
	 * follows its head store, and then rings the producer's doorbell. */
	_Atomic uint32_t prod_waiting;
	uint32_t pad0;
	uint8_t pad1[SHMRPC_CACHELINE - 16];
	/* line 1, consumer side. head: written by the consumer with release
	 * once a record is consumed; read by the producer with acquire. */
	_Atomic uint64_t head;
	uint8_t pad2[SHMRPC_CACHELINE - 8];
	/* lines 2-3: constant after creation. */
	uint64_t data_off;
	uint32_t size;
	uint16_t src;
	uint16_t dst;
	uint8_t pad3[2 * SHMRPC_CACHELINE - 16];
};
_Static_assert(offsetof(struct shm_ring_ctl, head) == 64, "head on its own line");
_Static_assert(offsetof(struct shm_ring_ctl, data_off) == 128, "constants on their own line");
_Static_assert(sizeof(struct shm_ring_ctl) == 256, "ring control is four lines");

#endif
