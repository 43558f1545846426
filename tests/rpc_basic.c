/*
 * rpc_sync / rpc_async between 2 and 4 workers under shmrun: all-to-all
 * calls, values of every type round-trip, calls to oneself, and each error
 * a caller can meet: a remote error (type, text, backtrace), an unknown
 * function, wrong argument count and type, a rank out of range, an
 * oversized payload, a timeout (and the late reply it leaves), futures
 * with then-callbacks, and a graceful shutdown.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

static int fn_echo(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = a[0]; /* points into the request's memory, valid until the reply is sent */
	return 0;
}

static int fn_whoami(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	char *s = shmrpc_call_alloc(c, 32);

	(void)a, (void)n, (void)u;
	snprintf(s, 32, "%d called %d", shmrpc_call_caller(c), shmrpc_rank());
	*r = shmrpc_str(s);
	return 0;
}

static int fn_fail(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)n, (void)r, (void)u;
	return shmrpc_call_error(c, "ValueError", "x must be positive, got %lld", (long long)a[0].u.i);
}

static int fn_sleep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	usleep((useconds_t)a[0].u.i * 1000);
	*r = shmrpc_nil();
	return 0;
}

static bool same(const shmrpc_value *x, const shmrpc_value *y)
{
	if (x->type != y->type || x->len != y->len)
		return false;
	switch (x->type) {
	case SHMRPC_NIL: return true;
	case SHMRPC_BOOL: return x->u.b == y->u.b;
	case SHMRPC_INT: return x->u.i == y->u.i;
	case SHMRPC_FLOAT: return x->u.f == y->u.f;
	case SHMRPC_STR:
	case SHMRPC_BYTES: return memcmp(x->u.p, y->u.p, x->len) == 0;
	default:
		for (uint32_t i = 0; i < (x->type == SHMRPC_MAP ? 2 * x->len : x->len); i++)
			if (!same(&x->u.items[i], &y->u.items[i]))
				return false;
		return true;
	}
}

static atomic_int then_ran;

static void on_done(shmrpc_future *f, void *arg)
{
	const shmrpc_value *v = shmrpc_future_value(f);

	if (v && v->type == SHMRPC_INT && v->u.i == (intptr_t)arg)
		atomic_fetch_add(&then_ran, 1);
}

/* The thread a then-callback ran on, once it has (then_on_set). */
static pthread_t then_on;
static atomic_int then_on_set;

static void note_thread(shmrpc_future *f, void *arg)
{
	(void)f, (void)arg;
	then_on = pthread_self();
	atomic_store(&then_on_set, 1);
}

/* Waits up to 5 s for note_thread to have run; whether it ran on this thread. */
static bool then_ran_here(void)
{
	for (int spins = 0; !atomic_load(&then_on_set) && spins < 5000; spins++)
		usleep(1000);
	CHECK(atomic_load(&then_on_set), "a then-callback did not run within 5 s");
	return pthread_equal(then_on, pthread_self());
}

static void expect_error(int rc, int code, const char *text)
{
	CHECK(rc == code, "got %d (%s), want %d: %s", rc, shmrpc_strerror(rc), code, shmrpc_errmsg());
	CHECK(strstr(shmrpc_errmsg(), text), "error \"%s\" lacks \"%s\"", shmrpc_errmsg(), text);
}

