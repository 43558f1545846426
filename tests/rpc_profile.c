/*
 * RPC profiling between 2 workers: while rank 0 profiles, its rpc_sync,
 * rpc_async, remote and proxy calls are recorded under torch's keys
 * ("rpc_sync#add(worker0 -> worker1)"), each with what the callee ran
 * beneath it ("...#remote_op: add", on rank 1, inside the call's time);
 * a failed call is recorded too; nothing after stop; the Chrome trace it
 * exports is JSON with one complete event per recorded event and a flow
 * for each remote one.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static int fn_add(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)n, (void)u;
	usleep(2000); /* a measurable time inside the call */
	*r = shmrpc_int(a[0].u.i + a[1].u.i);
	return 0;
}

/* The event named name, or NULL. */
static const struct shmrpc_profile_event *find(const shmrpc_profile *p, const char *name,
					       uint32_t *at)
{
	for (uint32_t i = 0; i < shmrpc_profile_count(p); i++)
		if (!strcmp(shmrpc_profile_event(p, i)->name, name)) {
			*at = i;
			return shmrpc_profile_event(p, i);
		}
	return NULL;
}

/* key was recorded on rank 0 with one remote_op child on rank 1 inside it. */
static void check_call(const shmrpc_profile *p, const char *key)
{
	const struct shmrpc_profile_event *e, *c;
	char child[256];
	uint32_t at, cat;

	e = find(p, key, &at);
	CHECK(e && e->rank == 0 && e->parent == -1 && e->end_ns > e->start_ns, "no event %s", key);
	snprintf(child, sizeof(child), "%s#remote_op: add", key);
	c = find(p, child, &cat);
	CHECK(c && c->rank == 1 && c->parent == (int)at, "no remote event %s", child);
	CHECK(c->start_ns >= e->start_ns && c->end_ns <= e->end_ns && c->end_ns - c->start_ns >= 2000000,
	      "%s does not lie inside its call", child);
}

static int worker(void)
{
	shmrpc_value args[2] = { shmrpc_int(2), shmrpc_int(3) };
	shmrpc_profile *p;
	shmrpc_future *f;
	shmrpc_rref *r;
	FILE *file;
	char path[64], buf[1 << 16];
	size_t n;
	uint32_t at;

	CHECK_OK(shmrpc_register("add", "ii", fn_add, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 0) {
		CHECK_OK(shmrpc_profile_start());
		CHECK_OK(shmrpc_rpc_sync(1, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == 5, "profiled rpc_sync's value");
		shmrpc_future_free(f);
		CHECK_OK(shmrpc_rpc_async(1, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK_OK(shmrpc_future_wait(f, -1));
		shmrpc_future_free(f);
		CHECK_OK(shmrpc_remote(1, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &r));
		CHECK_OK(shmrpc_rref_to_here(r, SHMRPC_TIMEOUT_DEFAULT, &f));
		CHECK(shmrpc_future_value(f)->u.i == 5, "profiled remote's value");
		shmrpc_future_free(f);
		CHECK(shmrpc_rpc_sync(1, "nosuch", NULL, 0, SHMRPC_TIMEOUT_DEFAULT, &f) < 0,
		      "an unknown function succeeded");
		CHECK_OK(shmrpc_profile_stop(&p));
		CHECK_OK(shmrpc_rpc_sync(1, "add", args, 2, SHMRPC_TIMEOUT_DEFAULT, &f));
		shmrpc_future_free(f);

		check_call(p, "rpc_sync#add(worker0 -> worker1)");
		check_call(p, "rpc_async#add(worker0 -> worker1)");
		check_call(p, "rpc_remote#add(worker0 -> worker1)");
		CHECK(find(p, "rpc_sync#nosuch(worker0 -> worker1)", &at), "the failed call");
		CHECK(shmrpc_profile_count(p) == 7, "%u events, want 3 calls with their remote "
		      "events and the failed call", shmrpc_profile_count(p));

		snprintf(path, sizeof(path), "/tmp/shmrpc-profile-%d.json", (int)getpid());
		CHECK_OK(shmrpc_profile_export_chrome(p, path));
		file = fopen(path, "r");
		CHECK(file, "cannot read %s back", path);
		n = fread(buf, 1, sizeof(buf) - 1, file);
		buf[n] = '\0';
		fclose(file);
		unlink(path);
		CHECK(!strncmp(buf, "{\"displayTimeUnit\"", 18) && strstr(buf, "]}\n"), "trace: %s", buf);
		CHECK(strstr(buf, "\"name\":\"rpc_remote#add(worker0 -> worker1)#remote_op: add\""),
		      "the trace lacks the remote event");
		at = 0;
		for (const char *s = buf; (s = strstr(s, "\"ph\":\"X\"")); s++)
			at++;
		CHECK(at == 7, "%u complete events in the trace", at);
		at = 0;
		for (const char *s = buf; (s = strstr(s, "\"ph\":\"f\"")); s++)
			at++;
		CHECK(at == 3, "%u flows in the trace", at);
		shmrpc_profile_free(p);
		shmrpc_rref_free(r);
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

int main(void)
{
	return tl_job_test(worker, "-n", "2", NULL);
}
