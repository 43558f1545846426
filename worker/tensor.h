/*
 * Tensors in the pool, as the agent handles them. Declared here, made in
 * several files (docs/ARCHITECTURE.md, "worker/ in levels"): the pool's
 * mapping (tensor_view.c), device tensors' bytes (tensor_dev.c), handles
 * (tensor.c), carry lists (carry.c), descriptors (tensor_wire.c); the
 * pins are pins.h's.
 *
 * Handing over. A tensor travels as a descriptor (pool offset, byte size,
 * dtype, shape) in a MessagePack extension (docs/PROTOCOL.md). The sender's
 * block must not be freed before the receiver has taken its own reference,
 * so the sender pins every tensor of a message (one more reference, held by
 * its rank) until it knows the receiver has it:
 *  - a request's tensors: until the reply comes (or its late reply, or the
 *    callee's death);
 *  - a reply's tensors: until the caller's TENSOR_ACK (or the caller's death).
 * A pinned reference of a process that dies goes back with the launcher's
 * sweep of its holder table, like every other reference it held. Each pin
 * and its release are flight-recorder records (PINNED, UNPINNED).
 *
 * Small tensors travel inline. A CPU tensor of at most the agent's
 * inline_max bytes taken from memory outside the pool
 * (shmrpc_tensor_from_dlpack: a plain torch or numpy array) is copied into
 * memory of this process (struct tensor_heap) instead of a pool block, and
 * its bytes travel inside the frame after its descriptor: the receiver
 * copies them into memory of its own. No pool block, holder record, pin or
 * TENSOR_ACK. A tensor already in the pool (shmrpc_tensor_alloc,
 * shmrpc.empty, one received by reference) is always handed over by
 * reference, whatever its size: the callee sees the caller's bytes. A
 * heap tensor goes inline while its message, its bytes included, stays
 * within half a frame's payload; one beyond that is copied into a pool
 * block at send time (tensor_list.made) and goes by reference.
 *
 * CUDA device tensors (kDLCUDA) travel through CUDA IPC (worker/cuda.h),
 * never copied; their handles share a struct tensor_dev. Lifetime, with no
 * message beyond the call's own:
 *  - The producer (the process whose allocation it is: a tensor taken with
 *    shmrpc_tensor_from_dlpack) allocates, at the first send, a lifetime
 *    token: a 64-byte pool block whose reference count counts the
 *    producer (one) and every receiver that holds the tensor (one each,
 *    for its handles or its idle cache entry). An export
 *    registry keeps the token and a reference to the source tensor.
 *  - A receiver takes a pool reference on the token before it maps the
 *    tensor, and drops it when the tensor is released (after dropping its
 *    mapping). So a receiver's death drops its counts with the launcher's
 *    sweep of its holder table, like any pool reference.
 *  - The idle cache: a received tensor whose last handle goes is kept,
 *    not released, with its mapping and its token reference, so that the
 *    next tensor of that allocation maps nothing (opening one costs ~140
 *    µs on an H100) while the producer keeps the allocation alive (the
 *    token pins one source of it, whose DLPack deleter would free it: no
 *    mapping outlives its memory). One entry per allocation (the latest
 *    tensor of it; the one before is released), at most TENSOR_IDLE_MAPS
 *    in a process, least recently parked released first; released too when
 *    the producer exits or dies (after cuda_forget_peer), when it reuses
 *    the allocation's addresses for another (it freed it: cuda.c sees the
 *    overlap), and when shmrpc_shutdown has passed its barrier (the cache
 *    serves while the worker waits there), before the agent goes GONE. A
 *    receiver's death drops the entries' tokens with its other references.
 *  - The producer releases a source (token reference, then its reference
 *    to the tensor: its DLPack deleter runs when no handle of this process
 *    is left) once no handle, pin or message of this process names it and
 *    the token counts only the producer: checked on each export, and
 *    every TENSOR_REAP_NS from the loop thread while there are exports
 *    (it hands the work to an executor: a deleter is user code, which
 *    never runs on the loop thread). The pins hold
 *    the source until the receiver has its token reference, so a count of
 *    one cannot be a tensor still in flight.
 *  - A producer that shuts down gracefully waits (after the barrier, up to
 *    TENSOR_SHUTDOWN_WAIT_MS) for its peers to go GONE, so that the idle
 *    caches of those leaving with it let go first. One that shuts down
 *    while receivers still hold tokens says on stderr who holds how many
 *    (idle cache entries count), and keeps those sources (their memory stays
 *    allocated until the process exits). A receiver checks the producer's
 *    slot (same pid, still RUNNING) before it maps a tensor and whenever it
 *    hands out the device pointer: once the producer exited or died, the
 *    tensor is an error, never the bytes of freed memory.
 *  - A receiver passes a tensor on with the producer's descriptor and an
 *    event of its own (cuda_export_forward) and the same token: the next
 *    receiver counts on the same producer.
 *  - A tensor that a device map (worker/devmap.h) lands on another device
 *    than its own is copied there on arrival: the receiver's handle is of
 *    a copy of its own (a source like a DLPack one, passed on as such),
 *    which holds the received tensor above until the copy goes.
 */
