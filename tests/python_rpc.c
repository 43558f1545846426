/*
 * The Python package's tests: each tests/python/NAME.py runs as a 2-worker
 * job, `shmrun -n 2 -- /usr/bin/python3 tests/python/NAME.py`, with the
 * built package on PYTHONPATH. A script exits 0 when all its checks pass.
 * Skips (77) when the package is not built (no Python headers, or a
 * sanitizer build) or Debian's python3 is missing.
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

static const struct {
	const char *name;
	const char *pool_size; /* shmrun --pool-size */
} scripts[] = {
	{ "rpc_basic", "64M" },
	{ "tensors", "1G" }, /* two 256 MiB arrays */
	{ "futures", "64M" },
};

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
		const char *argv[] = { tl_shmrun_path(), "-n", "2", "--pool-size", scripts[i].pool_size,
				       "--", PYTHON, script, NULL };
		int rc;

		snprintf(script, sizeof(script), "tests/python/%s.py", scripts[i].name);
		rc = tl_run(out, sizeof(out), argv);
		CHECK(rc == 0, "%s: shmrun exited %d", scripts[i].name, rc);
		CHECK(!strstr(out, "left in the RRef table"), "%s leaked RRefs", scripts[i].name);
	}
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
