/*
 * Two processes share device memory through CUDA IPC (cuda_export,
 * cuda_import). Skips (77) without a GPU.
 *  - 1 MiB, 64 MiB and 1 GiB buffers (a size the GPU has no room for is
 *    skipped) filled by the producer are read in place by the consumer,
 *    which writes a word the producer then reads: nothing was copied.
 *  - Sending the same buffer again opens nothing: the consumer's mapping
 *    and the producer's handle come from the caches (stats); the consumer
 *    releases with keep, so that its idle mappings stay cached. The gauges
 *    count what is open: a mapping per buffer and at least one event on
 *    the consumer's side, a handle per buffer and at least one event on
 *    the producer's.
 *  - Ordering: the producer's stream is held by a host function while a
 *    write is queued behind it and exported; the consumer queues a read of
 *    that word on its own stream, sees the stream not done, lets the
 *    producer go, and reads the new value: its stream waited for the
 *    producer's write, and the host never did.
 *  - A descriptor that leaves its allocation fails; cuda_forget_peer
 *    closes the mapping and the events, the gauges back to 0 (the next
 *    import opens one of each again); the producer
 *    importing its own descriptor gets its own pointer.
 */
#include <errno.h>
#include <semaphore.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/cuda_leftovers.h"
#include "worker/cuda.h"
#include "tests/lib/testlib.h"

#ifdef __SANITIZE_ADDRESS__
/* The CUDA driver maps memory in the range ASan protects by default. */
const char *__asan_default_options(void);
const char *__asan_default_options(void)
{
	return "protect_shadow_gap=0";
}
#endif

#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_READY 600
#define CU_STREAM_NON_BLOCKING 1u

#define NSIZES 3
#define OFF 4096ull /* the tensor starts this far into its allocation */
#define REPEATS 4   /* sends of each buffer */
#define LATE 0x1a7e1a7eu

/* The driver functions the test drives the GPU with (cuda_sym). */
static struct {
	int (*DeviceGet)(int *dev, int ordinal);
	int (*DevicePrimaryCtxRetain)(void **ctx, int dev);
	int (*CtxSetCurrent)(void *ctx);
	int (*StreamCreate)(void **s, unsigned flags);
	int (*StreamDestroy)(void *s);
	int (*StreamSynchronize)(void *s);
	int (*StreamQuery)(void *s);
	int (*MemAlloc)(uint64_t *p, size_t n);
	int (*MemFree)(uint64_t p);
	int (*MemAllocHost)(void **p, size_t n);
	int (*MemFreeHost)(void *p);
	int (*MemcpyHtoDAsync)(uint64_t dst, const void *src, size_t n, void *s);
	int (*MemcpyDtoHAsync)(void *dst, uint64_t src, size_t n, void *s);
	int (*MemsetD32Async)(uint64_t dst, unsigned v, size_t n, void *s);
	int (*LaunchHostFunc)(void *s, void (*fn)(void *), void *arg);
} drv;

static void *stream;
static uint32_t *pinned; /* host words the copies go through */

#define LOAD(field, name)                                                         \
	do {                                                                      \
		drv.field = (typeof(drv.field))cuda_sym(name);                    \
		CHECK(drv.field, "libcuda.so.1 has no %s", name);                 \
	} while (0)

