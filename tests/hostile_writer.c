/*
 * A hostile writer: a same-uid process (a child of worker 0, attaching the
 * job's tensor pool and RRef table read-write through the fds it
 * inherited, as any process of the user could through /proc) scribbles
 * on one kind of metadata of a live 2-worker job, one job per kind:
 *   records   the next free block record of a slab marked in use
 *   chunks    a live large block's chunk entry claims 2^40 chunks
 *   lists     a free-list head names a block in use
 *   holders   a holder table entry names a record past the pool's
 *   entries   a live RRef entry's owner set past the job's workers
 *   links     an owner's collect list made a loop through a live entry
 *   slots     worker 1's slot: state, pid, generation, exit record, name
 *             (no NUL), doorbell, sleepers, heartbeat and counters
 *   promises  worker 1's slot says all its servers are busy, its
 *             threads take their replies, and a thread of its spins
 *             for replies and one for requests: peers' frames would
 *             ring nothing (ipc/doorbell.h); worker 1 restores those
 *             words and names the slots (and its servers_newest, a
 *             hint, names a thread it does not have)
 *   header    the segment header's world size, ring size and job name
 * Worker 1 runs a load of its own all along (large tensors to worker 0),
 * and worker 0 runs its load again after the scribbling. Each time: no
 * process crashes (every
 * worker exits 0, shmrun exits 1 and not by a signal); a call either
 * returns the right value or fails with a sentence naming the structure
 * (and at least one fails so, where the kind has calls that touch it);
 * no block is handed out twice (the offsets of every live tensor differ);
 * shmrpc-inspect --check names it while the job runs (once a worker found
 * it); shmrun names the
 * structure; nothing is left in /dev/shm. The header is shmrun's: it
 * stops the job when it finds it changed, and the workers end by its
 * SIGTERM, not by the header. `hostile_writer KIND` runs one kind. The
 * rings, control and data, are broken in tests/ring_broken: it takes a
 * third worker to show that only the link is cut and a load goes on.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmrpc.h"
#include "shm/corrupt.h"
#include "shm/pool.h"
#include "shm/rref_table.h"
#include "shm/segment.h"
#include "tests/lib/job.h"
#include "tests/lib/run.h"
#include "tests/lib/testlib.h"

static const DLDataType i64 = { kDLInt, 64, 1 };

#define SMALL 8      /* int64 elements: a 64 B block, from a slab */
#define LARGE 32768  /* 256 KiB: a large block of 4 chunks */
#define HELD_MAX 64

struct kind {
	const char *name;
	const char *structure; /* shm_corrupt_name() of what it breaks */
	const char *finder;    /* who must find it: "worker 0 (worker0)"; "worker": either */
	bool calls_fail;       /* worker 0's calls touch it */
	const char *said;      /* what shmrun and shmrpc-inspect --check say of it; NULL: no more */
	bool stops;            /* shmrun stops the job for it: the workers end by its SIGTERM */
};

static const struct kind kinds[] = {
	{ "records", "the tensor pool's block record", "worker", true, NULL, false },
	{ "chunks", "the tensor pool's chunk table", "worker", true, NULL, false },
	{ "lists", "the tensor pool's free list", "worker", true, NULL, false },
	{ "holders", "the tensor pool's holder table", "worker 0 (worker0)", false, NULL, false },
	{ "entries", "the RRef table's entr", "worker 0 (worker0)", true, NULL, false },
	{ "links", "the RRef table's collect list", "worker 1 (worker1)", false, NULL, false },
	{ "slots", "the worker slots", "worker 0 (worker0)", false, "worker slot 1 is corrupt: ",
	  false },
	{ "promises", "the worker slots", "worker 1 (worker1)", false, NULL, false },
	{ "header", "the segment header", "shmrun", false, "the segment header is corrupt: its "
	  "world_size", true },
};

