/*
 * Small tensors travel inside the frame (issue 20; worker/tensor.h):
 *  - at the threshold's boundary (inline_max - 1, inline_max, inline_max + 1
 *    bytes), a tensor taken from plain memory goes inline up to it and by
 *    the pool above it, its bytes echoed back intact either way;
 *  - several dtypes and shapes, and zero-size tensors, echo intact;
 *  - a pool tensor (shmrpc_tensor_alloc) of a few bytes is still handed
 *    over by reference: what the callee writes, the caller sees;
 *  - a message whose small tensors pass half a frame sends the rest by the
 *    pool (copies made at send time), in a call, its reply and an RRef's
 *    value, all intact, the copies freed after;
 *  - 1,000,000 small tensors received and kept live in one worker (250 a
 *    call), with no pool block or holder record used on either side;
 *  - a corrupt inline descriptor (length, device, shape, dimensions) fails
 *    the call with a sentence, and the callee goes on serving.
 * Scaled down under the sanitizers.
 */
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "shm/pool.h"
#include "tests/lib/job.h"
#include "tests/lib/keep.h"
#include "tests/lib/settle.h"
#include "tests/lib/testlib.h"
#include "worker/client.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/value.h"

#define PER_CALL 250
#define TOTAL 1000000
#define SETTLE_NS 60000000000ull

struct plain {
	DLManagedTensor m;
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
};

static void plain_delete(DLManagedTensor *m)
{
	free(m->dl_tensor.data);
	free(m);
}

/* A tensor taken from malloc'd memory (as a plain torch tensor is), its
 * byte i holding seed + i. */
static shmrpc_tensor *plain_tensor(DLDataType dt, int32_t ndim, const int64_t *shape, int seed)
{
	struct plain *p = calloc(1, sizeof(*p));
	uint64_t n = (dt.bits * dt.lanes + 7u) / 8u;
	shmrpc_tensor *t;

	CHECK(p, "calloc");
	for (int32_t i = 0; i < ndim; i++)
		n *= (uint64_t)shape[i];
	if (ndim) /* a scalar's shape is NULL */
		memcpy(p->shape, shape, (size_t)ndim * sizeof(*shape));
	p->m.dl_tensor = (DLTensor){ .data = malloc(n ? n : 1), .device = { kDLCPU, 0 },
				     .ndim = ndim, .dtype = dt, .shape = p->shape };
	CHECK(p->m.dl_tensor.data, "malloc");
	for (uint64_t i = 0; i < n; i++)
		((uint8_t *)p->m.dl_tensor.data)[i] = (uint8_t)(seed + (int)i);
	p->m.deleter = plain_delete;
	CHECK_OK(shmrpc_tensor_from_dlpack(&p->m, &t));
	return t;
}

static bool in_pool(const shmrpc_tensor *t)
{
	return shmrpc_tensor_pool_offset(t) != UINT64_MAX;
}

static bool same(const shmrpc_tensor *a, const shmrpc_tensor *b)
{
	const DLTensor *x = shmrpc_tensor_dl(a), *y = shmrpc_tensor_dl(b);

	if (x->ndim != y->ndim || memcmp(&x->dtype, &y->dtype, sizeof(x->dtype)) ||
	    shmrpc_tensor_nbytes(a) != shmrpc_tensor_nbytes(b))
		return false;
	for (int32_t i = 0; i < x->ndim; i++)
		if (x->shape[i] != y->shape[i])
			return false;
	return memcmp(x->data, y->data, shmrpc_tensor_nbytes(a)) == 0;
}

/* [the argument, whether the callee got it in the pool] */
static int fn_where(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_value *items = shmrpc_call_alloc(c, 2 * sizeof(*items));

	(void)n, (void)u;
	if (!items)
		return shmrpc_call_error(c, "RuntimeError", "out of memory");
	items[0] = a[0];
	items[1] = shmrpc_bool(in_pool(a[0].u.t));
	*r = shmrpc_list(items, 2);
	return 0;
}

static int fn_echo(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = a[0];
	return 0;
}

