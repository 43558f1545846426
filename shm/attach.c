/*
 * The attach prologue of the job's files (attach.h). A file another
 * process made is read with pread first and mapped only once its header
 * holds together, so that a wrong fd, an older build's file or a cut one
 * is a sentence, never a fault in a mapping.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/error.h"
#include "shm/attach.h"

int shm_attach_header(int fd, const struct shm_file_kind *k, void *hdr, uint64_t *file_size)
{
	struct shm_file_head head;
	struct stat st;
	ssize_t n;

	if (fstat(fd, &st) < 0)
		return shmrpc__fail(-errno, "cannot attach to the %s on fd %d: %s", k->what, fd,
				    strerror(errno));
	memset(hdr, 0, k->header_size);
	n = pread(fd, hdr, k->header_size, 0);
	if (n < 0)
		return shmrpc__fail(-errno, "cannot read the %s header: %s", k->what,
				    strerror(errno));
	memcpy(&head, hdr, sizeof(head));
	if ((size_t)n < offsetof(struct shm_file_head, header_size) || head.magic != k->magic)
		return shmrpc__fail(-SHMRPC_EBADSEG, "not a shmrpc %s (bad magic)", k->what);
	if (head.format_version != k->version)
		return shmrpc__fail(-SHMRPC_EVERSION,
				    "%s format %u, this library reads format %u: run the job and "
				    "its tools from the same shmrpc build",
				    k->what, head.format_version, k->version);
	if ((size_t)n < k->header_size || (uint64_t)st.st_size < k->header_size)
		return shmrpc__fail(-SHMRPC_ETRUNC, "%s truncated: %lld bytes, header alone is %u",
				    k->what, (long long)st.st_size, k->header_size);
	if (head.header_size != k->header_size)
		return shm_attach_inconsistent(k, "header of %u bytes, this library's is %u",
					       head.header_size, k->header_size);
	*file_size = (uint64_t)st.st_size;
	return 0;
}

int shm_attach_inconsistent(const struct shm_file_kind *k, const char *fmt, ...)
{
	char detail[160];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(detail, sizeof(detail), fmt, ap);
	va_end(ap);
	return shmrpc__fail(-SHMRPC_EBADSEG, "not a shmrpc %s: header layout is inconsistent (%s)",
			    k->what, detail);
}

int shm_attach_map(int fd, const struct shm_file_kind *k, uint64_t total, uint64_t file_size,
		   bool readonly, uint8_t **base)
{
	void *m;

	if (file_size < total)
		return shmrpc__fail(-SHMRPC_ETRUNC, "%s truncated: %" PRIu64 " bytes, header says %"
				    PRIu64, k->what, file_size, total);
	if (total > SIZE_MAX)
		return shm_attach_inconsistent(k, "%" PRIu64 " bytes", total);
	m = mmap(NULL, (size_t)total, readonly ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED,
		 fd, 0);
	if (m == MAP_FAILED)
		return shmrpc__fail(-errno, "cannot map the %s (%" PRIu64 " bytes): %s", k->what,
				    total, strerror(errno));
	*base = m;
	return 0;
}