static void calls_to(int peer)
{
	shmrpc_future *f;
	char want[64];

	for (int i = 0; i < 200; i++) {
		shmrpc_value args[2] = { shmrpc_int(i), shmrpc_int(peer * 1000) };

		CHECK_OK(shmrpc_rpc_sync(peer, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == i + peer * 1000, "add returned %lld",
		      (long long)shmrpc_future_value(f)->u.i);
		shmrpc_future_free(f);
	}
	CHECK_OK(shmrpc_rpc_sync(peer, "whoami", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f));
	snprintf(want, sizeof(want), "%d called %d", shmrpc_rank(), peer);
	CHECK(strcmp(shmrpc_future_value(f)->u.s, want) == 0, "whoami: %s", shmrpc_future_value(f)->u.s);
	shmrpc_future_free(f);
}

static void values_round_trip(int peer)
{
	static const uint8_t blob[5] = { 0, 1, 2, 0xfe, 0xff };
	shmrpc_value inner[3] = { shmrpc_float(2.5), shmrpc_bool(1), shmrpc_nil() };
	shmrpc_value kv[4] = { shmrpc_str("k"), shmrpc_list(inner, 3), shmrpc_int(-7),
			       shmrpc_bytes(blob, 5) };
	shmrpc_value items[5] = { shmrpc_int(INT64_MIN), shmrpc_str("héllo"), shmrpc_map(kv, 2),
				  shmrpc_bytes(blob, 0), shmrpc_list(NULL, 0) };
	shmrpc_value v = shmrpc_list(items, 5);
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_sync(peer, "echo", &v, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(same(shmrpc_future_value(f), &v), "echo changed the value");
	shmrpc_future_free(f);
}

static void errors(int peer, int world)
{
	shmrpc_value neg = shmrpc_int(-3), str = shmrpc_str("x"), big;
	shmrpc_future *f;
	const char *type;
	char want[128];
	int rc;

	snprintf(want, sizeof(want), "Error on worker %d (worker%d): x must be positive, got -3", peer, peer);
	CHECK_OK(shmrpc_rpc_async(peer, "fail", &neg, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	expect_error(shmrpc_future_wait(f, -1), -SHMRPC_EREMOTE, want);
	type = shmrpc_future_error_type(f);
	CHECK(type && strcmp(type, "ValueError") == 0, "type %s", type ? type : "(none)");
	CHECK(shmrpc_future_remote_backtrace(f) && strstr(shmrpc_future_remote_backtrace(f), "rpc_basic"),
	      "no remote backtrace: %s", shmrpc_future_remote_backtrace(f));
	shmrpc_future_free(f);

	snprintf(want, sizeof(want), "Error on worker %d (worker%d): no function named \"nope\" is registered",
		 peer, peer);
	expect_error(shmrpc_rpc_sync(peer, "nope", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f), -SHMRPC_EREMOTE, want);
	CHECK(f == NULL, "a failed rpc_sync leaves no future");
	expect_error(shmrpc_rpc_sync(peer, "add", &neg, 1, SHMRPC_TIMEOUT_DEFAULT, &f), -SHMRPC_EREMOTE,
		     "add() takes 2 arguments but 1 was given");
	expect_error(shmrpc_rpc_sync(peer, "fail", &str, 1, SHMRPC_TIMEOUT_DEFAULT, &f), -SHMRPC_EREMOTE,
		     "fail(): argument 1 must be int, not str");
	snprintf(want, sizeof(want), "the job has %d workers", world);
	expect_error(shmrpc_rpc_sync(world, "add", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f), -EINVAL, want);
	expect_error(shmrpc_rpc_sync(-1, "add", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f), -EINVAL, want);

	{
		static char huge[1 << 20];

		big = shmrpc_bytes(huge, sizeof(huge));
		rc = shmrpc_rpc_sync(peer, "echo", &big, 1, SHMRPC_TIMEOUT_DEFAULT, &f);
		expect_error(rc, -EMSGSIZE, "does not fit in a frame");
	}
	{
		shmrpc_value ms = shmrpc_int(300);

		rc = shmrpc_rpc_sync(peer, "sleep", &ms, 1, 50, &f);
		expect_error(rc, -ETIMEDOUT, "RPC ran for more than the set timeout (50 ms) and will now be "
					     "marked with an error");
	}
}

static void futures_and_callbacks(int peer)
{
	enum { N = 64 };
	shmrpc_future *f[N];

	for (int i = 0; i < N; i++) {
		shmrpc_value args[2] = { shmrpc_int(i), shmrpc_int(1) };

		CHECK_OK(shmrpc_rpc_async(peer, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f[i]));
		CHECK_OK(shmrpc_future_then(f[i], on_done, (void *)(intptr_t)(i + 1)));
	}
	for (int i = 0; i < N; i++) {
		CHECK_OK(shmrpc_future_wait(f[i], -1));
		CHECK(shmrpc_future_done(f[i]) && shmrpc_future_value(f[i])->u.i == i + 1, "future %d", i);
		shmrpc_future_free(f[i]);
	}
	for (int spins = 0; atomic_load(&then_ran) < N && spins < 5000; spins++)
		usleep(1000);
	CHECK(atomic_load(&then_ran) == N, "%d of %d callbacks ran", atomic_load(&then_ran), N);
}

/* shmrpc_future_then's callback runs on an executor thread, as shmrpc.h
 * promises (it may call rpc_sync, take a lock its registering or waiting
 * thread holds): never inline in the caller of shmrpc_future_then when f
 * is done already, nor on a thread in shmrpc_future_wait, which only
 * future_hook's callbacks (the Python Future's) are for. */
static void then_runs_on_an_executor(int peer)
{
	shmrpc_value args[2] = { shmrpc_int(1), shmrpc_int(2) };
	shmrpc_future *f;

	CHECK_OK(shmrpc_rpc_async(peer, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK_OK(shmrpc_future_wait(f, -1));
	atomic_store(&then_on_set, 0);
	CHECK_OK(shmrpc_future_then(f, note_thread, NULL));
	CHECK(!then_ran_here(), "the then-callback of a done future ran inline in its caller, "
				"not on an executor thread");
	shmrpc_future_free(f);
	/* Registered while pending, with this thread waiting for the reply. */
	for (int i = 0; i < 20; i++) {
		shmrpc_value ms = shmrpc_int(5);

		CHECK_OK(shmrpc_rpc_async(peer, "sleep", &ms, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		atomic_store(&then_on_set, 0);
		CHECK_OK(shmrpc_future_then(f, note_thread, NULL));
		CHECK_OK(shmrpc_future_wait(f, -1));
		CHECK(!then_ran_here(), "a then-callback ran on the thread waiting in "
					"shmrpc_future_wait (call %d), not on an executor thread", i);
		shmrpc_future_free(f);
	}
}

static int worker(void)
{
	struct shmrpc_worker_info info;
	int me, world;

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_register("echo", "v", fn_echo, NULL));
	CHECK_OK(shmrpc_register("whoami", "", fn_whoami, NULL));
	CHECK_OK(shmrpc_register("fail", "i", fn_fail, NULL));
	CHECK_OK(shmrpc_register("sleep", "i", fn_sleep, NULL));
	CHECK(shmrpc_register("add", NULL, fn_add, NULL) == -EEXIST, "duplicate registration");
	CHECK_OK(shmrpc_init(NULL));
	me = shmrpc_rank();
	world = shmrpc_world_size();
	CHECK_OK(shmrpc_get_worker_info(NULL, &info));
	CHECK(info.rank == me, "self info");
	CHECK_OK(shmrpc_get_worker_info("worker1", &info));
	CHECK(info.rank == 1, "worker1 is rank %d", info.rank);
	CHECK(shmrpc_get_worker_info("nobody", &info) == -ENOENT, "unknown name");

	for (int peer = 0; peer < world; peer++)
		calls_to(peer); /* oneself included */
	values_round_trip((me + 1) % world);
	errors((me + 1) % world, world);
	futures_and_callbacks((me + 1) % world);
	then_runs_on_an_executor((me + 1) % world);
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	char out[1 << 16];

	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	CHECK(tl_shmrun(out, sizeof(out), "-n", "2", NULL) == 0, "2 workers failed");
	/* In spin mode, waiting callers and idle executors never sleep and take
	 * frames off the rings themselves (worker/link.h), not only within a
	 * short budget: the same checks must hold. */
	CHECK(tl_shmrun(out, sizeof(out), "-n", "2", "--wait=spin", NULL) == 0,
	      "2 workers in spin mode failed");
	return tl_job_test(worker, "-n", "4", NULL);
}
