/*
 * The shared memory of a job: memfds, never files in /dev/shm, so that
 * nothing is left behind whatever dies. Both the job segment and the tensor
 * pool are made here: created close-on-exec and mode 0600, sized, every
 * page committed (so that a full tmpfs or a memory limit is an error now,
 * with the size, and never a SIGBUS later), size sealed, mapped. The
 * pool's data is the exception: committed block by block (shm/pool_lock.c).
 */
#ifndef SHMRPC_SHM_MEMFD_H
#define SHMRPC_SHM_MEMFD_H

#include <stdint.h>

#include "common/compiler.h"

/*
 * Creates the memfd `name` of `bytes` and maps it read-write. On failure
 * the sentence reads "cannot commit N bytes for WHAT: REASON; free memory
 * or /dev/shm space, or pass a smaller HINT" (or names the failing step).
 * 0 with *fd and *base set, or -errno.
 */
SHMRPC_HIDDEN int shm_memfd_create(const char *name, uint64_t bytes, const char *what,
				   const char *hint, int *fd, void **base);
/* The same with only the first `commit` bytes committed: the rest is
 * address space (ftruncate of a memfd is sparse), for its owner to commit
 * piece by piece (shm_memfd_commit) before it touches it. */
SHMRPC_HIDDEN int shm_memfd_create_sparse(const char *name, uint64_t bytes, uint64_t commit,
					  const char *what, const char *hint, int *fd,
					  void **base);
/* RAM plus swap, the most any memfd can ever hold committed. */
SHMRPC_HIDDEN uint64_t shm_machine_bytes(void);

#endif
