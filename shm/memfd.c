/* Committed, sealed memfds; see memfd.h. */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "common/error.h"
#include "shm/memfd.h"

/* RAM plus swap: no memfd larger than this can ever be committed. A memfd
 * has no size limit of its own: fallocate beyond it does not fail, it runs
 * the OOM killer on other processes. */
uint64_t shm_machine_bytes(void)
{
	struct sysinfo si;

	if (sysinfo(&si) < 0)
		return UINT64_MAX;
	return ((uint64_t)si.totalram + si.totalswap) * si.mem_unit;
}

int shm_memfd_create(const char *name, uint64_t bytes, const char *what, const char *hint, int *fd,
		     void **base)
{
	return shm_memfd_create_sparse(name, bytes, bytes, what, hint, fd, base);
}

int shm_memfd_create_sparse(const char *name, uint64_t bytes, uint64_t commit, const char *what,
			    const char *hint, int *fd, void **base)
{
	const char *step = "memfd_create";
	int err, f = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	void *m;

	if (f < 0)
		return shmrpc__fail(-errno, "cannot create %s: memfd_create: %s", what, strerror(errno));
	if (fchmod(f, 0600) < 0 || ftruncate(f, (off_t)bytes) < 0) {
		err = errno;
		step = "ftruncate";
		goto fail;
	}
	err = commit > shm_machine_bytes() ? ENOMEM : posix_fallocate(f, 0, (off_t)commit);
	if (err) {
		close(f);
		return shmrpc__fail(-err, "cannot commit %llu bytes for %s: %s; free memory or "
				    "/dev/shm space, or pass a smaller %s",
				    (unsigned long long)commit, what, strerror(err), hint);
	}
	if (fcntl(f, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		err = errno;
		step = "sealing";
		goto fail;
	}
	m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
	if (m == MAP_FAILED) {
		err = errno;
		step = "mmap";
		goto fail;
	}
	*fd = f;
	*base = m;
	return 0;
fail:
	close(f);
	return shmrpc__fail(-err, "cannot create %s: %s: %s", what, step, strerror(err));
}
