/* The tensor-keeping worker functions; see keep.h. */
#include <stdatomic.h>

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