static const struct kind *kind_named(const char *name)
{
	for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
		if (!strcmp(kinds[i].name, name))
			return &kinds[i];
	CHECK(0, "no kind %s", name);
	return NULL;
}

/* ---- The workers ---------------------------------------------------------- */

static int fn_sum(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	const int64_t *d = shmrpc_tensor_data(a[0].u.t);
	uint64_t len = shmrpc_tensor_nbytes(a[0].u.t) / sizeof(int64_t);
	int64_t s = 0;

	(void)n, (void)u;
	if (!d)
		return shmrpc_call_error(c, "RuntimeError", "%s", shmrpc_errmsg());
	for (uint64_t i = 0; i < len; i++)
		s += d[i];
	*r = shmrpc_int(s);
	return 0;
}

static int fn_seven(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	*r = shmrpc_int(7);
	return 0;
}

/* The tensors worker 0 holds: every live block's offset differs. */
static shmrpc_tensor *held[HELD_MAX];
static int nheld;

static void check_distinct(void)
{
	for (int i = 0; i < nheld; i++)
		for (int k = i + 1; k < nheld; k++)
			CHECK(shmrpc_tensor_pool_offset(held[i]) != shmrpc_tensor_pool_offset(held[k]),
			      "the block at offset %llu was handed out twice",
			      (unsigned long long)shmrpc_tensor_pool_offset(held[i]));
}

/* A call that failed: its sentence must name the structure (a failure for
 * any other reason fails the test). */
static int failed_naming(const struct kind *k, const char *what)
{
	CHECK(strstr(shmrpc_errmsg(), k->structure), "%s failed without naming %s: %s", what,
	      k->structure, shmrpc_errmsg());
	return 1;
}

/* One round of the load: a tensor of n elements made, filled, kept, and
 * summed by worker 1. How many steps failed (naming the structure). */
static int load_tensor(const struct kind *k, int64_t n, int64_t seed)
{
	shmrpc_tensor *t;
	shmrpc_future *f;
	shmrpc_value v;
	int64_t *d, want = 0;

	if (shmrpc_tensor_alloc(i64, 1, &n, &t))
		return failed_naming(k, "a tensor's allocation");
	d = shmrpc_tensor_data(t);
	for (int64_t i = 0; i < n; i++)
		want += d[i] = seed + i;
	CHECK(nheld < HELD_MAX, "too many tensors held");
	held[nheld++] = t;
	check_distinct();
	v = shmrpc_tensor_value(t);
	if (shmrpc_rpc_sync(1, "sum", &v, 1, 20000, &f))
		return failed_naming(k, "a call with a tensor");
	CHECK(shmrpc_future_value(f)->u.i == want, "a wrong sum: %lld, want %lld",
	      (long long)shmrpc_future_value(f)->u.i, (long long)want);
	shmrpc_future_free(f);
	return 0;
}

/* The tensors made before the scribbling, sent again: their blocks' own
 * records and entries are what some kinds break. */
static int resend_held(const struct kind *k)
{
	int failed = 0;

	for (int i = 0; i < nheld; i++) {
		const int64_t *d = shmrpc_tensor_data(held[i]);
		uint64_t n = shmrpc_tensor_nbytes(held[i]) / sizeof(int64_t);
		shmrpc_value v = shmrpc_tensor_value(held[i]);
		shmrpc_future *f;
		int64_t want = 0;

		for (uint64_t e = 0; e < n; e++)
			want += d[e];
		if (shmrpc_rpc_sync(1, "sum", &v, 1, 20000, &f)) {
			failed += failed_naming(k, "a call with a tensor made before");
			continue;
		}
		CHECK(shmrpc_future_value(f)->u.i == want, "a wrong sum: %lld, want %lld",
		      (long long)shmrpc_future_value(f)->u.i, (long long)want);
		shmrpc_future_free(f);
	}
	return failed;
}

