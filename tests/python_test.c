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
 *   # unmet: needs a GPU              the skip reason when the needs
 *                                     line is false (else the line itself)
 *
 * `python_test NAME` runs the same module without the link (tests/gpu.sh,
 * whose folder carries no links), and SHMRPC_PYTHON names another
 * interpreter than /usr/bin/python3 (a GPU machine's, with CUDA torch).
 *
 * It runs `/usr/bin/python3 -m pytest tests/python/test_NAME.py`, under
 * shmrun where the header says so, with the built package on PYTHONPATH,
 * and fails when that exits non-zero, or leaves RRefs in the RRef table or
 * files in /dev/shm. A missing Python module is a failure, never a skip:
 * pytest, or a module the needs line asks has() about, fails the entry
 * with the Debian package to install (`make deps` installs them all), as
 * does a package not built outside a sanitizer build (python3-dev). It
 * skips (77) only when the package is not built because this is a
 * sanitizer build (SHMRPC_SAN, set by make check), or when the needs line
 * is false with every module it asked about there (no GPU): the runner's
 * allow-list, .ci/allowed-skips, says which skips make check accepts.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define DEBIAN_PYTHON "/usr/bin/python3"
#define MAX_SHMRUN_ARGS 16

/* The module's header: the comment lines it starts with. */
struct header {
	char shmrun[256]; /* "" when the module runs without shmrun */
	char needs[256];  /* "" when it needs nothing more */
	char unmet[256];  /* the skip reason when needs is false; "" : needs itself */
};

/* The Debian package of a Python module the tests import. */
static const char *debian_package(const char *module, char *buf, size_t len)
{
	static const char *const known[][2] = {
		{ "torch", "python3-torch" },
		{ "numpy", "python3-numpy" },
		{ "pytest", "python3-pytest" },
	};

	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
		if (strcmp(module, known[i][0]) == 0)
			return known[i][1];
	snprintf(buf, len, "python3-%s (or the package that has it)", module);
	return buf;
}

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
		take(line, "# unmet: ", h->unmet, sizeof(h->unmet));
	}
	fclose(f);
	CHECK(said, "%s does not start with a \"# shmrun: ARGS\" or \"# shmrun: none\" line", path);
	if (strcmp(h->shmrun, "none") == 0)
		h->shmrun[0] = '\0';
}

int main(int argc, char **argv)
{
	const char *build = getenv("SHMRPC_BUILD"), *name = strrchr(argv[0], '/');
	const char *san = getenv("SHMRPC_SAN"), *python = getenv("SHMRPC_PYTHON");
	const char *cmd[MAX_SHMRUN_ARGS + 8];
	char pkg[PATH_MAX], so[PATH_MAX + 32], module[PATH_MAX], code[1024];
	const char *probe[] = { NULL, "-c", code, NULL };
	static char out[1 << 20];
	struct header h;
	int n = 0, rc;

	name = name ? name + 1 : argv[0];
	if (argc == 2 && argv[1][0] && !strchr(argv[1], '/')) {
		snprintf(module, sizeof(module), "tests/python/test_%s.py", argv[1]);
	} else if (argc == 1 && strncmp(name, "py_", 3) == 0) {
		snprintf(module, sizeof(module), "tests/python/test_%s.py", name + 3);
	} else {
		fprintf(stderr, "usage: py_NAME (a link to %s), or %s NAME: runs "
			"tests/python/test_NAME.py\n", argv[0], argv[0]);
		return 2;
	}
	if (!python || !*python)
		python = DEBIAN_PYTHON;
	probe[0] = python;
	read_header(module, &h);
	snprintf(pkg, sizeof(pkg), "%s/python", build && *build ? build : "build");
	snprintf(so, sizeof(so), "%s/shmrpc/_shmrpc.abi3.so", pkg);
	if (access(so, R_OK) && san && *san) {
		printf("skip: sanitizer build (SAN=%s): the Python package is not built\n", san);
		return TL_SKIP;
	}
	CHECK(access(python, X_OK) == 0, "%s is missing: install python3 (make deps)%s", python,
	      strcmp(python, DEBIAN_PYTHON) ? ", or set SHMRPC_PYTHON to an interpreter's path" : "");
	CHECK(access(so, R_OK) == 0,
	      "%s is not built: install python3-dev (make deps), then make", so);
	CHECK(!h.shmrun[0] || access(tl_shmrun_path(), X_OK) == 0, "%s is not built: make",
	      tl_shmrun_path());
	/* has() finds a module without importing it (importing torch takes a
	 * second of CPU, and most modules only need it there) and names each
	 * one it misses: a missing module fails the entry, a false needs line
	 * with every module there (no GPU) skips it. */
	snprintf(code, sizeof(code),
		 "import importlib.util, shutil, sys\n"
		 "missing = []\n"
		 "def has(name):\n"
		 "    if importlib.util.find_spec(name) is None:\n"
		 "        missing.append(name)\n"
		 "        return False\n"
		 "    return True\n"
		 "ok = has('pytest') and (%s)\n"
		 "print(' '.join(missing))\n"
		 "sys.exit(0 if ok else 3 if missing else 4)\n",
		 h.needs[0] ? h.needs : "True");
	rc = tl_run(out, sizeof(out), probe);
	if (rc == 3) {
		char pkgs[512] = "", buf[128];
		char *save, *m = strtok_r(out, " \n", &save);

		for (; m; m = strtok_r(NULL, " \n", &save))
			snprintf(pkgs + strlen(pkgs), sizeof(pkgs) - strlen(pkgs), "%s%s (%s)",
				 pkgs[0] ? ", " : "", m, debian_package(m, buf, sizeof(buf)));
		fprintf(stderr, "%s needs the Python module(s) %s: `make deps` installs them\n",
			module, pkgs);
		return 1;
	}
	if (rc == 4) {
		printf("skip: %s\n", h.unmet[0] ? h.unmet : h.needs);
		return TL_SKIP;
	}
	CHECK(rc == 0, "%s: the probe of its needs (%s) exited %d: %s", module,
	      h.needs[0] ? h.needs : "pytest", rc, out);
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
	cmd[n++] = python;
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
