/*
 * Before shmrpc_init (and after shmrpc_shutdown is not reached: a process
 * that never joined), every entry point that needs the agent fails with
 * -ENOTCONN and the same sentence, which says what to call first.
 */
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/testlib.h"

#define SAYS "the RPC agent is not running in this process: call shmrpc_init"

static void refused(int rc, const char *what)
{
	CHECK(rc == -ENOTCONN, "%s returned %d (%s), expected -ENOTCONN", what, rc,
	      shmrpc_strerror(rc));
	CHECK(strncmp(shmrpc_errmsg(), SAYS, strlen(SAYS)) == 0, "%s said \"%s\"", what,
	      shmrpc_errmsg());
}

int main(void)
{
	struct shmrpc_worker_info info;
	shmrpc_future *f = (shmrpc_future *)&info;
	shmrpc_rref *r = (shmrpc_rref *)&info;
	shmrpc_tensor *t = (shmrpc_tensor *)&info;
	int64_t shape[1] = { 4 };

	refused(shmrpc_rank(), "shmrpc_rank");
	refused(shmrpc_world_size(), "shmrpc_world_size");
	refused(shmrpc_get_worker_info(NULL, &info), "shmrpc_get_worker_info");
	refused(shmrpc_get_worker_info_by_rank(0, &info), "shmrpc_get_worker_info_by_rank");
	refused(shmrpc_rpc_async(0, "f", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f), "shmrpc_rpc_async");
	CHECK(f == NULL, "shmrpc_rpc_async left *out set");
	refused(shmrpc_rpc_sync(0, "f", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f), "shmrpc_rpc_sync");
	CHECK(f == NULL, "shmrpc_rpc_sync left *out set");
	refused(shmrpc_remote(0, "f", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &r), "shmrpc_remote");
	CHECK(r == NULL, "shmrpc_remote left *out set");
	refused(shmrpc_tensor_alloc((DLDataType){ kDLFloat, 32, 1 }, 1, shape, &t),
		"shmrpc_tensor_alloc");
	refused(shmrpc_shutdown(1, 1000), "shmrpc_shutdown");
	printf("ok\n");
	return 0;
}
