/*
 * RRefs between 4 workers under shmrun, run twice: with to_here() reading
 * the shared RRef table, and with SHMRPC_RREF_FETCH=message (to_here() asks
 * the owner with SCRIPT_RREF_FETCH_CALL). Checks, from every worker to
 * every worker (itself included): remote + to_here, what an RRef says of
 * itself (owner, name, printable form, confirmed), local_value on the
 * owner and its error on a user, a remote error with its text, an unknown
 * function, a timeout, the three proxies, an RRef passed as an argument
 * to a third worker and one returned as a result, and a tensor value.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

#define NWORKERS 4

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

/* text(k): the first k letters of the alphabet (nil for -1); k <= 7
 * encode in at most 8 bytes, stored in the RRef's entry itself. */
static int fn_text(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	static const char abc[] = "abcdefghijklmnopqrstuvwxyz";

	(void)c, (void)n, (void)u;
	if (a[0].u.i < 0 || a[0].u.i >= (int64_t)sizeof(abc)) {
		*r = shmrpc_nil();
		return 0;
	}
	*r = shmrpc_strn(abc, (uint32_t)a[0].u.i);
	return 0;
}

static int fn_fail(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)a, (void)n, (void)r, (void)u;
	return shmrpc_call_error(c, "ValueError", "no value for you");
}

static int fn_sleep(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	usleep((useconds_t)a[0].u.i * 1000);
	*r = shmrpc_int(a[0].u.i);
	return 0;
}

/* deref(rref) -> its value, read by this worker (a third party). */
static int fn_deref(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	shmrpc_future *f;
	int rc;

	(void)n, (void)u;
	rc = shmrpc_rref_to_here(a[0].u.r, SHMRPC_TIMEOUT_DEFAULT, &f);
	if (rc)
		return shmrpc_call_error(c, "RuntimeError", "to_here: %s", shmrpc_errmsg());
	*r = shmrpc_int(shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	return 0;
}

/* make_remote(dst, x) -> an RRef to add(x, 100) owned by dst. */
static int fn_make_remote(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r,
			  void *u)
{
	shmrpc_value args[2] = { shmrpc_int(a[1].u.i), shmrpc_int(100) };
	shmrpc_rref *rr;

	(void)n, (void)u;
	if (shmrpc_remote((int)a[0].u.i, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &rr))
		return shmrpc_call_error(c, "RuntimeError", "remote: %s", shmrpc_errmsg());
	*r = shmrpc_rref_value(rr); /* the call frees it once the caller has its own */
	return 0;
}

static int fn_tensor(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	int64_t shape[1] = { a[0].u.i };
	shmrpc_tensor *t;

	(void)n, (void)u;
	if (shmrpc_tensor_alloc((DLDataType){ kDLInt, 32, 1 }, 1, shape, &t))
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	for (int64_t i = 0; i < shape[0]; i++)
		((int32_t *)shmrpc_tensor_data(t))[i] = (int32_t)(i * 3 + shmrpc_rank());
	*r = shmrpc_tensor_value(t);
	return 0;
}

static int64_t to_here_int(shmrpc_rref *r)
{
	shmrpc_future *f;
	int64_t v;

	CHECK_OK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->type == SHMRPC_INT, "to_here gave a %s",
	      shmrpc_type_name(shmrpc_future_value(f)->type));
	v = shmrpc_future_value(f)->u.i;
	shmrpc_future_free(f);
	return v;
}

static bool starts_with(const char *s, const char *prefix)
{
	return !strncmp(s, prefix, strlen(prefix));
}

/* Values on either side of the 8 encoded bytes an entry holds, read
 * twice, and on the owner itself. */
static void small_values(void)
{
	for (int dst = 0; dst < NWORKERS; dst++) {
		for (int64_t k = -1; k <= 12; k++) {
			shmrpc_value arg = shmrpc_int(k);
			const shmrpc_value *v;
			shmrpc_future *f;
			shmrpc_rref *r;

			CHECK_OK(shmrpc_remote(dst, "text", &arg, 1, SHMRPC_TIMEOUT_DEFAULT, &r));
			for (int i = 0; i < 2; i++) {
				CHECK_OK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f));
				v = shmrpc_future_value(f);
				CHECK(k < 0 ? v->type == SHMRPC_NIL :
				      v->type == SHMRPC_STR && v->len == (uint32_t)k &&
				      !strncmp(v->u.s, "abcdefghijkl", (size_t)k),
				      "text(%lld) on %d came back as a %s", (long long)k, dst,
				      shmrpc_type_name(v->type));
				shmrpc_future_free(f);
			}
			if (shmrpc_rref_is_owner(r)) {
				CHECK_OK(shmrpc_rref_local_value(r, &v));
				CHECK(v->type == (k < 0 ? SHMRPC_NIL : SHMRPC_STR), "text(%lld)'s local "
				      "value is a %s", (long long)k, shmrpc_type_name(v->type));
			}
			shmrpc_rref_free(r);
		}
	}
}

