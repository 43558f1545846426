/*
 * A shared structure found corrupt: which one, and who is told. Nothing
 * read from the job's memory is trusted (a stray or hostile write of a
 * same-uid process can change any word of it); a check that fails names
 * the structure in its sentence and sets that structure's bit in two
 * words: the finder's own (a worker's slot, shm_worker.corrupt_found, or
 * the launcher's memory), which shmrun reads when the job ends to say
 * which structures were corrupt and exit non-zero; and, where the file
 * has one, its header's, which every process of the job reads before it
 * uses the structure again (the tensor pool stops serving: a corrupt list
 * could hand a block out twice).
 */
#ifndef SHMRPC_SHM_CORRUPT_H
#define SHMRPC_SHM_CORRUPT_H

#include <stdatomic.h>
#include <stdint.h>

#include "common/compiler.h"

enum shm_corrupt_bit {
	SHM_CORRUPT_POOL_RECORDS = 1u << 0, /* block records: off, refs, slab links */
	SHM_CORRUPT_POOL_CHUNKS = 1u << 1,  /* the chunk table's entries */
	SHM_CORRUPT_POOL_LISTS = 1u << 2,   /* free-list heads and links, slab lists */
	SHM_CORRUPT_POOL_HOLDERS = 1u << 3, /* the holder tables */
	SHM_CORRUPT_RREF_ENTRIES = 1u << 4, /* RRef entries: owner, counts, total, state */
	SHM_CORRUPT_RREF_COLLECT = 1u << 5, /* the owners' collect lists */
	/* Found only by their readers' checks (shm/slot.h), nothing stops
	 * serving for them: a worker slot's fields out of range, or not what
	 * the launcher wrote; the segment header's constant fields changed
	 * since the launcher wrote them (which ends the job). */
	SHM_CORRUPT_SLOTS = 1u << 6,
	SHM_CORRUPT_HEADER = 1u << 7,
	SHM_CORRUPT_ALL = (1u << 8) - 1,
};

/* "the tensor pool's free lists": the structure of one bit. */
SHMRPC_HIDDEN const char *shm_corrupt_name(uint64_t bit);

/*
 * Records that this process found the structure `bit` corrupt: the bit in
 * *note and *shared (each may be NULL), and the sentence (printf-style)
 * as this thread's error. Returns -SHMRPC_ECORRUPT.
 */
SHMRPC_HIDDEN int shm_corrupt(_Atomic uint64_t *note, _Atomic uint64_t *shared, uint64_t bit,
			      const char *fmt, ...) SHMRPC_PRINTF(4, 5);

#endif
