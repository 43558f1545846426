/*
 * The job segment's format (SHM_FORMAT_VERSION). Everything here lives in shared
 * memory: fixed-width types, explicit padding, offsets instead of pointers,
 * and _Static_asserts so that a change of layout cannot go unnoticed.
 *
 *   offset 0            struct shm_header            (one page)
 *   worker_off          struct shm_worker[world]     (320 B each)
 *   ring_ctl_off        struct shm_ring_ctl[nrings]  (256 B each)
 *   ring_data_off       ring data, ring_size bytes each, page aligned
 *   trace_off           per worker: struct shm_trace_ctl[lanes] (one per
 *                       lane, shm_trace_lanes()), then
 *                       struct shm_trace_rec[trace_records], page aligned
 *   devmap_off          struct shm_devmap_head[world] (256 B each), then
 *                       struct shm_devmap_row[world * world] (16 B each),
 *                       page aligned: the CUDA device maps
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
/* 2: the flight recorder; 3: its tensor handoffs and ring-space waits,
 * and the CUDA IPC gauges of the worker slot; 4: the device maps; 5: the
 * 56-byte frame header (nesting depth, needed_by) and inline tensors; 6:
 * a request's help entries (help_n), the 208-byte CUDA descriptor (the
 * producer's allocation size, the device's UUID) and a ring's abandoned
 * mark; 7: the flight recorder's clock (trace_clock, its anchor), so that
 * workers of different builds meet a version error, not "corrupt"; 8: the
 * worker slot's servers_newest (its idle executors woken newest first)
 * and replies_watched, servers_watched (a spinner's promise to take the
 * replies, the requests); 9: the flight recorder's lanes (a struct
 * shm_trace_ctl per lane before the records); 10: the recorder's
 * RECEIVED_STARTED records (an inspector of 9 would show them as "?"). */
#define SHM_FORMAT_VERSION 10u
#define SHM_PAGE 4096u
#define SHM_MAX_WORLD 1024u
#define SHM_NAME_MAX 48u
#define SHM_RING_MIN (4u * 1024u)
#define SHM_RING_MAX (64u * 1024u * 1024u)
#define SHM_TRACE_MIN 16u       /* flight-recorder records per worker */
#define SHM_TRACE_MAX (1u << 20)
#define SHM_TRACE_LANES_MAX 8u  /* lanes of a worker's recorder (shm_trace_lanes) */
#define SHM_TRACE_LANE_MIN 512u /* records of a lane, but in a ring of fewer than 1024 */

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
	uint64_t trace_off;
	uint32_t trace_records; /* per worker, power of two */
	uint32_t trace_rec_size;
	uint64_t devmap_off;
	/* What a flight-recorder record's time counts (SHM_TRACE_CLOCK_*), and
	 * for ticks the anchor readers turn them into ns by, taken at creation
	 * (common/ticks.h). */
	uint32_t trace_clock;
	uint32_t reserved0;
	uint64_t trace_anchor_ticks;
	uint64_t trace_anchor_ns; /* CLOCK_MONOTONIC */
	uint8_t reserved[SHM_PAGE - 184];
};
_Static_assert(offsetof(struct shm_header, generation) == 80, "header layout");
_Static_assert(offsetof(struct shm_header, job_name) == 88, "header layout");
_Static_assert(offsetof(struct shm_header, trace_off) == 136, "header layout");
_Static_assert(offsetof(struct shm_header, devmap_off) == 152, "header layout");
_Static_assert(offsetof(struct shm_header, trace_anchor_ns) == 176, "header layout");
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
/* With state EXITED: refused at a rendezvous, its name being rank r's
 * (launcher/keeper.c); r below the kind. */
