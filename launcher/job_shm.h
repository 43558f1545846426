/*
 * A job's shared memory (segment, tensor pool, RRef table) and what is
 * done to it when one of its workers ends. shmrun uses both; so does a
 * process that starts workers of its own by fork (shmrpc.data's loader),
 * which is its job's launcher then.
 */
#ifndef SHMRPC_LAUNCHER_JOB_SHM_H
#define SHMRPC_LAUNCHER_JOB_SHM_H

#include <stdint.h>

#include "common/compiler.h"
#include "shm/pool.h"
#include "shm/rref_table.h"
#include "shm/segment.h"

struct job_shm {
	struct shm_seg seg;
	struct shm_pool pool;
	struct rref_table rrefs;
	/* SHM_CORRUPT_* bits of what this process (the launcher) found
	 * corrupt in the pool and the RRef table: their corrupt_note. */
	_Atomic uint64_t corrupt;
};

struct job_shm_params {
	uint32_t world;
	uint32_t ring_size;     /* 0: the segment's default */
	uint32_t trace_records; /* 0: the segment's default */
	uint32_t seg_flags;     /* SHM_F_* */
	const char *job_name;
	uint64_t pool_size;     /* bytes of tensor data at most; 0: pool_default_bytes() */
	uint32_t max_rrefs;     /* 0: the table's default */
	uint32_t holder_records; /* references each rank may hold; 0: the pool's default */
	uint32_t pool_records;  /* pool block records; 0: the pool's default */
	uint64_t pool_retain;   /* free pool bytes kept committed; 0: the pool's default */
};

/* Creates the three memfds (close-on-exec); what failed in shmrpc_errmsg(). */
SHMRPC_HIDDEN int job_shm_create(struct job_shm *js, const struct job_shm_params *p);
SHMRPC_HIDDEN void job_shm_close(struct job_shm *js);

/* How the process behind pidfd ended, as shm/layout.h encodes it (0: exit
 * code 0); reaps it. 0xffffffff when it cannot be collected (said on stderr). */
SHMRPC_HIDDEN uint32_t job_reap(int pidfd, int pid);

/* Rings every worker's doorbell (after a change they must look at). */
SHMRPC_HIDDEN void job_ring_all(const struct job_shm *js);

/*
 * Rank ended (exit_info as job_reap says): what it held in the pool and
 * the RRef table goes back, and its slot says EXITED (exit_info 0) or
 * DEAD, with the cause, and every doorbell rings so that sleeping workers
 * look at once and fail their calls to it.
 */
SHMRPC_HIDDEN void job_worker_ended(struct job_shm *js, uint32_t rank, uint32_t exit_info);

#endif
