#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/lib/testlib.h"

double tl_scale(void)
{
	const char *s = getenv("SHMRPC_TEST_SCALE");
	double v = s ? atof(s) : 0;

	if (v > 0)
		return v;
#if defined(__SANITIZE_THREAD__)
	return 0.02; /* ThreadSanitizer runs these loops 10 to 50 times slower */
#elif defined(__SANITIZE_ADDRESS__)
	return 0.1;
#else
	return 1.0;
#endif
}

bool tl_wait_children(void)
{
	bool ok = true;
	int status;
	pid_t pid;

	while ((pid = waitpid(-1, &status, 0)) > 0 || (pid < 0 && errno == EINTR)) {
		if (pid < 0)
			continue;
		if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
			continue;
		ok = false;
		if (WIFSIGNALED(status))
			fprintf(stderr, "child %d killed by signal %d (%s)\n", (int)pid, WTERMSIG(status),
				strsignal(WTERMSIG(status)));
		else
			fprintf(stderr, "child %d exited with %d\n", (int)pid, WEXITSTATUS(status));
	}
	return ok;
}

int tl_shm_leftovers(void)
{
	DIR *d = opendir("/dev/shm");
	struct dirent *e;
	int n = 0;

	if (!d)
		return 0;
	while ((e = readdir(d)))
		if (strcasestr(e->d_name, "shmrpc"))
			n++;
	closedir(d);
	return n;
}

int tl_wait_modes(const char **names, int max)
{
	static const char *all[] = { "uring", "futex", "spin" };
	int n = 0;

	for (int i = 0; i < 3 && n < max; i++)
		names[n++] = all[i];
	return n;
}