static int load_rref(const struct kind *k, shmrpc_rref *r)
{
	shmrpc_future *f;

	if (shmrpc_rref_to_here(r, 20000, &f))
		return failed_naming(k, "an RRef's to_here");
	CHECK(shmrpc_future_value(f)->u.i == 7, "a wrong RRef value: %lld",
	      (long long)shmrpc_future_value(f)->u.i);
	shmrpc_future_free(f);
	return 0;
}

static int load(const struct kind *k, int round)
{
	int failed = load_tensor(k, SMALL, round * 100) + load_tensor(k, LARGE, round * 1000);
	shmrpc_rref *r;

	if (shmrpc_remote(1, "seven", NULL, 0, 20000, &r))
		return failed + failed_naming(k, "an RRef's creation");
	failed += load_rref(k, r);
	shmrpc_rref_free(r);
	return failed;
}

/* Worker 1's load while worker 0 scribbles and loads: large tensors only
 * (no slab blocks, so that the records kind finds the slab block it
 * marked still free), summed by worker 0. Until worker 0 says stop. */
static atomic_bool stop_load;

static int fn_stop(shmrpc_call *c, const shmrpc_value *a, uint32_t n, shmrpc_value *r, void *u)
{
	(void)c, (void)a, (void)n, (void)u;
	/* Relaxed: a flag; the load thread's calls order nothing by it. */
	atomic_store_explicit(&stop_load, true, memory_order_relaxed);
	*r = shmrpc_nil();
	return 0;
}

static void *background_load(void *arg)
{
	const struct kind *k = arg;
	int64_t n = LARGE, seed = 0;

	while (!atomic_load_explicit(&stop_load, memory_order_relaxed)) {
		shmrpc_tensor *t;
		shmrpc_future *f;
		shmrpc_value v;
		int64_t *d, want = 0;

		if (shmrpc_tensor_alloc(i64, 1, &n, &t)) {
			failed_naming(k, "worker 1's allocation");
			usleep(1000);
			continue;
		}
		d = shmrpc_tensor_data(t);
		for (int64_t i = 0; i < n; i++)
			want += d[i] = seed++;
		v = shmrpc_tensor_value(t);
		if (shmrpc_rpc_sync(0, "sum", &v, 1, 20000, &f)) {
			failed_naming(k, "worker 1's call with a tensor");
		} else {
			CHECK(shmrpc_future_value(f)->u.i == want, "worker 1: a wrong sum");
			shmrpc_future_free(f);
		}
		shmrpc_tensor_free(t);
	}
	return NULL;
}

/* A mapping of our own of one of the job's files, through the fd the
 * worker inherited (named in var). */
static int dup_env_fd(const char *var)
{
	const char *v = getenv(var);
	int fd;

	CHECK(v, "no %s", var);
	fd = fcntl(atoi(v), F_DUPFD_CLOEXEC, 0);
	CHECK(fd >= 0, "dup(%s)", v);
	return fd;
}

/* The RRef table's entry of the RRef with a value owned by owner (there is
 * one: worker 0's kept one; those it let go of are unreferenced). */
static uint32_t live_entry(struct rref_table *t, uint32_t owner)
{
	for (uint32_t s = 0; s < t->capacity; s++) {
		struct rref_info info;

		if (rref_info_at(t, s, &info) && info.owner == owner && info.state == RREF_READY)
			return s;
	}
	CHECK(0, "no RRef entry of worker %u with a value", owner);
	return 0;
}

/* Worker 1's slot, every field but those that report corruption (and
 * the words its threads hand work over by, whose meaning is theirs):
 * lifecycle, name, doorbell, counters. Or the two words by which it lets
 * frames ring nothing. Or the segment header's layout and name. */
