/* The tensor pool in one process: blocks of many sizes, aligned and apart;
 * freed blocks are reused; references count; bad offsets, ranks and sizes
 * are refused with words and leave the pool as it was; exhaustion and a
 * full holder table are clear errors; a freed large block's pages are
 * punched out beyond the retain budget and kept within it; a non-pool fd
 * is refused at attach; the pool is empty again at the end. */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "tests/lib/testlib.h"

#define MiB (1ull << 20)

struct blk {
	uint64_t off, size;
};

static struct pool_stats stats(struct shm_pool *p)
{
	struct pool_stats st;

	pool_stats(p, &st);
	return st;
}

static void refused(int rc, int err, const char *text, const char *what)
{
	CHECK(rc == err, "%s: returned %d (%s), expected %d", what, rc, shmrpc_strerror(rc), err);
	CHECK(strstr(shmrpc_errmsg(), text), "%s: errmsg \"%s\" lacks \"%s\"", what, shmrpc_errmsg(),
	      text);
}

static void fill(struct shm_pool *p, const struct blk *b, uint8_t v)
{
	uint8_t *q = pool_at(p, b->off, b->size);

	CHECK(q, "block at %llu (%llu bytes) out of the pool", (unsigned long long)b->off,
	      (unsigned long long)b->size);
	memset(q, v, b->size);
}

static bool intact(struct shm_pool *p, const struct blk *b, uint8_t v)
{
	const uint8_t *q = pool_at(p, b->off, b->size);

	for (uint64_t i = 0; i < b->size; i++)
		if (q[i] != v)
			return false;
	return true;
}

static struct blk alloc(struct shm_pool *p, uint32_t rank, uint64_t bytes)
{
	struct blk b = { 0, bytes };
	int64_t cap;

	CHECK_OK(pool_alloc(p, rank, bytes, &b.off));
	cap = pool_block_size(p, b.off);
	CHECK(cap >= (int64_t)bytes && cap < 2 * (int64_t)bytes + 64,
	      "%llu bytes asked, block of %lld", (unsigned long long)bytes, (long long)cap);
	CHECK(b.off % 64 == 0, "offset %llu not 64-byte aligned", (unsigned long long)b.off);
	CHECK((uintptr_t)pool_at(p, b.off, 1) % 64 == 0, "pointer not 64-byte aligned");
	if (bytes > 2048)
		CHECK((uintptr_t)pool_at(p, b.off, 1) % 4096 == 0 && b.off % 4096 == 0,
		      "a %llu-byte block is not page aligned", (unsigned long long)bytes);
	return b;
}

/* Many sizes at once: aligned, apart (each keeps its fill), reused after free. */
static void test_sizes(struct shm_pool *p)
{
	static const uint64_t sizes[] = { 1, 8, 63, 64, 65, 100, 128, 1000, 2048, 2049, 4095,
					  4096, 4097, 10000, 65535, 65536, 65537, 200000, MiB,
					  3 * MiB + 5 };
	enum { N = sizeof(sizes) / sizeof(sizes[0]), ROUNDS = 4 };
	static struct blk b[N * ROUNDS + 2000];
	uint64_t x = 88172645463325252ull;
	size_t n = 0;

	for (int r = 0; r < ROUNDS; r++)
		for (size_t i = 0; i < N; i++)
			b[n++] = alloc(p, 0, sizes[i]);
	/* And many random small ones. */
	while (n < sizeof(b) / sizeof(b[0])) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		b[n++] = alloc(p, 0, 1 + x % 20000);
	}
	for (size_t i = 0; i < n; i++)
		fill(p, &b[i], (uint8_t)(i * 7 + 1));
	for (size_t i = 0; i < n; i++)
		CHECK(intact(p, &b[i], (uint8_t)(i * 7 + 1)), "block %zu (%llu bytes at %llu) "
		      "was overwritten: blocks overlap", i, (unsigned long long)b[i].size,
		      (unsigned long long)b[i].off);
	CHECK(stats(p).blocks_live == n, "%llu live blocks, %zu allocated",
	      (unsigned long long)stats(p).blocks_live, n);

	/* A freed block is the next one of its class handed out. */
	for (size_t i = 0; i < N; i++) {
		uint64_t off = b[i].off;

		CHECK_OK(pool_unref(p, 0, off));
		b[i] = alloc(p, 0, sizes[i]);
		CHECK(b[i].off == off, "a %llu-byte block was not reused after its free",
		      (unsigned long long)sizes[i]);
	}
	for (size_t i = 0; i < n; i++)
		CHECK_OK(pool_unref(p, 0, b[i].off));
	CHECK(stats(p).used == 0, "%llu bytes still in use", (unsigned long long)stats(p).used);
}

