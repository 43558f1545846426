/*
 * A barrier among the first `parties` ranks of a job, counted on rank 0:
 * each party calls rank 0 until all have arrived. Every worker calls
 * tl_barrier_register() before shmrpc_init. A party that never comes fails
 * the test after 60 s rather than hanging it. Phases 0..7.
 */
#ifndef SHMRPC_TESTS_BARRIER_H
#define SHMRPC_TESTS_BARRIER_H

int tl_barrier_register(void);
void tl_barrier(int phase, int parties);

#endif