static void scribble_segment(const char *kind)
{
	struct shm_seg seg;
	struct shm_worker *w;

	CHECK_OK(shm_seg_attach_fd(&seg, dup_env_fd(SHMRPC_ENV_JOB_FD), false));
	w = shm_worker(&seg, 1);
	if (!strcmp(kind, "slots")) {
		atomic_store(&w->state, 77);
		atomic_store(&w->pid, 0x7fffffffu);
		atomic_store(&w->generation, 12345);
		atomic_store(&w->exit_info, 0xdeadbeefu);
		memset(w->name, 'X', SHM_NAME_MAX);
		atomic_fetch_add(&w->doorbell, 1000);
		atomic_store(&w->sleepers, 1u << 20);
		atomic_store(&w->heartbeat_ns, ~0ull);
		atomic_store(&w->frames_sent, ~0ull);
		atomic_store(&w->bytes_recv, ~0ull);
		atomic_store(&w->calls_served, ~0ull);
		atomic_store(&w->num_pending_futures, ~0ull);
	} else if (!strcmp(kind, "promises")) {
		atomic_store(&w->servers_busy, 1);
		atomic_store(&w->replies_taken, 1);
		atomic_store(&w->servers_watched, 1);
		atomic_store(&w->replies_watched, 1);
		atomic_store(&w->servers_newest, 0x80000000u); /* a hint: no thread of its has this bit */
	} else {
		seg.hdr->world_size = 77;
		seg.hdr->ring_size = 3;
		memset(seg.hdr->job_name, 'X', SHM_NAME_MAX);
	}
	shm_seg_detach(&seg);
}

/* The child: scribbles, as a stray or hostile process would. */
static void scribble(const char *kind, uint64_t small_off, uint64_t large_off)
{
	struct shm_pool p;
	struct rref_table t;
	uint32_t cs, cl;

	if (!strcmp(kind, "slots") || !strcmp(kind, "promises") || !strcmp(kind, "header")) {
		scribble_segment(kind);
		return;
	}

	CHECK_OK(pool_attach_fd(&p, dup_env_fd(SHMRPC_ENV_POOL_FD), false));
	CHECK_OK(rref_table_attach_fd(&t, dup_env_fd(SHMRPC_ENV_RREF_FD), false));
	cs = (uint32_t)((small_off - p.data_off) >> POOL_CHUNK_SHIFT);
	cl = (uint32_t)((large_off - p.data_off) >> POOL_CHUNK_SHIFT);
	if (!strcmp(kind, "records")) {
		/* The slab's next free block, marked as in use. */
		uint32_t first = (uint32_t)atomic_load(&p.chunks[cs].entry);

		CHECK(p.chunks[cs].free_head, "the slab has no free block");
		atomic_store(&p.meta[first + p.chunks[cs].free_head - 1].refs, 3);
	} else if (!strcmp(kind, "chunks")) {
		uint64_t e = atomic_load(&p.chunks[cl].entry);

		atomic_store(&p.chunks[cl].entry, (e & ~(63ull << 56)) | 40ull << 56);
	} else if (!strcmp(kind, "lists")) {
		/* Every order's free list starts at the live large block. */
		for (uint32_t o = 0; o <= 2; o++)
			atomic_store(&p.hdr->chunk_free[o], cl + 1);
	} else if (!strcmp(kind, "holders")) {
		uint32_t gen = (uint32_t)(atomic_load(&p.holders[0].life) >> 32);

		for (uint32_t s = 0; s < p.holder_cap; s++)
			if (!atomic_load(&p.tables[s])) {
				atomic_store(&p.tables[s], 1ull << 48 | (uint64_t)(uint16_t)gen << 32 |
								   0x7ffffff0u);
				break;
			}
	} else if (!strcmp(kind, "entries")) {
		rref_entry_at(&t, live_entry(&t, 1))->owner = 5000;
	} else if (!strcmp(kind, "links")) {
		/* Worker 1's list: a live (READY) entry that links to itself. */
		uint32_t s = live_entry(&t, 1);

		atomic_store(&rref_entry_at(&t, s)->collect_next, s + 1);
		atomic_store(&t.heads[1], s + 1);
	}
	rref_table_detach(&t);
	pool_detach(&p);
}

