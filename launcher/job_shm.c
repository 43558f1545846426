/*
 * A job's shared memory and a worker's end; see job_shm.h.
 *
 * When a worker ends badly the launcher is the first to know. It records
 * how in the slot (exit_info, then state DEAD with release: a reader that
 * sees DEAD with acquire sees exit_info), bumps the slot's and the
 * header's generation, and rings every doorbell.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "shmrpc.h"
#include "common/cuda_leftovers.h"
#include "ipc/doorbell.h"
#include "launcher/job_shm.h"

int job_shm_create(struct job_shm *js, const struct job_shm_params *p)
{
	struct shm_seg_params sp = { .world_size = p->world, .ring_size = p->ring_size,
				     .trace_records = p->trace_records, .flags = p->seg_flags,
				     .job_name = p->job_name };
	struct pool_params pp = { .bytes = p->pool_size ? p->pool_size : pool_default_bytes(),
				  .world = p->world, .holder_cap = p->holder_records,
				  .max_blocks = p->pool_records, .retain = p->pool_retain };
	struct rref_table_params rp = { .max_rrefs = p->max_rrefs, .world = p->world };
	int rc;

	memset(js, 0, sizeof(*js));
	rc = shm_seg_create(&js->seg, &sp);
	if (rc)
		return rc;
	rc = pool_create(&js->pool, &pp);
	if (rc) {
		shm_seg_detach(&js->seg);
		return rc;
	}
	rc = rref_table_create(&js->rrefs, &rp);
	if (rc) {
		pool_detach(&js->pool);
		shm_seg_detach(&js->seg);
		return rc;
	}
	/* What our sweeps find corrupt: the launcher's own word, which no
	 * other process can write. */
	js->pool.corrupt_note = js->rrefs.corrupt_note = &js->corrupt;
	return 0;
}

void job_shm_close(struct job_shm *js)
{
	rref_table_detach(&js->rrefs);
	pool_detach(&js->pool);
	shm_seg_detach(&js->seg);
}

uint32_t job_reap(int pidfd, int pid)
{
	siginfo_t si = { 0 };
	int rc;

	/* Dead but not reaped first: its pid is not anyone else's yet. */
	do
		rc = waitid(P_PIDFD, (id_t)pidfd, &si, WEXITED | WNOWAIT);
	while (rc < 0 && errno == EINTR);
	if (rc == 0)
		cuda_leftovers_remove(pid);
	do
		rc = waitid(P_PIDFD, (id_t)pidfd, &si, WEXITED);
	while (rc < 0 && errno == EINTR);
	if (rc < 0) {
		fprintf(stderr, "shmrpc: cannot collect worker pid %d: %s\n", pid, strerror(errno));
		return 0xffffffffu; /* formats as "ended (cause unknown)" */
	}
	if (si.si_code == CLD_EXITED)
		return si.si_status ? SHM_EXIT_CODE(si.si_status) : 0;
	return SHM_EXIT_SIGNAL(si.si_status);
}

void job_ring_all(const struct job_shm *js)
{
	for (uint32_t r = 0; r < js->seg.world; r++)
		ipc_doorbell_ring(shm_worker(&js->seg, r), NULL);
}

/* Whatever the worker still held in the tensor pool goes back: all of it
 * after a death, what it forgot to release after a clean exit. Acquire:
 * the generation it ran as, written before its fork. */
static void sweep_pool(struct job_shm *js, uint32_t rank)
{
	uint32_t gen = atomic_load_explicit(&shm_worker(&js->seg, rank)->generation,
					    memory_order_acquire);

	if (pool_sweep(&js->pool, rank, gen) < 0)
		fprintf(stderr, "shmrpc: cannot release what worker %u held in the tensor pool: %s\n",
			rank, shmrpc_errmsg());
}

/* What the worker held in the RRef table, swept twice in the order the
 * table needs (shm/rref_table.h): before the pool frees its blocks, and
 * after it is marked dead or exited (with a seq_cst store: a sender that
 * charged it a reference reads that state with seq_cst after charging). */
static void sweep_rrefs(struct job_shm *js, uint32_t rank)
{
	if (rref_sweep_rank(&js->rrefs, rank) < 0)
		fprintf(stderr, "shmrpc: cannot release what worker %u held in the RRef table: %s\n",
			rank, shmrpc_errmsg());
}

void job_worker_ended(struct job_shm *js, uint32_t rank, uint32_t exit_info)
{
	struct shm_worker *w = shm_worker(&js->seg, rank);

	sweep_rrefs(js, rank);
	sweep_pool(js, rank);
	if (!exit_info) {
		/* seq_cst (release at least): pairs with the readers' acquire of
		 * the state, and with rref_charge's seq_cst read of it. */
		atomic_store_explicit(&w->state, SHM_WORKER_EXITED, memory_order_seq_cst);
		sweep_rrefs(js, rank);
		return;
	}
	/* Relaxed: published by the release store of DEAD that follows. */
	atomic_store_explicit(&w->exit_info, exit_info, memory_order_relaxed);
	/* seq_cst: also against rref_charge's seq_cst read (see it). */
	atomic_store_explicit(&w->state, SHM_WORKER_DEAD, memory_order_seq_cst);
	atomic_fetch_add_explicit(&w->generation, 1, memory_order_release);
	atomic_fetch_add_explicit(&js->seg.hdr->generation, 1, memory_order_release);
	sweep_rrefs(js, rank);
	job_ring_all(js);
}