#define SHM_EXIT_NAME_TAKEN(r) ((3u << 24) | ((uint32_t)(r) & 0xffffffu))
#define SHM_EXIT_KIND(info) ((info) >> 24)
#define SHM_EXIT_VALUE(info) ((info) & 0xffffffu)

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
	 * itself to `sleepers` (seq_cst) before re-checking its rings.
	 * Two promises let a frame ring nothing (ipc_doorbell_notify); the
	 * owner stores them seq_cst, peers load them after the same fence as
	 * `sleepers`. `servers_busy`, 1 while every thread of the owner that
	 * serves requests runs one: a request then waits for the first of
	 * them to finish, which stores 0, fences, and polls the rings itself
	 * (worker/executor.c), which keeps what it said and restores the
	 * word, naming the slot corrupt, when its loop thread finds it
	 * written by another process. `replies_taken`, 1 while the owner's threads
	 * take their replies themselves and none waits for one: a reply then
	 * waits for the next thread to wait, which stores 0, fences, and polls
	 * the rings first (worker/agent.c). And `servers_bell`, the futex word
	 * the owner's idle executor threads sleep on (`servers_asleep` of
	 * them, counted as `sleepers` is): a request wakes one of them there
	 * (seq_cst bump, FUTEX_WAKE of one), which polls the rings itself,
	 * instead of the loop thread, which would only queue it for them;
	 * `servers_newest`, the bit of the one that went to sleep last, is
	 * whom it wakes first (ipc/lifo.h: a hint, stored relaxed by the
	 * owner, any value safe). `replies_watched`, 1 while a thread of
	 * the owner spins for its reply polling the rings (worker/link.h
	 * agent_watch_begin): a reply then rings nothing, the spinner takes
	 * it; it stores 0, fences and looks at the rings once more when it
	 * stops. `servers_watched`, the same for requests while an idle
	 * executor thread of the owner spins polling the rings
	 * (worker/executor.c watch_requests).
	 * `replies_bell` / `replies_asleep` are the same for the owner's
	 * threads waiting for a reply while they take their replies (and for
	 * one thread per process waiting for its own reply, worker/link.h
	 * agent_wait_alone): a reply (or a local completion) wakes them all
	 * there, and they poll. */
	_Atomic uint32_t doorbell;
	_Atomic uint32_t sleepers;
	_Atomic uint32_t servers_busy;
	_Atomic uint32_t replies_taken;
	_Atomic uint32_t servers_bell;
	_Atomic uint32_t servers_asleep;
	_Atomic uint32_t replies_bell;
	_Atomic uint32_t replies_asleep;
	_Atomic uint32_t servers_newest;
	_Atomic uint32_t replies_watched;
	_Atomic uint32_t servers_watched;
	uint8_t pad1[SHMRPC_CACHELINE - 44];

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
	_Atomic uint64_t dlpack_copies; /* DLPack imports that had to copy (into the pool, or
					 * for a small tensor sent inline, our memory) */
	/* CUDA IPC (worker/cuda.c): how many of each this process has open
	 * now, stored whole (relaxed) by whichever of its threads changed
	 * one, under its CUDA lock; 0 in a worker that never used CUDA. */
	_Atomic uint32_t cuda_maps_open;       /* peers' allocations mapped here, idle cached ones too */
	_Atomic uint32_t cuda_events_open;     /* peers' interprocess events opened here */
	_Atomic uint32_t cuda_allocs_exported; /* own allocations whose IPC handle is kept (cached) */
	_Atomic uint32_t cuda_events_exported; /* own interprocess events, recorded for receivers */
	/* SHM_CORRUPT_* bits (shm/corrupt.h): the shared structures (the tensor
	 * pool's, the RRef table's) that this worker found corrupt; set by any
	 * of its threads (relaxed fetch_or), read by shmrun when the job ends
	 * and by inspectors. */
	_Atomic uint64_t corrupt_found;
	_Atomic uint64_t agent_reserved[3];
};
_Static_assert(offsetof(struct shm_worker, doorbell) == 64, "doorbell on its own line");
_Static_assert(offsetof(struct shm_worker, heartbeat_ns) == 128, "counters on their own line");
_Static_assert(offsetof(struct shm_worker, agent_state) == 192, "agent on its own lines");
_Static_assert(offsetof(struct shm_worker, cuda_maps_open) == 272, "CUDA gauges after the agent's");
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
	/* lines 2-3: constant after creation, but for abandoned, set once. */
	uint64_t data_off;
	uint32_t size;
	uint16_t src;
	uint16_t dst;
	/* abandoned: set (release) by a consumer that found the ring corrupt
	 * and reads it no more, before it rings the producer's doorbell; the
	 * producer reads it (acquire) before it sends, and on each turn of its
	 * loop, and fails its calls to the consumer (ipc_port_ring_abandoned).
	 * Here, not beside head, which the consumer writes all along: the
	 * producer's loop reads it for every peer. */
	_Atomic uint32_t abandoned;
	uint8_t pad3[2 * SHMRPC_CACHELINE - 20];
};
_Static_assert(offsetof(struct shm_ring_ctl, head) == 64, "head on its own line");
_Static_assert(offsetof(struct shm_ring_ctl, data_off) == 128, "constants on their own line");
_Static_assert(sizeof(struct shm_ring_ctl) == 256, "ring control is four lines");

