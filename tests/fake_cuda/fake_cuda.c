/*
 * A stand-in for libcuda.so.1, for tests on machines without a GPU: the
 * driver entry points worker/cuda.c uses (and the few a test drives the
 * "GPU" with), with host memory playing device memory. Loaded by naming it
 * in SHMRPC_LIBCUDA (worker/cuda.h); never on a real GPU.
 *
 * It is as strict as the driver's documentation, so that code which only
 * works because a call happened to be synchronous fails here too:
 *
 * - Devices. FAKE_CUDA_DEVICES physical devices (1 to 16; 1 when unset).
 *   Each process sees them through CUDA_VISIBLE_DEVICES, as the driver
 *   does: "1,0" makes ordinal 0 the physical device 1, so one GPU has
 *   different ordinals in different processes; cuDeviceGetUuid tells the
 *   physical device. One primary context per ordinal. Contexts are a
 *   per-thread stack (push, pop, set); the calls that need a current
 *   context fail without one.
 * - Device memory. cuMemAlloc of less than 2 MiB is sub-allocated from a
 *   2 MiB block shared with its neighbours (as the driver may); larger
 *   ones get a block each. A block is a memfd named "fake-cuda:PID:ID".
 *   cuMemGetAddressRange on an allocation gives the allocation. An IPC
 *   memory handle names the block and the allocation's place in it;
 *   cuIpcOpenMemHandle maps the whole block, so that cuMemGetAddressRange
 *   on a mapping gives the block (what the driver gives there is not
 *   documented: code that guesses an allocation's size from it is wrong
 *   here). Opening a handle of the calling process fails, as the driver's.
 * - cuMemAllocAsync plays a memory pool's allocation (torch's
 *   cudaMallocAsync backend; expandable_segments' cuMemCreate is alike):
 *   device memory whose IPC handle cuIpcGetMemHandle refuses, as the
 *   driver does (pools share through other handles).
 * - Streams are asynchronous. Copies, memsets, event records and event
 *   waits are queued on their stream and run later, in order, on a
 *   thread of the fake that plays the GPU. 0 and CU_STREAM_LEGACY are the
 *   legacy default stream of the current context, CU_STREAM_PER_THREAD
 *   the calling thread's own default stream (a different stream on each
 *   thread). The legacy stream's implicit ordering with other streams is
 *   not played: code must order what it needs with events. A test may
 *   hold a stream (fakeCuStreamHold): its work does not run until let go,
 *   as a busy GPU's. cuMemFree and cuIpcCloseMemHandle of memory that
 *   queued work still uses abort the process with a message: the work
 *   would read or write memory that is gone.
 * - Events keep only their latest capture: cuStreamWaitEvent waits for
 *   the record made last before it was called, on whatever stream that
 *   was. An event's state lives in a shared table (a memfd named
 *   "fake-cuda-events:PID"), so that a process that opened another's
 *   event handle waits for that process's stream. Only events made with
 *   CU_EVENT_INTERPROCESS and CU_EVENT_DISABLE_TIMING have a handle;
 *   opening one of the calling process fails, as the driver's. A wait on
 *   an event of a process that died is let go (its GPU work died too).
 * - Streams and events are checked against the live ones: a destroyed or
 *   made-up handle fails.
 * - fakeCuAllocCount(): allocations of this process not yet freed
 *   (mappings not counted), for tests that check memory went back.
 * - fakeCuStreamWaits(s) / fakeCuStreamSyncs(s): how many
 *   cuStreamWaitEvent / cuStreamSynchronize calls stream s had (0,
 *   CU_STREAM_LEGACY and CU_STREAM_PER_THREAD each count as their own),
 *   for tests that check a consumer's stream was ordered, or drained.
 *
 * Values and layouts are the real driver's (cuda.h), as
 * worker/cuda_driver.h declares them for worker/cuda.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "worker/cuda_driver.h"

#define EXPORT __attribute__((visibility("default")))

/* The entry points are the driver's, whose prototypes are in the toolkit's
 * cuda.h, which is not on the include path (worker/cuda.c). */
#pragma GCC diagnostic ignored "-Wmissing-prototypes"

#define MEM_MAGIC 0x4d454d4b414b4146ull /* "FAKAKMEM" */
#define EVENT_MAGIC 0x5645454b414b4146ull
#define SMALL_BLOCK (2u << 20) /* what allocations under it share */
#define SUB_ALIGN 512u
#define EVENT_SLOTS 16384u
#define SYNC_LIMIT_NS (20ull * 1000000000ull) /* a sync that waits longer is a hang */

struct CUctx_st {
	int device; /* ordinal */
};

/* A memfd that holds one large allocation or several small ones. */
struct block {
	struct block *next;
	int fd;
	void *at;
	size_t size, used;
	unsigned live; /* allocations in it not yet freed */
	unsigned long long id;
	int device;
};

