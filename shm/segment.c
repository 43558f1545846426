/*
 * Creating and attaching the job segment.
 *
 * The segment is a memfd: it has no name in /dev/shm, so nothing is left
 * behind whatever dies, and it goes away with the last fd and mapping.
 * Creation commits every page with fallocate() so that a full tmpfs or a
 * memory limit is an error here, with the size asked for, and never a
 * SIGBUS later; the size is then sealed so no process can shrink it under
 * the others.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "shm/attach.h"
#include "shm/memfd.h"
#include "shm/segment.h"

struct shm_shape {
	uint64_t worker_off, ring_ctl_off, ring_data_off, trace_off, devmap_off, total;
};

static uint64_t align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) & ~(a - 1);
}

static bool is_pow2(uint32_t v)
{
	return v && !(v & (v - 1));
}

/* The one place where the layout is computed, by creator and attacher alike. */
static bool shm_shape(uint32_t world, uint32_t ring_size, uint32_t trace_records,
		      struct shm_shape *s)
{
	uint64_t nrings;

	if (world < 1 || world > SHM_MAX_WORLD || !is_pow2(ring_size) ||
	    ring_size < SHM_RING_MIN || ring_size > SHM_RING_MAX || !is_pow2(trace_records) ||
	    trace_records < SHM_TRACE_MIN || trace_records > SHM_TRACE_MAX)
		return false;
	nrings = (uint64_t)world * (world - 1);
	s->worker_off = sizeof(struct shm_header);
	s->ring_ctl_off = align_up(s->worker_off + world * (uint64_t)sizeof(struct shm_worker),
				   SHMRPC_CACHELINE);
	s->ring_data_off = align_up(s->ring_ctl_off + nrings * sizeof(struct shm_ring_ctl), SHM_PAGE);
	s->trace_off = align_up(s->ring_data_off + nrings * ring_size, SHM_PAGE);
	s->devmap_off = align_up(s->trace_off + world * (shm_trace_lanes(trace_records) *
								 sizeof(struct shm_trace_ctl) +
							 (uint64_t)trace_records *
								 sizeof(struct shm_trace_rec)),
				 SHM_PAGE);
	s->total = align_up(s->devmap_off + world * (sizeof(struct shm_devmap_head) +
						     world * (uint64_t)sizeof(struct shm_devmap_row)),
			    SHM_PAGE);
	return true;
}

uint32_t shm_default_ring_size(uint32_t world)
{
	/* 64 KiB per ring while the rings stay under 64 MiB in all, smaller
	 * beyond (16 KiB at 64 workers); never below SHM_RING_MIN. */
	const uint64_t budget = 64ull << 20;
	uint64_t nrings = world > 1 ? (uint64_t)world * (world - 1) : 1;
	uint32_t size = 64u * 1024u;

	while (size > SHM_RING_MIN && nrings * size > budget)
		size >>= 1;
	return size;
}

uint32_t shm_default_trace_records(uint32_t world)
{
	/* 4096 records (128 KiB) per worker while the recorders stay under
	 * 32 MiB in all, i.e. up to 256 workers; fewer beyond (1024 at 1024). */
	const uint64_t budget = 32ull << 20;
	uint32_t n = 4096;

	while (n > SHM_TRACE_MIN && (uint64_t)world * n * sizeof(struct shm_trace_rec) > budget)
		n >>= 1;
	return n;
}

uint64_t shm_seg_bytes(uint32_t world, uint32_t ring_size)
{
	struct shm_shape s;

	return shm_shape(world, ring_size, shm_default_trace_records(world), &s) ? s.total : 0;
}

static void seg_fill(struct shm_seg *seg, const struct shm_shape *s, uint32_t world,
		     uint32_t ring_size, uint32_t trace_records)
{
	seg->hdr = (struct shm_header *)seg->base;
	seg->world = world;
	seg->ring_size = ring_size;
	seg->worker_off = s->worker_off;
	seg->ring_ctl_off = s->ring_ctl_off;
	seg->ring_data_off = s->ring_data_off;
	seg->trace_off = s->trace_off;
	seg->trace_records = trace_records;
	seg->devmap_off = s->devmap_off;
}

