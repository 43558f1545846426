/* Running a test program as a job under shmrun; see job.h. */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/lib/job.h"

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
	int argc = 0, fds[2], status;
	ssize_t n, self_len = readlink("/proc/self/exe", self, sizeof(self) - 1);
	size_t got = 0;
	va_list ap;
	pid_t pid;

	if (self_len < 0 || pipe(fds))
		return -1;
	self[self_len] = '\0';
	argv[argc++] = tl_shmrun_path();
	va_start(ap, opt);
	for (const char *a = opt; a && argc < 60; a = va_arg(ap, const char *))
		argv[argc++] = a;
	va_end(ap);
	argv[argc++] = "--";
	argv[argc++] = self;
	argv[argc] = NULL;
	fflush(NULL);
	pid = fork();
	if (pid == 0) {
		dup2(fds[1], 1);
		dup2(fds[1], 2);
		close(fds[0]);
		close(fds[1]);
		execv(argv[0], (char *const *)argv);
		fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
		_exit(127);
	}
	close(fds[1]);
	if (pid < 0) {
		close(fds[0]);
		return -1;
	}
	for (;;) {
		char buf[4096];

		n = read(fds[0], buf, sizeof(buf));
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		/* Echo everything, so that a failing test shows the job's output. */
		fwrite(buf, 1, (size_t)n, stderr);
		if (len && got < len - 1) {
			size_t take = (size_t)n < len - 1 - got ? (size_t)n : len - 1 - got;

			memcpy(out + got, buf, take);
			got += take;
		}
	}
	if (len)
		out[got] = '\0';
	close(fds[0]);
	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR)
			return -1;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