struct alloc {
	struct alloc *next;
	/* What cuMemGetAddressRange gives: the allocation (own memory) or
	 * the whole block (a mapping). */
	CUdeviceptr base;
	size_t size;
	CUdeviceptr ptr; /* what cuMemAlloc / cuIpcOpenMemHandle returned */
	size_t len;      /* of the allocation itself */
	unsigned long long id;
	int device;
	struct block *block; /* own memory; NULL for a mapping */
	bool imported;       /* a mapping of another process's allocation */
	bool pooled;         /* cuMemAllocAsync's: no IPC handle */
};

/* An event's state, shared with the processes that open its handle. */
struct slot {
	_Atomic uint64_t id;        /* the event's; 0: never used */
	_Atomic uint64_t recorded;  /* the latest capture's number */
	_Atomic uint64_t completed; /* the highest capture done */
};

enum op_kind { OP_COPY, OP_SET, OP_RECORD, OP_WAIT };

struct op {
	struct op *next;
	enum op_kind kind;
	CUdeviceptr dst, src; /* a host address where dst_host / src_host */
	bool dst_host, src_host;
	size_t n;
	unsigned char value;
	struct slot *slot; /* OP_RECORD, OP_WAIT */
	uint64_t seq;
	pid_t owner; /* OP_WAIT: the event's process */
};

struct CUstream_st {
	struct CUstream_st *next;
	int device;
	bool held, destroyed;
	struct op *head, *tail;
	int waits; /* cuStreamWaitEvent calls on it */
	int syncs; /* cuStreamSynchronize calls on it */
};

struct CUevent_st {
	struct CUevent_st *next;
	unsigned flags;
	unsigned long long id;
	bool imported;
	pid_t owner;
	struct slot *slot;
};

struct mem_handle {
	uint64_t magic;
	uint32_t pid;
	int32_t fd;         /* the block's, in pid */
	uint64_t block_size;
	uint64_t block_id;
	uint64_t off;       /* of the allocation in the block */
	uint64_t len;
	uint64_t id;        /* the allocation's buffer id */
};

struct event_handle {
	uint64_t magic;
	uint32_t pid;
	int32_t fd; /* the event table's, in pid */
	uint64_t id;
	uint32_t slot;
	uint32_t pad;
};

_Static_assert(sizeof(struct mem_handle) <= sizeof(CUipcMemHandle), "handle fits");
_Static_assert(sizeof(struct event_handle) <= sizeof(CUipcEventHandle), "handle fits");

/* Another process's event table, mapped here. */
struct table {
	struct table *next;
	uint32_t pid;
	struct slot *slots;
};

#define MAX_DEVICES 16
static struct CUctx_st primary[MAX_DEVICES];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *allocs;
static struct block *blocks, *small[MAX_DEVICES];
static struct CUstream_st *streams, *legacy[MAX_DEVICES];
static struct CUevent_st *events;
static struct table *tables;
static struct slot *own_slots;
static int own_slots_fd = -1;
static uint32_t slots_used;
static unsigned long long next_id = 1; /* buffer, block and event ids, never reused */
static int owned;                      /* own allocations not yet freed */

/* The handles the driver gives the default streams: 0, and cuda.h's
 * CU_STREAM_LEGACY and CU_STREAM_PER_THREAD, which DLPack consumers pass
 * (as 1 and 2): counted for tests by handle. */
#define SPECIAL_STREAMS 3
static int special_waits[SPECIAL_STREAMS], special_syncs[SPECIAL_STREAMS];

#define CTX_DEPTH 16
static __thread CUcontext stack[CTX_DEPTH];
static __thread int depth;
static __thread struct CUstream_st *per_thread[MAX_DEVICES];

static CUcontext current(void)
{
	return depth ? stack[depth - 1] : NULL;
}

/* FAKE_CUDA_DEVICES and CUDA_VISIBLE_DEVICES, read once. */
static int ndevices;           /* ordinals this process sees */
static int physical[MAX_DEVICES]; /* of each ordinal */

static void count_devices(void)
{
	const char *s = getenv("FAKE_CUDA_DEVICES");
	const char *vis = getenv("CUDA_VISIBLE_DEVICES");
	int n = s && *s ? atoi(s) : 1;

	n = n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
	for (int i = 0; i < MAX_DEVICES; i++)
		primary[i].device = i;
	if (!vis) {
		for (int i = 0; i < n; i++)
			physical[i] = i;
		ndevices = n;
		return;
	}
	/* As the driver: the list ends at the first entry that names no
	 * device (or repeats one). */
	while (*vis && ndevices < n) {
		char *end;
		long p = strtol(vis, &end, 10);
		bool seen = false;

		if (end == vis || p < 0 || p >= n)
			break;
		for (int i = 0; i < ndevices; i++)
			seen |= physical[i] == p;
		if (seen)
			break;
		physical[ndevices++] = (int)p;
		if (*end != ',')
			break;
		vis = end + 1;
	}
}

