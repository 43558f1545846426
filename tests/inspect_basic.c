/*
 * shmrpc-inspect on a live 2-worker job: rank 0 calls rank 1, then runs
 * the inspector on its own launcher (its parent) and checks what the text,
 * --json and --check say, that the job list names the launcher, and the
 * errors: a pid with no process, a worker's pid instead of the launcher's
 * (exit 1), a bad option and a JOB that is no pid (exit 2).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

#define CALLS 50
#define OUT_MAX 65536

static char out[OUT_MAX];

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

/* Runs the inspector with up to two arguments (NULL: fewer); its exit code. */
static const char *inspect_path(void)
{
	static char path[4096];
	const char *build = getenv("SHMRPC_BUILD");

	snprintf(path, sizeof(path), "%s/bin/shmrpc-inspect", build && *build ? build : "build");
	return path;
}

static int inspect(const char *a1, const char *a2)
{
	const char *argv[4] = { inspect_path(), a1, a2, NULL };

	return tl_run(out, sizeof(out), argv);
}

/* --watch redraws until stopped: two tables at least in 0.35 s at 0.1 s. */
static void watch_twice(const char *job)
{
	const char *argv[] = { inspect_path(), "--watch=0.1", job, NULL };
	int fd, tables = 0;
	pid_t pid = tl_spawn(argv, &fd);

	CHECK(pid > 0, "cannot run shmrpc-inspect --watch");
	usleep(350000);
	kill(pid, SIGTERM);
	tl_collect(pid, fd, out, sizeof(out));
	for (const char *at = out; (at = strstr(at, "launcher pid")); at++)
		tables++;
	CHECK(tables >= 2, "--watch drew %d tables", tables);
}

/* The unsigned number after "key": in the JSON object that starts at from. */
static unsigned long long json_num(const char *from, const char *key)
{
	char pat[64];
	const char *p;

	snprintf(pat, sizeof(pat), "\"%s\":", key);
	p = strstr(from, pat);
	CHECK(p, "no %s in %s", pat, from);
	return strtoull(p + strlen(pat), NULL, 10);
}

static void inspect_job(void)
{
	char job[16], self[16], line[64];
	const char *w1;
	int rc;

	snprintf(job, sizeof(job), "%d", (int)getppid());
	snprintf(self, sizeof(self), "%d", (int)getpid());

	rc = inspect(job, NULL);
	CHECK(rc == 0, "inspect %s exited %d", job, rc);
	snprintf(line, sizeof(line), "launcher pid   %s\n", job);
	CHECK(strstr(out, line), "no \"%s\"", line);
	CHECK(strstr(out, "world size     2\n"), "world size");
	CHECK(strstr(out, "worker0") && strstr(out, "worker1"), "workers not named");
	CHECK(strstr(out, "RUNNING"), "no RUNNING worker");
	CHECK(strstr(out, self), "own pid %s not shown", self);

	rc = inspect("--json", job);
	CHECK(rc == 0, "inspect --json exited %d", rc);
	CHECK(out[0] == '{' && strstr(out, "]}}\n"), "not one JSON object");
	CHECK(json_num(out, "launcher_pid") == (unsigned long long)getppid(), "launcher_pid");
	CHECK(json_num(out, "world_size") == 2, "world_size");
	CHECK(strstr(out, "\"job_name\":\""), "no job_name");
	CHECK(strstr(out, "{\"rank\":0,\"name\":\"worker0\",") &&
	      strstr(out, "{\"rank\":1,\"name\":\"worker1\","), "workers not named");
	CHECK(strstr(out, "\"state\":\"RUNNING\""), "no RUNNING worker");
	w1 = strstr(out, "{\"rank\":1,");
	CHECK(json_num(w1, "calls_served") >= CALLS, "rank 1 served %llu calls, %d made",
	      json_num(w1, "calls_served"), CALLS);
	CHECK(json_num(out, "frames_sent") >= CALLS, "rank 0 sent %llu frames", json_num(out, "frames_sent"));
	CHECK(json_num(out, "corrupt_frames") == 0, "corrupt frames");
	/* The tensor pool, read-only: shmrun's default size, both ranks holding it. */
	CHECK(strstr(out, "\"pool\":{") && json_num(strstr(out, "\"pool\":{"), "size") == 256ull << 20,
	      "no tensor pool of 256 MiB in the JSON");
	CHECK(strstr(out, "{\"rank\":1,\"pid\":") && strstr(out, "\"state\":\"live\""),
	      "the pool's holders are not listed");

	watch_twice(job);
	rc = inspect("--check", job);
	CHECK(rc == 0 && strcmp(out, "ok\n") == 0, "--check exited %d: %s", rc, out);

	rc = inspect(NULL, NULL);
	CHECK(rc == 0, "the job list exited %d", rc);
	snprintf(line, sizeof(line), "\n%7s ", job);
	CHECK(strstr(out, line), "the job list lacks the launcher %s", job);

	/* A worker holds the segment too, but it is not the job's name. */
	CHECK(inspect(self, NULL) == 1 && strstr(out, "not a launcher"), "a worker's pid");
	CHECK(inspect("999999", NULL) == 1 && strstr(out, "shmrpc-inspect: no such job"), "no process");
	CHECK(inspect("--bogus", NULL) == 2 && strstr(out, "usage:"), "bad option");
	CHECK(inspect("12ab", NULL) == 2, "a JOB that is no pid");
	CHECK(inspect("--check", NULL) == 2, "--check without JOB");
}

static int worker(void)
{
	shmrpc_future *f;

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		for (int i = 0; i < CALLS; i++) {
			shmrpc_value args[2] = { shmrpc_int(i), shmrpc_int(1) };

			CHECK_OK(shmrpc_rpc_sync(1, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
			CHECK(shmrpc_future_value(f)->u.i == i + 1, "add");
			shmrpc_future_free(f);
		}
		inspect_job();
	}
	/* Rank 1 waits here, still serving, until rank 0 is done inspecting. */
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	if (tl_is_worker())
		return worker();
	return tl_job_test(worker, "-n", "2", NULL);
}
