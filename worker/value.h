/*
 * Values on the wire: shmrpc_value <-> MessagePack, encoded by msgpack-c
 * and decoded here. Decoding
 * first walks the bytes with a checker that trusts no length: every string,
 * container count and nesting depth is bounded by the bytes actually there,
 * so a hostile or corrupt payload cannot make the decoder allocate or read
 * more than it holds. Extension types 1 (tensor), 2 (RRef fork data) and 3
 * (inline tensor) are reserved (docs/PROTOCOL.md).
 */
#ifndef SHMRPC_WORKER_VALUE_H
#define SHMRPC_WORKER_VALUE_H

#include <msgpack.h>
#include <stddef.h>
#include <stdint.h>

#include "shmrpc.h"
#include "common/compiler.h"
#include "worker/arena.h"

#define VALUE_MAX_DEPTH 64
#define VALUE_EXT_TENSOR 1
#define VALUE_EXT_RREF 2
#define VALUE_EXT_TENSOR_INLINE 3 /* a small CPU tensor's descriptor and bytes */
/* A reply's CPU tensor that its request carried (ext 1's body): the
 * caller's request pin keeps its block, so the callee pins nothing and the
 * caller owes no TENSOR_ACK for it. */
#define VALUE_EXT_TENSOR_COVERED 4

struct tensor_list;

/* Appends v; -EINVAL (with errmsg) for an unknown type or too deep nesting.
 * Each tensor met is added to sent (the caller pins them); with sent NULL a
 * tensor is refused. pk packs into a msgpack_sbuffer (its data): a small
 * tensor goes inline by how much the message holds so far (tensor.h). */
SHMRPC_HIDDEN int value_pack(msgpack_packer *pk, const shmrpc_value *v, struct tensor_list *sent);
/* Decodes one value from [buf, buf+len) into out, allocating from a;
 * *used gets the bytes taken. -EBADMSG with errmsg on malformed input.
 * Each tensor received becomes a handle added to got (whose owner frees
 * them); with got NULL a tensor is refused. */
SHMRPC_HIDDEN int value_unpack(const void *buf, size_t len, struct arena *a, shmrpc_value *out,
			       size_t *used, struct tensor_list *got);
/* Checks args against a signature (shmrpc_register); -EINVAL with errmsg. */
SHMRPC_HIDDEN int value_check_sig(const char *fn, const char *sig, const shmrpc_value *args,
				  uint32_t nargs);

#endif
