/*
 * shmrun's basics: the environment each worker gets, --tag-output (whole
 * lines, stderr too, a partial last line flushed), torchrun's spelling of
 * -n, --name-format, the job segment as a worker sees it (names and
 * generations written before the fork, its pid recorded), bad arguments
 * (exit 2 with the usage), --version, a program that cannot run, and a
 * worker's exit code.
 */
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define SH "/bin/sh"
#define OUT_MAX 16384

static char out[OUT_MAX];

/* True if line is one whole line of text. */
static bool has_line(const char *text, const char *line)
{
	size_t n = strlen(line);

	for (const char *p = text; (p = strstr(p, line)); p++)
		if ((p == text || p[-1] == '\n') && (p[n] == '\n' || p[n] == '\0'))
			return true;
	return false;
}

/* Worker side of segment_as_seen(): the launcher's writes, checked from inside. */
static int check_segment(void)
{
	struct shm_seg seg;
	uint32_t rank = (uint32_t)atoi(getenv("SHMRPC_RANK"));
	uint64_t deadline = shmrpc_now_ns() + 10000000000ull;

	CHECK_OK(shm_seg_attach_env(&seg));
	CHECK(seg.world == (uint32_t)atoi(getenv("SHMRPC_WORLD_SIZE")), "world %u", seg.world);
	CHECK(!strcmp(seg.hdr->job_name, "launcher_basic"), "job name \"%s\"", seg.hdr->job_name);
	CHECK(seg.hdr->launcher_pid == (uint32_t)getppid(), "launcher pid %u", seg.hdr->launcher_pid);
	for (uint32_t r = 0; r < seg.world; r++) {
		struct shm_worker *w = shm_worker(&seg, r);
		char want[SHM_NAME_MAX];

		snprintf(want, sizeof(want), "seg-%u", r);
		CHECK(!strcmp(w->name, want), "slot %u named \"%s\"", r, w->name);
		CHECK(atomic_load_explicit(&w->generation, memory_order_acquire) == 1,
		      "slot %u generation %u", r, atomic_load(&w->generation));
	}
	/* The launcher stores the pid after fork returns there: it may come after us. */
	while (atomic_load_explicit(&shm_worker(&seg, rank)->pid, memory_order_acquire) !=
	       (uint32_t)getpid()) {
		CHECK(shmrpc_now_ns() < deadline, "the launcher never recorded pid %d", (int)getpid());
		usleep(1000);
	}
	printf("rank %u segment ok\n", rank);
	shm_seg_detach(&seg);
	return 0;
}

static void environment_and_tags(void)
{
	const char *argv[] = { tl_shmrun_path(), "-n", "3", "--tag-output", "--", SH, "-c",
			       "echo \"$SHMRPC_RANK/$SHMRPC_WORLD_SIZE $SHMRPC_NAME $RANK $LOCAL_RANK "
			       "$WORLD_SIZE $SHMRPC_LOCAL_RANK\"; printf 'err%s' $RANK >&2",
			       NULL };
	char line[64];

	CHECK(tl_run(out, sizeof(out), argv) == 0, "3 tagged workers failed");
	for (int r = 0; r < 3; r++) {
		snprintf(line, sizeof(line), "[%d] %d/3 worker%d %d %d 3 %d", r, r, r, r, r, r);
		CHECK(has_line(out, line), "no line \"%s\"", line);
		/* stderr, without its newline: flushed as a line of its own */
		snprintf(line, sizeof(line), "[%d] err%d", r, r);
		CHECK(has_line(out, line), "no line \"%s\"", line);
	}
	CHECK(strstr(out, "shmrun: 3 workers, all exited 0 ("), "no summary");
}

static void spellings_and_names(void)
{
	const char *eq[] = { tl_shmrun_path(), "--nproc_per_node=2", "--name-format", "w{rank}",
			     "--tag-output", "--quiet", "--", SH, "-c",
			     "echo \"name=$SHMRPC_NAME\"; readlink /proc/self/fd/$SHMRPC_JOB_FD", NULL };
	const char *dash[] = { tl_shmrun_path(), "--nproc-per-node", "2", "--name-format=n{local_rank}x",
			       "--", SH, "-c", "echo \"name=$SHMRPC_NAME\"", NULL };

	CHECK(tl_run(out, sizeof(out), eq) == 0, "--nproc_per_node=2 failed");
	CHECK(has_line(out, "[0] name=w0") && has_line(out, "[1] name=w1"), "names from w{rank}");
	/* The worker inherited the job segment, a memfd, under the fd it was told. */
	CHECK(has_line(out, "[0] /memfd:shmrpc-job (deleted)") &&
	      has_line(out, "[1] /memfd:shmrpc-job (deleted)"), "SHMRPC_JOB_FD is not the segment");
	CHECK(!strstr(out, "shmrun:"), "--quiet printed a summary");

	CHECK(tl_run(out, sizeof(out), dash) == 0, "--nproc-per-node 2 failed");
	CHECK(has_line(out, "name=n0x") && has_line(out, "name=n1x"), "names from n{local_rank}x");
	CHECK(strstr(out, "shmrun: 2 workers, all exited 0"), "no summary");
}

