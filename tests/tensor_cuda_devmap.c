/*
 * CUDA device maps (shmrpc_options.device_maps, torch's set_device_map) on
 * the fake driver with two devices. One job where worker0 maps its cuda:0
 * to worker1's cuda:1 (worker1 gives no map):
 *  - a request's tensor lands on the mapped device, with the sender's
 *    bytes, as a copy (writes to it stay there); the copy is freed when
 *    dropped (worker1's allocations back to where they were), and the
 *    tensor it came from is released in its producer;
 *  - a reply travels by the inverse map (worker1's cuda:1 → worker0's
 *    cuda:0); a reply on worker1's cuda:0, which the inverse does not
 *    cover, fails the call with torch's text; so does a request of
 *    worker0's cuda:1, which its map does not cover;
 *  - worker1, with no map for worker0, hands its cuda:1 tensors over as
 *    before: the same device, shared, not copied.
 * Then one job per bad map, where shmrpc_init fails on every worker with
 * the same sentence (torch's): duplicated target devices, source and
 * target indices beyond the device count, an unknown worker name, a map
 * where CUDA is not available.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "worker/tensor.h"
#include "tests/lib/fakecuda.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"

#define LEN 4096

static uint8_t *bytes(shmrpc_tensor *t)
{
	uint8_t *d = shmrpc_tensor_data(t);

	CHECK(d, "no bytes: %s", shmrpc_errmsg());
	/* A landed copy is queued on its device's stream: read after it. */
	tl_fake_cuda_sync(shmrpc_tensor_dl(t)->device.device_id);
	return d;
}

/* [device, first byte, last byte]; writes 0xee over the first byte. */
static int fn_where(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value *v = shmrpc_call_alloc(c, 3 * sizeof(*v));
	const DLTensor *dl = shmrpc_tensor_dl(a[0].u.t);
	uint8_t *d = bytes(a[0].u.t);

	(void)n, (void)u;
	CHECK(dl && dl->device.device_type == kDLCUDA, "not a CUDA tensor");
	v[0] = shmrpc_int(dl->device.device_id);
	v[1] = shmrpc_int(d[0]);
	v[2] = shmrpc_int(d[LEN - 1]);
	d[0] = 0xee;
	*r = shmrpc_list(v, 3);
	return 0;
}

/* A tensor of ours on device a[0], filled with a[1], returned. */
static int fn_make(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_tensor_value(tl_fake_cuda_tensor_on((int)a[0].u.i, LEN, (uint8_t)a[1].u.i));
	return 0;
}

/* Worker1: a tensor on its cuda:1 sent to worker0, which writes 0xee
 * into it: zero-copy (no map), so the write is here. */
static int fn_shared(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor_on(1, LEN, 0x55);
	shmrpc_value arg = shmrpc_tensor_value(t);
	shmrpc_future *f;
	const shmrpc_value *v;

	(void)a, (void)n, (void)u;
	if (shmrpc_rpc_sync(0, "where", &arg, 1, SHMRPC_TIMEOUT_DEFAULT, &f))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	v = shmrpc_future_value(f);
	CHECK(v->u.items[0].u.i == 1 && v->u.items[1].u.i == 0x55, "worker0 got device %lld, 0x%llx",
	      (long long)v->u.items[0].u.i, (long long)v->u.items[1].u.i);
	shmrpc_future_free(f);
	*r = shmrpc_int(bytes(t)[0]);
	shmrpc_tensor_free(t);
	return 0;
}

