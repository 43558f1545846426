/* Reporting a corrupt shared structure (corrupt.h). */
#include <stdarg.h>

#include "shmrpc.h"
#include "common/error.h"
#include "shm/corrupt.h"

const char *shm_corrupt_name(uint64_t bit)
{
	switch (bit) {
	case SHM_CORRUPT_POOL_RECORDS:
		return "the tensor pool's block records";
	case SHM_CORRUPT_POOL_CHUNKS:
		return "the tensor pool's chunk table";
	case SHM_CORRUPT_POOL_LISTS:
		return "the tensor pool's free lists";
	case SHM_CORRUPT_POOL_HOLDERS:
		return "the tensor pool's holder tables";
	case SHM_CORRUPT_RREF_ENTRIES:
		return "the RRef table's entries";
	case SHM_CORRUPT_RREF_COLLECT:
		return "the RRef table's collect lists";
	case SHM_CORRUPT_SLOTS:
		return "the worker slots";
	case SHM_CORRUPT_HEADER:
		return "the segment header";
	default:
		return "an unknown structure";
	}
}

int shm_corrupt(_Atomic uint64_t *note, _Atomic uint64_t *shared, uint64_t bit, const char *fmt,
		...)
{
	va_list ap;

	/* Relaxed: a flag that orders nothing; a reader that misses it still
	 * checks everything it reads. */
	if (note)
		atomic_fetch_or_explicit(note, bit, memory_order_relaxed);
	if (shared)
		atomic_fetch_or_explicit(shared, bit, memory_order_relaxed);
	va_start(ap, fmt);
	shmrpc__vfail(0, fmt, ap);
	va_end(ap);
	return -SHMRPC_ECORRUPT;
}
