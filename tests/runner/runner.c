/*
 * The test runner: runs each test program in its own process group with a
 * timeout, as libuv's runner does, and judges by exit status: 0 pass,
 * 77 skip, anything else (a signal, a timeout) fail. The runner is a child
 * subreaper, so a process a test left behind comes back to it: that is a
 * failure too, and the process is killed. So is anything of the project
 * left in /dev/shm. Output of a test is shown when it fails (or with -v).
 * Ends with the line "N passed, N failed, N skipped".
 *
 * A skip shows its reason: the text after the last "skip: " line the test
 * printed (else its last line). With -a FILE, a skip is a failure unless a
 * line of FILE allows it: "PATTERN REASON", PATTERN a glob on the test's
 * name and REASON text its skip reason must contain ('#' starts a comment).
 * make check passes .ci/allowed-skips: a fresh machine after `make deps`
 * runs every test but those that need a GPU, and any other skip (a missing
 * package, a probe that failed) is caught instead of counted as fine.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
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

/*
 * The reason a skipping test gave, into buf: the rest of its last line
 * that starts with "skip: " (any case), else its last non-empty line, else
 * a sentence saying it gave none.
 */
static const char *skip_reason(FILE *out, char *buf, size_t len)
{
	char line[512];
	bool tagged = false;

	snprintf(buf, len, "it printed no reason");
	rewind(out);
	while (fgets(line, sizeof(line), out)) {
		size_t n = strcspn(line, "\n");
		const char *t = line;

		line[n] = '\0';
		while (*t == ' ' || *t == '\t')
			t++;
		if (!*t)
			continue;
		if (strncasecmp(t, "skip: ", 6) == 0) {
			snprintf(buf, len, "%s", t + 6);
			tagged = true;
		} else if (!tagged) {
			snprintf(buf, len, "%s", t);
		}
	}
	return buf;
}

/* The allow-list of -a: lines "PATTERN REASON". */
struct allow {
	char pattern[512];
	char reason[512];
};

static int read_allowed(const char *path, struct allow **out)
{
	FILE *f = fopen(path, "r");
	char line[512];
	int n = 0, cap = 0;

	if (!f) {
		fprintf(stderr, "cannot read the allowed skips %s: %s\n", path, strerror(errno));
		return -1;
	}
	*out = NULL;
	while (fgets(line, sizeof(line), f)) {
		char *p = line, *pat, *why;

		line[strcspn(line, "#\n")] = '\0';
		while (*p == ' ' || *p == '\t')
			p++;
		if (!*p)
			continue;
		pat = p;
		p += strcspn(p, " \t");
		if (*p)
			*p++ = '\0';
		while (*p == ' ' || *p == '\t')
			p++;
		why = p;
		for (char *e = why + strlen(why); e > why && (e[-1] == ' ' || e[-1] == '\t');)
			*--e = '\0';
		if (!*why) {
			fprintf(stderr, "%s: \"%s\" names no reason: each line is \"TEST REASON\"\n",
				path, pat);
			fclose(f);
			return -1;
		}
		if (n == cap) {
			cap = cap ? 2 * cap : 16;
			*out = realloc(*out, (size_t)cap * sizeof(**out));
			if (!*out) {
				fclose(f);
				return -1;
			}
		}
		snprintf((*out)[n].pattern, sizeof((*out)[n].pattern), "%s", pat);
		snprintf((*out)[n].reason, sizeof((*out)[n].reason), "%s", why);
		n++;
	}
	fclose(f);
	return n;
}

static bool skip_allowed(const struct allow *a, int n, const char *name, const char *reason)
{
	for (int i = 0; i < n; i++)
		if (fnmatch(a[i].pattern, name, 0) == 0 && strstr(reason, a[i].reason))
			return true;
	return false;
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
	const char *fuzz = getenv("SHMRPC_FUZZ"), *allowed_path = NULL;
	struct allow *allowed = NULL;
	int nallowed = 0;
	char **tests;
	int ntests, nplain;

	while ((opt = getopt(argc, argv, "a:t:v")) != -1) {
		if (opt == 't')
			timeout = atoi(optarg);
		else if (opt == 'v')
			verbose = true;
		else if (opt == 'a')
			allowed_path = optarg;
		else {
			fprintf(stderr, "usage: %s [-t SECONDS] [-v] [-a ALLOWED_SKIPS] TEST...\n",
				argv[0]);
			return 2;
		}
	}
	if (allowed_path && (nallowed = read_allowed(allowed_path, &allowed)) < 0)
		return 2;
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	signal(SIGPIPE, SIG_IGN);
	ntests = argc - optind;
	/* SHMRPC_FUZZ: the fuzz targets, separated by spaces, run after the
	 * tests; as many as the string has words at most. */
	tests = calloc((size_t)ntests + (fuzz ? strlen(fuzz) : 0) + 2, sizeof(*tests));
	for (int i = 0; i < ntests; i++)
		tests[i] = argv[optind + i];
	nplain = ntests;
	for (char *f = fuzz ? strtok(strdup(fuzz), " ") : NULL; f; f = strtok(NULL, " "))
		tests[ntests++] = f;

	for (int i = 0; i < ntests; i++) {
		const char *name = base(tests[i]);
		bool is_fuzz = i >= nplain;
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
			char why[512];

			skip_reason(out, why, sizeof(why));
			if (allowed_path && !skip_allowed(allowed, nallowed, name, why)) {
				printf("FAIL %s (skipped: %s; %s allows no such skip, %.2f s)\n", name,
				       why, allowed_path, dt);
				failed++;
			} else {
				printf("SKIP %s (%s, %.2f s)\n", name, why, dt);
				skipped++;
			}
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
	free(allowed);
	return failed ? 1 : 0;
}