/* Worker rank's corrupt_found (what it found) or, !found, its
 * replies_taken, replies_watched and servers_watched together (each 0
 * once it restored a stray 1: where its threads do not take their
 * replies, as a C worker's never do, and none spins for a reply or a
 * request). Relaxed: a flag (shm/corrupt.h), and a look at words the
 * worker restores. */
static uint64_t slot_word(uint32_t rank, bool found)
{
	struct shm_seg seg;
	struct shm_worker *w;
	uint64_t v;

	CHECK_OK(shm_seg_attach_fd(&seg, dup_env_fd(SHMRPC_ENV_JOB_FD), true));
	w = shm_worker(&seg, rank);
	v = found ? atomic_load_explicit(&w->corrupt_found, memory_order_relaxed)
		  : atomic_load_explicit(&w->replies_taken, memory_order_relaxed) |
			    atomic_load_explicit(&w->replies_watched, memory_order_relaxed) |
			    atomic_load_explicit(&w->servers_watched, memory_order_relaxed);
	shm_seg_detach(&seg);
	return v;
}

static uint64_t found_by(uint32_t rank)
{
	return slot_word(rank, true);
}

/* shmrpc-inspect --check on the live job names the structure, found by a
 * worker (the launcher is our parent). */
static void inspect_names(const struct kind *k)
{
	static char out[1 << 14];
	char job[16], text[128];
	const char *argv[] = { tl_inspect_path(), "--check", job, NULL };
	int rc;

	snprintf(job, sizeof(job), "%d", (int)getppid());
	rc = tl_run(out, sizeof(out), argv);
	snprintf(text, sizeof(text), "found %s", k->structure);
	CHECK(rc == 1 && strstr(out, text), "%s: shmrpc-inspect --check exited %d without \"%s\"",
	      k->name, rc, text);
	CHECK(!k->said || strstr(out, k->said), "%s: shmrpc-inspect --check does not say \"%s\"",
	      k->name, k->said);
}

static int worker(void)
{
	const struct kind *k = kind_named(getenv("HOSTILE_KIND"));
	int failed = 0, status;
	shmrpc_rref *kept = NULL;
	shmrpc_future *f;
	pid_t pid;

	CHECK_OK(shmrpc_register("sum", "t", fn_sum, NULL));
	CHECK_OK(shmrpc_register("seven", "", fn_seven, NULL));
	CHECK_OK(shmrpc_register("stop", "", fn_stop, NULL));
	CHECK_OK(shmrpc_init(NULL));
	if (shmrpc_rank() == 1) {
		pthread_t th;

		CHECK(!pthread_create(&th, NULL, background_load, (void *)k), "pthread_create");
		pthread_join(th, NULL);
	} else {
		CHECK(load(k, 1) == 0, "the load failed before any corruption: %s", shmrpc_errmsg());
		/* An RRef of worker 1's that lives across the scribbling. */
		CHECK_OK(shmrpc_remote(1, "seven", NULL, 0, 20000, &kept));
		CHECK(load_rref(k, kept) == 0, "to_here before any corruption");
		pid = fork();
		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			scribble(k->name, shmrpc_tensor_pool_offset(held[0]),
				 shmrpc_tensor_pool_offset(held[1]));
			_exit(0);
		}
		CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && !WEXITSTATUS(status),
		      "the scribbler failed");
		failed += load_rref(k, kept) + resend_held(k);
		for (int round = 2; round < 6; round++)
			failed += load(k, round);
		CHECK(!k->calls_fail || failed > 0, "no call touched %s", k->structure);
		if (!strcmp(k->name, "links") || !strcmp(k->name, "promises")) {
			/* Worker 1 walks its list, and looks at its slot's words,
			 * when its loop thread goes to sleep. */
			uint64_t bit = !strcmp(k->name, "links") ? SHM_CORRUPT_RREF_COLLECT
								 : SHM_CORRUPT_SLOTS;

			for (int i = 0; i < 1000 && !(found_by(1) & bit); i++)
				usleep(10000);
			CHECK(found_by(1) & bit, "%s: worker 1 found nothing", k->name);
		}
		if (!strcmp(k->name, "promises")) {
			/* While its load runs, worker 1's threads write 1 in
			 * these words of their own (a call spinning for its
			 * reply, the idle spinner): one look can see theirs.
			 * Its load stopped, nothing of it watches: the words
			 * must read 0 and stay so. */
			int zeros = 0;

			CHECK_OK(shmrpc_rpc_sync(1, "stop", NULL, 0, 20000, &f));
			shmrpc_future_free(f);
			for (int i = 0; i < 2000 && zeros < 20; i++) {
				zeros = slot_word(1, false) ? 0 : zeros + 1;
				usleep(5000);
			}
			CHECK(zeros >= 20, "promises: worker 1 left a stray replies_taken, "
			      "replies_watched or servers_watched");
		}
		fprintf(stderr, "hostile %s: %d steps failed naming %s\n", k->name, failed,
			k->structure);
		/* Found by now, where calls touch it or worker 1 walked its list
		 * (a holder table is read only when its holder's references go). */
		if (k->calls_fail || !strcmp(k->name, "links") || !strcmp(k->name, "slots") ||
		    !strcmp(k->name, "promises"))
			inspect_names(k);
		if (k->stops) {
			/* shmrun looks a few times a second: its SIGTERM ends us. */
			sleep(30);
			CHECK(0, "%s: shmrun did not stop the job", k->name);
		}
		CHECK_OK(shmrpc_rpc_sync(1, "stop", NULL, 0, 20000, &f));
		shmrpc_future_free(f);
		shmrpc_rref_free(kept);
		while (nheld)
			shmrpc_tensor_free(held[--nheld]);
	}
	CHECK_OK(shmrpc_shutdown(1, 30000));
	return 0;
}

