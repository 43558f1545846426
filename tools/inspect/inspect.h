/*
 * shmrpc-inspect's parts (tools/shmrpc-inspect.c tells what the tool
 * does): one file per subject of a job, each with its snapshot, its text
 * and JSON printers and its --check (workers.c: the segment's header and
 * worker slots; pool.c: the tensor pool; rrefs.c: the RRef table), then
 * jobs.c (finding and attaching a job, the job list), trace.c (--trace)
 * and util.c (what they share: /proc, durations, names).
 */
#ifndef SHMRPC_TOOLS_INSPECT_H
#define SHMRPC_TOOLS_INSPECT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "common/compiler.h"
#include "shm/pool.h"
#include "shm/rref_table.h"
#include "shm/segment.h"

#define PROG "shmrpc-inspect"
#define SEG_LINK "/memfd:shmrpc-job (deleted)"
#define POOL_LINK "/memfd:shmrpc-pool (deleted)"
#define RREF_LINK "/memfd:shmrpc-rrefs (deleted)"

#define RR_SHOWN 20                /* RRefs the text lists */
#define RR_LISTED 1000             /* RRefs the JSON lists */
#define RR_NSTATES (RREF_OWNER_DEAD + 1)

#define EXIT_ANOMALY 1
#define EXIT_USAGE 2

#define NCOUNTERS 12u /* workers.c's counters[] */
#define NGAUGES 4u    /* workers.c's cuda_gauges[] */

/* One worker slot as read once. */
struct wsnap {
	uint32_t state, pid, exit_info, agent;
	uint32_t cuda[NGAUGES];
	uint64_t hb_age_ns; /* UINT64_MAX: no heartbeat yet */
	uint64_t corrupt;   /* SHM_CORRUPT_* bits: what it found corrupt */
	uint64_t val[NCOUNTERS];
	uint64_t ring_in, ring_out;
	char name[SHM_NAME_MAX + 1];
	char exit_text[96]; /* "" unless EXITED or DEAD */
	/* The slot as shm/slot.h checks it; slot_why says why when !slot_ok. */
	bool slot_ok;
	char slot_why[192];
};

/* An RRef found by a walk: its id names it, not a later one in its slot. */
struct pick {
	uint64_t created_ns;
	uint64_t id;
	uint32_t slot;
};

/* What a walk of the table found: every live RRef counted by state, and
 * the k oldest picked. Until the walk ends, pick is a heap with the
 * youngest kept on top, so an older entry replaces it in log(k) steps: a
 * table of millions of RRefs costs k picks of memory, not millions. */
struct rscan {
	uint32_t live;
	uint32_t by_state[RR_NSTATES];
	struct pick *pick;
	uint32_t n, k;
};

/* What show() read of a job: the segment's worker table, and the pool and
 * the RRef table when the job has them; for --check (check) or the JSON
 * (json) or the text. */
struct view {
	pid_t pid;
	bool json, check;
	struct shm_seg seg;
	struct wsnap *ws;
	struct shm_pool pool;
	struct pool_stats pool_st;
	struct pool_holder_stats *holders; /* world of them; state 0 (idle): none */
	struct rref_table rrefs;
	struct rscan sc;
	uint32_t *counts; /* world of them: an RRef's counts, as read last */
};

/*
 * A part of a job that show() shows, described once: a job has it when
 * its launcher holds the memfd named memfd (NULL: always, the segment);
 * map attaches that memfd (0, or -errno and the sentence that says why it
 * cannot be read: shown where the part would be, and an anomaly for
 * --check, as it would hide whatever is wrong in it; fd is map's on
 * success only); snap reads it (false: out of memory); text and json
 * print it (json: its fields of the job's object); check prints its
 * anomalies and returns their number (-1: out of memory); detach lets it
 * go.
 */
struct subject {
	const char *title; /* its heading in the text */
	const char *what;  /* in --check's sentence */
	const char *key;   /* its JSON field */
	const char *memfd;
	int (*map)(struct view *v, int fd);
	bool (*snap)(struct view *v);
	void (*text)(struct view *v);
	void (*json)(struct view *v);
	int (*check)(struct view *v);
	void (*detach)(struct view *v);
};

/* The subjects, in the order show() takes them (workers first: the others
 * read its snapshot). */
extern const struct subject workers_subject, pool_subject, rrefs_subject;

/* workers.c */
extern const char *const state_names[];
#define NSTATES 5u
#define STATE_STARTED 4u
uint32_t shown_state(uint32_t state, uint32_t pid);

/* util.c */
int fail(const char *fmt, ...) SHMRPC_PRINTF(1, 2);
const char *name_of(const char *const *names, size_t n, uint32_t v);
char process_state(uint32_t pid);
bool process_gone(uint32_t pid);
int find_memfd(pid_t pid, const char *target, char *path, size_t len);
int open_memfd(pid_t pid, const char *target);
uint64_t age_ns(const struct shm_seg *seg);
const char *fmt_dur(uint64_t ns, char *buf, size_t len);
void copy_name(char *dst, const char *src);
const char *printable(const char *s, char *buf);

/* jobs.c: attaches to the job whose launcher is pid (quiet: no message
 * on failure; 0 or EXIT_ANOMALY); the job list. */
int attach_job(pid_t pid, struct shm_seg *seg, bool quiet);
int list_jobs(bool json);

/* trace.c: --trace, the flight recorder of one worker. */
int show_trace(pid_t pid, uint32_t rank, bool json);

#endif