#ifndef SHMRPC_WORKER_TENSOR_H
#define SHMRPC_WORKER_TENSOR_H

#include <msgpack.h>

#include "worker/cuda.h"
#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "shm/pool.h"

/* A mapping of a job's pool, shared by the agent and every handle into it:
 * it lasts until the last of them lets go, so that a tensor a program
 * still holds after shmrpc_shutdown (a data-loader batch kept past its
 * epoch) still reads its bytes. */
struct tensor_view {
	void *base;
	uint64_t size;
	_Atomic uint32_t refs;
};

struct tensor_dev; /* a device tensor's bytes (tensor_dev.c) */
struct tensor_heap; /* a small tensor's bytes in this process's memory (tensor_impl.h) */

struct shmrpc_tensor {
	struct tensor_view *view; /* the mapping dl.data points into; NULL on a device */
	struct tensor_dev *dev;   /* a device tensor's bytes, else NULL */
	struct tensor_heap *heap; /* bytes in our memory, sent inline; else NULL */
	uint64_t off;
	uint64_t nbytes;
	DLTensor dl;
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
	/* Its pool reference went to another handle (tensor_take_over): it
	 * describes the bytes still (tensor_list_covers reads it), and its
	 * free drops nothing. */
	bool spent;
};

/* The handles a message or a value holds: tensors and RRefs. take: when
 * decoding into the list, make a reference of our own to each RRef (a
 * value read from the RRef table) instead of adopting the sender's. */
struct devmap_landing;
struct tensor_list {
	shmrpc_tensor **t;
	uint32_t n, cap;
	shmrpc_rref **r;
	uint32_t nr, rcap;
	bool take;
	/* When encoding: the handles are the sender's to give (the binding's
	 * own, dropped once sent): the message's pin takes each one's
	 * reference over (tensor_take_over) instead of retaining a copy. The
	 * handles are spent from then on, whether the message goes or not. */
	bool give;
	/* When decoding a reply: its request's pin (pins_take), whose handles
	 * give their references to the reply's covered tensors of the same
	 * bytes (tensor_unpack), instead of a new reference each that the
	 * pin's release then drops. */
	struct tensor_list *pinned;
	/* When decoding: where received CUDA tensors land (devmap_landing();
	 * NULL: on the sender's ordinal). */
	const struct devmap_landing *land;
	/* When encoding: the pool copies of heap tensors that did not fit
	 * (the list's own, pinned with the others, freed with the list). */
	shmrpc_tensor **made;
	uint32_t nmade, madecap;
	/* When encoding: the CUDA descriptors packed, whose interprocess
	 * events stay busy until the receiver has waited on them: moved to
	 * the message's pin (tensor_list_hold), given back when the list
	 * that holds them goes (cuda_export_done). */
	struct cuda_ipc_desc *ev;
	uint32_t nev, evcap;
	/* When encoding a reply: the request's tensors. A tensor of the reply
	 * that is one of them by reference (the same bytes of the same pool
	 * block, tensor_list_covers) goes as VALUE_EXT_TENSOR_COVERED and is
	 * not pinned: the caller's pin of its request keeps the block until
	 * it has unpacked the reply (docs/PROTOCOL.md, "By reference"). */
	const struct tensor_list *covers;
	/* When decoding: how many of the handles came covered (no ack owed). */
	uint32_t ncovered;
};

/* A new handle of t's bytes with t's reference, which t gives up (spent):
 * for a handle its holder reads no more, as a received message's once the
 * binding made its objects of it, the pool's count and records left as
 * they are (shmrpc_tensor_retain would take a reference that t's free
 * then drops). A device or heap tensor is retained; a spent one is
 * refused (-EINVAL), as by shmrpc_tensor_retain. */
SHMRPC_HIDDEN int tensor_take_over(shmrpc_tensor *t, shmrpc_tensor **out);

/* A new handle of pool tensor t's bytes with no reference of its own
 * (spent from the start): for a reply's tensor that is one of its
 * request's (tensor_list_covers), which the reply only describes: the
 * caller's request pin keeps the block until it has unpacked the reply.
 * -EINVAL for a device or heap tensor. */
SHMRPC_HIDDEN int tensor_described(const shmrpc_tensor *t, shmrpc_tensor **out);

/* The agent's view of its pool: made when it attaches (one reference, the
 * agent's), dropped when it detaches; unmapped by the last holder. */
SHMRPC_HIDDEN int tensor_view_open(struct shm_pool *p, struct tensor_view **out);
SHMRPC_HIDDEN void tensor_view_put(struct tensor_view *v);

/* The lists' functions are carry.c's (the level above the handles). */
SHMRPC_HIDDEN int tensor_list_add(struct tensor_list *l, shmrpc_tensor *t);
SHMRPC_HIDDEN int tensor_list_add_rref(struct tensor_list *l, shmrpc_rref *r);
/* t, a pool copy the encoding made, the list's own from now on; on
 * failure (-ENOMEM) still the caller's. */
