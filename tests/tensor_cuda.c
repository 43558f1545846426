/*
 * CUDA device tensors are handed over through CUDA IPC, never copied, on
 * the fake driver (tests/fake_cuda: host memory playing device memory,
 * shared between the processes). Three workers:
 *  - Rank 0 sends a device tensor to rank 1, which reads rank 0's bytes in
 *    place, writes into them and returns the tensor: rank 0 sees the
 *    writes in its own memory and gets its own pointer back.
 *  - Passed on: rank 1 sends the tensor it received to rank 2, which writes
 *    into rank 0's memory too (the producer's descriptor, rank 1's event).
 *  - Caches: while rank 1 keeps one handle, more sends of the same tensor
 *    open nothing there (its mapping cache) and take no new IPC handle
 *    here (the producer's handle cache). A warm echo (rank 1 returns the
 *    tensor and keeps no handle) opens nothing either: rank 1's idle
 *    cache keeps the mapping, and its pin keeps our tensor: its deleter
 *    does not run while we let go, until TENSOR_IDLE_MAPS other tensors
 *    through ranks 1 and 2 push it out of their caches; then it runs once.
 *  - Results: rank 1 makes a device tensor and returns it; rank 0 writes
 *    into it and rank 1 sees the write. Rank 1 keeps the tensor while our
 *    idle cache holds it, and releases it once we forget it.
 *  - Drained: rank 1 reads a tensor on a stream of its own (waiting on the
 *    producer's event there); when it lets the tensor go, it first waits
 *    for that stream and its legacy default one (kernels still reading
 *    must finish before the producer may reuse the memory).
 *  - A producer that frees an allocation rank 1 caches (breaking the rule)
 *    and allocates another over its addresses: rank 1 drops the cached
 *    entry when the new one comes, releasing its pin.
 *  - Lifetime: once every receiver let go (cache entries forgotten), each
 *    producer releases its sources: the DLPack deleters run exactly once,
 *    the driver has no allocation left, the tokens are gone from the pool
 *    (empty), and the receivers' mappings are closed. What the caches
 *    hold at shutdown is released before the barrier: rank 0's last
 *    tensor, cached by rank 1, is released by rank 0's shutdown.
 *  - The API's edges: no pool offset for a device tensor, no stream (set
 *    or waited on) for a CPU one, shmrpc_tensor_dl says kDLCUDA, a descriptor of another
 *    device type is refused.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "worker/cuda.h"
#include "worker/tensor.h"
#include "tests/lib/fakecuda.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define LEN 65536
#define OWN_BLOCK (4u << 20)
#define REPEATS 4

/* A handle kept across calls; set and taken on executor threads that TSan
 * cannot see ordered (the order comes through rank 0). */
static shmrpc_tensor *_Atomic made;

static uint8_t *bytes(shmrpc_tensor *t)
{
	uint8_t *d = shmrpc_tensor_data(t);

	CHECK(d, "no bytes: %s", shmrpc_errmsg());
	return d;
}

/* Checks the argument is rank 0's tensor of a.u.i's fill, marks both ends,
 * and returns it. */
static int fn_touch(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const DLTensor *dl = shmrpc_tensor_dl(a[0].u.t);
	uint8_t *d = bytes(a[0].u.t);

	(void)c, (void)n, (void)u;
	CHECK(dl && dl->device.device_type == kDLCUDA && dl->device.device_id == 0 &&
	      dl->ndim == 1 && dl->shape[0] == LEN && dl->data == d, "the received tensor's DLTensor");
	CHECK(shmrpc_tensor_nbytes(a[0].u.t) == LEN, "nbytes");
	CHECK(d[1] == (uint8_t)a[1].u.i && d[LEN / 2] == (uint8_t)a[1].u.i,
	      "rank 0's bytes are not there: 0x%x", d[1]);
	d[0] = 0xa5;
	d[LEN - 1] = 0x5a;
	*r = a[0];
	return 0;
}

