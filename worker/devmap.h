/*
 * CUDA device maps (torch's TensorPipeRpcBackendOptions.set_device_map):
 * which device of the receiver a CUDA tensor lands on.
 *
 * Each worker gives its maps to shmrpc_init (shmrpc_options.device_maps):
 * for a destination worker, its cuda:i → the destination's cuda:j. A
 * request's tensors travel by the caller's map for the callee; a reply's
 * by the inverse of the caller's map for the callee (torch's reverse
 * device maps). So a worker needs, for each peer, its own map for the
 * peer and the peer's map for it: both are published in the job segment
 * (shm/layout.h, struct shm_devmap_*), checked by every worker at
 * shmrpc_init the way torch's _validate_device_maps checks them (so a bad
 * map fails every worker's init with the same sentence), and copied into
 * the agent, which trusts the copies from then on.
 *
 * Where a worker has no map for a peer, tensors keep their ordinal in
 * both directions (torch refuses CUDA tensors then; here the devices are
 * the same box's, shared through CUDA IPC). Where it has one, a tensor on
 * a device the map does not cover fails its call, with torch's words:
 * checked by the sender (devmap_check_send: the call or the reply fails
 * before anything goes) and again by the receiver (devmap_land), which
 * trusts no descriptor.
 */
#ifndef SHMRPC_WORKER_DEVMAP_H
#define SHMRPC_WORKER_DEVMAP_H

#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "shm/layout.h"

struct agent;
struct tensor_list;

/* Where the CUDA tensors of one kind of message from one peer land. */
struct devmap_landing {
	int8_t to[SHM_DEVMAP_DEVICES]; /* by the sender's device; -1: not mapped */
	uint32_t peer;                 /* the sender */
	bool reply;                    /* its replies (else its requests) */
};

/* shmrpc_init, before READY: checks the form of o's entries and says
 * how many there are in our slot. */
SHMRPC_HIDDEN int devmap_join_begin(struct agent *ag, const struct shmrpc_options *o);
/* shmrpc_init, after the startup barrier: publishes our maps (names
 * resolved, devices counted), waits (until deadline, CLOCK_MONOTONIC ns)
 * for every worker's, checks them all and keeps what concerns us. Nothing
 * at all when no worker gave a map. */
SHMRPC_HIDDEN int devmap_join(struct agent *ag, const struct shmrpc_options *o,
			      uint64_t deadline);
SHMRPC_HIDDEN void devmap_free(struct agent *ag);

/* The landing of peer's requests (reply false) or replies to ours; NULL
 * when no map applies (the same ordinal). */
SHMRPC_HIDDEN const struct devmap_landing *devmap_landing(const struct agent *ag, uint32_t peer,
							  bool reply);
/* The device a CUDA tensor on the sender's device lands on here;
 * -EBADMSG (torch's text) when the map does not cover it. */
SHMRPC_HIDDEN int devmap_land(const struct agent *ag, const struct devmap_landing *l,
			      int32_t device, int32_t *land);
/* 0 when every CUDA tensor of sent may go to peer in our request (reply
 * false) or our reply; else -EINVAL with torch's text. */
SHMRPC_HIDDEN int devmap_check_send(const struct agent *ag, uint32_t peer, bool reply,
				    const struct tensor_list *sent);

#endif
