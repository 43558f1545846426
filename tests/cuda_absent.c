/*
 * Without a GPU or a driver, every CUDA call fails with a negative errno
 * and "CUDA is not available on this machine: <why>", in every thread,
 * and nothing crashes. Skips where a GPU is present (cuda_ipc covers it).
 */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "worker/cuda.h"
#include "tests/lib/testlib.h"

#define NOT_AVAILABLE "CUDA is not available on this machine: "
#define THREADS 4

static int probe_rc;

static void check_unavailable(int rc, const char *what)
{
	CHECK(rc == probe_rc, "%s returned %d, cuda_probe %d", what, rc, probe_rc);
	CHECK(strstr(shmrpc_errmsg(), NOT_AVAILABLE), "%s: message \"%s\"", what, shmrpc_errmsg());
}

/* The calls a worker makes, each of which must fail cleanly. */
static void *try_everything(void *arg)
{
	uint32_t host[16] = { 0 };
	struct cuda_ipc_desc d;
	void *p = NULL;

	(void)arg;
	memset(&d, 0xab, sizeof(d));
	check_unavailable(cuda_export(host, sizeof(host), 0, &d), "cuda_export");
	d.pid = (uint32_t)getppid();
	check_unavailable(cuda_import(&d, 0, &p, NULL), "cuda_import");
	CHECK(p == NULL, "cuda_import set the pointer on failure");
	cuda_import_release(&d, false);
	cuda_forget_peer(d.pid);
	check_unavailable(cuda_probe(), "cuda_probe");
	return NULL;
}

int main(void)
{
	pthread_t t[THREADS];
	struct cuda_stats st;

	probe_rc = cuda_probe();
	if (probe_rc == 0) {
		printf("skip: a CUDA device is present: cuda_ipc tests it\n");
		return TL_SKIP;
	}
	CHECK(probe_rc == -ENOSYS || probe_rc == -ENODEV, "cuda_probe returned %d", probe_rc);
	check_unavailable(probe_rc, "cuda_probe");
	printf("%s\n", shmrpc_errmsg());
	try_everything(NULL);
	/* The message is per thread: each thread must get its own. */
	for (int i = 0; i < THREADS; i++)
		CHECK(pthread_create(&t[i], NULL, try_everything, NULL) == 0, "pthread_create");
	for (int i = 0; i < THREADS; i++)
		pthread_join(t[i], NULL);
	CHECK(cuda_sym("cuInit") == NULL, "cuda_sym found a driver function");
	cuda_stats_get(&st);
	CHECK(st.opens == 0 && st.cache_hits == 0 && st.exports == 0 && st.handle_cache_hits == 0 &&
	      st.maps_open == 0 && st.events_open == 0 && st.allocs_exported == 0 &&
	      st.events_exported == 0, "stats moved without a driver");
	return 0;
}