static void check_identity(shmrpc_rref *r, int me, int dst)
{
	char s[256], want[32];
	const shmrpc_value *v;
	int rc;

	CHECK(shmrpc_rref_owner(r) == dst, "owner %d, want %d", shmrpc_rref_owner(r), dst);
	snprintf(want, sizeof(want), "worker%d", dst);
	CHECK(!strcmp(shmrpc_rref_owner_name(r), want), "owner name %s", shmrpc_rref_owner_name(r));
	CHECK(shmrpc_rref_is_owner(r) == (me == dst), "is_owner");
	shmrpc_rref_str(r, s, sizeof(s));
	if (me == dst) {
		CHECK(starts_with(s, "OwnerRRef(GloballyUniqueId(created_on="), "str: %s", s);
		CHECK_OK(shmrpc_rref_local_value(r, &v));
		CHECK(v->type == SHMRPC_INT, "local value type %u", v->type);
	} else {
		CHECK(starts_with(s, "UserRRef(RRefId = GloballyUniqueId(created_on=") &&
		      strstr(s, ", ForkId = GloballyUniqueId("), "str: %s", s);
		rc = shmrpc_rref_local_value(r, &v);
		CHECK(rc == -EPERM && strstr(shmrpc_errmsg(), "can't call localValue() on user") &&
		      strstr(shmrpc_errmsg(), "Call it on owner worker"), "local_value on a user: %d %s",
		      rc, shmrpc_errmsg());
	}
	CHECK(shmrpc_rref_confirmed_by_owner(r), "not confirmed after to_here");
}

static void all_pairs(int me)
{
	for (int dst = 0; dst < NWORKERS; dst++) {
		shmrpc_value args[2] = { shmrpc_int(me * 10), shmrpc_int(dst) };
		shmrpc_rref *r;
		shmrpc_future *f;

		CHECK_OK(shmrpc_remote(dst, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &r));
		CHECK(to_here_int(r) == me * 10 + dst, "remote add on %d", dst);
		CHECK(to_here_int(r) == me * 10 + dst, "to_here twice on %d", dst);
		check_identity(r, me, dst);

		/* The proxies: add(value, 5) on the owner. */
		args[0] = shmrpc_int(5);
		CHECK_OK(shmrpc_rref_rpc_sync(r, "add", args, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == me * 10 + dst + 5, "rpc_sync proxy");
		shmrpc_future_free(f);
		CHECK_OK(shmrpc_rref_rpc_async(r, "add", args, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK_OK(shmrpc_future_wait(f, -1));
		CHECK(shmrpc_future_value(f)->u.i == me * 10 + dst + 5, "rpc_async proxy");
		shmrpc_future_free(f);
		{
			shmrpc_rref *r2;

			CHECK_OK(shmrpc_rref_remote(r, "add", args, 1, SHMRPC_TIMEOUT_DEFAULT, &r2));
			CHECK(shmrpc_rref_owner(r2) == dst, "remote proxy owner");
			CHECK(to_here_int(r2) == me * 10 + dst + 5, "remote proxy");
			shmrpc_rref_free(r2);
		}
		shmrpc_rref_free(r);
	}
}

static void errors(int me)
{
	int dst = (me + 1) % NWORKERS;
	shmrpc_value one = shmrpc_int(2000);
	shmrpc_future *f;
	shmrpc_rref *r;
	char want[64];
	int rc;

	CHECK_OK(shmrpc_remote(dst, "fail", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &r));
	rc = shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f);
	snprintf(want, sizeof(want), "Error on worker %d (worker%d): no value for you", dst, dst);
	CHECK(rc == -SHMRPC_EREMOTE && !f && strstr(shmrpc_errmsg(), want), "remote error: %d %s",
	      rc, shmrpc_errmsg());
	shmrpc_rref_free(r);

	CHECK_OK(shmrpc_remote(dst, "nosuch", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &r));
	rc = shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f);
	CHECK(rc < 0 && strstr(shmrpc_errmsg(), "no function named \"nosuch\" is registered"),
	      "unknown function: %d %s", rc, shmrpc_errmsg());
	shmrpc_rref_free(r);

	CHECK_OK(shmrpc_remote(dst, "sleep", &one, 1, SHMRPC_TIMEOUT_DEFAULT, &r));
	rc = shmrpc_rref_to_here(r, 50, &f);
	/* The table's wait, or the fetch request's timeout (SHMRPC_RREF_FETCH=message). */
	CHECK(rc == -ETIMEDOUT && (strstr(shmrpc_errmsg(), "was not ready within 50 ms") ||
				   strstr(shmrpc_errmsg(), "more than the set timeout (50 ms)")),
	      "timeout: %d %s", rc, shmrpc_errmsg());
	CHECK(to_here_int(r) == 2000, "the value after the timeout");
	shmrpc_rref_free(r);

	/* remote()'s own timeout passed: the RRef has failed, and stays failed
	 * once the owner has stored the value (torch's rule and words). */
	one = shmrpc_int(200);
	CHECK_OK(shmrpc_remote(dst, "sleep", &one, 1, 20, &r));
	for (int i = 0; i < 2; i++) {
		rc = shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f);
		CHECK(rc == -ETIMEDOUT && !f && strstr(shmrpc_errmsg(), "RRef creation via "
						       "rpc.remote() timed out"),
		      "creation timeout (%d): %d %s", i, rc, shmrpc_errmsg());
		usleep(300000); /* the owner stores it meanwhile */
	}
	shmrpc_rref_free(r);

	rc = shmrpc_remote(NWORKERS, "add", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &r);
	CHECK(rc == -EINVAL && strstr(shmrpc_errmsg(), "the job has 4 workers"), "bad rank: %s",
	      shmrpc_errmsg());
}