/* ---- The test ------------------------------------------------------------- */

static void run_kind(const struct kind *k)
{
	static char out[1 << 16];
	char text[256];
	int rc;

	setenv("HOSTILE_KIND", k->name, 1);
	rc = tl_shmrun(out, sizeof(out), "-n", "2", NULL);
	fprintf(stderr, "--- %s: shmrun exited %d\n%s", k->name, rc, out);
	CHECK(rc == 1, "%s: shmrun exited %d, want 1 (a corrupt structure fails the job)", k->name,
	      rc);
	snprintf(text, sizeof(text), "hostile %s: ", k->name);
	CHECK(k->stops || strstr(out, text), "%s: worker 0 did not finish its load", k->name);
	CHECK(!strstr(out, "died:") && !strstr(out, "exited with code"),
	      "%s: a worker crashed or failed", k->name);
	CHECK(!k->stops || strstr(out, "2 stopped for its corrupt segment header"),
	      "%s: the workers did not end by shmrun's stop", k->name);
	snprintf(text, sizeof(text), "shmrun: %s", k->said ? k->said : "");
	CHECK(!k->said || strstr(out, text), "%s: shmrun does not say \"%s\"", k->name, text);
	snprintf(text, sizeof(text), "shmrun: %s", k->structure);
	CHECK(strstr(out, text), "%s: shmrun does not name %s", k->name, k->structure);
	snprintf(text, sizeof(text), "found corrupt by %s", k->finder);
	CHECK(strstr(out, text), "%s: shmrun does not say %s found it", k->name, k->finder);
	CHECK(tl_shm_leftovers() == 0, "%s: files left in /dev/shm", k->name);
}

int main(int argc, char **argv)
{
	if (tl_is_worker())
		return worker();
	if (access(tl_shmrun_path(), X_OK))
		return tl_skip("shmrun is not built");
	if (argc > 1) {
		run_kind(kind_named(argv[1]));
		return 0;
	}
	for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
		run_kind(&kinds[i]);
	return 0;
}
