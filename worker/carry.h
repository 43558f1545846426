/*
 * Carry lists: struct tensor_list and its functions (worker/tensor.h),
 * and the RRef operations the levels below worker/rref.c reach it by.
 */
#ifndef SHMRPC_WORKER_CARRY_H
#define SHMRPC_WORKER_CARRY_H

#include <stdbool.h>
#include <stdint.h>

#include <msgpack.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/tensor.h"

struct agent;

/* What carry lists, values (value.c) and requests (client.c) do with the
 * RRefs they hold: worker/rref.c's functions (rref.h), set by agent.c
 * once per process before any agent starts, read-only after. */
struct rref_ops {
	int (*pack)(msgpack_packer *pk, const shmrpc_rref *r);
	int (*unpack)(const char *data, uint32_t len, bool take, shmrpc_rref **out);
	void (*free)(shmrpc_rref *r);
	/* A message's RRefs are charged to its receiver before it goes,
	 * and uncharged if it does not. */
	int (*charge)(struct agent *ag, const struct tensor_list *l, uint32_t dst);
	void (*uncharge)(struct agent *ag, const struct tensor_list *l, uint32_t dst);
};
SHMRPC_HIDDEN extern struct rref_ops rref_ops;
SHMRPC_HIDDEN void carry_set_rref_ops(const struct rref_ops *ops);

#endif
