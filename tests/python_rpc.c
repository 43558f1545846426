/*
 * The Python package's tests: each tests/python/NAME.py runs as a job of
 * the workers its entry says, `shmrun -n N -- /usr/bin/python3
 * tests/python/NAME.py`, with the built package on PYTHONPATH. A script
 * exits 0 when all its checks pass. An entry marked fake_cuda runs with
 * SHMRPC_LIBCUDA naming the stand-in driver (tests/fake_cuda), which only
 * that job may load: on a GPU machine the others use the real one.
 * Then the compatibility suite (tests/python/compat.py, issue 7): its cases
 * run on shmrpc, and where Debian's torch has torch.distributed.rpc also on
 * torch; the two outputs must be the same but for the known differences
 * that the cases file lists. Skips (77) when the package is not built (no
 * Python headers, or a sanitizer build) or Debian's python3 is missing.
 */
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/lib/fakecuda.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define PYTHON "/usr/bin/python3"

static const struct {
	const char *name;
	const char *pool_size; /* shmrun --pool-size */
	const char *workers;   /* shmrun -n */
	bool fake_cuda;        /* on the stand-in CUDA driver */
} scripts[] = {
	{ "rpc_basic", "64M", "2", false },
	{ "tensors", "1G", "2", false }, /* two 256 MiB arrays */
	{ "futures", "64M", "2", false },
	{ "profiling", "64M", "2", false },
	{ "autograd", "64M", "3", false }, /* model parallel over 3 workers */
	{ "optim", "64M", "3", false }, /* a model over 2 and 3 workers; runs its dead-worker job */
	{ "param_server", "64M", "2", false }, /* the tutorial's parameter server, one trainer */
	{ "debug_info", "64M", "2", false },
	{ "data_ranks", "64M", "3", false }, /* shmrpc.data loading on ranks 1 and 2 */
	{ "torch_late_import", "64M", "2", false }, /* torch first imported on an executor thread */
	{ "cuda_tensors", "64M", "2", true }, /* device arrays over the stand-in driver */
	{ "cuda_tensors", "64M", "2", false }, /* torch's CUDA tensors, where torch has CUDA */
	{ "device_maps", "64M", "2", false }, /* sets the stand-in driver itself; a job per bad map */
};

/* Runs argv with $COMPAT_OUT set to out_path; its exit code. */
static int run_to(const char *out_path, const char *const *argv, char *out, size_t len)
{
	int rc;

	setenv("COMPAT_OUT", out_path, 1);
	rc = tl_run(out, len, argv);
	unsetenv("COMPAT_OUT");
	return rc;
}

static void compat(char *out, size_t len)
{
	static const char script[] = "tests/python/compat.py";
	char dir[] = "/tmp/shmrpc-compat-XXXXXX", shm_txt[64], torch_txt[64];
	const char *shm_argv[] = { tl_shmrun_path(), "-n", "2", "--pool-size", "64M", "--",
				   PYTHON, script, "shmrpc", NULL };
	const char *probe[] = { PYTHON, "-c", "import torch.distributed.rpc as r; assert r.is_available()",
				NULL };
	const char *torch_argv[] = { PYTHON, script, "torch", NULL };
	const char *compare[] = { PYTHON, script, "compare", torch_txt, shm_txt, NULL };
	int rc;

	CHECK(mkdtemp(dir), "mkdtemp: %m");
	snprintf(shm_txt, sizeof(shm_txt), "%s/shmrpc.txt", dir);
	snprintf(torch_txt, sizeof(torch_txt), "%s/torch.txt", dir);
	rc = run_to(shm_txt, shm_argv, out, len);
	CHECK(rc == 0, "compat on shmrpc: shmrun exited %d (results in %s)", rc, dir);
	CHECK(!strstr(out, "left in the RRef table"), "compat leaked RRefs");
	if (tl_run(out, len, probe) == 0) {
		rc = run_to(torch_txt, torch_argv, out, len);
		CHECK(rc == 0, "compat on torch exited %d (results in %s)", rc, dir);
		rc = tl_run(out, len, compare);
		CHECK(rc == 0, "compat: torch and shmrpc differ (results in %s)", dir);
		unlink(torch_txt);
	} else {
		fprintf(stderr, "compat: no torch.distributed.rpc here: the shmrpc half only\n");
	}
	unlink(shm_txt);
	rmdir(dir);
}

int main(void)
{
	const char *build = getenv("SHMRPC_BUILD");
	char pkg[PATH_MAX], so[PATH_MAX + 32], script[PATH_MAX];
	static char out[1 << 16];

	snprintf(pkg, sizeof(pkg), "%s/python", build && *build ? build : "build");
	snprintf(so, sizeof(so), "%s/shmrpc/_shmrpc.abi3.so", pkg);
	if (access(so, R_OK) || access(PYTHON, X_OK) || access(tl_shmrun_path(), X_OK)) {
		fprintf(stderr, "skip: %s or %s is missing\n", so, PYTHON);
		return TL_SKIP;
	}
	setenv("PYTHONPATH", pkg, 1);
	setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
	for (size_t i = 0; i < sizeof(scripts) / sizeof(scripts[0]); i++) {
		const char *argv[] = { tl_shmrun_path(), "-n", scripts[i].workers, "--pool-size",
				       scripts[i].pool_size, "--", PYTHON, script, NULL };
		int rc;

		snprintf(script, sizeof(script), "tests/python/%s.py", scripts[i].name);
		if (scripts[i].fake_cuda)
			CHECK(tl_fake_cuda_use(), "%s: the stand-in CUDA driver is not built",
			      scripts[i].name);
		rc = tl_run(out, sizeof(out), argv);
		unsetenv("SHMRPC_LIBCUDA");
		CHECK(rc == 0, "%s%s: shmrun exited %d", scripts[i].name,
		      scripts[i].fake_cuda ? " (stand-in CUDA driver)" : "", rc);
		CHECK(!strstr(out, "left in the RRef table"), "%s leaked RRefs", scripts[i].name);
	}
	compat(out, sizeof(out));
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
