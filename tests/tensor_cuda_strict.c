/*
 * CUDA tensors against the strict stand-in driver (tests/fake_cuda:
 * asynchronous streams, events that keep their latest capture only,
 * sub-allocated blocks, per-process ordinals), each case one defect that
 * a driver-API review found (issue 24). Two physical devices; ranks 0
 * and 2 see them as CUDA_VISIBLE_DEVICES=0,1, rank 1 as 1,0, so that
 * rank 0's cuda:0 is rank 1's cuda:1. Rank 0 maps its cuda:0 to rank 2's
 * cuda:1 (another GPU: tensors to rank 2 land as copies).
 *  - Events: rank 0 writes a tensor on a stream it holds (the write has
 *    not run), sends it in one call with eight others written on another
 *    stream. A pool of 8 events would record the first tensor's event
 *    again for the ninth, on the stream that is done, and rank 1 would
 *    read before the write. Rank 1's copy of it stays queued until rank 0
 *    lets its stream go, then reads the write.
 *  - Devices by UUID: rank 1 gets rank 0's cuda:0 tensors on its cuda:1.
 *  - Forwarded to itself: rank 1 passes a received tensor in a call to
 *    itself; the driver opens no event handle of its own process.
 *  - Sub-allocated neighbours: two small tensors of one block, held
 *    together by rank 1, then sent again: two mappings opened in all
 *    (neither taken for an allocation the other replaced because an IPC
 *    mapping maps their whole block).
 *  - A landed copy: rank 2 holds the stream the copy is queued on; the
 *    tensor's release waits for it (freeing or releasing the source
 *    under queued work aborts the stand-in) and goes once let go.
 *  - The per-thread default stream: rank 1 consumes a tensor on its
 *    handler thread's per-thread stream (held) and releases it on
 *    another thread: the release waits for that stream's work.
 *  - Fork: a child forked after CUDA started gets an error, not the
 *    parent's handles.
 *  - The loop thread never waits for the GPU: rank 1 reads a tensor on a
 *    stream it holds and returns it; the reply's pin is the last handle,
 *    let go on the loop thread when rank 0's TENSOR_ACK comes. Rank 1
 *    still answers the next call at once, and lets the stream go after.
 *  - Memory of a pool (cuMemAllocAsync: torch's cudaMallocAsync backend)
 *    is refused when sent, with a "not supported yet" sentence.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shmrpc.h"
#include "worker/cuda.h"
#include "worker/tensor.h"
#include "tests/lib/fakecuda.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/testlib.h"

#define LEN 4096
#define BATCH 9 /* one more than the old pool of events per context */
#define NOT_READY 600 /* CUDA_ERROR_NOT_READY */
#define PER_THREAD ((uintptr_t)2)
/* How long the cases wait for work that must not run (it is held; the
 * wrong code runs it within a millisecond). */
#define HELD_MS 300

static void *sym(const char *name)
{
	void *f = cuda_sym(name);

	CHECK(f, "the stand-in CUDA driver has no %s: %s", name, shmrpc_errmsg());
	return f;
}

static void hold(uintptr_t s, int held)
{
	int (*f)(uintptr_t s, int held) = sym("fakeCuStreamHold");

	CHECK(f(s, held) == 0, "fakeCuStreamHold");
}

/* Queues a copy of n bytes of the device pointer p to host on stream s. */
static void read_async(void *host, const void *p, size_t n, uintptr_t s)
{
	int (*f)(void *dst, uint64_t src, size_t n, uintptr_t s) = sym("cuMemcpyDtoHAsync_v2");

	CHECK(f(host, (uint64_t)(uintptr_t)p, n, s) == 0, "cuMemcpyDtoHAsync");
}

/* True once the work queued on s is done, within ms. */
static bool done_within(uintptr_t s, int ms)
{
	int (*query)(uintptr_t s) = sym("cuStreamQuery");
	int r = NOT_READY;

	for (int i = 0; i < ms && (r = query(s)) == NOT_READY; i++)
		usleep(1000);
	CHECK(r == 0 || r == NOT_READY, "cuStreamQuery: %d", r);
	return r == 0;
}

static const DLTensor *dl_of(shmrpc_tensor *t)
{
	const DLTensor *dl = shmrpc_tensor_dl(t);

	CHECK(dl && dl->device.device_type == kDLCUDA, "not a CUDA tensor: %s", shmrpc_errmsg());
	return dl;
}

/* ---- rank 1 ---- */

static uint8_t early[LEN];

/* [device of the first, whether its read ran while its write is held]:
 * reads the first tensor on the legacy stream, the import's. */