static void test_refs(struct shm_pool *p)
{
	struct blk b = alloc(p, 0, 5000);

	CHECK_OK(pool_ref(p, 1, b.off));
	CHECK_OK(pool_ref(p, 1, b.off));
	CHECK_OK(pool_ref(p, 0, b.off));
	CHECK(stats(p).refs_live == 4 && stats(p).refs_held == 4, "4 references expected");
	CHECK_OK(pool_unref(p, 0, b.off));
	CHECK_OK(pool_unref(p, 0, b.off));
	refused(pool_unref(p, 0, b.off), -EINVAL, "rank 0 holds no reference", "unref beyond held");
	CHECK_OK(pool_unref(p, 1, b.off));
	CHECK(pool_block_size(p, b.off) > 0, "freed while rank 1 holds a reference");
	CHECK_OK(pool_unref(p, 1, b.off));
	refused(pool_ref(p, 1, b.off), -EINVAL, "is free", "ref of a freed block");
	refused(pool_unref(p, 1, b.off), -EINVAL, "already free", "unref of a freed block");
	CHECK(stats(p).used == 0, "not freed after the last reference");
}

/* Every bad argument is refused and changes nothing. */
static void test_refusals(struct shm_pool *p)
{
	struct blk small = alloc(p, 0, 4096), large = alloc(p, 0, 300000);
	struct pool_stats before = stats(p), after;
	uint64_t o;

	refused(pool_ref(p, 0, 0), -EINVAL, "outside the tensor pool's data", "offset 0");
	refused(pool_ref(p, 0, p->data_off - 64), -EINVAL, "outside", "offset before the data");
	refused(pool_ref(p, 0, p->size), -EINVAL, "outside", "offset at the end");
	refused(pool_unref(p, 0, UINT64_MAX), -EINVAL, "outside", "offset 2^64-1");
	refused(pool_ref(p, 0, small.off + 64), -EINVAL, "not the start", "inside a small block");
	refused(pool_unref(p, 0, large.off + 4096), -EINVAL, "not the start", "inside a large block");
	refused(pool_ref(p, 0, large.off + 65536), -EINVAL, "not the start", "in a large block's run");
	refused(pool_ref(p, 0, p->size - 65536), -EINVAL, "not the start", "never carved");
	refused(pool_block_size(p, small.off + 1), -EINVAL, "not the start", "size of an interior");
	refused(pool_unref(p, 1, small.off), -EINVAL, "rank 1 holds no reference", "not held");
	refused(pool_ref(p, 9, small.off), -EINVAL, "outside the tensor pool's 4 workers", "rank 9");
	refused(pool_alloc(p, 2, 64, &o), -EINVAL, "rank 2 has not joined", "rank not joined");
	refused(pool_alloc(p, 0, 0, &o), -EINVAL, "0 bytes", "0 bytes");
	refused(pool_join(p, 0, 7), -EBUSY, "held by pid", "join a live rank");
	after = stats(p);
	CHECK(memcmp(&before, &after, sizeof(before)) == 0, "a refused call changed the pool");
	CHECK(pool_at(p, p->size - 8, 16) == NULL && pool_at(p, 0, 8) == NULL &&
	      pool_at(p, small.off, 4096) != NULL, "pool_at bounds");
	CHECK_OK(pool_unref(p, 0, small.off));
	CHECK_OK(pool_unref(p, 0, large.off));
}

