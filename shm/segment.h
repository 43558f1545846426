/*
 * The job segment: one memfd holding the header, the worker table, the
 * rings and the workers' flight recorders. The launcher creates it; workers attach through the inherited fd
 * named in SHMRPC_JOB_FD; inspectors attach read-only through
 * /proc/PID/fd/N of the launcher.
 */
#ifndef SHMRPC_SHM_SEGMENT_H
#define SHMRPC_SHM_SEGMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/compiler.h"
#include "common/ticks.h"
#include "shm/layout.h"

#define SHMRPC_ENV_JOB_FD "SHMRPC_JOB_FD"
/* The segment memfd's inode number: a process that inherited the variables
 * but not the descriptors (started with its fds closed) sees another file
 * at SHMRPC_JOB_FD, or none. */
#define SHMRPC_ENV_JOB_INO "SHMRPC_JOB_INO"

struct shm_seg {
	int fd;
	bool readonly;
	uint8_t *base;
	uint64_t size;
	struct shm_header *hdr;
	/* The layout as this process computed and checked it at attach; the
	 * accessors below use these copies, never the header's fields. */
	uint32_t world;
	uint32_t ring_size;
	uint64_t worker_off;
	uint64_t ring_ctl_off;
	uint64_t ring_data_off;
	uint64_t trace_off;
	uint32_t trace_records;
	uint64_t devmap_off;
	/* The header's trace_clock, checked, and its anchor. */
	uint32_t trace_clock;
	struct shmrpc_anchor trace_anchor;
};

struct shm_seg_params {
	uint32_t world_size;
	uint32_t ring_size; /* 0: chosen from world_size */
	uint32_t trace_records; /* flight-recorder records per worker; 0: chosen from world_size */
	uint32_t flags;     /* SHM_F_* */
	const char *job_name;
};

/* Creates, sizes, commits and seals a new segment (fd is close-on-exec). */
SHMRPC_HIDDEN int shm_seg_create(struct shm_seg *seg, const struct shm_seg_params *p);
/* Maps an existing segment and checks magic, version, size and layout. */
SHMRPC_HIDDEN int shm_seg_attach_fd(struct shm_seg *seg, int fd, bool readonly);
SHMRPC_HIDDEN int shm_seg_attach_path(struct shm_seg *seg, const char *path, bool readonly);
SHMRPC_HIDDEN int shm_seg_attach_env(struct shm_seg *seg);
/* Unmaps and closes. */
SHMRPC_HIDDEN void shm_seg_detach(struct shm_seg *seg);

/* The ring size picked when none is asked for (see docs/ARCHITECTURE.md). */
SHMRPC_HIDDEN uint32_t shm_default_ring_size(uint32_t world);
/* The flight-recorder length picked when none is asked for. */
SHMRPC_HIDDEN uint32_t shm_default_trace_records(uint32_t world);
/* Bytes a segment of this shape (default recorder) needs; 0 when the shape is invalid. */
SHMRPC_HIDDEN uint64_t shm_seg_bytes(uint32_t world, uint32_t ring_size);

static inline struct shm_worker *shm_worker(const struct shm_seg *seg, uint32_t rank)
{
	return (struct shm_worker *)(seg->base + seg->worker_off) + rank;
}

static inline uint32_t shm_ring_index(uint32_t world, uint32_t src, uint32_t dst)
{
	return src * (world - 1) + (dst < src ? dst : dst - 1);
}

static inline struct shm_devmap_head *shm_devmap_head(const struct shm_seg *seg, uint32_t rank)
{
	return (struct shm_devmap_head *)(seg->base + seg->devmap_off) + rank;
}

/* src's device map for dst. */
static inline struct shm_devmap_row *shm_devmap_row(const struct shm_seg *seg, uint32_t src,
						    uint32_t dst)
{
	return (struct shm_devmap_row *)(seg->base + seg->devmap_off +
					 seg->world * (uint64_t)sizeof(struct shm_devmap_head)) +
	       (uint64_t)src * seg->world + dst;
}

static inline struct shm_ring_ctl *shm_ring(const struct shm_seg *seg, uint32_t src, uint32_t dst)
{
	return (struct shm_ring_ctl *)(seg->base + seg->ring_ctl_off) +
	       shm_ring_index(seg->world, src, dst);
}

static inline uint8_t *shm_ring_data(const struct shm_seg *seg, uint32_t src, uint32_t dst)
{
	return seg->base + seg->ring_data_off +
	       (uint64_t)shm_ring_index(seg->world, src, dst) * seg->ring_size;
}

/* Rank's flight recorder: its lanes' control lines, then its records. */
static inline struct shm_trace_ctl *shm_trace(const struct shm_seg *seg, uint32_t rank)
{
	return (struct shm_trace_ctl *)(seg->base + seg->trace_off +
					rank * (shm_trace_lanes(seg->trace_records) *
							sizeof(struct shm_trace_ctl) +
						(uint64_t)seg->trace_records * sizeof(struct shm_trace_rec)));
}

static inline struct shm_trace_rec *shm_trace_recs(const struct shm_seg *seg, uint32_t rank)
{
	return (struct shm_trace_rec *)(shm_trace(seg, rank) + shm_trace_lanes(seg->trace_records));
}

/* A pointer to [off, off+len) inside the segment, or NULL if out of bounds. */
static inline void *shm_at(const struct shm_seg *seg, uint64_t off, uint64_t len)
{
	if (off > seg->size || len > seg->size - off)
		return NULL;
	return seg->base + off;
}

#endif
