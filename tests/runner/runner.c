/*
 * The test runner: runs each test program in its own process group with a
 * timeout, as libuv's runner does, and judges by exit status: 0 pass,
 * 77 skip, anything else (a signal, a timeout) fail. The runner is a child
 * subreaper, so a process a test left behind comes back to it: that is a
 * failure too, and the process is killed. So is anything of the project
 * left in /dev/shm. Output of a test is shown when it fails (or with -v).
 * Ends with the line "N passed, N failed, N skipped".
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int shm_leftovers(void)
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

/* Kills every live child of ours (strays re-parented to the subreaper
 * included) found in /proc; returns how many. */
static int kill_children(void)
{
	DIR *d = opendir("/proc");
	struct dirent *e;
	int n = 0;

	if (!d)
		return 0;
	while ((e = readdir(d))) {
		char path[64], line[256];
		FILE *f;
		pid_t pid = (pid_t)atoi(e->d_name), ppid = 0;
		char st = 0;

		if (pid <= 0)
			continue;
		snprintf(path, sizeof(path), "/proc/%d/stat", pid);
		if (!(f = fopen(path, "r")))
			continue;
		/* "pid (comm) S ppid": comm may hold spaces, so parse after ')' */
		if (fgets(line, sizeof(line), f)) {
			char *p = strrchr(line, ')');

			if (p)
				sscanf(p + 1, " %c %d", &st, &ppid);
		}
		fclose(f);
		if (ppid == getpid() && st != 'Z') {
			kill(pid, SIGKILL);
			n++;
		}
	}
	closedir(d);
	return n;
}

/* Kills and reaps whatever the test left: its process group, and any
 * process that came back to us. Returns how many were still alive. */
static int reap_strays(pid_t pgid)
{
	int n = 0;

	/* Zombies first: a group of zombies only is not a stray. */
	while (waitpid(-1, NULL, __WALL | WNOHANG) > 0)
		;
	if (kill(-pgid, SIGKILL) == 0)
		n++;
	for (;;) {
		pid_t p = waitpid(-1, NULL, __WALL | WNOHANG);

		if (p > 0)
			continue;
		if (p < 0)
			break;
		n += kill_children();
		usleep(1000);
	}
	return n;
}

static void show(FILE *out)
{
	char buf[4096];
	size_t n;

	rewind(out);
	while ((n = fread(buf, 1, sizeof(buf), out)) > 0)
		fwrite(buf, 1, n, stdout);
}

static const char *base(const char *path)
{
	const char *s = strrchr(path, '/');

	return s ? s + 1 : path;
}

int main(int argc, char **argv)
{
	int timeout = 120, passed = 0, failed = 0, skipped = 0, opt;
	bool verbose = false;
	const char *fuzz = getenv("SHMRPC_FUZZ");
	char **tests;
	int ntests;

	while ((opt = getopt(argc, argv, "t:v")) != -1) {
		if (opt == 't')
			timeout = atoi(optarg);
		else if (opt == 'v')
			verbose = true;
		else {
			fprintf(stderr, "usage: %s [-t SECONDS] [-v] TEST...\n", argv[0]);
			return 2;
		}
	}
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	signal(SIGPIPE, SIG_IGN);
	ntests = argc - optind;
	tests = calloc((size_t)ntests + 2, sizeof(*tests));
	for (int i = 0; i < ntests; i++)
		tests[i] = argv[optind + i];
	if (fuzz && *fuzz)
		tests[ntests++] = (char *)fuzz;

	for (int i = 0; i < ntests; i++) {
		const char *name = base(tests[i]);
		bool is_fuzz = fuzz && tests[i] == fuzz;
		FILE *out = tmpfile();
		int shm_before = shm_leftovers(), status = 0, strays;
		double t0 = now_s(), dt;
		bool timed_out = false;
		int failed_before = failed;
		pid_t pid;

		fflush(stdout);
		pid = fork();
		if (pid == 0) {
			setpgid(0, 0);
			dup2(fileno(out), 1);
			dup2(fileno(out), 2);
			if (is_fuzz)
				execl(tests[i], tests[i], "-max_total_time=20", "-print_final_stats=0",
				      "-print_funcs=0",
				      (char *)NULL);
			else
				execl(tests[i], tests[i], (char *)NULL);
			fprintf(stderr, "cannot run %s: %s\n", tests[i], strerror(errno));
			_exit(127);
		}
		setpgid(pid, pid);
		for (;;) {
			pid_t r = waitpid(pid, &status, WNOHANG);

			if (r == pid)
				break;
			if (now_s() - t0 > timeout) {
				kill(-pid, SIGKILL);
				waitpid(pid, &status, 0);
				timed_out = true;
				break;
			}
			usleep(2000);
		}
		dt = now_s() - t0;
		strays = reap_strays(pid);
		if (timed_out) {
			printf("FAIL %s (timed out after %d s)\n", name, timeout);
			failed++;
		} else if (WIFSIGNALED(status)) {
			printf("FAIL %s (killed by signal %d: %s, %.2f s)\n", name, WTERMSIG(status),
			       strsignal(WTERMSIG(status)), dt);
			failed++;
		} else if (WEXITSTATUS(status) == 77) {
			printf("SKIP %s (%.2f s)\n", name, dt);
			skipped++;
		} else if (WEXITSTATUS(status) != 0) {
			printf("FAIL %s (exit %d, %.2f s)\n", name, WEXITSTATUS(status), dt);
			failed++;
		} else if (strays) {
			printf("FAIL %s (left %d process(es) behind, %.2f s)\n", name, strays, dt);
			failed++;
		} else if (shm_leftovers() > shm_before) {
			printf("FAIL %s (left files in /dev/shm, %.2f s)\n", name, dt);
			failed++;
		} else {
			printf("PASS %s (%.2f s)\n", name, dt);
			passed++;
		}
		if (verbose || failed > failed_before)
			show(out);
		fclose(out);
	}
	printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
	free(tests);
	return failed ? 1 : 0;
}
