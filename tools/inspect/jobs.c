/* Finding a job: its launcher's memfd attached read-only; the job list. */
#include <dirent.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tools/inspect/inspect.h"
#include "common/json.h"

/* Attaches to the job whose launcher is pid; quiet: no message on failure. */
int attach_job(pid_t pid, struct shm_seg *seg, bool quiet)
{
	char path[PATH_MAX], proc[32];
	struct stat st;
	int err;

	snprintf(proc, sizeof(proc), "/proc/%d", (int)pid);
	if (stat(proc, &st) < 0)
		return quiet ? -1 : fail("no such job: no process %d", (int)pid);
	if (st.st_uid != getuid())
		return quiet ? -1 : fail("process %d belongs to another user", (int)pid);
	err = find_memfd(pid, SEG_LINK, path, sizeof(path));
	/* A launcher that has exited but is not reaped yet holds no fds:
	 * its job has ended, which "not a shmrpc job" would hide. */
	if (err && process_gone((uint32_t)pid))
		return quiet ? -1 : fail("no such job: process %d has ended", (int)pid);
	if (err == -ENOENT)
		return quiet ? -1 : fail("process %d is not a shmrpc job", (int)pid);
	if (err)
		return quiet ? -1 : fail("cannot read %s/fd: %s", proc, strerror(-err));
	if (shm_seg_attach_path(seg, path, true)) {
		if (quiet)
			return -1;
		if (process_gone((uint32_t)pid)) /* it exited as we opened it */
			return fail("no such job: process %d has ended", (int)pid);
		return fail("process %d: %s", (int)pid, shmrpc_errmsg());
	}
	if (seg->hdr->launcher_pid != (uint32_t)pid) {
		uint32_t launcher = seg->hdr->launcher_pid;

		shm_seg_detach(seg);
		return quiet ? -1 :
			fail("process %d is a worker, not a launcher: the job is %u", (int)pid, launcher);
	}
	return 0;
}

int list_jobs(bool json)
{
	DIR *proc = opendir("/proc");
	struct dirent *d;
	int found = 0;

	if (!proc)
		return fail("cannot read /proc: %s", strerror(errno));
	if (json)
		printf("{\"jobs\":[");
	while ((d = readdir(proc))) {
		char *end, name[SHM_NAME_MAX + 1], pbuf[SHM_NAME_MAX + 1], dur[32];
		long pid = strtol(d->d_name, &end, 10);
		uint32_t n[NSTATES] = { 0 };
		struct shm_seg seg;

		if (*end || pid <= 0 || attach_job((pid_t)pid, &seg, true))
			continue;
		for (uint32_t r = 0; r < seg.world; r++) {
			const struct shm_worker *w = shm_worker(&seg, r);
			/* Acquire, as snap_worker: the pid the launcher stored first. */
			uint32_t st = atomic_load_explicit(&w->state, memory_order_acquire);

			st = shown_state(st, atomic_load_explicit(&w->pid, memory_order_relaxed));
			n[st < NSTATES ? st : 0]++;
		}
		copy_name(name, seg.hdr->job_name);
		if (json) {
			printf("%s{\"launcher_pid\":%ld,\"job_name\":", found++ ? "," : "", pid);
			json_put_str(stdout, name);
			printf(",\"world_size\":%u,\"age_s\":%.3f,\"workers\":{", seg.world,
			       (double)age_ns(&seg) / 1e9);
			for (uint32_t st = 0; st < NSTATES; st++)
				printf("%s\"%s\":%u", st ? "," : "", state_names[st], n[st]);
			printf("}}");
			shm_seg_detach(&seg);
			continue;
		}
		if (!found++)
			printf("%7s %-24s %5s %8s %7s %7s %6s %4s\n", "PID", "JOB", "WORLD", "AGE",
			       "STARTED", "RUNNING", "EXITED", "DEAD");
		printf("%7ld %-24s %5u %8s %7u %7u %6u %4u\n", pid, printable(name, pbuf), seg.world,
		       fmt_dur(age_ns(&seg), dur, sizeof(dur)), n[STATE_STARTED],
		       n[SHM_WORKER_RUNNING], n[SHM_WORKER_EXITED], n[SHM_WORKER_DEAD]);
		shm_seg_detach(&seg);
	}
	closedir(proc);
	if (json)
		printf("]}\n");
	else if (!found)
		printf("no shmrpc jobs of this user\n");
	return 0;
}
