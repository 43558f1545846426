/*
 * A peer the agent cannot watch (no pidfd: 64 workers, each allowed 48
 * open files) still has its death noticed, by the launcher's word in its
 * slot: a pending call to it fails naming it, and so does a new one,
 * instead of hanging for ever. The agent says on stderr, once, how many
 * peers it could not watch.
 */
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define N "64"
#define LAST 63
#define DEATH_TEXT "worker 63 (worker63) died: exited with code 3"

static int fn_hang(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	pause();
	return 0;
}

static int fn_die(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	usleep(200000); /* the caller's hanging call is in by then */
	_exit(3);
}

static int worker(void)
{
	struct rlimit rl = { 48, 48 };
	shmrpc_future *hung, *dying, *p;
	const char *msg;
	uint64_t t0;
	int rc;

	/* Below what 63 pidfds need: the last peers go unwatched. */
	CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0, "setrlimit");
	CHECK_OK(shmrpc_register("hang", "", fn_hang, NULL));
	CHECK_OK(shmrpc_register("die", "", fn_die, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		CHECK_OK(shmrpc_rpc_async(LAST, "hang", NULL, 0, SHMRPC_TIMEOUT_NONE, &hung));
		CHECK_OK(shmrpc_rpc_async(LAST, "die", NULL, 0, SHMRPC_TIMEOUT_NONE, &dying));
		t0 = shmrpc_now_ns();
		rc = shmrpc_future_wait(hung, 20000);
		CHECK(rc == -SHMRPC_EPEERDEAD, "the pending call: %d (%s)", rc, shmrpc_errmsg());
		shmrpc_future_error(hung, &msg);
		CHECK(strstr(msg, DEATH_TEXT), "\"%s\"", msg);
		fprintf(stderr, "the pending call failed %.1f ms after the call that kills\n",
			(double)(shmrpc_now_ns() - t0) / 1e6);
		CHECK(shmrpc_rpc_sync(LAST, "hang", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &p) ==
		      -SHMRPC_EPEERDEAD && strstr(shmrpc_errmsg(), DEATH_TEXT), "a new call: %s",
		      shmrpc_errmsg());
		shmrpc_future_free(hung);
		shmrpc_future_free(dying);
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	static const char *const texts[] = { "the pending call failed",
					     "ends are noticed by the launcher's word instead",
					     "shmrun: " DEATH_TEXT, NULL };

	return tl_job_expect(worker, 1, texts, "-n", N, "--on-failure=continue", NULL);
}
