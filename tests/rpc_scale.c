/*
 * Many workers on two cores: 16 workers calling each other all-to-all, and
 * a 64-worker job that starts, makes one call each (to the next rank) and
 * shuts down.
 */
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

static void call(int peer, int64_t x)
{
	shmrpc_value args[2] = { shmrpc_int(x), shmrpc_int(peer) };
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_sync(peer, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->u.i == x + peer, "add on %d", peer);
	shmrpc_future_free(f);
}

static int worker(void)
{
	struct shmrpc_options o = SHMRPC_OPTIONS(.num_threads = 1);
	int me, world;

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_init(&o));
	me = shmrpc_rank();
	world = shmrpc_world_size();
	if (strcmp(getenv("TL_SCENARIO"), "all") == 0) {
		for (int i = 0; i < 20; i++)
			for (int peer = 0; peer < world; peer++)
				if (peer != me)
					call(peer, i);
	} else {
		call((me + 1) % world, me);
	}
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	char out[1 << 16];

	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	setenv("TL_SCENARIO", "all", 1);
	CHECK(tl_shmrun(out, sizeof(out), "-n", "16", NULL) == 0, "16 workers all-to-all failed");
	setenv("TL_SCENARIO", "one", 1);
	CHECK(tl_shmrun(out, sizeof(out), "-n", "64", NULL) == 0, "64 workers failed");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
