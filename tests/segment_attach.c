/* Attaching refuses what is not a whole segment of our format, each case
 * with its own code and words; a read-only attach through /proc/PID/fd/N
 * maps read-only; an impossible size fails at creation naming the bytes. */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/segment.h"
#include "tests/lib/testlib.h"

/* A memfd holding bytes [0, len) then zeros up to size. */
static int memfd_with(const void *bytes, size_t len, size_t size)
{
	int fd = memfd_create("not-a-segment", MFD_CLOEXEC);

	CHECK(fd >= 0, "memfd_create");
	CHECK(ftruncate(fd, (off_t)size) == 0, "ftruncate");
	CHECK(pwrite(fd, bytes, len, 0) == (ssize_t)len, "pwrite");
	return fd;
}

static void refused(const char *what, int fd, int err, const char *text)
{
	struct shm_seg seg;
	int rc = shm_seg_attach_fd(&seg, fd, false);

	CHECK(rc == err, "%s: attach returned %d (%s), expected %d", what, rc, shmrpc_strerror(rc),
	      err);
	CHECK(strstr(shmrpc_errmsg(), text), "%s: errmsg \"%s\" lacks \"%s\"", what, shmrpc_errmsg(),
	      text);
	CHECK(seg.base == NULL, "%s: mapped anyway", what);
	close(fd);
}

static void test_refusals(const struct shm_seg *good)
{
	struct shm_header h = *good->hdr;
	static uint8_t junk[8192];
	uint64_t x = 0x9e3779b97f4a7c15ull;
	char text[128];

	for (size_t i = 0; i < sizeof(junk); i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		junk[i] = (uint8_t)x;
	}
	refused("random bytes", memfd_with(junk, sizeof(junk), sizeof(junk)), -SHMRPC_EBADSEG,
		"not a shmrpc segment");
	refused("empty file", memfd_with(junk, 0, 0), -SHMRPC_EBADSEG, "not a shmrpc segment");

	h.magic ^= 1;
	refused("wrong magic", memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG,
		"not a shmrpc segment (bad magic)");

	h = *good->hdr;
	h.format_version = SHM_FORMAT_VERSION + 1;
	snprintf(text, sizeof(text), "segment format %u, this library reads format %u",
		 SHM_FORMAT_VERSION + 1, SHM_FORMAT_VERSION);
	refused("newer format", memfd_with(&h, sizeof(h), good->size), -SHMRPC_EVERSION, text);

	h = *good->hdr;
	snprintf(text, sizeof(text), "segment truncated: %zu bytes, header says %llu", sizeof(h),
		 (unsigned long long)good->size);
	refused("header only", memfd_with(&h, sizeof(h), sizeof(h)), -SHMRPC_ETRUNC, text);
	refused("half a header", memfd_with(&h, sizeof(h) / 2, sizeof(h) / 2), -SHMRPC_ETRUNC,
		"header alone is 4096");

	h.world_size++;
	refused("inconsistent layout", memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG,
		"header layout is inconsistent (world 3");

	/* The recorder's clock picks how readers turn times into ns. */
	h = *good->hdr;
	h.trace_clock = SHM_TRACE_CLOCK_TICKS + 1;
	refused("unknown trace clock", memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG,
		"header layout is inconsistent");
}

/* The permissions /proc/self/maps shows for the mapping that starts at p. */
static void map_perms(const void *p, char perms[5])
{
	FILE *f = fopen("/proc/self/maps", "r");
	unsigned long start, end;
	char line[512];
	bool found = false;

	CHECK(f, "cannot open /proc/self/maps");
	while (!found && fgets(line, sizeof(line), f))
		found = sscanf(line, "%lx-%lx %4s", &start, &end, perms) == 3 &&
			start == (unsigned long)p;
	fclose(f);
	CHECK(found, "no mapping at %p in /proc/self/maps", p);
}

static void test_readonly(struct shm_seg *rw)
{
	struct shm_seg ro;
	char path[64], perms[5];
	uint8_t *data;

	/* What an inspector does: the launcher's fd, through /proc. */
	snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)getpid(), rw->fd);
	CHECK_OK(shm_seg_attach_path(&ro, path, true));
	CHECK(ro.readonly && !rw->readonly, "readonly flags %d %d", ro.readonly, rw->readonly);
	CHECK(ro.world == rw->world && ro.ring_size == rw->ring_size && ro.size == rw->size &&
		      ro.ring_data_off == rw->ring_data_off && ro.trace_clock == rw->trace_clock &&
		      ro.trace_anchor.ticks == rw->trace_anchor.ticks &&
		      ro.trace_anchor.ns == rw->trace_anchor.ns,
	      "read-only attach sees another layout");
	map_perms(ro.base, perms);
	CHECK(!strcmp(perms, "r--s"), "read-only mapping is %s", perms);
	map_perms(rw->base, perms);
	CHECK(!strcmp(perms, "rw-s"), "writable mapping is %s", perms);
	/* Same memory: a write through the creator shows through the inspector. */
	data = shm_ring_data(rw, 1, 0);
	data[5] = 0xa5;
	CHECK(shm_ring_data(&ro, 1, 0)[5] == 0xa5, "read-only view does not share memory");
	shm_seg_detach(&ro);
	CHECK(ro.base == NULL && ro.fd == -1, "detach left state");
}

static void test_create_limits(void)
{
	struct shm_seg_params huge = { .world_size = SHM_MAX_WORLD, .ring_size = SHM_RING_MAX };
	struct shm_seg_params odd = { .world_size = 2, .ring_size = 5000 };
	struct shm_seg seg;
	char text[64];
	int rc;

	/* About 64 TiB: more than any machine here holds. */
	rc = shm_seg_create(&seg, &huge);
	CHECK(rc == -ENOMEM, "creating %llu bytes returned %d (%s)",
	      (unsigned long long)shm_seg_bytes(SHM_MAX_WORLD, SHM_RING_MAX), rc, shmrpc_errmsg());
	snprintf(text, sizeof(text), "cannot commit %llu bytes",
		 (unsigned long long)shm_seg_bytes(SHM_MAX_WORLD, SHM_RING_MAX));
	CHECK(strstr(shmrpc_errmsg(), text), "errmsg \"%s\" lacks \"%s\"", shmrpc_errmsg(), text);
	CHECK(seg.base == NULL && seg.fd == -1, "failed create left state");

	rc = shm_seg_create(&seg, &odd);
	CHECK(rc == -EINVAL && strstr(shmrpc_errmsg(), "with 5000-byte rings"),
	      "ring of 5000 bytes: %d (%s)", rc, shmrpc_errmsg());
}

int main(void)
{
	struct shm_seg_params sp = { .world_size = 2 };
	struct shm_seg seg;

	CHECK_OK(shm_seg_create(&seg, &sp));
	test_refusals(&seg);
	test_readonly(&seg);
	test_create_limits();
	shm_seg_detach(&seg);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