/* Rank 1: passes its argument on to rank 2 ("mark"), returns nil. */
static int fn_pass(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_future *f;

	(void)n, (void)u;
	if (shmrpc_rpc_sync(2, "mark", a, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	shmrpc_future_free(f);
	*r = shmrpc_nil();
	return 0;
}

/* The stream "consume" read its tensor on, for "consumer_syncs". */
static _Atomic uintptr_t consumer;

/* Rank 1: its work on the argument goes on a stream of its own. */
static int fn_consume(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	uintptr_t s = tl_fake_cuda_stream();

	(void)n, (void)u;
	if (shmrpc_tensor_cuda_wait(a[0].u.t, s))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	atomic_store(&consumer, s);
	*r = shmrpc_nil();
	return 0;
}

/* Rank 1: how often that stream was synchronized. */
static int fn_consumer_syncs(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			     void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(tl_fake_cuda_syncs(atomic_load(&consumer)));
	return 0;
}

/* Rank 2: writes a mark into the tensor passed on. */
static int fn_mark(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	bytes(a[0].u.t)[2] = 0x77;
	*r = shmrpc_nil();
	return 0;
}

/* Rank 1: a device tensor of its own, returned (and kept, to look at). */
static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor(LEN, (uint8_t)a[0].u.i), *mine;

	(void)n, (void)u;
	if (shmrpc_tensor_retain(t, &mine))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	atomic_store(&made, mine);
	*r = shmrpc_tensor_value(t); /* the call frees t once the caller has it */
	return 0;
}

/* Rank 1: the byte rank 0 wrote into the made tensor; lets it go. */
static int fn_seen(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_tensor *t = atomic_exchange(&made, NULL);

	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(bytes(t)[3]);
	shmrpc_tensor_free(t);
	return 0;
}

static void edges(shmrpc_tensor *t)
{
	int64_t shape[1] = { 16 };
	int32_t vulkan = kDLVulkan, ndim = 1;
	uint8_t wire[40] = { 0 };
	shmrpc_tensor *cpu;

	CHECK(shmrpc_tensor_pool_offset(t) == UINT64_MAX && strstr(shmrpc_errmsg(), "not in the pool"),
	      "pool offset of a device tensor: %s", shmrpc_errmsg());
	/* A descriptor (docs/PROTOCOL.md) of a device this build cannot take. */
	memcpy(wire + 8, &(uint64_t){ 16 }, 8);
	wire[16] = kDLUInt, wire[17] = 8, wire[18] = 1;
	memcpy(wire + 20, &ndim, 4);
	memcpy(wire + 24, &vulkan, 4);
	memcpy(wire + 32, &(int64_t){ 16 }, 8);
	CHECK(tensor_unpack((const char *)wire, sizeof(wire), NULL, NULL, &cpu) == -ENOTSUP &&
	      strstr(shmrpc_errmsg(), "device type 7 came in"), "a Vulkan descriptor: %s",
	      shmrpc_errmsg());
	CHECK_OK(shmrpc_tensor_alloc((DLDataType){ kDLUInt, 8, 1 }, 1, shape, &cpu));
	CHECK(shmrpc_tensor_set_cuda_stream(cpu, 0) == -EINVAL, "a stream for a CPU tensor");
	CHECK(shmrpc_tensor_cuda_wait(cpu, 0) == -EINVAL, "a CPU tensor has nothing to wait for");
	CHECK(shmrpc_tensor_dl(cpu)->device.device_type == kDLCPU, "CPU tensor's device");
	shmrpc_tensor_free(cpu);
}

/* A tensor over device memory the test frees itself: its deleter only
 * counts. */
struct borrowed {
	DLManagedTensor m;
	int64_t shape[1];
};

static atomic_int borrowed_deleted;

static void borrowed_delete(DLManagedTensor *m)
{
	free(m);
	atomic_fetch_add(&borrowed_deleted, 1);
}

static shmrpc_tensor *borrow(uint64_t p)
{
	struct borrowed *b = calloc(1, sizeof(*b));
	shmrpc_tensor *t;

	CHECK(b, "out of memory");
	b->shape[0] = LEN;
	b->m.dl_tensor = (DLTensor){ .data = (void *)(uintptr_t)p,
				     .device = { kDLCUDA, 0 },
				     .ndim = 1,
				     .dtype = { kDLUInt, 8, 1 },
				     .shape = b->shape };
	b->m.deleter = borrowed_delete;
	CHECK_OK(shmrpc_tensor_from_dlpack(&b->m, &t));
	return t;
}

/*
 * A producer that breaks the rule: it frees an allocation that rank 1
 * caches and allocates another over its addresses. Rank 1 sees the
 * overlap when the new one comes: the cached entry goes (its pin too).
 */
static void reused(void)
{
	int (*mem_alloc)(uint64_t *p, size_t n) = cuda_sym("cuMemAlloc_v2");
	int (*mem_free)(uint64_t p) = cuda_sym("cuMemFree_v2");
	int64_t opens = tl_fake_cuda_stat(1, TL_CUDA_OPENS);
	uint64_t x, y;
	shmrpc_tensor *t;
	shmrpc_value v;

	tl_fake_cuda_thread();
	/* Of a block of its own (the fake sub-allocates smaller ones from
	 * blocks it keeps), whose addresses the next such allocation gets. */
	CHECK(mem_alloc && mem_free && mem_alloc(&x, OWN_BLOCK) == 0, "cuMemAlloc");
	t = borrow(x);
	v = shmrpc_tensor_value(t);
	tl_call(1, "mark", &v, 1);
	shmrpc_tensor_free(t);
	tl_fake_cuda_wait_stat(1, TL_CUDA_MAPS_OPEN, 1, "mappings open");
	usleep(5 * TENSOR_REAP_NS / 1000);
	CHECK(atomic_load(&borrowed_deleted) == 0, "released while rank 1 caches it");
	CHECK(mem_free(x) == 0 && mem_alloc(&y, OWN_BLOCK) == 0, "cuMemFree, cuMemAlloc");
	CHECK(y == x, "the fake driver gave other addresses (0x%llx, then 0x%llx)",
	      (unsigned long long)x, (unsigned long long)y);
	t = borrow(y);
	v = shmrpc_tensor_value(t);
	tl_call(1, "mark", &v, 1);
	shmrpc_tensor_free(t);
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_OPENS) == opens + 2, "rank 1 opened %lld mappings, want 2",
	      (long long)(tl_fake_cuda_stat(1, TL_CUDA_OPENS) - opens));
	/* The first went when the second came: its source, then the second's
	 * once forgotten. */
	tl_fake_cuda_wait_stat(1, TL_CUDA_MAPS_OPEN, 1, "mappings open");
	for (int i = 0; i < 500 && atomic_load(&borrowed_deleted) != 1; i++)
		usleep(10000);
	CHECK(atomic_load(&borrowed_deleted) == 1, "%d borrowed sources released, want 1",
	      atomic_load(&borrowed_deleted));
	tl_call(1, "forget", NULL, 0);
	tl_fake_cuda_wait_stat(1, TL_CUDA_MAPS_OPEN, 0, "mappings open");
	for (int i = 0; i < 500 && atomic_load(&borrowed_deleted) != 2; i++)
		usleep(10000);
	CHECK(atomic_load(&borrowed_deleted) == 2, "%d borrowed sources released, want 2",
	      atomic_load(&borrowed_deleted));
	CHECK(mem_free(y) == 0, "cuMemFree");
}