/*
 * The flight recorder: each worker's last message and call steps, in a
 * ring of fixed records split into lanes of equal length
 * (shm_trace_lanes(): a ring of 1024 records or more has up to 8, of 512
 * or more each; a smaller one, one). Lane 0 is shared: any thread of the
 * worker appends to it without a lock. Each other lane is one thread's: the
 * first lanes-1 threads of the worker to record take one each, for their
 * life (worker/trace.h), and only that thread writes it. Inspectors and the
 * launcher read the lanes while they move and merge them by time.
 *
 * Record i of a lane is its slot i % (its length). A writer of the shared
 * lane claims i with a relaxed fetch_add on the lane's `head`, then takes
 * the slot with a CAS of its seq from an even value below 2i+1 to 2i+1 (a
 * slot still odd, or already past i, is being written by a writer a lap
 * away: the record is dropped and counted); a lane's own thread stores
 * seq = 2i+1 (relaxed; no other thread writes the lane) and, once the
 * record is whole, head = i+1 (relaxed). Then both: a release fence, the
 * three words (relaxed), and seq = 2i+2 (release). A reader wanting
 * record i loads seq (acquire), the words (relaxed), an acquire fence, seq
 * again: the record is whole only if both seqs are 2i+2; otherwise it is
 * skipped. 0 is a slot never written. A reader takes the records from
 * head - length to head, and the ones past head while their seq says
 * they are whole (an own lane's thread stores head after the record).
 * A record is rewritten only by the thread that wrote it, and only while
 * it is that thread's newest (worker/trace.c, trace_fold_to: RECEIVED
 * becoming RECEIVED_STARTED): seq = 2i+1 again (own lane: a store; shared
 * lane: a CAS from 2i+2, which fails when a writer a lap ahead has the
 * slot), the release fence, the new info, seq = 2i+2 (release); a reader
 * meanwhile skips it, or reads it whole, before or after, and a shared
 * lane's writer a lap behind finds the slot odd and drops its record.
 *
 * A record's time is the CPU's time-stamp counter where the segment's
 * creator found it invariant (trace_clock SHM_TRACE_CLOCK_TICKS: a read
 * costs a few ns against the 20-40 of CLOCK_MONOTONIC's vDSO call);
 * readers turn it into CLOCK_MONOTONIC ns along the line through the
 * header's anchor and one they take when they read. Elsewhere
 * (SHM_TRACE_CLOCK_NS) it is CLOCK_MONOTONIC ns. Both clocks are one for
 * every CPU, so the lanes merge by it.
 */
struct shm_trace_ctl {
	/* The lane's records claimed (shared lane: relaxed RMW, any thread
	 * of the owner) or written (own lane: relaxed store, its thread). */
	_Atomic uint64_t head;
	_Atomic uint64_t dropped; /* shared lane: records given up, their slot busy (relaxed RMW) */
	uint8_t pad[SHMRPC_CACHELINE - 16];
};
_Static_assert(sizeof(struct shm_trace_ctl) == SHMRPC_CACHELINE, "trace control is one line");

