/* The tensor-keeping worker functions; see keep.h. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/keep.h"
#include "tests/lib/testlib.h"

/* Set and taken on executor threads. */
static shmrpc_tensor *_Atomic kept;

static int fn_keep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const DLTensor *dl = shmrpc_tensor_dl(a[0].u.t);
	shmrpc_tensor *t;

	(void)n, (void)u;
	if (shmrpc_tensor_retain(a[0].u.t, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	/* The reply is read from t before t is published: a drop on another
	 * executor thread may free it as soon as it is in kept. */
	*r = shmrpc_int(dl && dl->device.device_type == kDLCPU
				? (int64_t)shmrpc_tensor_pool_offset(t) : -1);
	shmrpc_tensor_free(atomic_exchange(&kept, t));
	return 0;
}

static int fn_drop(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	shmrpc_tensor_free(atomic_exchange(&kept, NULL));
	*r = shmrpc_nil();
	return 0;
}

void tl_keep_register(void)
{
	CHECK_OK(shmrpc_register("keep", "t", fn_keep, NULL));
	CHECK_OK(shmrpc_register("drop", "", fn_drop, NULL));
}

static int fn_copy_first(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			 void *u)
{
	static const DLDataType u8 = { kDLUInt, 8, 1 };
	int64_t bytes = (int64_t)shmrpc_tensor_nbytes(a[0].u.t);
	shmrpc_tensor *t;
	int rc = shmrpc_tensor_alloc(u8, 1, &bytes, &t);

	(void)c, (void)n, (void)u;
	if (rc)
		return rc;
	memcpy(shmrpc_tensor_data(t), shmrpc_tensor_data(a[0].u.t), (size_t)bytes);
	*r = shmrpc_tensor_value(t);
	return 0;
}

void tl_copy_register(void)
{
	CHECK_OK(shmrpc_register("copy_first", "tt", fn_copy_first, NULL));
}

/* Many at once, kept by whichever executor threads run the calls, which
 * other processes order: under a lock that ThreadSanitizer can see. */
static pthread_mutex_t many_lock = PTHREAD_MUTEX_INITIALIZER;
static shmrpc_tensor **many;
static int nmany, many_cap;
static tl_kept_check_fn many_check;

static int fn_keep_all(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
		       void *u)
{
	const shmrpc_value *items = a[0].u.items;
	int rc = 0;

	(void)n, (void)u;
	pthread_mutex_lock(&many_lock);
	if (nmany + (int)a[0].len > many_cap)
		rc = shmrpc_call_error(c, "RuntimeError", "keeping %d more than the %d asked for",
				       nmany + (int)a[0].len - many_cap, many_cap);
	for (uint32_t i = 0; i < a[0].len && rc == 0; i++)
		if (shmrpc_tensor_retain(items[i].u.t, &many[nmany++]))
			rc = shmrpc_call_error(c, "RuntimeError", "keeping tensor %d: %s", nmany,
					       shmrpc_errmsg());
	*r = shmrpc_int(nmany);
	pthread_mutex_unlock(&many_lock);
	return rc;
}

static int fn_release(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
		      void *u)
{
	int rc;

	(void)a, (void)n, (void)u;
	pthread_mutex_lock(&many_lock);
	rc = many_check(c, many, nmany);
	*r = shmrpc_int(nmany);
	while (nmany > 0)
		shmrpc_tensor_free(many[--nmany]);
	pthread_mutex_unlock(&many_lock);
	return rc;
}

void tl_keep_all_register(int capacity, tl_kept_check_fn check)
{
	many = calloc((size_t)capacity, sizeof(*many));
	CHECK(many, "calloc");
	many_cap = capacity;
	many_check = check;
	CHECK_OK(shmrpc_register("keep_all", "l", fn_keep_all, NULL));
	CHECK_OK(shmrpc_register("release", "", fn_release, NULL));
}

void tl_keep_all_free(void)
{
	free(many);
	many = NULL;
}
