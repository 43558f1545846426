/*
 * The CUDA driver's files of a process that ended without its atexit
 * handlers (/dev/shm/cuda.shm.UID.PID.N, PID in hex; common/cuda_leftovers.h)
 * go with it: shmrun removes those of each worker and of each orphan it
 * reaps, and leaves alone those of a process still running. The workers
 * here write such files themselves, as the driver would.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

static char out[16384];

/* /dev/shm/cuda.shm.UID.PID.n */
static void driver_file(char *buf, size_t len, pid_t pid, int n)
{
	snprintf(buf, len, "/dev/shm/cuda.shm.%u.%x.%d", (unsigned)geteuid(), (unsigned)pid, n);
}

/* The pid rank's process wrote to dir/WHAT. */
static pid_t read_pid(const char *dir, const char *what, int rank)
{
	char path[128];
	FILE *f;
	int pid = 0;

	snprintf(path, sizeof(path), "%s/%s%d", dir, what, rank);
	f = fopen(path, "r");
	CHECK(f && fscanf(f, "%d", &pid) == 1 && pid > 0, "%s has no pid", path);
	fclose(f);
	unlink(path);
	return pid;
}

int main(void)
{
	char dir[] = "/tmp/shmrun-cudafiles-XXXXXX", mine[96];
	/* Each worker writes its file, starts a process that writes its own
	 * and outlives the worker (shmrun's orphan then), and ends once the
	 * orphan's file is there. */
	const char *script =
		"u=$(id -u); d=$0; r=$SHMRPC_RANK; "
		"touch /dev/shm/cuda.shm.$u.$(printf %x $$).1 && echo $$ > $d/w$r; "
		"sh -c 'touch /dev/shm/cuda.shm.'$u'.$(printf %x $$).2 && echo $$ > '$d'/o'$r'; "
		"sleep 0.2' & "
		"while [ ! -s $d/o$r ]; do sleep 0.01; done";
	const char *argv[] = { tl_shmrun_path(), "-n", "2", "--", "/bin/sh", "-c", script, dir, NULL };
	FILE *f;
	int rc;

	CHECK(access(tl_shmrun_path(), X_OK) == 0, "%s is not built", tl_shmrun_path());
	CHECK(mkdtemp(dir), "mkdtemp");
	/* A running process's file (this one's) stays. */
	driver_file(mine, sizeof(mine), getpid(), 9);
	CHECK((f = fopen(mine, "w")), "create %s: %s", mine, strerror(errno));
	fclose(f);
	rc = tl_run(out, sizeof(out), argv);
	CHECK(rc == 0, "shmrun exited %d:\n%s", rc, out);
	for (int r = 0; r < 2; r++) {
		char path[96];

		driver_file(path, sizeof(path), read_pid(dir, "w", r), 1);
		CHECK(access(path, F_OK) < 0 && errno == ENOENT, "worker %d's %s is left", r, path);
		driver_file(path, sizeof(path), read_pid(dir, "o", r), 2);
		CHECK(access(path, F_OK) < 0 && errno == ENOENT, "orphan %d's %s is left", r, path);
	}
	CHECK(access(mine, F_OK) == 0, "%s, a running process's, was removed", mine);
	unlink(mine);
	CHECK(rmdir(dir) == 0, "rmdir %s: %s", dir, strerror(errno));
	return 0;
}