/* How many lanes a ring of `records` records (a power of two) has: a power
 * of two, each lane SHM_TRACE_LANE_MIN records or more. */
static inline uint32_t shm_trace_lanes(uint32_t records)
{
	uint32_t lanes = records / SHM_TRACE_LANE_MIN;

	return lanes < 2 ? 1 : lanes > SHM_TRACE_LANES_MAX ? SHM_TRACE_LANES_MAX : lanes;
}

struct shm_trace_rec {
	_Atomic uint64_t seq;
	_Atomic uint64_t msg_id;
	_Atomic uint64_t time;    /* the header's trace_clock */
	_Atomic uint64_t info;    /* SHM_TRACE_INFO() */
};
_Static_assert(sizeof(struct shm_trace_rec) == 32, "trace record is 32 bytes");

/* What a record's time counts (shm_header.trace_clock). */
enum shm_trace_clock {
	SHM_TRACE_CLOCK_NS = 0,    /* CLOCK_MONOTONIC ns */
	SHM_TRACE_CLOCK_TICKS = 1, /* the invariant time-stamp counter */
};

/* What a record says happened (shm_trace_rec.info's kind). */
enum shm_trace_kind {
	SHM_TRACE_SENT = 1,      /* a request went out (peer: its callee) */
	SHM_TRACE_RECEIVED = 2,  /* a request came in and was queued (peer: its caller) */
	SHM_TRACE_STARTED = 3,   /* an executor thread began to run it */
	SHM_TRACE_FINISHED = 4,  /* its reply went out (status: ok or error) */
	SHM_TRACE_COMPLETED = 5, /* a call of ours ended: reply, timeout, death, shutdown */
	/* The tensors of a message of ours (a request, or our reply to peer's
	 * request msg_id) handed over: pinned until the receiver has them. */
	SHM_TRACE_PINNED = 6,
	/* Those pins released (status: ok when the receiver took them, by its
	 * reply or TENSOR_ACK, or when the message never went; peer-dead;
	 * shutdown). */
	SHM_TRACE_UNPINNED = 7,
	SHM_TRACE_BLOCKED = 8,   /* a send found its ring to peer full and waits for space */
	SHM_TRACE_UNBLOCKED = 9, /* that wait ended: the frame went (ok) or peer died */
	/* RECEIVED and STARTED as one: the thread that took the request off
	 * its ring ran it before it wrote any other record. The time is the
	 * arrival's; the record was RECEIVED until the run began (below). */
	SHM_TRACE_RECEIVED_STARTED = 10,
};

/* How it went (shm_trace_rec.info's status). */
enum shm_trace_status {
	SHM_TRACE_OK = 0,
	SHM_TRACE_ERROR = 1,     /* an EXCEPTION, or a send that failed */
	SHM_TRACE_TIMEOUT = 2,
	SHM_TRACE_PEER_DEAD = 3,
	SHM_TRACE_SHUTDOWN = 4,  /* failed by shmrpc_shutdown */
	SHM_TRACE_LATE = 5,      /* a reply that came after its call had ended */
};

/* info: size in bits 0-31 (payload bytes, saturated), peer 32-47, message
 * type 48-55 (types above 255 saturate), kind 56-59, status 60-63. */
#define SHM_TRACE_INFO(kind, status, type, peer, size)                                   \
	((uint64_t)(size) | (uint64_t)(peer) << 32 | (uint64_t)(type) << 48 |             \
	 (uint64_t)(kind) << 56 | (uint64_t)(status) << 60)
#define SHM_TRACE_SIZE(info) ((uint32_t)(info))
#define SHM_TRACE_PEER(info) ((uint32_t)((info) >> 32) & 0xffffu)
#define SHM_TRACE_TYPE(info) ((uint32_t)((info) >> 48) & 0xffu)
#define SHM_TRACE_KIND(info) ((uint32_t)((info) >> 56) & 0xfu)
#define SHM_TRACE_STATUS(info) ((uint32_t)((info) >> 60))
_Static_assert(SHM_MAX_WORLD <= 0x10000u, "a rank fits a record's peer field");

