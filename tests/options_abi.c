/*
 * shmrpc_options' ABI guard: shmrpc_init refuses options whose size is
 * not its struct's (zero, smaller: not made with SHMRPC_OPTIONS; larger: a
 * newer header) or whose reserved fields are set, each with a sentence
 * that says how to make them, before it reads anything else; and options
 * made with SHMRPC_OPTIONS pass and take effect (in a 2-worker job, each
 * worker's name and thread count).
 */
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/job.h"
#include "tests/lib/testlib.h"

static void refused(const struct shmrpc_options *o, const char *why, const char *says)
{
	int rc = shmrpc_init(o);

	CHECK(rc == -EINVAL, "%s: shmrpc_init returned %d (%s)", why, rc, shmrpc_errmsg());
	CHECK(strstr(shmrpc_errmsg(), says), "%s: the message \"%s\" does not say \"%s\"", why,
	      shmrpc_errmsg(), says);
}

static int worker(void)
{
	char name[16];
	struct shmrpc_options o = SHMRPC_OPTIONS(.name = name, .num_threads = 1);
	struct shmrpc_worker_info me, peer;

	snprintf(name, sizeof(name), "abi-%s", getenv("SHMRPC_RANK"));
	CHECK_OK(shmrpc_init(&o));
	CHECK_OK(shmrpc_get_worker_info(NULL, &me));
	CHECK(strcmp(me.name, name) == 0, "named %s, expected %s", me.name, name);
	CHECK_OK(shmrpc_get_worker_info_by_rank(1 - me.rank, &peer));
	snprintf(name, sizeof(name), "abi-%d", 1 - me.rank);
	CHECK(strcmp(peer.name, name) == 0, "the peer is named %s, expected %s", peer.name, name);
	return shmrpc_shutdown(1, 30000) ? 1 : 0;
}

int main(void)
{
	struct shmrpc_options ok = SHMRPC_OPTIONS(.num_threads = 2), o;

	if (tl_is_worker())
		return worker();
	CHECK(ok.size == sizeof(struct shmrpc_options), "SHMRPC_OPTIONS set size %u", ok.size);

	o = ok;
	o.size = 0;
	refused(&o, "size 0", "make the options with SHMRPC_OPTIONS");
	o.size = offsetof(struct shmrpc_options, reserved);
	refused(&o, "an older, smaller size", "smaller than");
	o.size = sizeof(o) + 8;
	refused(&o, "a newer, larger size", "built against a newer shmrpc.h");
	o = ok;
	o.reserved32 = 1;
	refused(&o, "reserved32 set", "reserved fields set");
	o = ok;
	o.reserved[7] = 1;
	refused(&o, "reserved[7] set", "reserved fields set");

	/* Good options, and none, get past the check: outside a job, to the
	 * sentence that says to start the program with shmrun. */
	refused(&ok, "good options outside a job", "start the program with shmrun");
	refused(NULL, "no options outside a job", "start the program with shmrun");

	return tl_job_test(worker, "-n", "2", NULL);
}