/* RRefs as arguments and results, across three workers. */
static void passing(int me)
{
	int owner = (me + 1) % NWORKERS, third = (me + 2) % NWORKERS;
	shmrpc_value args[2] = { shmrpc_int(7), shmrpc_int(me) }, arg;
	shmrpc_future *f;
	shmrpc_rref *r;

	CHECK_OK(shmrpc_remote(owner, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &r));
	arg = shmrpc_rref_value(r);
	CHECK_OK(shmrpc_rpc_sync(third, "deref", &arg, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->u.i == 7 + me, "deref on a third worker");
	shmrpc_future_free(f);
	/* To the owner itself: there it is an OwnerRRef. */
	CHECK_OK(shmrpc_rpc_sync(owner, "deref", &arg, 1, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->u.i == 7 + me, "deref on the owner");
	shmrpc_future_free(f);
	shmrpc_rref_free(r);

	/* A result: third makes an RRef owned by owner and returns it. */
	args[0] = shmrpc_int(owner);
	args[1] = shmrpc_int(me);
	CHECK_OK(shmrpc_rpc_sync(third, "make_remote", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
	CHECK(shmrpc_future_value(f)->type == SHMRPC_RREF, "make_remote gave a %s",
	      shmrpc_type_name(shmrpc_future_value(f)->type));
	CHECK_OK(shmrpc_rref_retain(shmrpc_future_value(f)->u.r, &r));
	shmrpc_future_free(f);
	CHECK(shmrpc_rref_owner(r) == owner, "returned RRef's owner");
	CHECK(to_here_int(r) == me + 100, "returned RRef's value");
	shmrpc_rref_free(r);
}

static void tensors(int me)
{
	int dst = (me + 3) % NWORKERS;
	shmrpc_value n = shmrpc_int(4096);
	const shmrpc_value *v;
	shmrpc_future *f;
	shmrpc_rref *r;

	CHECK_OK(shmrpc_remote(dst, "tensor", &n, 1, SHMRPC_TIMEOUT_DEFAULT, &r));
	CHECK_OK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f));
	v = shmrpc_future_value(f);
	CHECK(v->type == SHMRPC_TENSOR && shmrpc_tensor_nbytes(v->u.t) == 4096 * 4, "tensor value");
	for (int i = 0; i < 4096; i++)
		CHECK(((int32_t *)shmrpc_tensor_data(v->u.t))[i] == i * 3 + dst, "tensor byte %d", i);
	shmrpc_future_free(f);
	shmrpc_rref_free(r);
}

static int worker(void)
{
	struct shmrpc_options o = SHMRPC_OPTIONS(.num_threads = 2);
	int me;

	CHECK_OK(shmrpc_register("add", NULL, fn_add, NULL));
	CHECK_OK(shmrpc_register("fail", "", fn_fail, NULL));
	CHECK_OK(shmrpc_register("text", "i", fn_text, NULL));
	CHECK_OK(shmrpc_register("sleep", "i", fn_sleep, NULL));
	CHECK_OK(shmrpc_register("deref", "r", fn_deref, NULL));
	CHECK_OK(shmrpc_register("make_remote", "ii", fn_make_remote, NULL));
	CHECK_OK(shmrpc_register("tensor", "i", fn_tensor, NULL));
	CHECK_OK(shmrpc_init(&o));
	me = shmrpc_rank();
	all_pairs(me);
	small_values();
	errors(me);
	passing(me);
	tensors(me);
	CHECK_OK(shmrpc_shutdown(1, 60000));
	return 0;
}

int main(void)
{
	int rc;

	if (tl_is_worker())
		return worker();
	rc = tl_job_test(worker, "-n", "4", NULL);
	if (rc)
		return rc;
	setenv("SHMRPC_RREF_FETCH", "message", 1);
	return tl_job_test(worker, "-n", "4", NULL);
}