static void segment_as_seen(void)
{
	char self[4096];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	const char *argv[] = { tl_shmrun_path(), "-n", "3", "--name-format", "seg-{rank}", "--",
			       self, "worker", NULL };

	CHECK(n > 0, "readlink /proc/self/exe");
	self[n] = '\0';
	CHECK(tl_run(out, sizeof(out), argv) == 0, "the workers' view of the segment is wrong");
	for (int r = 0; r < 3; r++) {
		char line[32];

		snprintf(line, sizeof(line), "rank %d segment ok", r);
		CHECK(has_line(out, line), "no \"%s\"", line);
	}
}

static void bad_usage(const char *why, const char *const *args)
{
	const char *argv[16] = { tl_shmrun_path() };
	int i = 1;

	while (*args && i < 15)
		argv[i++] = *args++;
	argv[i] = NULL;
	CHECK(tl_run(out, sizeof(out), argv) == 2, "%s: exit code is not 2", why);
	CHECK(strstr(out, why), "no reason \"%s\"", why);
	CHECK(strstr(out, "\nusage: shmrun -n N [options] -- PROG"), "%s: no usage", why);
}

static void bad_arguments(void)
{
	const char *none[] = { "--", SH, "-c", "true", NULL };
	const char *zero[] = { "-n", "0", "--", SH, "-c", "true", NULL };
	const char *big[] = { "-n", "1025", "--", SH, "-c", "true", NULL };
	const char *unknown[] = { "-n", "2", "--bogus", "--", SH, "-c", "true", NULL };
	const char *noprog[] = { "-n", "2", "--", NULL };
	const char *noarg[] = { "-n", NULL };
	const char *ring[] = { "-n", "2", "--ring-size", "5000", "--", SH, NULL };
	const char *same[] = { "-n", "2", "--name-format", "w", "--", SH, NULL };
	const char *fail[] = { "-n", "2", "--on-failure=maybe", "--", SH, NULL };

	bad_usage("missing -n N", none);
	bad_usage("must be 1..1024, not '0'", zero);
	bad_usage("must be 1..1024, not '1025'", big);
	bad_usage("unknown option '--bogus'", unknown);
	bad_usage("missing the program to run", noprog);
	bad_usage("option '-n' needs an argument", noarg);
	bad_usage("--ring-size must be a power of two", ring);
	bad_usage("gives every worker the same name", same);
	bad_usage("--on-failure is abort or continue", fail);
}

static void help_and_version(void)
{
	const char *version[] = { tl_shmrun_path(), "--version", NULL };
	const char *help[] = { tl_shmrun_path(), "--help", NULL };
	char want[64];

	snprintf(want, sizeof(want), "shmrun (shmrpc) %s\n", shmrpc_version());
	CHECK(tl_run(out, sizeof(out), version) == 0, "--version failed");
	CHECK(!strcmp(out, want), "--version said \"%s\"", out);
	CHECK(tl_run(out, sizeof(out), help) == 0, "--help failed");
	CHECK(!strncmp(out, "usage: shmrun", 13), "--help said \"%.40s\"", out);
}

static void failing_programs(void)
{
	const char *missing[] = { tl_shmrun_path(), "-n", "2", "--", "/nonexistent/prog", NULL };
	const char *code[] = { tl_shmrun_path(), "-n", "3", "--on-failure=continue", "--", SH, "-c",
			       "[ $SHMRPC_RANK = 1 ] && exit 3; exit 0", NULL };

	CHECK(tl_run(out, sizeof(out), missing) == 1, "a missing program: exit code not 1");
	CHECK(strstr(out, "shmrun: cannot run /nonexistent/prog: No such file or directory"),
	      "no \"cannot run\" text");
	CHECK(strstr(out, "exited with code 127"), "exit code 127 not reported");

	CHECK(tl_run(out, sizeof(out), code) == 1, "a worker's exit 3: launcher exit code not 1");
	CHECK(has_line(out, "shmrun: worker 1 (worker1) died: exited with code 3"), "no death line");
	CHECK(strstr(out, "shmrun: 3 workers, 1 failed: worker 1 (worker1) exited with code 3, "
			  "2 exited 0 ("), "no summary");
}

int main(int argc, char **argv)
{
	if (tl_is_worker() && argc == 2 && !strcmp(argv[1], "worker"))
		return check_segment();
	CHECK(access(tl_shmrun_path(), X_OK) == 0, "%s is not built", tl_shmrun_path());
	environment_and_tags();
	spellings_and_names();
	segment_as_seen();
	bad_arguments();
	help_and_version();
	failing_programs();
	CHECK(tl_wait_children(), "a child failed");
	CHECK(tl_shm_leftovers() == 0, "left in /dev/shm");
	return 0;
}
