/*
 * The Python package's tests (issue 7): one pytest module,
 * tests/python/test_NAME.py, per entry of make check. The Makefile links
 * this program as build/tests/py_NAME for each module, and argv[0] names
 * the module. Its header lines say how it runs (tests/python/conftest.py
 * tells the rest):
 *
 *   # shmrun: -n 3 --pool-size 64M    shmrun's arguments: every rank of the
 *                                     job runs pytest on the module
 *   # shmrun: none                    pytest alone (shmrpc.data's loader
 *                                     starts its own workers)
 *   # needs: has("torch")             a Python expression that must be
 *                                     true, else skip (below)
 *
 * It runs `/usr/bin/python3 -m pytest tests/python/test_NAME.py`, under
 * shmrun where the header says so, with the built package on PYTHONPATH,
 * and fails when that exits non-zero, or leaves RRefs in the RRef table or
 * files in /dev/shm. Skips (77) when the package is not built (no Python
 * headers, or a sanitizer build), Debian's python3 or its pytest
 * (python3-pytest) is missing, or the module's needs are not met.
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
#define MAX_SHMRUN_ARGS 16

/* The module's header: the comment lines it starts with. */
struct header {
	char shmrun[256]; /* "" when the module runs without shmrun */
	char needs[256];  /* "" when it needs nothing more */
};

/* The text after "# key: " at the start of line, into out. */
static void take(const char *line, const char *key, char *out, size_t len)
{
	size_t n = strlen(key);

	if (strncmp(line, key, n) == 0)
		snprintf(out, len, "%.*s", (int)strcspn(line + n, "\n"), line + n);
}

static void read_header(const char *path, struct header *h)
{
	FILE *f = fopen(path, "r");
	char line[512];
	bool said = false;

	CHECK(f, "%s: %m", path);
	memset(h, 0, sizeof(*h));
	while (fgets(line, sizeof(line), f) && line[0] == '#') {
		said |= strncmp(line, "# shmrun: ", 10) == 0;
		take(line, "# shmrun: ", h->shmrun, sizeof(h->shmrun));
		take(line, "# needs: ", h->needs, sizeof(h->needs));
	}
	fclose(f);
	CHECK(said, "%s does not start with a \"# shmrun: ARGS\" or \"# shmrun: none\" line", path);
	if (strcmp(h->shmrun, "none") == 0)
		h->shmrun[0] = '\0';
}

int main(int argc, char **argv)
{
	const char *build = getenv("SHMRPC_BUILD"), *name = strrchr(argv[0], '/');
	const char *cmd[MAX_SHMRUN_ARGS + 8];
	char pkg[PATH_MAX], so[PATH_MAX + 32], module[PATH_MAX], code[512];
	const char *probe[] = { PYTHON, "-c", code, NULL };
	static char out[1 << 20];
	struct header h;
	int n = 0, rc;

	name = name ? name + 1 : argv[0];
	if (argc != 1 || strncmp(name, "py_", 3) != 0) {
		fprintf(stderr, "usage: py_NAME (a link to %s): runs tests/python/test_NAME.py\n",
			argv[0]);
		return 2;
	}
	snprintf(module, sizeof(module), "tests/python/test_%s.py", name + 3);
	read_header(module, &h);
	snprintf(pkg, sizeof(pkg), "%s/python", build && *build ? build : "build");
	snprintf(so, sizeof(so), "%s/shmrpc/_shmrpc.abi3.so", pkg);
	if (access(so, R_OK) || access(PYTHON, X_OK) ||
	    (h.shmrun[0] && access(tl_shmrun_path(), X_OK))) {
		fprintf(stderr, "skip: %s, %s or shmrun is missing\n", so, PYTHON);
		return TL_SKIP;
	}
	/* has() finds a module without importing it: importing torch takes
	 * a second of CPU, and most modules only need it there. */
	snprintf(code, sizeof(code),
		 "import importlib.util, shutil, sys\n"
		 "def has(name):\n"
		 "    return importlib.util.find_spec(name) is not None\n"
		 "sys.exit(0 if has('pytest') and (%s) else 1)\n",
		 h.needs[0] ? h.needs : "True");
	if (tl_run(out, sizeof(out), probe) != 0) {
		fprintf(stderr, "skip: %s needs pytest (python3-pytest)%s%s\n", module,
			h.needs[0] ? " and " : "", h.needs);
		return TL_SKIP;
	}
	setenv("PYTHONPATH", pkg, 1);
	setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
	if (h.shmrun[0]) {
		/* Each line a rank prints is tagged [rank]: three ranks' pytest
		 * output comes through one pipe. */
		cmd[n++] = tl_shmrun_path();
		cmd[n++] = "--tag-output";
		for (char *save, *arg = strtok_r(h.shmrun, " ", &save); arg;
		     arg = strtok_r(NULL, " ", &save)) {
			CHECK(n < MAX_SHMRUN_ARGS, "%s: more than %d shmrun arguments", module,
			      MAX_SHMRUN_ARGS - 2);
			cmd[n++] = arg;
		}
		cmd[n++] = "--";
	}
	cmd[n++] = PYTHON;
	cmd[n++] = "-m";
	cmd[n++] = "pytest";
	cmd[n++] = module;
	cmd[n] = NULL;
	rc = tl_run(out, sizeof(out), cmd);
	CHECK(rc == 0, "%s: %s exited %d", module, cmd[0], rc);
	CHECK(!strstr(out, "left in the RRef table"), "%s leaked RRefs", module);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