#define CU(call)                                                                  \
	do {                                                                      \
		int r_ = (call);                                                  \
		CHECK(r_ == 0, "%s: CUDA error %d", #call, r_);                   \
	} while (0)

enum op { OP_BUF, OP_SKIP, OP_WROTE, OP_GATED, OP_GO, OP_DONE };

struct msg {
	uint32_t op, arg;
	uint64_t val;
	struct cuda_ipc_desc d;
};

static const uint64_t sizes[NSIZES] = { 1ull << 20, 64ull << 20, 1ull << 30 };

static uint64_t tensor_len(int i)
{
	return sizes[i] - 2 * OFF;
}

/* Word offsets in a tensor of len bytes. */
static uint64_t mark_spot(uint64_t len, int k)
{
	const uint64_t at[3] = { 0, len / 2, len - 4 };

	return at[k] & ~3ull;
}

static uint64_t fill_spot(uint64_t len, int k)
{
	return (len / 4 * (uint64_t)(2 * k + 1)) & ~3ull; /* len/4, 3len/4 */
}

static uint64_t wrote_spot(uint64_t len)
{
	return (len / 3) & ~3ull;
}

static uint32_t fill(int i)
{
	return 0x5a5a0000u + (uint32_t)i;
}

static uint32_t mark(int i, int k)
{
	return 0xc0de0000u + (uint32_t)(i * 16 + k);
}

static uint32_t wrote(int i)
{
	return 0xfeed0000u + (uint32_t)i;
}

static void send_msg(int sock, const struct msg *m)
{
	CHECK(send(sock, m, sizeof(*m), MSG_NOSIGNAL) == (ssize_t)sizeof(*m), "send: %s", strerror(errno));
}

static struct msg recv_msg(int sock, enum op want)
{
	struct msg m;
	ssize_t n;

	do
		n = recv(sock, &m, sizeof(m), 0);
	while (n < 0 && errno == EINTR);
	CHECK(n == (ssize_t)sizeof(m), "recv: %zd (%s): the other side is gone", n, strerror(errno));
	CHECK(m.op == want || (want == OP_BUF && m.op == OP_SKIP), "message %u, expected %d", m.op, want);
	return m;
}

static void setup(void)
{
	void *ctx;
	int dev;

	CHECK_OK(cuda_probe());
	LOAD(DeviceGet, "cuDeviceGet");
	LOAD(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	LOAD(CtxSetCurrent, "cuCtxSetCurrent");
	LOAD(StreamCreate, "cuStreamCreate");
	LOAD(StreamDestroy, "cuStreamDestroy_v2");
	LOAD(StreamSynchronize, "cuStreamSynchronize");
	LOAD(StreamQuery, "cuStreamQuery");
	LOAD(MemAlloc, "cuMemAlloc_v2");
	LOAD(MemFree, "cuMemFree_v2");
	LOAD(MemAllocHost, "cuMemAllocHost_v2");
	LOAD(MemFreeHost, "cuMemFreeHost");
	LOAD(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
	LOAD(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
	LOAD(MemsetD32Async, "cuMemsetD32Async");
	LOAD(LaunchHostFunc, "cuLaunchHostFunc");
	CU(drv.DeviceGet(&dev, 0));
	CU(drv.DevicePrimaryCtxRetain(&ctx, dev));
	CU(drv.CtxSetCurrent(ctx));
	CU(drv.StreamCreate(&stream, CU_STREAM_NON_BLOCKING));
	CU(drv.MemAllocHost((void **)&pinned, 64));
}

static void teardown(void)
{
	CU(drv.MemFreeHost(pinned));
	CU(drv.StreamDestroy(stream));
}

/* One word through this process's stream, after what is queued there. */
static void write_word(uint64_t at, uint32_t v)
{
	pinned[0] = v;
	CU(drv.MemcpyHtoDAsync(at, pinned, 4, stream));
	CU(drv.StreamSynchronize(stream));
}

static uint32_t read_word(uint64_t at)
{
	CU(drv.MemcpyDtoHAsync(pinned, at, 4, stream));
	CU(drv.StreamSynchronize(stream));
	return pinned[0];
}

static uint64_t import(const struct cuda_ipc_desc *d)
{
	void *p = NULL;

	CHECK_OK(cuda_import(d, (uintptr_t)stream, &p, NULL));
	return (uintptr_t)p;
}

/* Holds the producer's stream until the consumer has queued its read. */
static void hold(void *gate)
{
	while (sem_wait(gate) < 0 && errno == EINTR)
		;
}

static void producer(int sock)
{
	uint64_t buf[NSIZES] = { 0 };
	struct cuda_stats st;
	struct msg m;
	uint64_t sent = 0;
	uint32_t allocated = 0;
	sem_t gate;

	setup();
	for (int i = 0; i < NSIZES; i++) {
		uint64_t len = tensor_len(i);
		int rc = drv.MemAlloc(&buf[i], sizes[i]);

		if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
			printf("%llu bytes do not fit on the GPU: skipped\n", (unsigned long long)sizes[i]);
			buf[i] = 0;
			send_msg(sock, &(struct msg){ .op = OP_SKIP, .arg = (uint32_t)i });
			continue;
		}
		CU(rc);
		allocated++;
		CU(drv.MemsetD32Async(buf[i] + OFF, fill(i), len / 4, stream));
		for (int k = 0; k < 3; k++)
			write_word(buf[i] + OFF + mark_spot(len, k), mark(i, k));
		for (int r = 0; r < REPEATS; r++) {
			m = (struct msg){ .op = OP_BUF, .arg = (uint32_t)i };
			CHECK_OK(cuda_export((void *)(uintptr_t)(buf[i] + OFF), len, (uintptr_t)stream, &m.d));
			CHECK(m.d.base == buf[i] && m.d.offset == OFF && m.d.len == len &&
			      m.d.pid == (uint32_t)getpid() && m.d.device == 0,
			      "descriptor: base 0x%llx (buffer 0x%llx), offset %llu, len %llu, pid %u, device %d",
			      (unsigned long long)m.d.base, (unsigned long long)buf[i],
			      (unsigned long long)m.d.offset, (unsigned long long)m.d.len, m.d.pid, m.d.device);
			send_msg(sock, &m);
			sent++;
		}
		/* Its own descriptor gives a process its own pointer back. */
		CHECK(import(&m.d) == buf[i] + OFF, "a self-import gave another address");
		cuda_import_release(&m.d, true);
		m = recv_msg(sock, OP_WROTE);
		CHECK(read_word(buf[i] + OFF + m.val) == wrote(i),
		      "the consumer's write at %llu is not in the producer's buffer of %llu bytes",
		      (unsigned long long)m.val, (unsigned long long)sizes[i]);
	}
	cuda_stats_get(&st);
	CHECK(st.exports == sent && st.handle_cache_hits == sent - sent / REPEATS,
	      "exports %llu, handle cache hits %llu, for %llu sends", (unsigned long long)st.exports,
	      (unsigned long long)st.handle_cache_hits, (unsigned long long)sent);
	CHECK(st.allocs_exported == allocated && st.events_exported >= 1 &&
	      st.events_exported <= sent, "%u allocations and %u events exported, for %u buffers "
	      "sent %llu times", st.allocs_exported, st.events_exported, allocated,
	      (unsigned long long)sent);

	CHECK(buf[0], "no room on the GPU for 1 MiB");
	CHECK(sem_init(&gate, 0, 0) == 0, "sem_init");
	CU(drv.LaunchHostFunc(stream, hold, &gate));
	CU(drv.MemsetD32Async(buf[0] + OFF, LATE, 1, stream));
	m = (struct msg){ .op = OP_GATED };
	CHECK_OK(cuda_export((void *)(uintptr_t)(buf[0] + OFF), 4, (uintptr_t)stream, &m.d));
	send_msg(sock, &m);
	recv_msg(sock, OP_GO);
	sem_post(&gate);
	CU(drv.StreamSynchronize(stream));
	sem_destroy(&gate);

	/* Keep every buffer until the consumer has closed its mappings. */
	recv_msg(sock, OP_DONE);
	for (int i = 0; i < NSIZES; i++)
		if (buf[i])
			CU(drv.MemFree(buf[i]));
	teardown();
}

static void consumer(int sock, pid_t producer_pid)
{
	struct cuda_stats before, after;
	struct cuda_ipc_desc bad;
	struct msg m;
	uint64_t p;
	uint32_t mapped = 0;
	void *q;

	setup();
	for (int i = 0; i < NSIZES; i++) {
		uint64_t len = tensor_len(i);

		m = recv_msg(sock, OP_BUF);
		if (m.op == OP_SKIP)
			continue;
		CHECK(m.arg == (uint32_t)i && m.d.pid == (uint32_t)producer_pid && m.d.len == len,
		      "buffer %u from pid %u, %llu bytes", m.arg, m.d.pid, (unsigned long long)m.d.len);
		cuda_stats_get(&before);
		p = import(&m.d);
		for (int k = 0; k < 3; k++)
			CHECK(read_word(p + mark_spot(len, k)) == mark(i, k), "mark %d of buffer %d", k, i);
		for (int k = 0; k < 2; k++)
			CHECK(read_word(p + fill_spot(len, k)) == fill(i), "fill %d of buffer %d", k, i);
		for (int r = 1; r < REPEATS; r++) {
			m = recv_msg(sock, OP_BUF);
			CHECK(import(&m.d) == p, "a repeated send gave another address");
		}
		cuda_stats_get(&after);
		/* Released below, each mapping stays open: the cache. */
		CHECK(after.maps_open == ++mapped && after.events_open >= 1,
		      "buffer %d: %u mappings and %u events open", i, after.maps_open, after.events_open);
		CHECK(after.opens == before.opens + 1 && after.cache_hits == before.cache_hits + REPEATS - 1,
		      "buffer %d: %llu opens, %llu cache hits for %d sends", i,
		      (unsigned long long)(after.opens - before.opens),
		      (unsigned long long)(after.cache_hits - before.cache_hits), REPEATS);
		for (int r = 0; r < REPEATS; r++)
			cuda_import_release(&m.d, true);
		write_word(p + wrote_spot(len), wrote(i));
		send_msg(sock, &(struct msg){ .op = OP_WROTE, .val = wrote_spot(len) });
	}

	m = recv_msg(sock, OP_GATED);
	cuda_stats_get(&before);
	p = import(&m.d);
	CU(drv.MemcpyDtoHAsync(pinned, p, 4, stream));
	CHECK(drv.StreamQuery(stream) == CUDA_ERROR_NOT_READY,
	      "the read ran while the producer's write was held back");
	send_msg(sock, &(struct msg){ .op = OP_GO });
	CU(drv.StreamSynchronize(stream));
	CHECK(pinned[0] == LATE, "read 0x%x before the producer's write of 0x%x", pinned[0], LATE);
	cuda_stats_get(&after);
	CHECK(after.opens == before.opens, "a warm import opened the allocation again");
	cuda_import_release(&m.d, true);

	bad = m.d;
	bad.len = 1ull << 40;
	q = NULL;
	CHECK(cuda_import(&bad, (uintptr_t)stream, &q, NULL) == -EINVAL && q == NULL &&
	      strstr(shmrpc_errmsg(), "leaves"), "a descriptor past its allocation: %s", shmrpc_errmsg());

	cuda_forget_peer((uint32_t)producer_pid);
	cuda_stats_get(&before);
	CHECK(before.maps_open == 0 && before.events_open == 0,
	      "%u mappings and %u events open after cuda_forget_peer", before.maps_open,
	      before.events_open);
	p = import(&m.d);
	cuda_stats_get(&after);
	CHECK(after.opens == before.opens + 1, "the mapping was not closed by cuda_forget_peer");
	CHECK(after.maps_open == 1 && after.events_open == 1, "%u mappings and %u events open "
	      "after one import", after.maps_open, after.events_open);
	CHECK(read_word(p) == LATE, "reopened mapping reads 0x%x", read_word(p));
	cuda_import_release(&m.d, true);
	cuda_forget_peer((uint32_t)producer_pid);
	teardown();
	send_msg(sock, &(struct msg){ .op = OP_DONE });
}

/* Waits for child pid; its exit status, or -1. The CUDA driver's files of
 * a child that ended without its atexit handlers (the probe's _exit) go
 * first, as shmrun's would (common/cuda_leftovers.h). */
static int reap(pid_t pid)
{
	siginfo_t si = { 0 };
	int status;

	if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) == 0)
		cuda_leftovers_remove(pid);
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return -1;
	return WEXITSTATUS(status);
}

int main(void)
{
	int sv[2], rc;
	pid_t pid, producer_pid;

	/* CUDA does not survive fork(): the probe runs in a child of its own,
	 * and this process never touches CUDA. */
	pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		rc = cuda_probe();
		if (rc)
			printf("skip: needs a GPU: %s\n", shmrpc_errmsg());
		fflush(stdout);
		_exit(rc ? TL_SKIP : 0);
	}
	rc = reap(pid);
	if (rc == TL_SKIP)
		return TL_SKIP;
	CHECK(rc == 0, "probe child exited with %d", rc);

	CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0, "socketpair: %s", strerror(errno));
	producer_pid = fork();
	CHECK(producer_pid >= 0, "fork");
	if (producer_pid == 0) {
		close(sv[1]);
		producer(sv[0]);
		exit(0);
	}
	pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		close(sv[0]);
		consumer(sv[1], producer_pid);
		exit(0);
	}
	close(sv[0]);
	close(sv[1]);
	CHECK(reap(producer_pid) == 0, "the producer failed");
	CHECK(reap(pid) == 0, "the consumer failed");
	return 0;
}