/* Leaving drops what the rank still holds; a rank joins again only later. */
static void test_leave(struct shm_pool *p)
{
	struct blk a = alloc(p, 3, 100), b = alloc(p, 3, 200000);

	CHECK_OK(pool_ref(p, 3, a.off));
	CHECK_OK(pool_ref(p, 0, b.off));
	CHECK(pool_leave(p, 3) == 3, "leave should drop 3 references");
	CHECK(stats(p).used == (uint64_t)pool_block_size(p, b.off), "only b should stay live");
	CHECK(pool_sweep(p, 3, 1) == 0, "a second sweep dropped something");
	refused(pool_join(p, 3, 1), -EINVAL, "generation 1 was there before", "same generation");
	CHECK_OK(pool_join(p, 3, 2));
	CHECK_OK(pool_unref(p, 0, b.off));
	CHECK(stats(p).used == 0, "pool not empty");
}

static void test_exhaustion(void)
{
	struct pool_params pp = { .bytes = 2 * MiB, .world = 1, .holder_cap = 64 };
	struct shm_pool p;
	struct blk b[80];
	uint64_t o;
	size_t n = 0;
	int rc;

	CHECK_OK(pool_create(&p, &pp));
	CHECK_OK(pool_join(&p, 0, 1));
	b[n++] = alloc(&p, 0, MiB);
	refused(pool_alloc(&p, 0, 3ull << 30, &o), -ENOMEM,
		"tensor pool exhausted: asked 3 GiB (a 4 GiB block), pool 2 MiB, 1 MiB in use, "
		"largest free block 1 MiB", "3 GiB");
	refused(pool_alloc(&p, 0, MiB + 1, &o), -ENOMEM, "asked 1.0 MiB (a 2 MiB block)",
		"more than is free");
	/* Fill it up with 64 KiB blocks and write every byte: no SIGBUS. */
	while ((rc = pool_alloc(&p, 0, 65536, &b[n].off)) == 0) {
		b[n].size = 65536;
		fill(&p, &b[n], 0x5a);
		n++;
		CHECK(n < 40, "more than 2 MiB handed out");
	}
	refused(rc, -ENOMEM, "2 MiB in use, largest free block 0 B", "full");
	CHECK(n == 17, "%zu blocks in a 2 MiB pool", n);
	/* A small request when only the 1 MiB block is free splits it. */
	CHECK_OK(pool_unref(&p, 0, b[0].off));
	CHECK_OK(pool_alloc(&p, 0, 100, &o));
	CHECK(o >= b[0].off && o < b[0].off + MiB && pool_block_size(&p, o) == 128,
	      "a 100-byte block at %llu, size %lld: not carved from the free 1 MiB",
	      (unsigned long long)o, (long long)pool_block_size(&p, o));
	b[0].off = o;
	for (size_t i = 0; i < n; i++)
		CHECK_OK(pool_unref(&p, 0, b[i].off));
	CHECK(stats(&p).used == 0, "pool not empty");
	pool_detach(&p);
}