/*
 * info of PINNED and UNPINNED, which have no message type but a count and
 * more bytes: bytes in bits 0-31 (below 2^31 exact; else bit 31 set and
 * the KiB, rounded up, below it: to 2 TiB), peer 32-41, tensors 42-54
 * (saturated), 55 set when the tensors went with a reply (else a
 * request); kind and status where every record has them.
 */
#define SHM_TRACE_PIN_BYTES_KIB (1u << 31)
#define SHM_TRACE_PIN_MAX_TENSORS 0x1fffu
#define SHM_TRACE_PIN_INFO(kind, status, reply, tensors, peer, bytes)                  \
	((uint64_t)(bytes) | (uint64_t)(peer) << 32 | (uint64_t)(tensors) << 42 |        \
	 (uint64_t)(reply) << 55 | (uint64_t)(kind) << 56 | (uint64_t)(status) << 60)
#define SHM_TRACE_PIN_PEER(info) ((uint32_t)((info) >> 32) & 0x3ffu)
#define SHM_TRACE_PIN_TENSORS(info) ((uint32_t)((info) >> 42) & SHM_TRACE_PIN_MAX_TENSORS)
#define SHM_TRACE_PIN_REPLY(info) ((uint32_t)((info) >> 55) & 1u)
_Static_assert(SHM_MAX_WORLD <= 0x400u, "a rank fits a pin record's peer field");

/*
 * CUDA device maps (worker/devmap.h, torch's set_device_map): what each
 * worker gave at shmrpc_init, published for every other to check and use.
 * Written by its worker only, in two steps of shmrpc_init, each before a
 * release store that peers read with acquire before they read it:
 *  - before READY (agent_state): `entries`, so that after the startup
 *    barrier every worker knows whether the job has maps at all (without
 *    any, no worker loads CUDA to count its devices);
 *  - after the startup barrier: `device_count`, its rows and `error`, then
 *    `state` (release) = SHM_DEVMAP_DONE; peers wait for it (acquire).
 * Row (src, dst) is src's map for dst: to[i] is the device of dst on
 * which src's cuda:i tensors of src's requests land (-1: not mapped).
 * Devices 0 to SHM_DEVMAP_DEVICES - 1 only; 16 bytes per ordered pair of
 * workers (16 KiB for 32 workers, 16 MiB for 1024), a sixteenth of the
 * pair's ring control block.
 */
#define SHM_DEVMAP_DEVICES 16
#define SHM_DEVMAP_ERROR_MAX 232u

enum shm_devmap_state {
	SHM_DEVMAP_NONE = 0, /* not published yet */
	SHM_DEVMAP_DONE = 1, /* rows, device count and error are there */
};

struct shm_devmap_head {
	_Atomic uint32_t state; /* SHM_DEVMAP_*; release after the rest */
	uint32_t entries;       /* map entries given; written before READY */
	int32_t device_count;   /* CUDA devices; -1: not counted (no maps in the job, or no CUDA) */
	uint32_t reserved;
	uint8_t pad[8];
	/* NUL-terminated; empty unless its own maps are invalid in a way only
	 * it can tell (an unknown worker name, no CUDA): the sentence every
	 * worker's shmrpc_init then fails with. */
	char error[SHM_DEVMAP_ERROR_MAX];
};
_Static_assert(offsetof(struct shm_devmap_head, error) == 24, "devmap head layout");
_Static_assert(sizeof(struct shm_devmap_head) == 256, "devmap head is four lines");

struct shm_devmap_row {
	int8_t to[SHM_DEVMAP_DEVICES];
};
_Static_assert(sizeof(struct shm_devmap_row) == SHM_DEVMAP_DEVICES, "devmap row: no padding");

#endif