SHMRPC_HIDDEN int tensor_list_add_made(struct tensor_list *l, shmrpc_tensor *t);
/* Frees every handle of the list (dropping their references) and the list. */
SHMRPC_HIDDEN void tensor_list_free(struct tensor_list *l);
/* Frees the list only: its handles belong to someone else (its made
 * copies are its own, and go). */
SHMRPC_HIDDEN void tensor_list_forget(struct tensor_list *l);
SHMRPC_HIDDEN bool tensor_list_has(const struct tensor_list *l, const shmrpc_tensor *t);
/* True when t is among the first n handles of l. */
SHMRPC_HIDDEN bool tensor_list_has_before(const struct tensor_list *l, uint32_t n,
					  const shmrpc_tensor *t);

/* d's event to give back when l goes. */
SHMRPC_HIDDEN int tensor_list_add_event(struct tensor_list *l, const struct cuda_ipc_desc *d);
/* Adds to held a reference of ours to each tensor of sent that went by
 * reference (not inline; the pool copies the encoding made included), and
 * moves sent's CUDA events there. */
SHMRPC_HIDDEN int tensor_list_hold(struct tensor_list *sent, struct tensor_list *held);
/* Whether tensor_list_hold(sent) would hold anything: a tensor by
 * reference and not covered, or an event. */
SHMRPC_HIDDEN bool tensor_list_pins(const struct tensor_list *sent);
/* True when t, a tensor being sent, is one of request's received handles
 * by reference: a CPU pool tensor with the same block, bytes, dtype and
 * shape (a slice, a view of another shape or dtype, an inline or CUDA
 * tensor is not). */
SHMRPC_HIDDEN bool tensor_list_covers(const struct tensor_list *request, const shmrpc_tensor *t);
/* Handles of l whose bytes went by reference (pool or CUDA), so that the
 * sender pinned them and, for a reply, waits for a TENSOR_ACK; covered
 * ones (tensor_list_covers) are not counted. */
SHMRPC_HIDDEN uint32_t tensor_list_by_ref(const struct tensor_list *l);

/* The default of shmrpc_init's inline_max (SHMRPC_INLINE_MAX): CPU
 * tensors up to this many bytes travel inside the frame. Measured with
 * bench/tensor_handoff's inline lines (docs/ARCHITECTURE.md). */
#define TENSOR_INLINE_MAX_DEFAULT 1024u

/* Appends t's descriptor (with its bytes, for a heap tensor that fits the
 * message's inline budget) to a message being packed into a
 * msgpack_sbuffer (pk's data), and t to sent. */
SHMRPC_HIDDEN int tensor_pack(msgpack_packer *pk, shmrpc_tensor *t, struct tensor_list *sent);
/* An inline tensor received (ext VALUE_EXT_TENSOR_INLINE): a new handle
 * owning a copy of its bytes. */
SHMRPC_HIDDEN int tensor_unpack_inline(const char *data, uint32_t len, shmrpc_tensor **out);
/* A descriptor received: a new handle holding its own reference. A CUDA
 * tensor lands by land (NULL: on its own device): on another device it is
 * copied there (cuda_import_copy), the copy owned by the handle's bytes,
 * which hold the received tensor until the copy goes. pinned (a covered
 * tensor of a reply: its request's pin, else NULL): a handle of the pin
 * with the same bytes gives its reference over (tensor_take_over). */
SHMRPC_HIDDEN int tensor_unpack(const char *data, uint32_t len, const struct devmap_landing *land,
				struct tensor_list *pinned, shmrpc_tensor **out);

/* How often the loop thread has a producer's exports checked while there
 * are any. */
#define TENSOR_REAP_NS (10u * 1000u * 1000u)
/* Received device tensors with no handle kept, with their mappings,
 * each pinning memory in its producer. */
#define TENSOR_IDLE_MAPS 16
/* shmrpc_init opens the idle cache once the agent serves. */
SHMRPC_HIDDEN void tensor_idle_open(void);
/* shmrpc_shutdown, first: releases every entry and parks none after. */
SHMRPC_HIDDEN void tensor_idle_close(void);
/* Releases the entries of producer pid (0: of every producer). */
SHMRPC_HIDDEN void tensor_idle_forget(uint32_t pid);

/* Loop thread: queues a check of the exports (on an executor) when one is
 * due; returns when the next is (UINT64_MAX: none exported). */
SHMRPC_HIDDEN uint64_t tensor_exports_tick(uint64_t now);
/* How long a graceful shutdown waits for its peers to go GONE (their idle
 * caches let go of our tensors then) before it reports what is held. */
#define TENSOR_SHUTDOWN_WAIT_MS 1000
/* shmrpc_shutdown, on the caller's thread after the executors stopped:
 * releases what receivers let go (wait: after a graceful barrier, waiting
 * for the peers to leave), reports the rest on stderr. */
struct agent;
SHMRPC_HIDDEN void tensor_exports_shutdown(struct agent *ag, bool wait);

#endif