static int fn_write(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	memset(shmrpc_tensor_data(a[0].u.t), 0x5a, shmrpc_tensor_nbytes(a[0].u.t));
	*r = shmrpc_nil();
	return 0;
}

/* [the argument, a list, and how many of its tensors came in the pool] */
static int fn_count_pool(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			 void *u)
{
	shmrpc_value *items = shmrpc_call_alloc(c, 2 * sizeof(*items));
	int64_t k = 0;

	(void)n, (void)u;
	if (!items)
		return shmrpc_call_error(c, "RuntimeError", "out of memory");
	for (uint32_t i = 0; i < a[0].len; i++)
		k += in_pool(a[0].u.items[i].u.t);
	items[0] = a[0];
	items[1] = shmrpc_int(k);
	*r = shmrpc_list(items, 2);
	return 0;
}

/* The kept tensors are inline ones: none in the pool, nothing of the pool
 * used or recorded here, each holding its index. */
static int check_kept(shmrpc_call *c, shmrpc_tensor *const *kept, int n)
{
	struct pool_stats st;

	pool_stats(&worker_agent->pool, &st);
	if (st.used || st.refs_held)
		return shmrpc_call_error(c, "ValueError", "holding %d inline tensors, the pool has "
					 "%llu bytes used and %llu references recorded", n,
					 (unsigned long long)st.used,
					 (unsigned long long)st.refs_held);
	for (int i = 0; i < n; i++)
		if (in_pool(kept[i]) || *(int64_t *)shmrpc_tensor_data(kept[i]) != i)
			return shmrpc_call_error(c, "ValueError", "tensor %d: in the pool %d, holds "
						 "%lld", i, in_pool(kept[i]),
						 (long long)*(int64_t *)shmrpc_tensor_data(kept[i]));
	return 0;
}

