/*
 * kill -9 a worker while 1000 calls to it are pending: every one fails with
 * the death error naming the worker and the signal, within 100 ms (the test
 * allows 1 s so that a loaded machine cannot fail it; the measured time is
 * printed). The survivors shut down gracefully without the dead one, and
 * the launcher exits 1 naming rank and cause.
 */
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define CALLS 1000
#define DEATH_TEXT "worker 1 (worker1) died: killed by signal 9 (SIGKILL)"

static int fn_pid(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(getpid());
	return 0;
}

static int fn_hang(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)r, (void)u;
	pause();
	return 0;
}

static int worker(void)
{
	static shmrpc_future *f[CALLS];
	shmrpc_future *p;
	uint64_t t0, worst = 0;
	pid_t victim;

	CHECK_OK(shmrpc_register("pid", "", fn_pid, NULL));
	CHECK_OK(shmrpc_register("hang", "", fn_hang, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		CHECK_OK(shmrpc_rpc_sync(1, "pid", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &p));
		victim = (pid_t)shmrpc_future_value(p)->u.i;
		shmrpc_future_free(p);
		for (int i = 0; i < CALLS; i++)
			CHECK_OK(shmrpc_rpc_async(1, "hang", NULL, 0, SHMRPC_TIMEOUT_NONE, &f[i]));
		usleep(20000); /* let some of them start running */
		t0 = shmrpc_now_ns();
		CHECK(kill(victim, SIGKILL) == 0, "kill");
		for (int i = 0; i < CALLS; i++) {
			const char *msg;
			int rc = shmrpc_future_wait(f[i], 5000);
			uint64_t dt = shmrpc_now_ns() - t0;

			CHECK(rc == -SHMRPC_EPEERDEAD, "call %d: %d (%s)", i, rc, shmrpc_errmsg());
			shmrpc_future_error(f[i], &msg);
			CHECK(strstr(msg, DEATH_TEXT), "call %d: \"%s\"", i, msg);
			if (dt > worst)
				worst = dt;
			shmrpc_future_free(f[i]);
		}
		fprintf(stderr, "all %d pending calls failed %.1f ms after the kill\n", CALLS,
			(double)worst / 1e6);
		CHECK(worst < 1000000000u, "took %.1f ms (target 100 ms)", (double)worst / 1e6);
		/* A new call to the dead worker fails at once with the same text. */
		CHECK(shmrpc_rpc_sync(1, "pid", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &p) == -SHMRPC_EPEERDEAD,
		      "call after death");
		CHECK(strstr(shmrpc_errmsg(), DEATH_TEXT), "%s", shmrpc_errmsg());
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	static const char *const texts[] = { "all 1000 pending calls failed", "shmrun: " DEATH_TEXT,
					     NULL };

	return tl_job_expect(worker, 1, texts, "-n", "3", "--on-failure=continue", NULL);
}
