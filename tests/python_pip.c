/*
 * `pip install ./python` (issue 7): Debian's pip, offline (--no-index,
 * --no-build-isolation: setuptools as installed), builds the extension from
 * the C sources with python/setup.py and installs the package into a
 * temporary --target; a 2-worker job then imports shmrpc from there, not
 * from the build folder, and makes an rpc_sync each way.
 *
 * pip builds in the source tree (python/build, python/shmrpc.egg-info), so
 * the test builds a copy of python/ beside links to the other source
 * folders: concurrent runs share nothing and the checkout stays clean.
 * Fails, naming the Debian package (python3-pip, python3-dev), when
 * /usr/bin/python3, pip, setuptools or Python.h is missing: make deps
 * installs them, so that is never a reason to skip.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define PYTHON "/usr/bin/python3"

static char tmp[] = "/tmp/shmrpc-pip-XXXXXX";

/* The job's script: argv[1] is where pip installed the package. */
static const char script[] =
	"import os, sys\n"
	"import shmrpc as rpc\n"
	"site = os.path.realpath(sys.argv[1]) + os.sep\n"
	"for m in (rpc, rpc._shmrpc):\n"
	"    assert os.path.realpath(m.__file__).startswith(site), m.__file__\n"
	"assert rpc._shmrpc.__file__.endswith('.abi3.so'), rpc._shmrpc.__file__\n"
	"rank = int(os.environ['SHMRPC_RANK'])\n"
	"rpc.init_rpc(f'worker{rank}')\n"
	"got = rpc.rpc_sync(f'worker{1 - rank}', divmod, args=(7 + rank, 2))\n"
	"assert got == divmod(7 + rank, 2), got\n"
	"rpc.shutdown()\n"
	"print(f'rank {rank}: the pip-installed shmrpc works')\n";

static const char probe[] =
	"import importlib.util, os, sys, sysconfig\n"
	"need = [m for m in ('pip', 'setuptools') if importlib.util.find_spec(m) is None]\n"
	"if not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')):\n"
	"    need.append('Python.h')\n"
	"print('missing: ' + ', '.join(need) if need else 'ok')\n"
	"sys.exit(1 if need else 0)\n";

static void remove_tmp(void)
{
	const char *rm[] = { "/bin/rm", "-rf", tmp, NULL };
	char out[256];

	tl_run(out, sizeof(out), rm);
}

int main(void)
{
	static char out[1 << 16];
	char src[64], site[64], pkg[80], copy[512];
	const char *probe_argv[] = { PYTHON, "-c", probe, NULL };
	const char *copy_argv[] = { "/bin/sh", "-c", copy, NULL };
	const char *pip[] = { PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
			      "--no-build-isolation", "--target", site, pkg, NULL };
	const char *job[] = { tl_shmrun_path(), "-n", "2", "--pool-size", "64M", "--",
			      PYTHON, "-c", script, site, NULL };
	int rc;

	/* Nothing here is a skip: make deps installs python3, pip and Python.h. */
	CHECK(access(PYTHON, X_OK) == 0, "%s is missing: install python3 (make deps)", PYTHON);
	CHECK(access(tl_shmrun_path(), X_OK) == 0, "%s is not built: make", tl_shmrun_path());
	if (tl_run(out, sizeof(out), probe_argv)) {
		fprintf(stderr, "%s cannot build a package: install python3-pip and python3-dev "
			"(make deps)\n", PYTHON);
		return 1;
	}
	CHECK(mkdtemp(tmp), "mkdtemp: %m");
	atexit(remove_tmp);
	snprintf(src, sizeof(src), "%s/src", tmp);
	snprintf(site, sizeof(site), "%s/site", tmp);
	snprintf(pkg, sizeof(pkg), "%s/python", src);
	snprintf(copy, sizeof(copy),
		 "mkdir -p %s && cp -r python/setup.py python/*.c python/*.h python/shmrpc %s && "
		 "for d in common shm ipc worker launcher include; do ln -s \"$PWD/$d\" %s/$d; done",
		 pkg, pkg, src);
	CHECK(tl_run(out, sizeof(out), copy_argv) == 0, "copying the sources failed");

	/* Hermetic: no pip.conf (its index or links), no cache, temporary
	 * files under tmp. */
	setenv("PIP_CONFIG_FILE", "/dev/null", 1);
	setenv("PIP_NO_CACHE_DIR", "1", 1);
	setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1", 1);
	setenv("PIP_ROOT_USER_ACTION", "ignore", 1);
	setenv("TMPDIR", tmp, 1);
	rc = tl_run(out, sizeof(out), pip);
	CHECK(rc == 0, "pip install exited %d", rc);
	unsetenv("TMPDIR");

	setenv("PYTHONPATH", site, 1);
	setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
	rc = tl_run(out, sizeof(out), job);
	CHECK(rc == 0, "the job on the pip-installed package: shmrun exited %d", rc);
	CHECK(strstr(out, "rank 0: the pip-installed shmrpc works") &&
	      strstr(out, "rank 1: the pip-installed shmrpc works"), "a worker did not finish");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
