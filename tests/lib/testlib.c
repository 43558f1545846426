#include <dirent.h>
#include <sched.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/lib/testlib.h"

int tl_skip(const char *reason)
{
	printf("skip: %s\n", reason);
	fflush(stdout);
	return TL_SKIP;
}

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

unsigned tl_cores(void)
{
	cpu_set_t set;

	return sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0
		       ? (unsigned)CPU_COUNT(&set)
		       : 1;
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

char tl_proc_state(pid_t pid)
{
	char path[64], stat[512], *at;
	FILE *f;
	char state = 0;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	if (!(f = fopen(path, "r")))
		return 0;
	/* The state follows the command's closing parenthesis and a space. */
	if (fgets(stat, sizeof(stat), f) && (at = strrchr(stat, ')')) && at[1] == ' ')
		state = at[2];
	fclose(f);
	return state;
}

static void *continue_later(void *arg)
{
	const struct tl_pause *p = arg;
	const struct timespec later = { (time_t)(p->ns / 1000000000u), (long)(p->ns % 1000000000u) };

	nanosleep(&later, NULL);
	CHECK(kill(p->pid, SIGCONT) == 0, "SIGCONT");
	return NULL;
}

void tl_pause_begin(struct tl_pause *p, pid_t pid, uint64_t ns)
{
	p->pid = pid;
	p->ns = ns;
	CHECK(kill(pid, SIGSTOP) == 0, "SIGSTOP");
	while (tl_proc_state(pid) != 'T')
		usleep(1000);
	CHECK(pthread_create(&p->thread, NULL, continue_later, p) == 0, "pthread_create");
}

void tl_pause_end(struct tl_pause *p)
{
	pthread_join(p->thread, NULL);
}

unsigned long long tl_json_num(const char *from, const char *key)
{
	char pat[64];
	const char *p;

	snprintf(pat, sizeof(pat), "\"%s\":", key);
	p = strstr(from, pat);
	CHECK(p, "no %s in %s", pat, from);
	return strtoull(p + strlen(pat), NULL, 10);
}
