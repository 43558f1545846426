/* The tensor pool's subject: its figures and holders, and --check's word on them. */
#include <stdlib.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tools/inspect/inspect.h"

/* The job's tensor pool, read-only, from its memfd (struct subject's map). */
static int map_pool(struct view *v, int fd)
{
	return pool_attach_fd(&v->pool, fd, true);
}

static const char *const holder_names[] = { "idle", "live", "dead", "swept" };

/* The pool's figures and its holders (a holder that cannot be read shown
 * as none). */
static bool snap_pool(struct view *v)
{
	if (!(v->holders = calloc(v->pool.world, sizeof(*v->holders))))
		return false;
	pool_stats(&v->pool, &v->pool_st);
	for (uint32_t r = 0; r < v->pool.world; r++)
		if (pool_holder_stats(&v->pool, r, &v->holders[r]))
			v->holders[r] = (struct pool_holder_stats){ 0 };
	return true;
}

static void detach_pool(struct view *v)
{
	free(v->holders);
	pool_detach(&v->pool);
}

static void print_pool_text(struct view *v)
{
	const struct pool_stats st = v->pool_st;

	printf("\ntensor pool    %llu bytes, %llu used, %llu free, largest free block %llu\n",
	       (unsigned long long)st.size, (unsigned long long)st.used, (unsigned long long)st.free,
	       (unsigned long long)st.largest_free);
	printf("               %llu live blocks; %llu bytes lost and %llu references unrecorded "
	       "(left by deaths)\n", (unsigned long long)st.blocks_live, (unsigned long long)st.lost,
	       (unsigned long long)st.refs_unrecorded);
	printf("%4s %7s %-6s %8s %8s\n", "RANK", "PID", "HOLDER", "BLOCKS", "REFS");
	for (uint32_t r = 0; r < v->pool.world; r++) {
		const struct pool_holder_stats *hs = &v->holders[r];

		if (hs->state)
			printf("%4u %7u %-6s %8u %8llu\n", r, hs->pid,
			       name_of(holder_names, 4, hs->state), hs->entries,
			       (unsigned long long)hs->refs);
	}
}

static void print_pool_json(struct view *v)
{
	const struct pool_stats st = v->pool_st;
	bool first = true;

	printf(",\"pool\":{\"size\":%llu,\"used\":%llu,\"free\":%llu,\"largest_free\":%llu,"
	       "\"blocks_live\":%llu,\"lost\":%llu,\"refs_unrecorded\":%llu,\"holders\":[",
	       (unsigned long long)st.size, (unsigned long long)st.used, (unsigned long long)st.free,
	       (unsigned long long)st.largest_free, (unsigned long long)st.blocks_live,
	       (unsigned long long)st.lost, (unsigned long long)st.refs_unrecorded);
	for (uint32_t r = 0; r < v->pool.world; r++) {
		const struct pool_holder_stats *hs = &v->holders[r];

		if (!hs->state)
			continue;
		printf("%s{\"rank\":%u,\"pid\":%u,\"state\":\"%s\",\"blocks\":%u,\"refs\":%llu}",
		       first ? "" : ",", r, hs->pid, name_of(holder_names, 4, hs->state),
		       hs->entries, (unsigned long long)hs->refs);
		first = false;
	}
	printf("]}");
}

/*
 * A dead holder that still holds references: the sweep has not run. Also
 * one still LIVE whose process is gone: the launcher, which marks it DEAD
 * and sweeps it as it reaps the worker, has not done so (stopped, stuck,
 * or killed), so its blocks stay taken. The holder is read again after its
 * process is found gone: a worker that leaves cleanly releases its
 * references before it exits, and the launcher may have swept it since.
 */
static int check_pool(struct view *v)
{
	struct shm_pool *pool = &v->pool;
	int bad = 0;

	for (uint32_t r = 0; r < pool->world; r++) {
		struct pool_holder_stats hs = v->holders[r];

		if (!hs.refs)
			continue;
		if (hs.state == POOL_HOLDER_DEAD) {
			printf("rank %u died holding %llu references in the tensor pool\n", r,
			       (unsigned long long)hs.refs);
			bad++;
		} else if (hs.state == POOL_HOLDER_LIVE && process_gone(hs.pid)) {
			uint32_t pid = hs.pid;

			if (pool_holder_stats(pool, r, &hs) || hs.state != POOL_HOLDER_LIVE ||
			    hs.pid != pid || !hs.refs)
				continue;
			printf("rank %u (pid %u) is gone holding %llu references in the tensor pool, "
			       "not swept: its holder is still live\n", r, pid,
			       (unsigned long long)hs.refs);
			bad++;
		}
	}
	return bad;
}

const struct subject pool_subject = { "tensor pool", "the tensor pool", "pool", POOL_LINK,
				      map_pool, snap_pool, print_pool_text, print_pool_json,
				      check_pool, detach_pool };