/* Sends t to "where": checks how it went and that its echo is intact. */
static void check_where(shmrpc_tensor *t, bool want_pool, const char *what)
{
	shmrpc_value v = shmrpc_tensor_value(t);
	const shmrpc_value *res;
	shmrpc_future *f;

	CHECK(in_pool(t) == want_pool, "%s: taken %s", what, want_pool ? "inline" : "in the pool");
	CHECK(shmrpc_rpc_sync(1, "where", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == 0, "%s: %s", what,
	      shmrpc_errmsg());
	res = shmrpc_future_value(f);
	CHECK(res->type == SHMRPC_LIST && res->len == 2, "%s: a reply of type %u", what, res->type);
	CHECK(res->u.items[1].u.b == want_pool, "%s: the callee got it %s", what,
	      res->u.items[1].u.b ? "in the pool" : "inline");
	CHECK(in_pool(res->u.items[0].u.t) == want_pool, "%s: came back %s", what,
	      want_pool ? "inline" : "in the pool");
	CHECK(same(t, res->u.items[0].u.t), "%s: the echo differs", what);
	shmrpc_future_free(f);
}

static void boundary(void)
{
	const DLDataType u8 = { kDLUInt, 8, 1 };
	int64_t max = worker_agent->inline_max;
	char what[64];

	for (int64_t d = -1; d <= 1; d++) {
		int64_t shape[1] = { max + d };
		shmrpc_tensor *t = plain_tensor(u8, 1, shape, (int)d);

		snprintf(what, sizeof(what), "%lld bytes (threshold %lld)", (long long)shape[0],
			 (long long)max);
		check_where(t, d > 0, what);
		shmrpc_tensor_free(t);
	}
}

static void dtypes(void)
{
	static const DLDataType dt[] = { { kDLFloat, 32, 1 }, { kDLFloat, 64, 1 },
					 { kDLFloat, 16, 1 }, { kDLBfloat, 16, 1 },
					 { kDLInt, 8, 1 },    { kDLInt, 16, 1 },
					 { kDLInt, 32, 1 },   { kDLInt, 64, 1 },
					 { kDLUInt, 8, 1 },   { kDLComplex, 64, 1 } };
	static const int64_t shapes[][3] = { { 3, 5, 2 }, { 0, 0, 0 }, { 4, 0, 7 } };
	static const int32_t ndims[] = { 3, 1, 3 };
	char what[64];

	for (size_t i = 0; i < sizeof(dt) / sizeof(dt[0]); i++) {
		for (size_t s = 0; s < 3; s++) {
			shmrpc_tensor *t = plain_tensor(dt[i], ndims[s], shapes[s], (int)i);

			snprintf(what, sizeof(what), "dtype %u/%u, shape %zu", dt[i].code,
				 dt[i].bits, s);
			check_where(t, false, what);
			shmrpc_tensor_free(t);
		}
	}
	/* A scalar (no dimension). */
	shmrpc_tensor *t = plain_tensor(dt[0], 0, NULL, 9);

	check_where(t, false, "a scalar");
	shmrpc_tensor_free(t);
}

/* A tiny pool tensor goes by reference: the callee's write shows here. */
static void by_reference(void)
{
	const DLDataType u8 = { kDLUInt, 8, 1 };
	int64_t shape[1] = { 16 };
	shmrpc_tensor *t;
	shmrpc_future *f;
	shmrpc_value v;

	CHECK_OK(shmrpc_tensor_alloc(u8, 1, shape, &t));
	memset(shmrpc_tensor_data(t), 0, 16);
	check_where(t, true, "a 16-byte pool tensor");
	v = shmrpc_tensor_value(t);
	CHECK_OK(shmrpc_rpc_sync(1, "write", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	shmrpc_future_free(f);
	for (int i = 0; i < 16; i++)
		CHECK(((uint8_t *)shmrpc_tensor_data(t))[i] == 0x5a,
		      "byte %d of a pool tensor is %u after the callee wrote it", i,
		      ((uint8_t *)shmrpc_tensor_data(t))[i]);
	shmrpc_tensor_free(t);
}

/* BUDGET_N tensors of inline_max bytes: more than half a frame. */
#define BUDGET_N 40

/* BUDGET_N plain tensors of inline_max bytes made here, tensor i as
 * plain_tensor(..., i) makes it. */
static int fn_make_plain(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			 void *u)
{
	const DLDataType u8 = { kDLUInt, 8, 1 };
	int64_t shape[1] = { worker_agent->inline_max };
	shmrpc_value *items = shmrpc_call_alloc(c, BUDGET_N * sizeof(*items));

	(void)a, (void)n, (void)u;
	if (!items)
		return shmrpc_call_error(c, "RuntimeError", "out of memory");
	for (int i = 0; i < BUDGET_N; i++)
		items[i] = shmrpc_tensor_value(plain_tensor(u8, 1, shape, i));
	*r = shmrpc_list(items, BUDGET_N);
	return 0;
}

static void check_list(const shmrpc_value *got, shmrpc_tensor *const *sent, const char *what)
{
	CHECK(got->type == SHMRPC_LIST && got->len == BUDGET_N, "%s: a list of %u", what, got->len);
	for (int i = 0; i < BUDGET_N; i++)
		CHECK(same(sent[i], got->u.items[i].u.t), "%s: tensor %d differs", what, i);
}

static void budget(void)
{
	const DLDataType u8 = { kDLUInt, 8, 1 };
	int64_t shape[1] = { worker_agent->inline_max };
	uint64_t half = ipc_port_max_payload(&worker_agent->port) / 2;
	int64_t fit = (int64_t)(half / (uint64_t)shape[0]);
	shmrpc_tensor *t[BUDGET_N];
	shmrpc_value items[BUDGET_N], v;
	const shmrpc_value *res;
	shmrpc_future *f;
	shmrpc_rref *rr;

	CHECK(fit < BUDGET_N, "%d tensors of %lld bytes fit half a frame (%llu bytes)", BUDGET_N,
	      (long long)shape[0], (unsigned long long)half);
	for (int i = 0; i < BUDGET_N; i++) {
		t[i] = plain_tensor(u8, 1, shape, i);
		items[i] = shmrpc_tensor_value(t[i]);
	}
	v = shmrpc_list(items, BUDGET_N);
	CHECK(shmrpc_rpc_sync(1, "count_pool", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
	      "count_pool: %s", shmrpc_errmsg());
	res = shmrpc_future_value(f);
	/* Inline while the message stays within half a frame: fewer than fit
	 * (the descriptors and the call's name count too), at least one. */
	CHECK(res->u.items[1].u.i >= BUDGET_N - fit && res->u.items[1].u.i < BUDGET_N,
	      "%lld of %d tensors of %lld bytes came by the pool (half a frame: %llu bytes, "
	      "%lld of them)", (long long)res->u.items[1].u.i, BUDGET_N, (long long)shape[0],
	      (unsigned long long)half, (long long)fit);
	check_list(&res->u.items[0], t, "past the budget, echoed");
	shmrpc_future_free(f);
	CHECK_OK(shmrpc_remote(1, "echo", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &rr));
	CHECK(shmrpc_rref_to_here(rr, SHMRPC_TIMEOUT_DEFAULT, &f) == 0, "to_here: %s",
	      shmrpc_errmsg());
	check_list(shmrpc_future_value(f), t, "past the budget, in an RRef");
	shmrpc_future_free(f);
	shmrpc_rref_free(rr);
	/* Made by the callee: its result and an RRef's value past the budget. */
	CHECK(shmrpc_rpc_sync(1, "make_plain", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
	      "make_plain: %s", shmrpc_errmsg());
	check_list(shmrpc_future_value(f), t, "past the budget, a result");
	shmrpc_future_free(f);
	CHECK_OK(shmrpc_remote(1, "make_plain", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &rr));
	for (int round = 0; round < 2; round++) { /* the value read twice: still there */
		CHECK(shmrpc_rref_to_here(rr, SHMRPC_TIMEOUT_DEFAULT, &f) == 0, "to_here: %s",
		      shmrpc_errmsg());
		check_list(shmrpc_future_value(f), t, "past the budget, an RRef's value");
		shmrpc_future_free(f);
	}
	shmrpc_rref_free(rr);
	for (int i = 0; i < BUDGET_N; i++)
		shmrpc_tensor_free(t[i]);
}

static void million(void)
{
	const DLDataType i64 = { kDLInt, 64, 1 };
	int total = (int)(TOTAL * tl_scale()) / PER_CALL * PER_CALL;
	static shmrpc_value items[PER_CALL];
	static shmrpc_tensor *t[PER_CALL];
	int64_t shape[1] = { 1 };
	struct pool_stats st;
	shmrpc_future *f;
	shmrpc_value v;

	for (int sent = 0; sent < total; sent += PER_CALL) {
		for (int i = 0; i < PER_CALL; i++) {
			t[i] = plain_tensor(i64, 1, shape, 0);
			*(int64_t *)shmrpc_tensor_data(t[i]) = sent + i;
			items[i] = shmrpc_tensor_value(t[i]);
		}
		v = shmrpc_list(items, PER_CALL);
		CHECK(shmrpc_rpc_sync(1, "keep_all", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f) == 0,
		      "after %d tensors kept: %s", sent, shmrpc_errmsg());
		CHECK(shmrpc_future_value(f)->u.i == sent + PER_CALL, "rank 1 keeps %lld",
		      (long long)shmrpc_future_value(f)->u.i);
		shmrpc_future_free(f);
		for (int i = 0; i < PER_CALL; i++)
			shmrpc_tensor_free(t[i]);
		pool_stats(&worker_agent->pool, &st);
		CHECK(st.used == 0 && st.refs_held == 0, "after %d inline tensors sent, the pool "
		      "has %llu bytes used and %llu references recorded", sent + PER_CALL,
		      (unsigned long long)st.used, (unsigned long long)st.refs_held);
	}
	CHECK(shmrpc_rpc_sync(1, "release", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f) == 0, "release: %s",
	      shmrpc_errmsg());
	CHECK(shmrpc_future_value(f)->u.i == total, "rank 1 held %lld of %d",
	      (long long)shmrpc_future_value(f)->u.i, total);
	shmrpc_future_free(f);
	printf("rank 1 held %d inline tensors at once, the pool unused\n", total);
}

/* A call of "echo" whose argument is an inline tensor descriptor made by
 * hand, as a hostile or corrupt sender would: the call fails with want. */
static void corrupt(int32_t ndim, int32_t device_type, uint64_t says, uint32_t follow,
		    const char *want)
{
	struct {
		uint64_t off, nbytes;
		uint8_t code, bits;
		uint16_t lanes;
		int32_t ndim, device_type, device_id;
		int64_t shape[1];
	} w = { 0, says, kDLUInt, 8, 1, ndim, device_type, 0, { 8 } };
	static const uint8_t bytes[64];
	struct tensor_list none = { 0 };
	size_t head = 32 + (ndim > 0 ? 8 : 0);
	msgpack_sbuffer sb;
	msgpack_packer pk;
	shmrpc_future *f;
	const char *msg = NULL;

	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	CHECK(follow <= sizeof(bytes), "follow %u", follow);
	CHECK(msgpack_pack_array(&pk, 2) == 0 && msgpack_pack_str_with_body(&pk, "echo", 4) == 0 &&
	      msgpack_pack_array(&pk, 1) == 0 &&
	      msgpack_pack_ext(&pk, head + follow, VALUE_EXT_TENSOR_INLINE) == 0 &&
	      msgpack_pack_ext_body(&pk, &w, head) == 0 &&
	      msgpack_pack_ext_body(&pk, bytes, follow) == 0, "packing");
	CHECK_OK(client_request(worker_agent, 1, MSG_SCRIPT_CALL, &sb, &none,
				SHMRPC_TIMEOUT_DEFAULT, "call echo", &f));
	msgpack_sbuffer_destroy(&sb);
	CHECK(shmrpc_future_wait(f, -1) != 0, "a corrupt inline tensor (%s) was taken", want);
	shmrpc_future_error(f, &msg);
	CHECK(msg && strstr(msg, want), "a corrupt inline tensor failed with \"%s\", not \"%s\"",
	      msg ? msg : "(nothing)", want);
	printf("corrupt: %s\n", msg);
	shmrpc_future_free(f);
}

static void corrupt_frames(void)
{
	const DLDataType u8 = { kDLUInt, 8, 1 };
	int64_t shape[1] = { 8 };
	shmrpc_tensor *t;

	corrupt(1, kDLCPU, 1000, 8, "an inline tensor says it holds 1000 bytes, and 8 follow");
	corrupt(1, kDLCPU, UINT64_MAX, 8, "bytes, and 8 follow its descriptor");
	corrupt(1, kDLCPU, 8, 4, "an inline tensor says it holds 8 bytes, and 4 follow");
	corrupt(1, kDLCPU, 6, 6, "an inline tensor of 6 bytes has a shape of 8 bytes");
	corrupt(1, kDLCUDA, 8, 8, "it can only be a CPU tensor");
	corrupt(9, kDLCPU, 8, 8, "an inline tensor with 9 dimensions");
	corrupt(-1, kDLCPU, 8, 8, "an inline tensor with -1 dimensions");
	/* The callee serves on. */
	t = plain_tensor(u8, 1, shape, 3);
	check_where(t, false, "after the corrupt ones");
	shmrpc_tensor_free(t);
}

static int worker(void)
{
	tl_keep_all_register(TOTAL, check_kept);
	CHECK_OK(shmrpc_register("where", "t", fn_where, NULL));
	CHECK_OK(shmrpc_register("echo", "v", fn_echo, NULL));
	CHECK_OK(shmrpc_register("write", "t", fn_write, NULL));
	CHECK_OK(shmrpc_register("count_pool", "l", fn_count_pool, NULL));
	CHECK_OK(shmrpc_register("make_plain", "", fn_make_plain, NULL));
	CHECK_OK(shmrpc_init(NULL));
	CHECK(worker_agent->inline_max == TENSOR_INLINE_MAX_DEFAULT, "inline_max %u",
	      worker_agent->inline_max);
	if (shmrpc_rank() == 0) {
		boundary();
		dtypes();
		by_reference();
		budget();
		corrupt_frames();
		million();
		CHECK(tl_wait_empty(SETTLE_NS), "the pool did not empty: %llu bytes used",
		      (unsigned long long)tl_pool_used());
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	tl_keep_all_free();
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "2", NULL);
}
