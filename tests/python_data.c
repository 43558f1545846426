/*
 * shmrpc.data's tests (issue 8): each tests/python/data_*.py runs as a
 * plain program, `/usr/bin/python3 tests/python/data_NAME.py`, with the
 * built package on PYTHONPATH: the loader launches its own workers. A
 * script exits 0 when all its checks pass. Skips (77) when the package is
 * not built (no Python headers, or a sanitizer build) or Debian's python3
 * has no torch.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define PYTHON "/usr/bin/python3"

static const char *const scripts[] = { "data_order", "data_faults", "data_native", "data_gpu" };

int main(void)
{
	const char *build = getenv("SHMRPC_BUILD");
	const char *probe[] = { PYTHON, "-c", "import torch.utils.data", NULL };
	char pkg[PATH_MAX], so[PATH_MAX + 32], script[PATH_MAX];
	static char out[1 << 16];

	snprintf(pkg, sizeof(pkg), "%s/python", build && *build ? build : "build");
	snprintf(so, sizeof(so), "%s/shmrpc/_shmrpc.abi3.so", pkg);
	if (access(so, R_OK) || access(PYTHON, X_OK)) {
		fprintf(stderr, "skip: %s or %s is missing\n", so, PYTHON);
		return TL_SKIP;
	}
	if (tl_run(out, sizeof(out), probe) != 0) {
		fprintf(stderr, "skip: %s has no torch (python3-torch)\n", PYTHON);
		return TL_SKIP;
	}
	setenv("PYTHONPATH", pkg, 1);
	setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
	/* torch's warning that 4 workers exceed 2 cores is not ours to show. */
	setenv("PYTHONWARNINGS", "ignore::UserWarning", 1);
	for (size_t i = 0; i < sizeof(scripts) / sizeof(scripts[0]); i++) {
		const char *argv[] = { PYTHON, script, NULL };
		int rc;

		snprintf(script, sizeof(script), "tests/python/%s.py", scripts[i]);
		rc = tl_run(out, sizeof(out), argv);
		if (rc == TL_SKIP) /* e.g. data_native without a C compiler */
			continue;
		CHECK(rc == 0, "%s exited %d", scripts[i], rc);
	}
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