static int devices(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;

	pthread_once(&once, count_devices);
	return ndevices;
}

static bool is_ctx(CUcontext ctx)
{
	return ctx >= primary && ctx < primary + devices();
}

static void die(const char *what)
{
	fprintf(stderr, "fake CUDA (pid %d): %s\n", (int)getpid(), what);
	abort();
}

/* ---- the GPU: a thread that runs the streams' queued work ---- */

static bool alive(pid_t pid)
{
	return !(kill(pid, 0) && errno == ESRCH);
}

/* Caller holds lock. */
static struct alloc *find(CUdeviceptr p)
{
	for (struct alloc *a = allocs; a; a = a->next)
		if (p >= a->base && p - a->base < a->size)
			return a;
	return NULL;
}

/* n bytes at p are known memory. Caller holds lock. */
static bool known(CUdeviceptr p, size_t n)
{
	struct alloc *a = find(p);

	return a && n <= a->size - (p - a->base);
}

/* Caller holds lock. */
static bool runnable(const struct op *o)
{
	if (o->kind != OP_WAIT)
		return true;
	/* Acquire pairs with the release of the capture's completion (run). */
	return atomic_load_explicit(&o->slot->completed, memory_order_acquire) >= o->seq ||
	       (o->owner != getpid() && !alive(o->owner));
}

/* Caller holds lock. */
static void run(struct op *o)
{
	uint64_t was;

	switch (o->kind) {
	case OP_COPY:
		if ((!o->dst_host && !known(o->dst, o->n)) || (!o->src_host && !known(o->src, o->n)))
			die("a copy queued on a stream ran after its memory was freed or unmapped");
		memmove((void *)(uintptr_t)o->dst, (const void *)(uintptr_t)o->src, o->n);
		break;
	case OP_SET:
		if (!known(o->dst, o->n))
			die("a memset queued on a stream ran after its memory was freed");
		memset((void *)(uintptr_t)o->dst, o->value, o->n);
		break;
	case OP_RECORD:
		/* Release pairs with runnable's acquire, here and in the
		 * processes that opened the event: the work before is done. */
		was = atomic_load_explicit(&o->slot->completed, memory_order_relaxed);
		if (o->seq > was)
			atomic_store_explicit(&o->slot->completed, o->seq, memory_order_release);
		break;
	case OP_WAIT:
		break;
	}
}

static void *gpu(void *arg)
{
	struct timespec idle = { 0, 100000 };

	(void)arg;
	for (;;) {
		bool progress = false;

		pthread_mutex_lock(&lock);
		for (struct CUstream_st **pp = &streams, *s; (s = *pp);) {
			struct op *o;

			while (!s->held && (o = s->head) && runnable(o)) {
				run(o);
				s->head = o->next;
				if (!s->head)
					s->tail = NULL;
				free(o);
				progress = true;
			}
			if (s->destroyed && !s->head) {
				*pp = s->next;
				free(s);
				continue;
			}
			pp = &s->next;
		}
		pthread_mutex_unlock(&lock);
		if (!progress)
			nanosleep(&idle, NULL);
	}
	return NULL;
}

static void start_gpu(void)
{
	pthread_t t;
	pthread_attr_t a;

	pthread_attr_init(&a);
	pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&t, &a, gpu, NULL))
		die("cannot start the thread that plays the GPU");
	pthread_attr_destroy(&a);
}

static void gpu_once(void)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;

	pthread_once(&once, start_gpu);
}

/* A new stream of device, linked. Caller holds lock. */
static struct CUstream_st *new_stream(int device)
{
	struct CUstream_st *s = calloc(1, sizeof(*s));

	if (!s)
		return NULL;
	s->device = device;
	s->next = streams;
	streams = s;
	return s;
}

/* The stream handle s names in the current context, or NULL when it names
 * none (a destroyed or made-up one). Caller holds lock. */
static struct CUstream_st *resolve(CUstream s)
{
	CUcontext ctx = current();
	uintptr_t h = (uintptr_t)s;

	if (h < SPECIAL_STREAMS) {
		struct CUstream_st **at;

		if (!ctx)
			return NULL;
		at = h == (uintptr_t)CU_STREAM_PER_THREAD ? &per_thread[ctx->device]
							   : &legacy[ctx->device];
		if (!*at)
			*at = new_stream(ctx->device);
		return *at;
	}
	for (struct CUstream_st *x = streams; x; x = x->next)
		if (x == s && !x->destroyed)
			return x;
	return NULL;
}

