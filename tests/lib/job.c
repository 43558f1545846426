/* Running a test program as a job under shmrun; see job.h. */
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tests/lib/job.h"
#include "tests/lib/run.h"

bool tl_is_worker(void)
{
	return getenv("SHMRPC_RANK") != NULL;
}

const char *tl_shmrun_path(void)
{
	static char path[PATH_MAX];
	const char *build = getenv("SHMRPC_BUILD");

	snprintf(path, sizeof(path), "%s/bin/shmrun", build && *build ? build : "build");
	return path;
}

int tl_shmrun(char *out, size_t len, const char *opt, ...)
{
	const char *argv[64];
	char self[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	int argc = 0;
	va_list ap;

	if (n < 0)
		return -1;
	self[n] = '\0';
	argv[argc++] = tl_shmrun_path();
	va_start(ap, opt);
	for (const char *a = opt; a && argc < 60; a = va_arg(ap, const char *))
		argv[argc++] = a;
	va_end(ap);
	argv[argc++] = "--";
	argv[argc++] = self;
	argv[argc] = NULL;
	return tl_run(out, len, argv);
}