static void worker0(void)
{
	shmrpc_tensor *t = tl_fake_cuda_tensor_on(0, LEN, 0x11), *back;
	shmrpc_value args[2] = { shmrpc_tensor_value(t) };
	const shmrpc_value *v;
	int64_t allocs1 = tl_fake_cuda_stat(1, TL_CUDA_ALLOCS), got;
	shmrpc_future *f;
	const DLTensor *dl;

	/* A request: onto worker1's cuda:1, a copy there. */
	CHECK_OK(shmrpc_rpc_sync(1, "where", args, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	v = shmrpc_future_value(f);
	CHECK(v->u.items[0].u.i == 1 && v->u.items[1].u.i == 0x11 && v->u.items[2].u.i == 0x11,
	      "worker1 got device %lld, bytes 0x%llx 0x%llx", (long long)v->u.items[0].u.i,
	      (long long)v->u.items[1].u.i, (long long)v->u.items[2].u.i);
	shmrpc_future_free(f);
	CHECK(bytes(t)[0] == 0x11, "worker1's write reached our memory: not a copy");

	/* The copy is worker1's memory while it holds it, freed when dropped;
	 * then our tensor goes too, once worker1's cache lets it go. */
	tl_call(1, "keep", args, 1);
	tl_fake_cuda_wait_stat(1, TL_CUDA_ALLOCS, allocs1 + 1, "worker1's allocations (the copy kept)");
	tl_call(1, "drop", NULL, 0);
	tl_fake_cuda_wait_stat(1, TL_CUDA_ALLOCS, allocs1, "worker1's allocations after the drop");
	shmrpc_tensor_free(t);
	tl_call(1, "forget", NULL, 0);
	for (int i = 0; i < 500 && tl_fake_cuda_deleted() != 1; i++)
		usleep(10000);
	CHECK(tl_fake_cuda_deleted() == 1 && tl_fake_cuda_allocs() == 0,
	      "our source: %d deleters ran, %d allocations left", tl_fake_cuda_deleted(),
	      tl_fake_cuda_allocs());

	/* A reply: worker1's cuda:1 comes back to our cuda:0. */
	args[0] = shmrpc_int(1);
	args[1] = shmrpc_int(0x22);
	CHECK_OK(shmrpc_rpc_sync(1, "make", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	back = shmrpc_future_value(f)->u.t;
	dl = shmrpc_tensor_dl(back);
	CHECK(dl && dl->device.device_id == 0 && bytes(back)[0] == 0x22 &&
	      bytes(back)[LEN - 1] == 0x22, "the reply landed on device %d",
	      dl ? dl->device.device_id : -1);
	CHECK(tl_fake_cuda_allocs() == 1, "%d allocations here, want the copy's", tl_fake_cuda_allocs());
	shmrpc_future_free(f);
	/* The future's last reference may be the loop thread's, a moment later. */
	for (int i = 0; i < 500 && tl_fake_cuda_allocs(); i++)
		usleep(10000);
	CHECK(tl_fake_cuda_allocs() == 0, "the copy was not freed with its handle");

	/* A reply on worker1's cuda:0, which our map does not reach. */
	args[0] = shmrpc_int(0);
	CHECK(shmrpc_rpc_sync(1, "make", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f) != 0 &&
	      strstr(shmrpc_errmsg(), "Response device mapping is not available for destination "
				      "worker0 for device cuda:0 but received a tensor on that device"),
	      "an unmapped reply: %s", shmrpc_errmsg());
	/* A request of our cuda:1, which our map does not name. */
	t = tl_fake_cuda_tensor_on(1, LEN, 0x33);
	args[0] = shmrpc_tensor_value(t);
	CHECK(shmrpc_rpc_sync(1, "where", args, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == -EINVAL &&
	      strstr(shmrpc_errmsg(), "Request device mapping is not available for destination "
				      "worker1 for device cuda:1 but received a tensor on that device"),
	      "an unmapped request: %s", shmrpc_errmsg());
	shmrpc_tensor_free(t);

	/* No map from worker1 to us: its cuda:1 tensor is shared, as before. */
	CHECK_OK(shmrpc_rpc_sync(1, "shared", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->u.i == 0xee, "worker1 sees 0x%llx: the tensor was copied",
	      (long long)shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	tl_call(1, "forget", NULL, 0);
	/* The argument of worker1's call here is freed (and parked in our
	 * cache) after its reply went: maybe after a first forget. */
	for (int tries = 0; (got = tl_fake_cuda_stat(1, TL_CUDA_ALLOCS)) != 0 && tries < 500; tries++) {
		tensor_idle_forget(0);
		usleep(10000);
	}
	CHECK(got == 0, "worker1 has %lld allocations left", (long long)got);
	fprintf(stderr, "worker0: device maps landed and released\n");
}

static const char *name_of(int rank)
{
	return rank ? "worker1" : "worker0";
}

/* The maps of each case, by rank. */
static void maps_of(const char *kase, int rank, struct shmrpc_device_map_entry *m, uint32_t *n)
{
	*n = 0;
	if (!strcmp(kase, "good") || !strcmp(kase, "nocuda")) {
		if (rank == 0)
			m[(*n)++] = (struct shmrpc_device_map_entry){ "worker1", 0, 1 };
	} else if (!strcmp(kase, "duplicate")) {
		if (rank == 0) {
			m[(*n)++] = (struct shmrpc_device_map_entry){ "worker1", 0, 1 };
			m[(*n)++] = (struct shmrpc_device_map_entry){ "worker1", 1, 1 };
		}
	} else if (!strcmp(kase, "source")) {
		if (rank == 1)
			m[(*n)++] = (struct shmrpc_device_map_entry){ "worker0", 5, 0 };
	} else if (!strcmp(kase, "target")) {
		if (rank == 0)
			m[(*n)++] = (struct shmrpc_device_map_entry){ "worker1", 0, 3 };
	} else if (!strcmp(kase, "unknown")) {
		if (rank == 1)
			m[(*n)++] = (struct shmrpc_device_map_entry){ "nosuch", 0, 0 };
	}
}

static int worker(void)
{
	const char *kase = getenv("DEVMAP_CASE");
	int rank = atoi(getenv("SHMRPC_RANK"));
	struct shmrpc_device_map_entry m[2];
	struct shmrpc_options o = SHMRPC_OPTIONS(.name = name_of(rank), .device_maps = m);
	int rc;

	CHECK(kase, "DEVMAP_CASE is not set");
	maps_of(kase, rank, m, &o.num_device_maps);
	CHECK_OK(shmrpc_register("where", "t", fn_where, NULL));
	CHECK_OK(shmrpc_register("make", "ii", fn_make, NULL));
	tl_fake_cuda_register();
	CHECK_OK(shmrpc_register("shared", "", fn_shared, NULL));
	tl_keep_register();
	rc = shmrpc_init(&o);
	if (strcmp(kase, "good")) {
		CHECK(rc == -EINVAL, "shmrpc_init returned %d (%s)", rc, shmrpc_errmsg());
		/* One line, for the test to find it once per worker. */
		fprintf(stderr, "%s: init failed: %.*s\n", name_of(rank),
			(int)strcspn(shmrpc_errmsg(), "\n"), shmrpc_errmsg());
		return 0;
	}
	CHECK_OK(rc);
	if (rank == 0)
		worker0();
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

/* Runs the job of kase; both workers must fail with want. */
static void bad(const char *kase, const char *want)
{
	char w0[256], w1[256];
	const char *texts[] = { w0, w1, NULL };

	snprintf(w0, sizeof(w0), "worker0: init failed: %s", want);
	snprintf(w1, sizeof(w1), "worker1: init failed: %s", want);
	CHECK(setenv("DEVMAP_CASE", kase, 1) == 0, "setenv");
	CHECK(tl_job_expect(worker, 0, texts, "-n", "2", NULL) == 0, "case %s", kase);
}

int main(void)
{
	static const char *const texts[] = { "worker0: device maps landed and released", NULL };

	if (tl_is_worker())
		return worker();
	if (!tl_fake_cuda_use() || access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun or the stand-in CUDA driver (tests/fake_cuda) is not built");
	CHECK(setenv("FAKE_CUDA_DEVICES", "2", 1) == 0 && setenv("DEVMAP_CASE", "good", 1) == 0,
	      "setenv");
	CHECK(tl_job_expect(worker, 0, texts, "-n", "2", NULL) == 0, "the job with maps");
	bad("duplicate", "Node worker0 has duplicated target devices in its device map for worker1");
	bad("source", "Node worker1 has source devices with invalid indices in its device map for "
		      "worker0");
	bad("target", "Node worker0 has target devices with invalid indices in its device map for "
		      "worker1");
	bad("unknown", "Node worker1 has invalid target node names in its device maps");
	CHECK(setenv("SHMRPC_LIBCUDA", "/nonexistent/libcuda.so.1", 1) == 0, "setenv");
	bad("nocuda", "Node worker0 has device maps, but CUDA is not available on this machine");
	return 0;
}
