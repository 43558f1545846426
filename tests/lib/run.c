/* Running a command with its output captured; see run.h. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/lib/run.h"

pid_t tl_spawn(const char *const *argv, int *out_fd)
{
	int fds[2];
	pid_t pid;

	if (pipe(fds))
		return -1;
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
	*out_fd = fds[0];
	return pid;
}

int tl_collect(pid_t pid, int out_fd, char *out, size_t len)
{
	size_t got = 0;
	int status;

	for (;;) {
		char buf[4096];
		ssize_t n = read(out_fd, buf, sizeof(buf));

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		fwrite(buf, 1, (size_t)n, stderr);
		if (len && got < len - 1) {
			size_t take = (size_t)n < len - 1 - got ? (size_t)n : len - 1 - got;

			memcpy(out + got, buf, take);
			got += take;
		}
	}
	if (len)
		out[got] = '\0';
	close(out_fd);
	while (waitpid(pid, &status, 0) < 0)
		if (errno != EINTR)
			return -1;
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int tl_run(char *out, size_t len, const char *const *argv)
{
	int fd;
	pid_t pid = tl_spawn(argv, &fd);

	return pid < 0 ? -1 : tl_collect(pid, fd, out, len);
}