/* Queues o on s. Caller holds lock. */
static void enqueue(struct CUstream_st *s, struct op *o)
{
	o->next = NULL;
	if (s->tail)
		s->tail->next = o;
	else
		s->head = o;
	s->tail = o;
}

static CUresult queue_op(CUstream h, const struct op *what)
{
	struct op *o = malloc(sizeof(*o));
	struct CUstream_st *s;

	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*o = *what;
	gpu_once();
	pthread_mutex_lock(&lock);
	s = resolve(h);
	if (s)
		enqueue(s, o);
	pthread_mutex_unlock(&lock);
	if (!s)
		free(o);
	return s ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Aborts when queued work still uses [p, p + n). Caller holds lock. */
static void check_unused(CUdeviceptr p, size_t n, const char *what)
{
	for (struct CUstream_st *s = streams; s; s = s->next)
		for (struct op *o = s->head; o; o = o->next)
			if ((o->kind == OP_COPY || o->kind == OP_SET) &&
			    ((!o->dst_host && o->dst < p + n && p < o->dst + o->n) ||
			     (o->kind == OP_COPY && !o->src_host && o->src < p + n &&
			      p < o->src + o->n)))
				die(what);
}

/* ---- devices and contexts ---- */

EXPORT CUresult cuInit(unsigned flags)
{
	return flags ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *n)
{
	*n = devices();
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
	if (ordinal < 0 || ordinal >= devices())
		return CUDA_ERROR_INVALID_DEVICE;
	*dev = ordinal;
	return CUDA_SUCCESS;
}

/* The physical device's, the same in every process. */
EXPORT CUresult cuDeviceGetUuid(CUuuid *u, CUdevice dev)
{
	if (dev < 0 || dev >= devices())
		return CUDA_ERROR_INVALID_DEVICE;
	memset(u, 0, sizeof(*u));
	snprintf(u->bytes, sizeof(u->bytes), "fakegpu-%d", physical[dev]);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice dev)
{
	return cuDeviceGetUuid(u, dev);
}

EXPORT CUresult cuGetErrorName(CUresult r, const char **s)
{
	static const struct {
		CUresult r;
		const char *name;
	} names[] = {
		{ CUDA_SUCCESS, "CUDA_SUCCESS" },
		{ CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE" },
		{ CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY" },
		{ CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE" },
		{ CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT" },
		{ CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED" },
		{ CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE" },
		{ CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND" },
		{ CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY" },
	};

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (names[i].r == r) {
			*s = names[i].name;
			return CUDA_SUCCESS;
		}
	*s = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s)
{
	CUresult rc = cuGetErrorName(r, s);

	if (rc == CUDA_SUCCESS)
		*s = "fake CUDA driver (tests/fake_cuda)";
	return rc;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
	if (dev < 0 || dev >= devices())
		return CUDA_ERROR_INVALID_DEVICE;
	*ctx = &primary[dev];
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
	if (!is_ctx(ctx))
		return CUDA_ERROR_INVALID_CONTEXT;
	if (depth == CTX_DEPTH)
		return CUDA_ERROR_INVALID_VALUE;
	stack[depth++] = ctx;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
	if (!depth)
		return CUDA_ERROR_INVALID_CONTEXT;
	*ctx = stack[--depth];
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
	if (ctx && !is_ctx(ctx))
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!ctx) {
		if (depth)
			depth--;
		return CUDA_SUCCESS;
	}
	if (!depth)
		depth = 1;
	stack[depth - 1] = ctx;
	return CUDA_SUCCESS;
}

/* ---- memory ---- */

/* An allocation of the current context, linked. Caller holds lock. */
static CUresult add_alloc(CUdeviceptr base, size_t size, CUdeviceptr ptr, size_t len,
			  struct block *b, CUdeviceptr *p)
{
	struct alloc *a = calloc(1, sizeof(*a));

	if (!a)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*a = (struct alloc){ .next = allocs, .base = base, .size = size, .ptr = ptr, .len = len,
			     .id = next_id++, .device = current()->device, .block = b,
			     .imported = !b };
	allocs = a;
	owned += !!b;
	*p = ptr;
	return CUDA_SUCCESS;
}

/* A new block of size on the current device. Caller holds lock. */
static struct block *new_block(size_t size)
{
	struct block *b = calloc(1, sizeof(*b));
	char name[64];

	if (!b)
		return NULL;
	b->id = next_id++;
	snprintf(name, sizeof(name), "fake-cuda:%d:%llu", (int)getpid(), b->id);
	b->fd = memfd_create(name, MFD_CLOEXEC);
	if (b->fd < 0 || ftruncate(b->fd, (off_t)size) ||
	    (b->at = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, b->fd, 0)) == MAP_FAILED) {
		if (b->fd >= 0)
			close(b->fd);
		free(b);
		return NULL;
	}
	b->size = size;
	b->device = current()->device;
	b->next = blocks;
	blocks = b;
	return b;
}

static void drop_block(struct block *b)
{
	struct block **pp;

	for (pp = &blocks; *pp != b; pp = &(*pp)->next)
		;
	*pp = b->next;
	for (int i = 0; i < MAX_DEVICES; i++)
		if (small[i] == b)
			small[i] = NULL;
	munmap(b->at, b->size);
	close(b->fd);
	free(b);
}

static CUresult mem_alloc(CUdeviceptr *p, size_t n, bool pooled);

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
	return mem_alloc(p, n, false);
}

/* Ready at once: the stream plays no part here. */
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s)
{
	(void)s;
	return mem_alloc(p, n, true);
}

static CUresult mem_alloc(CUdeviceptr *p, size_t n, bool pooled)
{
	struct block *b;
	size_t at = 0;
	CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
	int dev;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!n)
		return CUDA_ERROR_INVALID_VALUE;
	dev = current()->device;
	pthread_mutex_lock(&lock);
	if (n < SMALL_BLOCK) {
		b = small[dev];
		if (!b || b->size - b->used < n)
			b = small[dev] = new_block(SMALL_BLOCK);
		if (b) {
			at = b->used;
			b->used += (n + SUB_ALIGN - 1) & ~(size_t)(SUB_ALIGN - 1);
		}
	} else {
		b = new_block(n);
	}
	if (b) {
		r = add_alloc((uintptr_t)b->at + at, n, (uintptr_t)b->at + at, n, b, p);
		if (r == CUDA_SUCCESS) {
			allocs->pooled = pooled;
			b->live++;
		}
		else if (!b->live)
			drop_block(b);
	}
	pthread_mutex_unlock(&lock);
	return r;
}

/* Unlinks the allocation or mapping returned as p. Caller holds lock. */
static struct alloc *take_alloc(CUdeviceptr p, bool imported)
{
	struct alloc **pp, *a;

	for (pp = &allocs; (a = *pp); pp = &a->next)
		if (a->ptr == p && a->imported == imported) {
			*pp = a->next;
			owned -= !imported;
			break;
		}
	return a;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
	struct alloc *a;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	a = take_alloc(p, false);
	if (a) {
		check_unused(a->ptr, a->len, "cuMemFree of memory that work queued on a stream "
					     "still uses");
		/* A small block stays while it has allocations, or is the one
		 * new small ones go to. */
		if (!--a->block->live && small[a->block->device] != a->block)
			drop_block(a->block);
	}
	pthread_mutex_unlock(&lock);
	free(a);
	return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p)
{
	struct alloc *a;
	unsigned long long id = 0;
	int device = -2;

	pthread_mutex_lock(&lock);
	a = find(p);
	if (a) {
		id = a->id;
		device = a->device;
	}
	pthread_mutex_unlock(&lock);
	/* As the driver: memory it does not know is memory type 0, no error. */
	for (unsigned i = 0; i < n; i++) {
		switch (attrs[i]) {
		case CU_POINTER_ATTRIBUTE_CONTEXT:
			*(CUcontext *)data[i] = a ? &primary[device] : NULL;
			break;
		case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
			*(unsigned *)data[i] = a ? CU_MEMORYTYPE_DEVICE : 0;
			break;
		case CU_POINTER_ATTRIBUTE_BUFFER_ID:
			*(unsigned long long *)data[i] = id;
			break;
		case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
			*(int *)data[i] = device;
			break;
		default:
			return CUDA_ERROR_INVALID_VALUE;
		}
	}
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
	struct alloc *a;

	pthread_mutex_lock(&lock);
	a = find(p);
	if (a) {
		*base = a->base;
		*size = a->size;
	}
	pthread_mutex_unlock(&lock);
	return a ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
	struct mem_handle mh = { MEM_MAGIC, (uint32_t)getpid(), -1, 0, 0, 0, 0, 0 };
	struct alloc *a;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	a = find(p);
	if (a && a->ptr == p && !a->imported && !a->pooled) {
		mh.fd = a->block->fd;
		mh.block_size = a->block->size;
		mh.block_id = a->block->id;
		mh.off = a->ptr - (uintptr_t)a->block->at;
		mh.len = a->len;
		mh.id = a->id;
	}
	pthread_mutex_unlock(&lock);
	if (mh.fd < 0)
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof(*h));
	memcpy(h, &mh, sizeof(mh));
	return CUDA_SUCCESS;
}

/* fd (of pid, /proc path in path) is still the memfd named name. */
static bool fd_is(const char *path, const char *want)
{
	char got[128];
	ssize_t n = readlink(path, got, sizeof(got) - 1);

	if (n < 0)
		return false; /* its process or its memory is gone */
	got[n] = '\0';
	/* The fd number may have been reused: the name says which. */
	return !strncmp(got, want, strlen(want));
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags)
{
	struct mem_handle mh;
	char path[64], want[64];
	struct stat st;
	void *at;
	int fd;
	CUresult r;

	(void)flags;
	memcpy(&mh, &h, sizeof(mh));
	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	/* The driver refuses a handle of the calling process itself. */
	if (mh.magic != MEM_MAGIC || mh.pid == (uint32_t)getpid() || mh.fd < 0 || !mh.len ||
	    mh.off > mh.block_size || mh.len > mh.block_size - mh.off)
		return CUDA_ERROR_INVALID_HANDLE;
	snprintf(path, sizeof(path), "/proc/%u/fd/%d", mh.pid, mh.fd);
	snprintf(want, sizeof(want), "/memfd:fake-cuda:%u:%llu ", mh.pid,
		 (unsigned long long)mh.block_id);
	if (!fd_is(path, want))
		return CUDA_ERROR_INVALID_HANDLE;
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_INVALID_HANDLE;
	if (fstat(fd, &st) || (uint64_t)st.st_size != mh.block_size ||
	    (at = mmap(NULL, mh.block_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
		close(fd);
		return CUDA_ERROR_MAP_FAILED;
	}
	close(fd);
	/* The whole block is mapped: its neighbours' bytes are there too. */
	pthread_mutex_lock(&lock);
	r = add_alloc((uintptr_t)at, mh.block_size, (uintptr_t)at + mh.off, mh.len, NULL, p);
	pthread_mutex_unlock(&lock);
	if (r != CUDA_SUCCESS)
		munmap(at, mh.block_size);
	return r;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
	struct alloc *a;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	a = take_alloc(p, true);
	if (a)
		check_unused(a->base, a->size, "cuIpcCloseMemHandle of a mapping that work queued "
					       "on a stream still uses");
	pthread_mutex_unlock(&lock);
	if (!a)
		return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)(uintptr_t)a->base, a->size);
	free(a);
	return CUDA_SUCCESS;
}

/* ---- streams ---- */

EXPORT CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
	struct CUstream_st *x;

	(void)flags;
	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	x = new_stream(current()->device);
	pthread_mutex_unlock(&lock);
	if (!x)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*s = x;
	return CUDA_SUCCESS;
}

/* As the driver: queued work still runs; the handle is dead at once. */
EXPORT CUresult cuStreamDestroy_v2(CUstream s)
{
	struct CUstream_st *x;

	pthread_mutex_lock(&lock);
	x = (uintptr_t)s < SPECIAL_STREAMS ? NULL : resolve(s);
	if (x) {
		x->destroyed = true;
		x->held = false;
	}
	pthread_mutex_unlock(&lock);
	gpu_once(); /* frees it */
	return x ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

/* Waits until every stream that match says is done, with the lock held
 * on return; false after SYNC_LIMIT_NS (a hang: work that cannot run). */
static bool drain(bool (*match)(const struct CUstream_st *s, const void *arg), const void *arg)
{
	struct timespec t0, now, pause = { 0, 50000 };

	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		bool busy = false;

		pthread_mutex_lock(&lock);
		for (struct CUstream_st *s = streams; s && !busy; s = s->next)
			busy = s->head && match(s, arg);
		if (!busy)
			return true;
		pthread_mutex_unlock(&lock);
		clock_gettime(CLOCK_MONOTONIC, &now);
		if ((uint64_t)(now.tv_sec - t0.tv_sec) * 1000000000ull + (uint64_t)now.tv_nsec -
			    (uint64_t)t0.tv_nsec > SYNC_LIMIT_NS) {
			fprintf(stderr, "fake CUDA (pid %d): a synchronize waited %llu s for work "
				"that does not run (a held stream, or an event never recorded)\n",
				(int)getpid(), SYNC_LIMIT_NS / 1000000000ull);
			pthread_mutex_lock(&lock);
			return false;
		}
		nanosleep(&pause, NULL);
	}
}

static bool is_stream(const struct CUstream_st *s, const void *arg)
{
	return s == arg;
}

static bool of_device(const struct CUstream_st *s, const void *arg)
{
	return s->device == *(const int *)arg;
}

EXPORT CUresult cuStreamSynchronize(CUstream s)
{
	struct CUstream_st *x;
	bool done;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	x = resolve(s);
	if (x) {
		x->syncs++;
		if ((uintptr_t)s < SPECIAL_STREAMS)
			special_syncs[(uintptr_t)s]++;
	}
	pthread_mutex_unlock(&lock);
	if (!x)
		return CUDA_ERROR_INVALID_HANDLE;
	gpu_once();
	done = drain(is_stream, x);
	pthread_mutex_unlock(&lock);
	return done ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuCtxSynchronize(void)
{
	bool done;
	int dev;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	dev = current()->device;
	gpu_once();
	done = drain(of_device, &dev);
	pthread_mutex_unlock(&lock);
	return done ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuStreamQuery(CUstream s)
{
	struct CUstream_st *x;
	bool busy = false;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	x = resolve(s);
	if (x)
		busy = x->head != NULL;
	pthread_mutex_unlock(&lock);
	return !x ? CUDA_ERROR_INVALID_HANDLE : busy ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

/* ---- copies ---- */

/* Both ranges must be known memory of the contexts named. */
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dctx, CUdeviceptr src, CUcontext sctx,
				  size_t n, CUstream s)
{
	struct alloc *d, *f;
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!is_ctx(dctx) || !is_ctx(sctx))
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	d = find(dst);
	f = find(src);
	ok = d && f && d->device == dctx->device && f->device == sctx->device &&
	     n <= d->size - (dst - d->base) && n <= f->size - (src - f->base);
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	return queue_op(s, &(struct op){ .kind = OP_COPY, .dst = dst, .src = src, .n = n });
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, CUstream s)
{
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	ok = known(dst, n);
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	return queue_op(s, &(struct op){ .kind = OP_SET, .dst = dst, .n = n, .value = value });
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	ok = known(src, n);
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	return queue_op(s, &(struct op){ .kind = OP_COPY, .dst = (uintptr_t)dst, .dst_host = true,
					 .src = src, .n = n });
}

/* ---- events ---- */

/* The slot of a new event of ours. Caller holds lock. */
static struct slot *new_slot(unsigned long long id, uint32_t *index)
{
	if (!own_slots) {
		char name[64];
		size_t size = EVENT_SLOTS * sizeof(struct slot);
		void *at;

		snprintf(name, sizeof(name), "fake-cuda-events:%d", (int)getpid());
		own_slots_fd = memfd_create(name, MFD_CLOEXEC);
		if (own_slots_fd < 0)
			return NULL;
		if (ftruncate(own_slots_fd, (off_t)size) ||
		    (at = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, own_slots_fd, 0)) ==
			    MAP_FAILED) {
			close(own_slots_fd);
			own_slots_fd = -1;
			return NULL;
		}
		own_slots = at;
	}
	if (slots_used == EVENT_SLOTS)
		return NULL;
	*index = slots_used++;
	/* Relaxed: the slot is not yet known outside this process. */
	atomic_store_explicit(&own_slots[*index].id, id, memory_order_relaxed);
	return &own_slots[*index];
}

/* Caller holds lock. */
static bool event_ok(CUevent ev)
{
	for (struct CUevent_st *x = events; x; x = x->next)
		if (x == ev)
			return true;
	return false;
}

EXPORT CUresult cuEventCreate(CUevent *ev, unsigned flags)
{
	struct CUevent_st *x;
	uint32_t index;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!(x = calloc(1, sizeof(*x))))
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&lock);
	x->id = next_id++;
	x->slot = new_slot(x->id, &index);
	if (x->slot) {
		x->flags = flags;
		x->owner = getpid();
		x->next = events;
		events = x;
	}
	pthread_mutex_unlock(&lock);
	if (!x->slot) {
		free(x);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*ev = x;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent ev, CUstream s)
{
	struct op o = { .kind = OP_RECORD };
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	/* An opened interprocess event cannot be recorded here (the driver's rule). */
	ok = event_ok(ev) && !ev->imported;
	if (ok) {
		o.slot = ev->slot;
		/* A new capture: the latest, which waits made from now on wait
		 * for. Release pairs with cuStreamWaitEvent's acquire. */
		o.seq = atomic_load_explicit(&ev->slot->recorded, memory_order_relaxed) + 1;
		atomic_store_explicit(&ev->slot->recorded, o.seq, memory_order_release);
	}
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_HANDLE;
	return queue_op(s, &o);
}

EXPORT CUresult cuEventDestroy_v2(CUevent ev)
{
	struct CUevent_st **pp, *x;

	pthread_mutex_lock(&lock);
	for (pp = &events; (x = *pp); pp = &x->next)
		if (x == ev) {
			*pp = x->next;
			break;
		}
	pthread_mutex_unlock(&lock);
	if (!x)
		return CUDA_ERROR_INVALID_HANDLE;
	free(x);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent ev)
{
	struct event_handle eh = { EVENT_MAGIC, (uint32_t)getpid(), -1, 0, 0, 0 };
	bool ok;

	pthread_mutex_lock(&lock);
	ok = event_ok(ev) && !ev->imported &&
	     (ev->flags & (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)) ==
		     (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
	if (ok) {
		eh.id = ev->id;
		eh.fd = own_slots_fd;
		eh.slot = (uint32_t)(ev->slot - own_slots);
	}
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	memset(h, 0, sizeof(*h));
	memcpy(h, &eh, sizeof(eh));
	return CUDA_SUCCESS;
}

/* pid's event table, mapped here once. Caller holds lock. */
static struct slot *table_of(uint32_t pid, int fd)
{
	char path[64], want[64];
	struct table *t;
	void *at;
	int mfd;

	for (t = tables; t; t = t->next)
		if (t->pid == pid)
			return t->slots;
	snprintf(path, sizeof(path), "/proc/%u/fd/%d", pid, fd);
	snprintf(want, sizeof(want), "/memfd:fake-cuda-events:%u ", pid);
	if (!fd_is(path, want) || (mfd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
		return NULL;
	at = mmap(NULL, EVENT_SLOTS * sizeof(struct slot), PROT_READ, MAP_SHARED, mfd, 0);
	close(mfd);
	if (at == MAP_FAILED)
		return NULL;
	if (!(t = calloc(1, sizeof(*t)))) {
		munmap(at, EVENT_SLOTS * sizeof(struct slot));
		return NULL;
	}
	*t = (struct table){ .next = tables, .pid = pid, .slots = at };
	tables = t;
	return t->slots;
}

EXPORT CUresult cuIpcOpenEventHandle(CUevent *ev, CUipcEventHandle h)
{
	struct event_handle eh;
	struct CUevent_st *x;
	struct slot *slots;

	memcpy(&eh, &h, sizeof(eh));
	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	/* The driver refuses a handle of the calling process itself. */
	if (eh.magic != EVENT_MAGIC || eh.pid == (uint32_t)getpid() || !eh.id ||
	    eh.slot >= EVENT_SLOTS)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!(x = calloc(1, sizeof(*x))))
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&lock);
	slots = table_of(eh.pid, eh.fd);
	/* Acquire: pairs with nothing but makes the id check see the slot's
	 * own store; a slot whose id differs is not this event. */
	if (slots && atomic_load_explicit(&slots[eh.slot].id, memory_order_acquire) == eh.id) {
		*x = (struct CUevent_st){ .next = events, .flags = CU_EVENT_INTERPROCESS |
				CU_EVENT_DISABLE_TIMING, .id = eh.id, .imported = true,
				.owner = (pid_t)eh.pid, .slot = &slots[eh.slot] };
		events = x;
	} else {
		free(x);
		x = NULL;
	}
	pthread_mutex_unlock(&lock);
	if (!x)
		return CUDA_ERROR_INVALID_HANDLE;
	*ev = x;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent ev, unsigned flags)
{
	struct op o = { .kind = OP_WAIT };
	struct CUstream_st *x = NULL;
	bool ok;

	if (!current())
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&lock);
	ok = !flags && event_ok(ev) && (x = resolve(s));
	if (ok) {
		x->waits++;
		if ((uintptr_t)s < SPECIAL_STREAMS)
			special_waits[(uintptr_t)s]++;
		/* The latest capture, made before this call: acquire pairs with
		 * cuEventRecord's release. */
		o.slot = ev->slot;
		o.seq = atomic_load_explicit(&ev->slot->recorded, memory_order_acquire);
		o.owner = ev->owner;
	}
	pthread_mutex_unlock(&lock);
	if (!ok)
		return CUDA_ERROR_INVALID_HANDLE;
	/* An event never recorded is complete: nothing to wait for. */
	return o.seq ? queue_op(s, &o) : CUDA_SUCCESS;
}

/* ---- for tests ---- */

EXPORT int fakeCuAllocCount(void)
{
	int n;

	pthread_mutex_lock(&lock);
	n = owned;
	pthread_mutex_unlock(&lock);
	return n;
}

/* Holds s's work (held: it does not run until let go), in the current
 * context; -1 when s names no stream. */
EXPORT int fakeCuStreamHold(CUstream s, int held)
{
	struct CUstream_st *x;

	pthread_mutex_lock(&lock);
	x = resolve(s);
	if (x)
		x->held = held;
	pthread_mutex_unlock(&lock);
	return x ? 0 : -1;
}

/* The count of a special handle, or of s (a live stream), or -1. */
static int stream_counted(CUstream s, bool syncs)
{
	int n = -1;

	pthread_mutex_lock(&lock);
	if ((uintptr_t)s < SPECIAL_STREAMS) {
		n = syncs ? special_syncs[(uintptr_t)s] : special_waits[(uintptr_t)s];
	} else {
		for (struct CUstream_st *x = streams; x; x = x->next)
			if (x == s && !x->destroyed)
				n = syncs ? x->syncs : x->waits;
	}
	pthread_mutex_unlock(&lock);
	return n;
}

EXPORT int fakeCuStreamSyncs(CUstream s)
{
	return stream_counted(s, true);
}

EXPORT int fakeCuStreamWaits(CUstream s)
{
	return stream_counted(s, false);
}
