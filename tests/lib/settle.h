/*
 * What a worker of a job test sees of the job's shared state: the RRefs
 * live in the table and the bytes in use in the pool. References a job
 * drops settle asynchronously (acks, deletes, sweeps), so the end of an
 * RRef test waits for both to be 0.
 */
#ifndef SHMRPC_TESTS_SETTLE_H
#define SHMRPC_TESTS_SETTLE_H

#include <stdbool.h>
#include <stdint.h>

uint32_t tl_rrefs_live(void);
uint64_t tl_pool_used(void);
/* Waits up to timeout_ns until both are 0; whether they are. */
bool tl_wait_empty(uint64_t timeout_ns);

#endif