/* The holder table: 64 records, then a clear error and nothing changed. */
static void test_table(void)
{
	struct pool_params pp = { .bytes = 2 * MiB, .world = 1, .holder_cap = 64 };
	struct shm_pool p;
	struct blk b[80];
	size_t n;
	uint64_t o;
	int rc;

	CHECK_OK(pool_create(&p, &pp));
	CHECK_OK(pool_join(&p, 0, 1));
	for (n = 0; n < 40; n++)
		b[n] = alloc(&p, 0, 64);
	for (size_t i = 0; i < 24; i++)
		CHECK_OK(pool_ref(&p, 0, b[i].off)); /* one entry each still: counts add up */
	CHECK(stats(&p).refs_held == 64, "64 references held");
	while ((rc = pool_alloc(&p, 0, 64, &o)) == 0) {
		b[n++].off = o;
		CHECK(n <= 64, "more blocks held than the table has records");
	}
	refused(rc, -ENOSPC, "holder table is full (64 records)", "table full");
	CHECK(n == 64, "table full after %zu blocks", n);
	CHECK(stats(&p).blocks_live == 64, "a refused allocation left a block live");
	for (size_t i = 0; i < 24; i++)
		CHECK_OK(pool_unref(&p, 0, b[i].off));
	for (size_t i = 0; i < n; i++)
		CHECK_OK(pool_unref(&p, 0, b[i].off));
	CHECK(stats(&p).used == 0 && stats(&p).refs_held == 0, "pool not empty");
	pool_detach(&p);
}

/* Bytes of the pool's memfd that hold pages. */
static uint64_t committed(struct shm_pool *p)
{
	struct stat st;

	CHECK(fstat(p->fd, &st) == 0, "fstat of the pool");
	return (uint64_t)st.st_blocks * 512;
}

/* A 16 MiB block, written and freed, in a 64 MiB pool that keeps retain
 * bytes committed (0: the default, an eighth): punched out beyond the
 * budget; kept within it, and the next such block reuses its pages. */
static void retain_case(uint64_t retain, uint64_t expect_retain, bool kept)
{
	struct pool_params pp = { .bytes = 64 * MiB, .world = 1, .holder_cap = 64,
				  .retain = retain };
	struct shm_pool p;
	struct blk b;
	uint64_t base, during, after;

	CHECK_OK(pool_create(&p, &pp));
	CHECK(p.retain == expect_retain && p.hdr->retain == expect_retain,
	      "retain %llu asked: budget %llu (header %llu), expected %llu",
	      (unsigned long long)retain, (unsigned long long)p.retain,
	      (unsigned long long)p.hdr->retain, (unsigned long long)expect_retain);
	CHECK_OK(pool_join(&p, 0, 1));
	base = committed(&p);
	b = alloc(&p, 0, 16 * MiB);
	fill(&p, &b, 0x3c);
	during = committed(&p);
	CHECK(during >= base + 16 * MiB, "a 16 MiB block in use: %llu bytes committed, %llu before",
	      (unsigned long long)during, (unsigned long long)base);
	CHECK_OK(pool_unref(&p, 0, b.off));
	after = committed(&p);
	if (!kept) {
		CHECK(after < base + 16 * MiB, "retain %llu: the freed 16 MiB block stayed "
		      "committed (%llu bytes, %llu before it)", (unsigned long long)retain,
		      (unsigned long long)after, (unsigned long long)base);
	} else {
		CHECK(after == during, "retain %llu: the freed 16 MiB block was given back "
		      "(%llu bytes committed, %llu with it)", (unsigned long long)retain,
		      (unsigned long long)after, (unsigned long long)during);
		b = alloc(&p, 0, 16 * MiB);
		CHECK(intact(&p, &b, 0x3c) && committed(&p) == during,
		      "the next 16 MiB block did not reuse the kept pages (%llu bytes committed)",
		      (unsigned long long)committed(&p));
		CHECK_OK(pool_unref(&p, 0, b.off));
	}
	CHECK(stats(&p).used == 0, "pool not empty");
	pool_detach(&p);
}

static void test_retain(void)
{
	retain_case(0, 8 * MiB, false);
	retain_case(64 * MiB, 64 * MiB, true);
	retain_case(1ull << 40, 64 * MiB, true); /* the data bytes at most */
}

static int memfd_with(const void *bytes, size_t len, size_t size)
{
	int fd = memfd_create("not-a-pool", MFD_CLOEXEC);

	CHECK(fd >= 0, "memfd_create");
	CHECK(ftruncate(fd, (off_t)size) == 0, "ftruncate");
	CHECK(pwrite(fd, bytes, len, 0) == (ssize_t)len, "pwrite");
	return fd;
}