/* Rank 1 drains the streams it used a tensor on before letting it go (its
 * argument goes after the reply: polled). */
static void drained(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor(LEN, 0x33);
	shmrpc_value v = shmrpc_tensor_value(t);
	int64_t legacy = tl_fake_cuda_stat(1, TL_CUDA_SYNCS), syncs = 0;
	int deleted = tl_fake_cuda_deleted();
	shmrpc_future *f;

	tl_call(1, "consume", &v, 1);
	for (int i = 0; i < 500 && syncs < 1; i++) {
		CHECK_OK(shmrpc_rpc_sync(1, "consumer_syncs", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
		syncs = shmrpc_future_value(f)->u.i;
		shmrpc_future_free(f);
		if (syncs < 1)
			usleep(10000);
	}
	CHECK(syncs == 1, "rank 1 synchronized its consumer stream %lld times, want 1",
	      (long long)syncs);
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_SYNCS) > legacy,
	      "rank 1 did not synchronize its legacy default stream");
	shmrpc_tensor_free(t);
	tl_call(1, "forget", NULL, 0);
	/* Gone before reused() counts on the driver's addresses. */
	for (int i = 0; i < 500 && tl_fake_cuda_deleted() != deleted + 1; i++)
		usleep(10000);
	CHECK(tl_fake_cuda_deleted() == deleted + 1, "the consumed tensor was not released");
}

