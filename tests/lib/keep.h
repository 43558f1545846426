/*
 * A worker that keeps one tensor it was sent, for tests of tensor
 * lifetimes: "keep"(t) holds a handle of its own on t (letting go of the
 * one it kept before) and answers t's pool offset, or -1 for a device
 * tensor; "drop"() lets the kept one go.
 */
#ifndef SHMRPC_TESTS_KEEP_H
#define SHMRPC_TESTS_KEEP_H

/* Registers "keep" and "drop" (before shmrpc_init). */
void tl_keep_register(void);

#endif