static void attach_refused(int fd, int err, const char *text, const char *what)
{
	struct shm_pool p;

	refused(pool_attach_fd(&p, fd, false), err, text, what);
	CHECK(p.base == NULL, "%s: mapped anyway", what);
	close(fd);
}

static void test_attach(struct shm_pool *good)
{
	struct pool_header h = *good->hdr;
	struct pool_params huge = { .bytes = 1ull << 45, .world = 1 };
	struct shm_pool p;
	struct blk b;
	int fd;

	attach_refused(memfd_with(&h, 0, 0), -SHMRPC_EBADSEG, "bad magic", "empty file");
	h.magic ^= 1;
	attach_refused(memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG,
		       "not a shmrpc tensor pool (bad magic)", "wrong magic");
	h = *good->hdr;
	h.format_version = POOL_FORMAT_VERSION + 1;
	{
		char text[96];

		snprintf(text, sizeof(text), "tensor pool format %u, this library reads format %u",
			 POOL_FORMAT_VERSION + 1, POOL_FORMAT_VERSION);
		attach_refused(memfd_with(&h, sizeof(h), good->size), -SHMRPC_EVERSION, text,
			       "newer format");
	}
	h = *good->hdr;
	attach_refused(memfd_with(&h, sizeof(h), good->size - 4096), -SHMRPC_ETRUNC,
		       "tensor pool truncated", "short file");
	attach_refused(memfd_with(&h, 64, 64), -SHMRPC_ETRUNC, "header alone", "header cut");
	h.meta_off += 64;
	attach_refused(memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG, "inconsistent",
		       "moved records");
	h = *good->hdr;
	h.retain = h.data_size + 1;
	attach_refused(memfd_with(&h, sizeof(h), good->size), -SHMRPC_EBADSEG, "inconsistent",
		       "retain beyond the data");

	/* A second mapping of the same pool sees the same blocks. */
	fd = dup(good->fd);
	CHECK(fd >= 0, "dup");
	CHECK_OK(pool_attach_fd(&p, fd, false));
	b = alloc(good, 0, 1000);
	fill(good, &b, 0xa5);
	CHECK(intact(&p, &b, 0xa5), "second mapping sees other bytes");
	CHECK_OK(pool_unref(&p, 0, b.off));
	CHECK(stats(good).used == 0, "free through the second mapping not seen");
	pool_detach(&p);

	refused(pool_create(&p, &huge), -ENOMEM, "cannot commit", "32 TiB pool");
	CHECK(strstr(shmrpc_errmsg(), "32 TiB of tensor data asked"), "size not named: %s",
	      shmrpc_errmsg());
}

int main(void)
{
	struct pool_params pp = { .bytes = 256 * MiB, .world = 4, .holder_cap = 8192 };
	struct shm_pool p;
	struct pool_stats st;

	CHECK(pool_total_bytes(&pp) > pp.bytes, "total must include the records");
	CHECK_OK(pool_create(&p, &pp));
	CHECK_OK(pool_join(&p, 0, 1));
	CHECK_OK(pool_join(&p, 1, 1));
	CHECK_OK(pool_join(&p, 3, 1));
	test_sizes(&p);
	test_refs(&p);
	test_refusals(&p);
	test_leave(&p);
	test_attach(&p);
	test_exhaustion();
	test_table();
	test_retain();
	st = stats(&p);
	CHECK(st.used == 0 && st.refs_live == 0 && st.refs_held == 0 && st.lost == 0 &&
	      st.free_listed == st.carved && st.free == st.size,
	      "pool not back to empty: used %llu, lost %llu, listed %llu of %llu carved",
	      (unsigned long long)st.used, (unsigned long long)st.lost,
	      (unsigned long long)st.free_listed, (unsigned long long)st.carved);
	pool_detach(&p);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
