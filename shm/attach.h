/*
 * What every attacher of the job's files (the job segment, the tensor
 * pool, the RRef table) does before it trusts a byte of them: one
 * prologue for the three. Each header begins with the same four fields
 * (struct shm_file_head); the rest of a header is its file's own, checked
 * by its attacher between the two steps here.
 */
#ifndef SHMRPC_SHM_ATTACH_H
#define SHMRPC_SHM_ATTACH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"

/* The fields every header starts with, in this order. */
struct shm_file_head {
	uint64_t magic;
	uint32_t format_version;
	uint32_t header_size;
	uint64_t total_size;
};

/* One kind of file: how its sentences name it and what its header holds. */
struct shm_file_kind {
	const char *what;     /* "segment", "tensor pool", "RRef table" */
	uint64_t magic;
	uint32_t version;
	uint32_t header_size; /* sizeof its header struct */
};

/*
 * Reads the header of the file at fd into hdr (k->header_size bytes) with
 * pread, never mapping what is not checked yet, and checks its magic, its
 * format version, its header_size and that the file holds the header.
 * *file_size: the file's size, for shm_attach_map. 0, or -errno with a
 * sentence naming the file's kind (SHMRPC_EBADSEG, EVERSION, ETRUNC).
 */
SHMRPC_HIDDEN int shm_attach_header(int fd, const struct shm_file_kind *k, void *hdr,
				    uint64_t *file_size);
/* The sentence for a header whose layout the attacher found inconsistent:
 * "not a shmrpc WHAT: header layout is inconsistent (DETAIL)". */
SHMRPC_HIDDEN int shm_attach_inconsistent(const struct shm_file_kind *k, const char *fmt, ...)
	SHMRPC_PRINTF(2, 3);
/* Once the layout is checked: maps its total bytes, shared, read-only or
 * read-write, after checking that the file holds them. */
SHMRPC_HIDDEN int shm_attach_map(int fd, const struct shm_file_kind *k, uint64_t total,
				 uint64_t file_size, bool readonly, uint8_t **base);

#endif
