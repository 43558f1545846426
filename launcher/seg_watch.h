/*
 * A launcher's watch over its job's segment header and worker slots: the
 * checks that shmrun's watch loop (integrity.c) and the keeper of a job
 * joined without shmrun (keeper.c) both run a few times a second. The
 * header is the launcher's, written once at creation but for two words
 * only it writes (generation, shutting_down), so it keeps a private copy
 * and compares. A slot's lifecycle is the launcher's word too (the pid it
 * started or let join, the generation and end it recorded); a slot that
 * holds together no more (shm/slot.h), or says otherwise, is said once.
 * Both note their SHM_CORRUPT_* bit in the launcher's word. What each
 * launcher then does (stop the job, fail it at its end) is its own.
 */
#ifndef SHMRPC_LAUNCHER_SEG_WATCH_H
#define SHMRPC_LAUNCHER_SEG_WATCH_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/compiler.h"
#include "shm/segment.h"

/* How often a launcher looks: a few times a second. */
#define SEG_WATCH_EVERY_NS 100000000ull

struct seg_watch {
	const char *who;      /* "shmrun": the launcher, in its sentences */
	struct shm_header hdr; /* the header as the launcher wrote it */
	uint32_t generation;   /* what the header's generation must say: the deaths recorded */
	bool header_bad;       /* found changed: said once */
};

/* What the launcher knows of one worker, which its slot must say. */
struct seg_watch_rank {
	pid_t pid;           /* the process started, or that joined; 0: none yet */
	uint32_t generation; /* the one the launcher wrote: 0 none yet, 1 (a death adds one) */
	pid_t pid_seen;      /* a descendant of pid that its slot named (found so once) */
	bool ended;          /* its end recorded (job_worker_ended) */
	uint32_t exit_info;  /* that end: 0 exited 0, SHM_EXIT_* otherwise */
	bool bad;            /* its slot was found corrupt: said once */
};

/* Keeps the header as written now; who names the launcher. */
SHMRPC_HIDDEN void seg_watch_init(struct seg_watch *w, const struct shm_seg *seg,
				  const char *who);

/*
 * Compares the header with the copy (the generation with w->generation,
 * shutting_down with the value given). The first time it differs: true,
 * "WHO: the segment header is corrupt: its F is not what WHO wrote (...)
 * THEN" on stderr, SHM_CORRUPT_HEADER in *corrupt. False otherwise.
 */
SHMRPC_HIDDEN bool seg_watch_header(struct seg_watch *w, const struct shm_seg *seg,
				    bool shutting_down, _Atomic uint64_t *corrupt,
				    const char *then);

/*
 * Reads rank's slot and compares it with r. The first time it holds
 * together no more or says otherwise: true, "WHO: worker slot N is
 * corrupt: ... THEN" on stderr, SHM_CORRUPT_SLOTS in *corrupt.
 */
SHMRPC_HIDDEN bool seg_watch_slot(const struct seg_watch *w, const struct shm_seg *seg,
				  uint32_t rank, struct seg_watch_rank *r,
				  _Atomic uint64_t *corrupt, const char *then);

#endif