static int fn_batch(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value *v = shmrpc_call_alloc(c, 2 * sizeof(*v));
	const DLTensor *dl = dl_of(a[0].u.items[0].u.t);

	(void)n, (void)u;
	tl_fake_cuda_device(dl->device.device_id);
	memset(early, 0, sizeof(early));
	read_async(early, dl->data, LEN, 0);
	v[0] = shmrpc_int(dl->device.device_id);
	v[1] = shmrpc_int(done_within(0, HELD_MS));
	*r = shmrpc_list(v, 2);
	return 0;
}

/* The first byte fn_batch read, once its stream is done. */
static int fn_batch_read(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			 void *u)
{
	int (*sync)(uintptr_t s) = sym("cuStreamSynchronize");

	(void)c, (void)a, (void)n, (void)u;
	tl_fake_cuda_device(1);
	CHECK(sync(0) == 0, "cuStreamSynchronize");
	*r = shmrpc_int(early[0]);
	return 0;
}

/* The first byte of a tensor, read on the legacy stream. */
static int fn_peek(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const DLTensor *dl = dl_of(a[0].u.t);
	uint8_t b = 0;

	(void)c, (void)n, (void)u;
	tl_fake_cuda_device(dl->device.device_id);
	read_async(&b, dl->data, 1, 0);
	tl_fake_cuda_sync(dl->device.device_id);
	*r = shmrpc_int(b);
	return 0;
}

