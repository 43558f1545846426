/* What shmrpc-inspect's parts share: /proc, durations, names (inspect.h). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/proc_stat.h"
#include "tools/inspect/inspect.h"

const char *name_of(const char *const *names, size_t n, uint32_t v)
{
	return v < n ? names[v] : "?";
}

int fail(const char *fmt, ...)
{
	va_list ap;

	fputs(PROG ": ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return EXIT_ANOMALY;
}

/*
 * Whether process pid has ended: no such process, or a zombie its parent
 * has not reaped yet (it holds no fds any more). A pid taken again by
 * another process reads as alive: the slot's pid is all there is to go by.
 */
/* The state letter of /proc/PID/stat ('R', 'S', 'T'...), or 0 when the
 * process is gone. */
char process_state(uint32_t pid)
{
	char buf[512];
	int err;
	const char *f = proc_stat_fields((pid_t)pid, buf, sizeof(buf), &err);

	if (f)
		return f[0];
	return !err || err == -ENOENT || err == -ESRCH ? 0 : '?';
}

bool process_gone(uint32_t pid)
{
	char st = process_state(pid);

	return !st || st == 'Z' || st == 'X';
}

/*
 * Finds the job segment among the fds of pid: path gets /proc/PID/fd/N.
 * 0 when found, -ENOENT when pid holds none, or -errno of /proc.
 */
int find_memfd(pid_t pid, const char *target, char *path, size_t len)
{
	char dir[64], link[64];
	struct dirent *d;
	DIR *fds;
	int err = -ENOENT;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
	fds = opendir(dir);
	if (!fds)
		return -errno;
	while ((d = readdir(fds))) {
		ssize_t n;

		if (d->d_name[0] == '.')
			continue;
		snprintf(path, len, "%s/%s", dir, d->d_name);
		n = readlink(path, link, sizeof(link) - 1);
		if (n < 0)
			continue;
		link[n] = '\0';
		if (strcmp(link, target) == 0) {
			err = 0;
			break;
		}
	}
	closedir(fds);
	return err;
}

/* pid's memfd whose link is target, opened read-only; -1 when none. */
int open_memfd(pid_t pid, const char *target)
{
	char path[PATH_MAX];

	return find_memfd(pid, target, path, sizeof(path)) ? -1 : open(path, O_RDONLY);
}

uint64_t age_ns(const struct shm_seg *seg)
{
	uint64_t now = shmrpc_realtime_ns();

	return now > seg->hdr->created_ns ? now - seg->hdr->created_ns : 0;
}

/* "850ms", "12.3s", "4m05s", "3h07m", "2d04h". */
const char *fmt_dur(uint64_t ns, char *buf, size_t len)
{
	uint64_t s = ns / 1000000000u;

	if (ns == UINT64_MAX)
		snprintf(buf, len, "-");
	else if (ns < 1000000000u)
		snprintf(buf, len, "%llums", (unsigned long long)(ns / 1000000u));
	else if (s < 60)
		snprintf(buf, len, "%.1fs", (double)ns / 1e9);
	else if (s < 3600)
		snprintf(buf, len, "%llum%02llus", (unsigned long long)(s / 60), (unsigned long long)(s % 60));
	else if (s < 86400)
		snprintf(buf, len, "%lluh%02llum", (unsigned long long)(s / 3600),
			 (unsigned long long)(s % 3600 / 60));
	else
		snprintf(buf, len, "%llud%02lluh", (unsigned long long)(s / 86400),
			 (unsigned long long)(s % 86400 / 3600));
	return buf;
}

/* A name from the segment, bounded and NUL-terminated whatever is there. */
void copy_name(char *dst, const char *src)
{
	size_t n = strnlen(src, SHM_NAME_MAX);

	memcpy(dst, src, n);
	dst[n] = '\0';
}

/* The same name for a terminal: control bytes become '?'. */
const char *printable(const char *s, char *buf)
{
	size_t i;

	for (i = 0; s[i]; i++)
		buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
	buf[i] = '\0';
	return buf;
}