int shm_seg_create(struct shm_seg *seg, const struct shm_seg_params *p)
{
	uint32_t ring_size = p->ring_size ? p->ring_size : shm_default_ring_size(p->world_size);
	uint32_t trace_records = p->trace_records ? p->trace_records
						  : shm_default_trace_records(p->world_size);
	struct shm_shape s;
	struct shm_header *h;
	char what[96];
	void *mem;
	int fd, err;

	memset(seg, 0, sizeof(*seg));
	seg->fd = -1;
	if (!shm_shape(p->world_size, ring_size, trace_records, &s))
		return shmrpc__fail(-EINVAL,
				    "cannot create a job segment for %u workers with %u-byte rings "
				    "and %u trace records: world size must be 1..%u, ring size a "
				    "power of two in %u..%u, trace records a power of two in %u..%u",
				    p->world_size, ring_size, trace_records, SHM_MAX_WORLD, SHM_RING_MIN,
				    SHM_RING_MAX, SHM_TRACE_MIN, SHM_TRACE_MAX);

	snprintf(what, sizeof(what), "the job segment (%u workers, %u-byte rings)", p->world_size,
		 ring_size);
	err = shm_memfd_create("shmrpc-job", s.total, what, "--ring-size", &fd, &mem);
	if (err)
		return err;
	seg->base = mem;
	seg->fd = fd;
	seg->size = s.total;
	seg_fill(seg, &s, p->world_size, ring_size, trace_records);

	h = seg->hdr;
	h->magic = SHM_MAGIC;
	h->format_version = SHM_FORMAT_VERSION;
	h->header_size = sizeof(*h);
	h->total_size = s.total;
	h->world_size = p->world_size;
	h->flags = p->flags;
	h->created_ns = shmrpc_realtime_ns();
	h->launcher_pid = (uint32_t)getpid();
	h->ring_size = ring_size;
	h->worker_off = s.worker_off;
	h->ring_ctl_off = s.ring_ctl_off;
	h->ring_data_off = s.ring_data_off;
	h->worker_size = sizeof(struct shm_worker);
	h->ring_ctl_size = sizeof(struct shm_ring_ctl);
	snprintf(h->job_name, sizeof(h->job_name), "%s", p->job_name ? p->job_name : "shmrpc");
	h->trace_off = s.trace_off;
	h->trace_records = trace_records;
	h->trace_rec_size = sizeof(struct shm_trace_rec);
	h->devmap_off = s.devmap_off;
	if (shmrpc_ticks_usable()) {
		seg->trace_anchor = shmrpc_anchor_now();
		h->trace_clock = seg->trace_clock = SHM_TRACE_CLOCK_TICKS;
		h->trace_anchor_ticks = seg->trace_anchor.ticks;
		h->trace_anchor_ns = seg->trace_anchor.ns;
	}

	for (uint32_t src = 0; src < p->world_size; src++) {
		for (uint32_t dst = 0; dst < p->world_size; dst++) {
			struct shm_ring_ctl *c;

			if (src == dst)
				continue;
			c = shm_ring(seg, src, dst);
			c->data_off = (uint64_t)(shm_ring_data(seg, src, dst) - seg->base);
			c->size = ring_size;
			c->src = (uint16_t)src;
			c->dst = (uint16_t)dst;
		}
	}
	return 0;
}

static const struct shm_file_kind seg_kind = { "segment", SHM_MAGIC, SHM_FORMAT_VERSION,
						sizeof(struct shm_header) };

int shm_seg_attach_fd(struct shm_seg *seg, int fd, bool readonly)
{
	struct shm_header h;
	struct shm_shape s;
	uint64_t file_size;
	int err;

	memset(seg, 0, sizeof(*seg));
	seg->fd = -1;
	if ((err = shm_attach_header(fd, &seg_kind, &h, &file_size)))
		return err;
	if (h.worker_size != sizeof(struct shm_worker) ||
	    h.ring_ctl_size != sizeof(struct shm_ring_ctl) ||
	    h.trace_rec_size != sizeof(struct shm_trace_rec) ||
	    !shm_shape(h.world_size, h.ring_size, h.trace_records, &s) || s.total != h.total_size ||
	    s.worker_off != h.worker_off || s.ring_ctl_off != h.ring_ctl_off ||
	    s.ring_data_off != h.ring_data_off || s.trace_off != h.trace_off ||
	    s.devmap_off != h.devmap_off || h.trace_clock > SHM_TRACE_CLOCK_TICKS)
		return shm_attach_inconsistent(&seg_kind, "world %u, ring size %u, total %llu",
					       h.world_size, h.ring_size,
					       (unsigned long long)h.total_size);
	if ((err = shm_attach_map(fd, &seg_kind, h.total_size, file_size, readonly, &seg->base)))
		return err;
	seg->fd = fd;
	seg->readonly = readonly;
	seg->size = h.total_size;
	seg_fill(seg, &s, h.world_size, h.ring_size, h.trace_records);
	seg->trace_clock = h.trace_clock;
	seg->trace_anchor = (struct shmrpc_anchor){ h.trace_anchor_ticks, h.trace_anchor_ns };
	return 0;
}

int shm_seg_attach_path(struct shm_seg *seg, const char *path, bool readonly)
{
	int fd = open(path, (readonly ? O_RDONLY : O_RDWR) | O_CLOEXEC);
	int err;

	if (fd < 0)
		return shmrpc__fail(-errno, "cannot open %s: %s", path, strerror(errno));
	err = shm_seg_attach_fd(seg, fd, readonly);
	if (err)
		close(fd);
	return err;
}

int shm_seg_attach_env(struct shm_seg *seg)
{
	const char *v = getenv(SHMRPC_ENV_JOB_FD);
	char *end;
	long fd;
	int err;

	if (!v || !*v)
		return shmrpc__fail(-ENOENT, "%s is not set: start this program with shmrun",
				    SHMRPC_ENV_JOB_FD);
	fd = strtol(v, &end, 10);
	if (*end || fd < 0 || fd > 1 << 20)
		return shmrpc__fail(-EINVAL, "%s=%s is not a file descriptor", SHMRPC_ENV_JOB_FD, v);
	err = shm_seg_attach_fd(seg, (int)fd, false);
	if (err == -EBADF)
		return shmrpc__fail(err, "%s=%ld is not open in this process: was it started by shmrun?",
				    SHMRPC_ENV_JOB_FD, fd);
	if (err == 0)
		(void)fcntl((int)fd, F_SETFD, FD_CLOEXEC); /* programs we exec need not inherit it */
	return err;
}

void shm_seg_detach(struct shm_seg *seg)
{
	if (seg->base)
		munmap(seg->base, seg->size);
	if (seg->fd >= 0)
		close(seg->fd);
	seg->base = NULL;
	seg->hdr = NULL;
	seg->fd = -1;
}