/* The tensor passed to ourselves: its first byte as we see it there. */
static int fn_self(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_future *f;

	(void)n, (void)u;
	if (shmrpc_rpc_sync(shmrpc_rank(), "peek", a, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	*r = *shmrpc_future_value(f);
	shmrpc_future_free(f);
	return 0;
}

static void *release(void *t)
{
	shmrpc_tensor_free(t);
	return NULL;
}

/* Mappings open here once the idle cache let go of what it holds: those
 * still referenced. */
static uint32_t maps_held(void)
{
	struct cuda_stats st;

	tensor_idle_forget(0);
	cuda_stats_get(&st);
	return st.maps_open;
}

static uint32_t maps_during;
static atomic_bool during_done;

/* maps_held on a thread of its own: a release it runs may wait for the
 * held stream (an idle cache entry parked by the loop thread drains at
 * its release), which only the handler lets go. */
static void *count_during(void *x)
{
	(void)x;
	maps_during = maps_held();
	/* Release: pairs with the handler's acquire. */
	atomic_store_explicit(&during_done, true, memory_order_release);
	return NULL;
}

/* [mappings held before the release of a tensor from rank 0 (its last
 * handle, on another thread) while this thread's per-thread stream,
 * where it was consumed, has work held; whether the release let the
 * mapping go while held; mappings held once let go]. The release drains
 * before it lets the mapping go: held, it cannot have. */
static int fn_per_thread(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			 void *u)
{
	shmrpc_value *v = shmrpc_call_alloc(c, 3 * sizeof(*v));
	shmrpc_future *f;
	shmrpc_tensor *t;
	const DLTensor *dl;
	uint32_t before, after = 0;
	uint8_t b;
	pthread_t th, counter;
	bool let_go;

	(void)a, (void)n, (void)u;
	CHECK_OK(shmrpc_rpc_sync(0, "make", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK_OK(shmrpc_tensor_retain(shmrpc_future_value(f)->u.t, &t));
	shmrpc_future_free(f);
	dl = dl_of(t);
	tl_fake_cuda_device(dl->device.device_id);
	CHECK_OK(shmrpc_tensor_cuda_wait(t, PER_THREAD));
	hold(PER_THREAD, 1);
	read_async(&b, dl->data, 1, PER_THREAD);
	before = maps_held();
	atomic_store_explicit(&during_done, false, memory_order_relaxed);
	CHECK(pthread_create(&th, NULL, release, t) == 0, "pthread_create");
	usleep(HELD_MS * 1000);
	CHECK(pthread_create(&counter, NULL, count_during, NULL) == 0, "pthread_create");
	usleep(HELD_MS * 1000);
	/* Acquire: pairs with count_during's release. */
	let_go = atomic_load_explicit(&during_done, memory_order_acquire) &&
		maps_during == before - 1;
	hold(PER_THREAD, 0);
	CHECK(pthread_join(th, NULL) == 0 && pthread_join(counter, NULL) == 0, "pthread_join");
	/* Whoever dropped the last handle (the future's may have been last,
	 * elsewhere) finishes the release now. */
	for (int i = 0; i < 500 && (after = maps_held()) != before - 1; i++)
		usleep(10000);
	v[0] = shmrpc_int(before);
	v[1] = shmrpc_int(let_go);
	v[2] = shmrpc_int(after);
	*r = shmrpc_list(v, 3);
	return 0;
}

/* keep_all's check: what it holds are CUDA tensors. */
static int kept_cuda(shmrpc_call *c, shmrpc_tensor *const *kept, int n)
{
	(void)c;
	for (int i = 0; i < n; i++)
		dl_of(kept[i]);
	return 0;
}

static uintptr_t relay_stream; /* fn_relay's, held until fn_relay_done */
static uint8_t relay_byte;

/* The tensor, read on a stream of ours that is held, returned. */
static int fn_relay(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const DLTensor *dl = dl_of(a[0].u.t);
	int (*create)(void **s, unsigned flags) = sym("cuStreamCreate");
	shmrpc_tensor *t;
	void *s;

	(void)c, (void)n, (void)u;
	tl_fake_cuda_device(dl->device.device_id);
	CHECK(create(&s, 0) == 0, "cuStreamCreate");
	relay_stream = (uintptr_t)s;
	CHECK_OK(shmrpc_tensor_cuda_wait(a[0].u.t, relay_stream));
	hold(relay_stream, 1);
	read_async(&relay_byte, dl->data, 1, relay_stream);
	CHECK_OK(shmrpc_tensor_retain(a[0].u.t, &t));
	*r = shmrpc_tensor_value(t);
	return 0;
}

/* Lets fn_relay's stream go. */
static int fn_relay_done(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			 void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	tl_fake_cuda_device(1);
	hold(relay_stream, 0);
	*r = shmrpc_nil();
	return 0;
}

/* ---- rank 2 ---- */

static int fn_hold(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	tl_fake_cuda_device((int)a[0].u.i);
	hold(0, (int)a[1].u.i);
	*r = shmrpc_nil();
	return 0;
}

/* The device the tensor landed on. */
static int fn_landed(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(dl_of(a[0].u.t)->device.device_id);
	return 0;
}

/* ---- rank 0 ---- */

static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_tensor_value(tl_fake_cuda_tensor_on(0, LEN, 0x33));
	return 0;
}

static uintptr_t stream_on(int device)
{
	int (*create)(void **s, unsigned flags) = sym("cuStreamCreate");
	void *s;

	tl_fake_cuda_device(device);
	CHECK(create(&s, 0) == 0, "cuStreamCreate");
	return (uintptr_t)s;
}

static void memset_async(shmrpc_tensor *t, uint8_t value, uintptr_t s)
{
	int (*f)(uint64_t p, unsigned char v, size_t n, uintptr_t s) = sym("cuMemsetD8Async");

	CHECK(f((uint64_t)(uintptr_t)shmrpc_tensor_data(t), value, LEN, s) == 0, "cuMemsetD8Async");
	CHECK_OK(shmrpc_tensor_set_cuda_stream(t, s));
}

static const shmrpc_value *call(shmrpc_future **f, int rank, const char *fn,
				const shmrpc_value *args, uint32_t n)
{
	CHECK_OK(shmrpc_rpc_sync(rank, fn, args, n, SHMRPC_TIMEOUT_DEFAULT, f));
	return shmrpc_future_value(*f);
}

static void events_and_devices(void)
{
	uintptr_t held = stream_on(0), busy = stream_on(0);
	shmrpc_tensor *t[BATCH];
	shmrpc_value items[BATCH], list;
	const shmrpc_value *v;
	shmrpc_future *f;

	for (int i = 0; i < BATCH; i++) {
		t[i] = tl_fake_cuda_tensor_on(0, LEN, 0x00);
		items[i] = shmrpc_tensor_value(t[i]);
	}
	hold(held, 1);
	memset_async(t[0], 0xab, held);
	for (int i = 1; i < BATCH; i++)
		memset_async(t[i], 0xcd, busy);
	list = shmrpc_list(items, BATCH);
	v = call(&f, 1, "batch", &list, 1);
	CHECK(!v->u.items[1].u.i, "rank 1 read the tensor before rank 0's write ran");
	CHECK(v->u.items[0].u.i == 1, "rank 1 got rank 0's cuda:0 (its cuda:1) as cuda:%lld",
	      (long long)v->u.items[0].u.i);
	shmrpc_future_free(f);
	tl_fake_cuda_device(0);
	hold(held, 0);
	v = call(&f, 1, "batch_read", NULL, 0);
	CHECK(v->u.i == 0xab, "rank 1 read 0x%llx, after the write 0xab",
	      (unsigned long long)v->u.i);
	shmrpc_future_free(f);
	for (int i = 0; i < BATCH; i++)
		shmrpc_tensor_free(t[i]);
}

static void forwarded_to_itself(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor_on(0, LEN, 0x5a);
	shmrpc_value a = shmrpc_tensor_value(t);
	shmrpc_future *f;

	CHECK(shmrpc_rpc_sync(1, "self", &a, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
	      "a tensor rank 1 passes to itself: %s", shmrpc_errmsg());
	CHECK(shmrpc_future_value(f)->u.i == 0x5a, "rank 1 read 0x%llx there, want 0x5a",
	      (unsigned long long)shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	shmrpc_tensor_free(t);
}

static void neighbours(void)
{
	shmrpc_tensor *p = tl_fake_cuda_tensor_on(0, LEN, 0x01), *q = tl_fake_cuda_tensor_on(0, LEN, 0x02);
	shmrpc_value a[2] = { shmrpc_tensor_value(p), shmrpc_tensor_value(q) };
	shmrpc_value both = shmrpc_list(a, 2);
	int64_t opens = tl_fake_cuda_stat(1, TL_CUDA_OPENS);
	shmrpc_future *f;

	/* Held together, then parked in rank 1's idle cache: neither was
	 * taken for an allocation the other replaced. */
	tl_call(1, "keep_all", &both, 1);
	tl_call(1, "release", NULL, 0);
	for (int i = 0; i < 2; i++) {
		CHECK(call(&f, 1, "peek", &a[i], 1)->u.i == 1 + i, "rank 1 read the wrong tensor of "
		      "two neighbours");
		shmrpc_future_free(f);
	}
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_OPENS) == opens + 2, "rank 1 opened %lld mappings for two "
	      "allocations sent twice each, want 2",
	      (long long)(tl_fake_cuda_stat(1, TL_CUDA_OPENS) - opens));
	shmrpc_tensor_free(p);
	shmrpc_tensor_free(q);
}

static void landed_copy(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor_on(0, LEN, 0x77);
	shmrpc_value a = shmrpc_tensor_value(t), h[2] = { shmrpc_int(1), shmrpc_int(1) };
	int64_t allocs = tl_fake_cuda_stat(2, TL_CUDA_ALLOCS);
	shmrpc_future *f;

	tl_call(2, "hold", h, 2);
	/* Rank 0's cuda:0 lands on rank 2's cuda:1: another GPU, a copy,
	 * queued on the stream held there; the call's handle goes after. */
	CHECK(call(&f, 2, "landed", &a, 1)->u.i == 1, "the copy landed on rank 2's cuda:%lld",
	      (long long)shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	usleep(HELD_MS * 1000);
	h[1] = shmrpc_int(0);
	tl_call(2, "hold", h, 2);
	tl_fake_cuda_wait_stat(2, TL_CUDA_ALLOCS, allocs, "rank 2's allocations once the copy went");
	shmrpc_tensor_free(t);
}

static void per_thread(void)
{
	const shmrpc_value *v;
	shmrpc_future *f;

	v = call(&f, 1, "per_thread", NULL, 0);
	CHECK(!v->u.items[1].u.i, "rank 1 released a tensor (its mapping closed) while its "
	      "per-thread stream, where it was read, still had the read queued");
	CHECK(v->u.items[2].u.i == v->u.items[0].u.i - 1, "rank 1's release did not finish once "
	      "the stream was let go (%lld mappings held, want %lld)", (long long)v->u.items[2].u.i,
	      (long long)v->u.items[0].u.i - 1);
	shmrpc_future_free(f);
}

static void loop_never_waits(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor_on(0, LEN, 0x44);
	shmrpc_value a = shmrpc_tensor_value(t);
	shmrpc_future *f;

	call(&f, 1, "relay", &a, 1);
	shmrpc_future_free(f); /* our TENSOR_ACK goes, with the next frame at the latest */
	CHECK(shmrpc_rpc_sync(1, "stats", NULL, 0, HELD_MS * 10, &f) == 0,
	      "rank 1 did not answer while a tensor it had read on a held stream was let go: %s",
	      shmrpc_errmsg());
	shmrpc_future_free(f);
	tl_call(1, "relay_done", NULL, 0);
	shmrpc_tensor_free(t);
}

static void forked(void)
{
	pid_t pid = fork();
	int status;

	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		int rc = cuda_probe();

		_exit(rc == -ENOTSUP && strstr(shmrpc_errmsg(), "forked") ? 0 : 1);
	}
	CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "a child forked after CUDA started was not told CUDA is unusable there");
}

struct pooled {
	DLManagedTensor m;
	int64_t shape[1];
};

static void pooled_delete(DLManagedTensor *m)
{
	int (*mem_free)(uint64_t p) = sym("cuMemFree_v2");

	tl_fake_cuda_device(0);
	CHECK(mem_free((uint64_t)(uintptr_t)m->dl_tensor.data) == 0, "cuMemFree");
	free(m);
}

static void pool_memory(void)
{
	int (*alloc_async)(uint64_t *p, size_t n, uintptr_t s) = sym("cuMemAllocAsync");
	struct pooled *b = calloc(1, sizeof(*b));
	shmrpc_tensor *t;
	shmrpc_value a;
	shmrpc_future *f;
	uint64_t p;

	CHECK(b, "out of memory");
	tl_fake_cuda_device(0);
	CHECK(alloc_async(&p, LEN, 0) == 0, "cuMemAllocAsync");
	b->shape[0] = LEN;
	b->m.dl_tensor = (DLTensor){ .data = (void *)(uintptr_t)p, .device = { kDLCUDA, 0 },
				     .ndim = 1, .dtype = { kDLUInt, 8, 1 }, .shape = b->shape };
	b->m.deleter = pooled_delete;
	CHECK_OK(shmrpc_tensor_from_dlpack(&b->m, &t));
	a = shmrpc_tensor_value(t);
	CHECK(shmrpc_rpc_sync(1, "peek", &a, 1, SHMRPC_TIMEOUT_DEFAULT, &f) != 0 &&
	      strstr(shmrpc_errmsg(), "not supported yet"),
	      "a tensor of pool memory was sent, or refused without saying it is not supported "
	      "yet: %s", shmrpc_errmsg());
	shmrpc_tensor_free(t);
}

static int worker(void)
{
	int rank = atoi(getenv("SHMRPC_RANK"));
	struct shmrpc_device_map_entry map = { "worker2", 0, 1 };
	struct shmrpc_options o = SHMRPC_OPTIONS(.device_maps = &map, .num_device_maps = rank == 0);

	/* Before the first CUDA call: the driver reads it once. */
	CHECK(setenv("CUDA_VISIBLE_DEVICES", rank == 1 ? "1,0" : "0,1", 1) == 0, "setenv");
	CHECK_OK(shmrpc_register("batch", "l", fn_batch, NULL));
	CHECK_OK(shmrpc_register("batch_read", "", fn_batch_read, NULL));
	CHECK_OK(shmrpc_register("peek", "t", fn_peek, NULL));
	CHECK_OK(shmrpc_register("self", "t", fn_self, NULL));
	CHECK_OK(shmrpc_register("make", "", fn_make, NULL));
	CHECK_OK(shmrpc_register("relay", "t", fn_relay, NULL));
	CHECK_OK(shmrpc_register("relay_done", "", fn_relay_done, NULL));
	CHECK_OK(shmrpc_register("per_thread", "", fn_per_thread, NULL));
	CHECK_OK(shmrpc_register("hold", "ii", fn_hold, NULL));
	CHECK_OK(shmrpc_register("landed", "t", fn_landed, NULL));
	tl_fake_cuda_register();
	tl_keep_all_register(2, kept_cuda);
	CHECK_OK(shmrpc_init(&o));
	if (rank == 0) {
		static const struct {
			const char *name;
			void (*run)(void);
		} cases[] = { { "events", events_and_devices }, { "self", forwarded_to_itself },
			      { "neighbours", neighbours },     { "landed", landed_copy },
			      { "per_thread", per_thread },     { "fork", forked },
			      { "pool", pool_memory },          { "loop", loop_never_waits } };
		/* STRICT_CASE names one case to run alone (to see each fail on
		 * its own against an older library); all by default. */
		const char *only = getenv("STRICT_CASE");

		for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
			if (!only || !strcmp(only, cases[i].name))
				cases[i].run();
		printf("rank 0: the strict driver's cases pass\n");
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	tl_keep_all_free();
	return 0;
}

int main(void)
{
	static const char *const texts[] = { "rank 0: the strict driver's cases pass", NULL };

	if (tl_is_worker())
		return worker();
	if (!tl_fake_cuda_use() || access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun or the stand-in CUDA driver (tests/fake_cuda) is not built");
	CHECK(setenv("FAKE_CUDA_DEVICES", "2", 1) == 0, "setenv");
	CHECK(tl_job_expect(worker, 0, texts, "-n", "3", NULL) == 0, "the job");
	return 0;
}
