/* Reading /proc/PID/stat (proc_stat.h). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/proc_stat.h"

const char *proc_stat_fields(pid_t pid, char *buf, size_t len, int *err)
{
	char path[32], *paren;
	ssize_t n;
	int fd, e;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		e = -errno;
		goto fail;
	}
	n = read(fd, buf, len - 1);
	e = n < 0 ? -errno : 0;
	close(fd);
	if (n <= 0)
		goto fail;
	buf[n] = '\0';
	/* The last ')' ends the name, whatever it holds. */
	paren = strrchr(buf, ')');
	if (paren && paren[1] == ' ' && paren[2])
		return paren + 2;
	e = -EINVAL;
fail:
	if (err)
		*err = e;
	return NULL;
}
