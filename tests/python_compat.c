/*
 * The compatibility suite (tests/python/compat.py, issue 7): its cases run
 * on shmrpc, and where Debian's torch has torch.distributed.rpc also on
 * torch; the two outputs must be the same but for the known differences
 * that the cases file lists. It compares printed results, so it is no
 * pytest module (those are tests/python_test.c's). Skips (77) when the
 * package is not built (no Python headers, or a sanitizer build) or
 * Debian's python3 is missing.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define PYTHON "/usr/bin/python3"

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
		/* Not a skip: make deps installs torch, and the comparison is the test. */
		CHECK(false, "compat: no torch.distributed.rpc here (results in %s): install "
		      "python3-torch (make deps)", dir);
	}
	unlink(shm_txt);
	rmdir(dir);
}

int main(void)
{
	const char *build = getenv("SHMRPC_BUILD"), *san = getenv("SHMRPC_SAN");
	char pkg[PATH_MAX], so[PATH_MAX + 32];
	static char out[1 << 16];

	snprintf(pkg, sizeof(pkg), "%s/python", build && *build ? build : "build");
	snprintf(so, sizeof(so), "%s/shmrpc/_shmrpc.abi3.so", pkg);
	if (access(so, R_OK) && san && *san) {
		printf("skip: sanitizer build (SAN=%s): the Python package is not built\n", san);
		return TL_SKIP;
	}
	/* Anything else missing is a failure: make deps installs it all. */
	CHECK(access(PYTHON, X_OK) == 0, "%s is missing: install python3 (make deps)", PYTHON);
	CHECK(access(so, R_OK) == 0, "%s is not built: install python3-dev (make deps), then make",
	      so);
	CHECK(access(tl_shmrun_path(), X_OK) == 0, "%s is not built: make", tl_shmrun_path());
	setenv("PYTHONPATH", pkg, 1);
	setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
	compat(out, sizeof(out));
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
