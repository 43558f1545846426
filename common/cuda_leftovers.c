/* The CUDA driver's files of an ended process (cuda_leftovers.h). */
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/cuda_leftovers.h"

#define PREFIX "cuda.shm."

/* Whether name is PREFIX UID.PID.N with PID (hex) equal to pid. */
static int names_pid(const char *name, pid_t pid)
{
	const char *p = strchr(name + sizeof(PREFIX) - 1, '.');
	char *end;
	unsigned long v;

	if (!p || !*++p)
		return 0;
	v = strtoul(p, &end, 16);
	return end != p && *end == '.' && v == (unsigned long)pid;
}

int cuda_leftovers_remove(pid_t pid)
{
	DIR *d = opendir("/dev/shm");
	struct dirent *de;
	struct stat st;
	int n = 0;

	if (!d)
		return 0;
	while ((de = readdir(d))) {
		if (strncmp(de->d_name, PREFIX, sizeof(PREFIX) - 1) || !names_pid(de->d_name, pid))
			continue;
		/* Another user's file of the same pid number is not ours to judge. */
		if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode) ||
		    st.st_uid != geteuid())
			continue;
		if (unlinkat(dirfd(d), de->d_name, 0) == 0)
			n++;
	}
	closedir(d);
	return n;
}