static void rank0(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor(LEN, 0x11), *back;
	uint8_t *d = bytes(t);
	shmrpc_value args[2] = { shmrpc_tensor_value(t), shmrpc_int(0x11) };
	struct cuda_stats before, after;
	int64_t opens, hits;
	shmrpc_future *f;

	edges(t);
	CHECK_OK(shmrpc_tensor_set_cuda_stream(t, tl_fake_cuda_stream()));

	/* There and back: rank 1 wrote into our memory, we get our pointer. */
	CHECK_OK(shmrpc_rpc_sync(1, "touch", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(d[0] == 0xa5 && d[LEN - 1] == 0x5a, "rank 1's writes are not in our memory");
	back = shmrpc_future_value(f)->u.t;
	CHECK(shmrpc_tensor_data(back) == d && shmrpc_tensor_nbytes(back) == LEN &&
	      shmrpc_tensor_dl(back)->device.device_type == kDLCUDA,
	      "the result is not our own tensor");
	shmrpc_future_free(f);

	/* Passed on by rank 1 to rank 2. */
	tl_call(1, "pass", args, 1);
	CHECK(d[2] == 0x77, "rank 2's write is not in our memory");

	/* Caches: rank 1 keeps a handle; more sends open nothing. */
	tl_call(1, "keep", args, 1);
	opens = tl_fake_cuda_stat(1, TL_CUDA_OPENS);
	hits = tl_fake_cuda_stat(1, TL_CUDA_CACHE_HITS);
	cuda_stats_get(&before);
	for (int i = 0; i < REPEATS; i++)
		tl_call(1, "touch", args, 2);
	cuda_stats_get(&after);
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_OPENS) == opens && tl_fake_cuda_stat(1, TL_CUDA_CACHE_HITS) == hits + REPEATS,
	      "rank 1: %lld opens and %lld cache hits for %d sends of a mapped tensor",
	      (long long)(tl_fake_cuda_stat(1, TL_CUDA_OPENS) - opens), (long long)(tl_fake_cuda_stat(1, TL_CUDA_CACHE_HITS) - hits), REPEATS);
	CHECK(after.exports == before.exports + REPEATS &&
	      after.handle_cache_hits == before.handle_cache_hits + REPEATS,
	      "%llu exports, %llu handle cache hits for %d sends",
	      (unsigned long long)(after.exports - before.exports),
	      (unsigned long long)(after.handle_cache_hits - before.handle_cache_hits), REPEATS);
	tl_call(1, "drop", NULL, 0);

	/* A warm echo: rank 1 holds no handle between the calls; its idle
	 * cache keeps the mapping. */
	opens = tl_fake_cuda_stat(1, TL_CUDA_OPENS);
	hits = tl_fake_cuda_stat(1, TL_CUDA_CACHE_HITS);
	for (int i = 0; i < REPEATS; i++)
		tl_call(1, "touch", args, 2);
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_OPENS) == opens && tl_fake_cuda_stat(1, TL_CUDA_CACHE_HITS) == hits + REPEATS,
	      "rank 1: %lld opens and %lld cache hits for %d echoes",
	      (long long)(tl_fake_cuda_stat(1, TL_CUDA_OPENS) - opens), (long long)(tl_fake_cuda_stat(1, TL_CUDA_CACHE_HITS) - hits), REPEATS);
	tl_fake_cuda_wait_stat(1, TL_CUDA_MAPS_OPEN, 1, "mappings open");

	/* Their caches pin our source: it stays, after we let go too, until
	 * other tensors push it out of both. */
	CHECK(tl_fake_cuda_deleted() == 0, "the deleter ran while the tensor is ours");
	shmrpc_tensor_free(t);
	usleep(5 * TENSOR_REAP_NS / 1000);
	CHECK(tl_fake_cuda_deleted() == 0, "the deleter ran while ranks 1 and 2 cache the mapping");
	for (int i = 0; i < TENSOR_IDLE_MAPS; i++) {
		shmrpc_tensor *o = tl_fake_cuda_tensor(LEN, (uint8_t)i);
		shmrpc_value v = shmrpc_tensor_value(o);

		tl_call(1, "mark", &v, 1);
		tl_call(2, "mark", &v, 1);
		shmrpc_tensor_free(o);
	}
	for (int i = 0; i < 500 && !tl_fake_cuda_deleted(); i++)
		usleep(10000);
	usleep(5 * TENSOR_REAP_NS / 1000);
	CHECK(tl_fake_cuda_deleted() == 1, "%d deleters ran here", tl_fake_cuda_deleted());
	CHECK(tl_fake_cuda_allocs() == TENSOR_IDLE_MAPS, "%d allocations left, want %d",
	      tl_fake_cuda_allocs(), TENSOR_IDLE_MAPS);
	tl_fake_cuda_wait_stat(1, TL_CUDA_MAPS_OPEN, TENSOR_IDLE_MAPS, "mappings open");
	tl_fake_cuda_wait_stat(2, TL_CUDA_MAPS_OPEN, TENSOR_IDLE_MAPS, "mappings open");
	/* Forgotten: the rest go, each once. */
	tl_call(1, "forget", NULL, 0);
	tl_call(2, "forget", NULL, 0);
	for (int i = 0; i < 500 && tl_fake_cuda_allocs(); i++)
		usleep(10000);
	CHECK(tl_fake_cuda_deleted() == 1 + TENSOR_IDLE_MAPS && tl_fake_cuda_allocs() == 0,
	      "%d deleters ran, %d allocations left", tl_fake_cuda_deleted(), tl_fake_cuda_allocs());
	tl_fake_cuda_wait_stat(1, TL_CUDA_MAPS_OPEN, 0, "mappings open");
	tl_fake_cuda_wait_stat(2, TL_CUDA_MAPS_OPEN, 0, "mappings open");

	/* A result: rank 1's tensor, written here, seen there. */
	args[0] = shmrpc_int(0x22);
	CHECK_OK(shmrpc_rpc_sync(1, "make", args, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	back = shmrpc_future_value(f)->u.t;
	d = bytes(back);
	CHECK(d[0] == 0x22 && d[LEN - 1] == 0x22, "rank 1's bytes are not there");
	d[3] = 0x33;
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_DELETED) == 0, "rank 1 released its tensor while we hold it");
	shmrpc_future_free(f);
	CHECK_OK(shmrpc_rpc_sync(1, "seen", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->u.i == 0x33, "rank 1 saw 0x%llx",
	      (long long)shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	usleep(5 * TENSOR_REAP_NS / 1000);
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_DELETED) == 0, "rank 1 released its tensor while our cache holds it");
	cuda_stats_get(&after);
	CHECK(after.maps_open == 1, "%u mappings open here", after.maps_open);
	tensor_idle_forget(0);
	tl_fake_cuda_wait_stat(1, TL_CUDA_DELETED, 1, "deleters run");
	CHECK(tl_fake_cuda_stat(1, TL_CUDA_ALLOCS) == 0, "rank 1 has %lld allocations left", (long long)tl_fake_cuda_stat(1, TL_CUDA_ALLOCS));
	cuda_stats_get(&after);
	CHECK(after.maps_open == 0, "%u mappings open here", after.maps_open);

	/* The tokens went with the sources. */
	for (int i = 0; i < 500 && tl_pool_used(); i++)
		usleep(10000);
	CHECK(tl_pool_used() == 0, "the pool still holds %llu bytes", (unsigned long long)tl_pool_used());
	CHECK(tl_fake_cuda_deleted() == 1 + TENSOR_IDLE_MAPS, "%d deleters ran here",
	      tl_fake_cuda_deleted());

	drained();
	reused();

	/* Left in rank 1's cache for the shutdowns. */
	t = tl_fake_cuda_tensor(LEN, 0x44);
	args[0] = shmrpc_tensor_value(t);
	tl_call(1, "mark", args, 1);
	shmrpc_tensor_free(t);
	tl_fake_cuda_wait_stat(1, TL_CUDA_MAPS_OPEN, 1, "mappings open");
	fprintf(stderr, "rank 0: device tensors handed over and released\n");
}

