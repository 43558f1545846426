/*
 * The descendants of a process, found through /proc/PID/task/TID/children
 * (every thread's list: a child's parent is the thread that forked it).
 *
 * Why not a process group per worker: a worker in a group of its own is
 * in the background of a terminal shmrun runs in, and stops (SIGTTIN) the
 * first time it reads it, or (SIGTTOU, with `stty tostop`) writes to it;
 * handing it the terminal's foreground would take Ctrl-C from the others.
 * And a group misses what leaves it: a `setsid` daemon, a shell with job
 * control putting its jobs in groups of their own. The tree misses none of
 * them while they live: each is some process's child, and once its parent
 * ends it is shmrun's (the subreaper, orphans.c), so a walk from shmrun,
 * repeated until it finds nothing, reaches every descendant of every
 * worker, whatever group or session it is in.
 *
 * What a walk cannot promise: a process forked after its parent's list
 * was read is found by the next walk, and a pid read from a list may
 * have ended and been given to another process before the signal goes
 * (only between the read and the kill, microseconds, and pids are
 * handed out in order, so not soon again).
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/shmrun.h"

/* Appends the children of every thread of pid to out[*n..most). */
static void children_of(pid_t pid, pid_t *out, int *n, int most)
{
	char path[320]; /* a task's name is a number; d_name's room, for the compiler */
	struct dirent *de;
	DIR *tasks;

	snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
	if (!(tasks = opendir(path)))
		return; /* gone */
	while (*n < most && (de = readdir(tasks))) {
		FILE *f;
		int child;

		if (de->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/%d/task/%s/children", (int)pid, de->d_name);
		if (!(f = fopen(path, "r")))
			continue;
		while (*n < most && fscanf(f, "%d", &child) == 1)
			out[(*n)++] = (pid_t)child;
		fclose(f);
	}
	closedir(tasks);
}

int tree_list(pid_t root, pid_t *out, int most)
{
	int n = 0;

	children_of(root, out, &n, most);
	/* Breadth first: out[] is its own queue, parents before children. */
	for (int at = 0; at < n && n < most; at++)
		children_of(out[at], out, &n, most);
	return n;
}
