/* Running a test program as a job under shmrun; see job.h. */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

bool tl_is_worker(void)
{
	return getenv("SHMRPC_RANK") != NULL;
}

const char *tl_build_path(char path[static PATH_MAX], const char *rel)
{
	const char *build = getenv("SHMRPC_BUILD");

	snprintf(path, PATH_MAX, "%s/%s", build && *build ? build : "build", rel);
	return path;
}

const char *tl_shmrun_path(void)
{
	static char path[PATH_MAX];

	return tl_build_path(path, "bin/shmrun");
}

const char *tl_inspect_path(void)
{
	static char path[PATH_MAX];

	return tl_build_path(path, "bin/shmrpc-inspect");
}

static int vshmrun(char *out, size_t len, const char *opt, va_list ap)
{
	const char *argv[64];
	char self[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	int argc = 0;

	if (n < 0)
		return -1;
	self[n] = '\0';
	argv[argc++] = tl_shmrun_path();
	for (const char *a = opt; a && argc < 60; a = va_arg(ap, const char *))
		argv[argc++] = a;
	argv[argc++] = "--";
	argv[argc++] = self;
	argv[argc] = NULL;
	return tl_run(out, len, argv);
}

int tl_shmrun(char *out, size_t len, const char *opt, ...)
{
	va_list ap;
	int rc;

	va_start(ap, opt);
	rc = vshmrun(out, len, opt, ap);
	va_end(ap);
	return rc;
}

static int job_test(int (*worker)(void), int want_rc, const char *const *texts, const char *opt,
		    va_list ap)
{
	static char out[1 << 16];
	int rc;

	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	rc = vshmrun(out, sizeof(out), opt, ap);
	CHECK(rc == want_rc, "shmrun exited %d, want %d", rc, want_rc);
	for (; texts && *texts; texts++)
		CHECK(strstr(out, *texts), "the job's output lacks \"%s\"", *texts);
	/* Every job, passing or failing, must leave the RRef table empty. */
	CHECK(!strstr(out, "left in the RRef table"), "the job leaked RRefs");
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}

int tl_job_test(int (*worker)(void), const char *opt, ...)
{
	va_list ap;
	int rc;

	va_start(ap, opt);
	rc = job_test(worker, 0, NULL, opt, ap);
	va_end(ap);
	return rc;
}

int tl_job_expect(int (*worker)(void), int want_rc, const char *const *texts, const char *opt, ...)
{
	va_list ap;
	int rc;

	va_start(ap, opt);
	rc = job_test(worker, want_rc, texts, opt, ap);
	va_end(ap);
	return rc;
}
