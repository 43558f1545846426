/*
 * shmrun -n N [options] -- PROG [ARGS...]: creates the job segment, starts
 * N workers, watches them until all have ended, and says how it went.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "launcher/shmrun.h"

/* fds 0-2 open, so that no fd of ours lands there and a worker's dup2 of
 * its output pipes cannot close the segment under it. */
static void keep_std_fds_open(void)
{
	int fd;

	while ((fd = open("/dev/null", O_RDWR)) >= 0 && fd <= 2)
		;
	if (fd > 2)
		close(fd);
}

/* The launcher holds a pidfd per worker, and two pipes with --tag-output;
 * each worker a pidfd per peer beside its own files (the limit is
 * inherited). */
static int raise_fd_limit(const struct shmrun_opts *o)
{
	rlim_t need = (rlim_t)o->nproc * (o->tag_output ? 3 : 1) + 256;
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur >= need)
		return 0;
	if (rl.rlim_max < need) {
		fprintf(stderr, "shmrun: %u workers need %llu open files, the limit is %llu "
			"(raise it with ulimit -n)\n", o->nproc, (unsigned long long)need,
			(unsigned long long)rl.rlim_max);
		return -1;
	}
	rl.rlim_cur = need;
	if (setrlimit(RLIMIT_NOFILE, &rl) < 0) {
		fprintf(stderr, "shmrun: cannot raise the open-file limit to %llu: %s\n",
			(unsigned long long)need, strerror(errno));
		return -1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct shmrun_opts o;
	struct job j = { .o = &o, .sigfd = -1 };
	struct job_shm_params jp;
	int rc = shmrun_parse_options(argc, argv, &o);

	if (rc >= 0)
		return rc;
	rc = SHMRUN_EXIT_FAILED;
	keep_std_fds_open();
	j.launcher_pid = getpid();
	j.start_ns = shmrpc_now_ns();
	j.procs = calloc(o.nproc, sizeof(*j.procs));
	if (!j.procs) {
		fprintf(stderr, "shmrun: out of memory\n");
		return rc;
	}
	for (uint32_t r = 0; r < o.nproc; r++) {
		j.procs[r].pidfd = -1;
		j.procs[r].out[0].fd = j.procs[r].out[1].fd = -1;
	}
	if (raise_fd_limit(&o) || orphans_adopt() || watch_init(&j))
		goto out;
	jp = (struct job_shm_params){ .world = o.nproc, .ring_size = o.ring_size,
				      .trace_records = o.trace_records, .seg_flags = o.seg_flags,
				      .job_name = basename(o.argv[0]), .pool_size = o.pool_size,
				      .max_rrefs = o.max_rrefs, .holder_records = o.holder_records,
				      .pool_records = o.pool_records };
	if (job_shm_create(&j.shm, &jp)) {
		fprintf(stderr, "shmrun: %s\n", shmrpc_errmsg());
		goto out;
	}
	integrity_init(&j);
	guard_start(&j); /* without it the job runs as before: said on stderr */
	if (spawn_workers(&j))
		watch_stop(&j, STOP_ERROR, SIGTERM);
	rc = watch_job(&j);
	integrity_check(&j); /* what changed since its last look */
	orphans_end(&j);
	guard_stop(&j);
	/* A failed job's trace is the one most wanted; a failed write only
	 * turns a success into a failure. */
	if (o.trace_path && trace_json_write(&j, o.trace_path) && !rc)
		rc = SHMRUN_EXIT_FAILED;
	if (!o.quiet)
		report_summary(&j);
	report_leaks(&j);
	if (report_corrupt(&j) && !rc)
		rc = SHMRUN_EXIT_FAILED; /* frames were lost: a success would be a lie */
	job_shm_close(&j.shm);
out:
	watch_free(&j);
	free(j.procs);
	return rc;
}
