/*
 * A worker that keeps one tensor it was sent, for tests of tensor
 * lifetimes: "keep"(t) holds a handle of its own on t (letting go of the
 * one it kept before) and answers t's pool offset, or -1 for a device
 * tensor; "drop"() lets the kept one go. Or many at once (below).
 */
#ifndef SHMRPC_TESTS_KEEP_H
#define SHMRPC_TESTS_KEEP_H

#include "shmrpc.h"

/* Registers "keep" and "drop" (before shmrpc_init). */
void tl_keep_register(void);

/* Registers "copy_first"(t, u) (before shmrpc_init): answers a copy of t,
 * bytes as uint8, in a block of its own, which the reply pins until the
 * caller's TENSOR_ACK (t itself would go covered by the request's pin,
 * with no ack: docs/PROTOCOL.md, "By reference"). */
void tl_copy_register(void);

/*
 * Many received tensors held at once: "keep_all"([t...]) holds a handle of
 * its own on each (answers how many are held now); "release"() runs check
 * on them all (0, or what shmrpc_call_error returned), lets them all go
 * and answers how many it held. Registers both (before shmrpc_init), for
 * up to capacity tensors; tl_keep_all_free after the shutdown.
 */
typedef int (*tl_kept_check_fn)(shmrpc_call *c, shmrpc_tensor *const *kept, int n);
void tl_keep_all_register(int capacity, tl_kept_check_fn check);
void tl_keep_all_free(void);

#endif