static int worker(void)
{
	int rank;

	CHECK_OK(shmrpc_register("touch", "ti", fn_touch, NULL));
	CHECK_OK(shmrpc_register("pass", "t", fn_pass, NULL));
	CHECK_OK(shmrpc_register("mark", "t", fn_mark, NULL));
	tl_keep_register();
	tl_fake_cuda_register();
	CHECK_OK(shmrpc_register("make", "i", fn_make, NULL));
	CHECK_OK(shmrpc_register("seen", "", fn_seen, NULL));
	CHECK_OK(shmrpc_register("consume", "t", fn_consume, NULL));
	CHECK_OK(shmrpc_register("consumer_syncs", "", fn_consumer_syncs, NULL));
	CHECK_OK(shmrpc_init(NULL));
	rank = shmrpc_rank();
	if (rank == 0)
		rank0();
	CHECK_OK(shmrpc_shutdown(1, 60000));
	if (rank == 0) {
		/* Rank 1 emptied its cache before the barrier: our last tensor
		 * went in our shutdown, with no report of it held. The first,
		 * the cache's TENSOR_IDLE_MAPS, drained()'s and the last. */
		CHECK(tl_fake_cuda_deleted() == 3 + TENSOR_IDLE_MAPS && tl_fake_cuda_allocs() == 0,
		      "after shutdown: %d deleters ran, %d allocations left", tl_fake_cuda_deleted(),
		      tl_fake_cuda_allocs());
		fprintf(stderr, "rank 0: released at shutdown\n");
	}
	return 0;
}

int main(void)
{
	static const char *const texts[] = { "rank 0: device tensors handed over and released",
					     "rank 0: released at shutdown", NULL };

	if (!tl_is_worker() && !tl_fake_cuda_use())
		return tl_skip("the stand-in CUDA driver (tests/fake_cuda) is not built");
	return tl_job_expect(worker, 0, texts, "-n", "3", NULL);
}
