/*
 * libFuzzer target for the walkers of the shared metadata that any process
 * of the job can write: the tensor pool's (block records, chunk table,
 * free lists, slabs, holder tables) and the RRef table's (entries, counts,
 * collect lists). A small pool and table are made once, given live blocks,
 * references and RRefs, and their metadata saved; each input restores it,
 * then overwrites words of it, then runs what the workers and the launcher
 * run on it: allocations, references and drops, sweeps, statistics, RRef
 * holds, releases, sweeps and collect walks. Whatever the words, nothing
 * may read or write outside the mappings, run forever or hit undefined
 * behaviour (the sanitizers say), and a block handed out must lie in the
 * data area, aligned to its size.
 *
 * The input is a list of 12-byte writes: [u32 where][u64 value], where
 * 'where' picks the file (bit 31: the RRef table) and the 8-byte-aligned
 * word (the rest, modulo the metadata's size). The pool's lock is never
 * written: a process that scribbles on it stops the pool (pool.h says so),
 * which no check can tell from a slow holder.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "shm/pool.h"
#include "shm/rref_table.h"

#define FUZZ_WRITES 16
#define FUZZ_WORLD 2

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct shm_pool pool;
static struct rref_table table;
static uint8_t *pool_saved, *table_saved;
static uint64_t offs[8];     /* the live blocks of the saved state */
static uint32_t slots[4];
static uint64_t ids[4];
static _Atomic uint64_t found; /* what the walkers found corrupt */

static void setup(void)
{
	struct pool_params pp = { .bytes = 16u << 16, .world = FUZZ_WORLD, .holder_cap = 16,
				  .max_blocks = 2048 };
	struct rref_table_params tp = { .max_rrefs = 8, .world = FUZZ_WORLD };
	static const uint64_t sizes[8] = { 64, 64, 200, 4096, 1u << 16, 3u << 16, 64, 1u << 17 };

	if (pool_create(&pool, &pp) || rref_table_create(&table, &tp) || pool_join(&pool, 0, 1) ||
	    pool_join(&pool, 1, 1))
		abort();
	for (int i = 0; i < 8; i++) {
		if (pool_alloc(&pool, (uint32_t)i & 1, sizes[i], &offs[i]))
			abort();
		if (i % 3 == 0 && pool_ref(&pool, 1, offs[i]))
			abort();
	}
	for (uint32_t i = 0; i < 4; i++) {
		ids[i] = RREF_ID(0, i + 1);
		if (rref_insert(&table, ids[i], i & 1, 0, 0, &slots[i]))
			abort();
	}
	/* One with a value, one unreferenced on its owner's list. */
	rref_store(&table, slots[0], ids[0], RREF_READY, offs[0], 64);
	rref_store(&table, slots[2], ids[2], RREF_READY, offs[2], 64);
	if (rref_release(&table, slots[2], ids[2], 0, 1) == 1)
		rref_collect_push(&table, slots[2]);
	pool.corrupt_note = table.corrupt_note = &found;
	pool_saved = malloc(pool.data_off);
	table_saved = malloc(table.size);
	if (!pool_saved || !table_saved)
		abort();
	memcpy(pool_saved, pool.base, pool.data_off);
	memcpy(table_saved, table.base, table.size);
}

/* A word of the metadata: never the pool's lock. */
static void scribble(uint32_t where, uint64_t value)
{
	uint64_t at;

	if (where & 0x80000000u) {
		at = ((uint64_t)(where & 0x7fffffffu) * 8) % table.size;
		memcpy(table.base + at, &value, sizeof(value));
		return;
	}
	at = ((uint64_t)where * 8) % pool.data_off;
	if (at >= offsetof(struct pool_header, lock) &&
	    at < offsetof(struct pool_header, lock) + sizeof(pool.hdr->lock))
		return;
	memcpy(pool.base + at, &value, sizeof(value));
}

static void check_block(uint64_t off, uint64_t bytes)
{
	uint64_t align = bytes >= (1u << 16) ? (1u << 16) : 64;

	if (!pool_at(&pool, off, bytes) || (off - pool.data_off) % align)
		__builtin_trap();
}

static void walk_pool(const uint8_t *data, size_t size)
{
	static const uint64_t asks[5] = { 1, 64, 5000, 1u << 16, 5u << 16 };
	struct pool_holder_stats hs;
	struct pool_stats st;
	uint64_t off;

	for (int i = 0; i < 5; i++)
		if (pool_alloc(&pool, (uint32_t)i & 1, asks[i], &off) == 0) {
			check_block(off, asks[i]);
			pool_unref(&pool, (uint32_t)i & 1, off);
		}
	for (int i = 0; i < 8; i++) {
		uint64_t ref = size > (size_t)i ? offs[i] + data[i] % 3 * 64 : offs[i];

		pool_block_size(&pool, ref);
		pool_block_refs(&pool, ref);
		pool_holder_refs(&pool, 0, ref);
		if (pool_ref(&pool, 0, ref) == 0)
			pool_unref(&pool, 0, ref);
		if (i & 1)
			pool_unref(&pool, 1, offs[i]);
	}
	pool_stats(&pool, &st);
	pool_holder_stats(&pool, 0, &hs);
	pool_sweep(&pool, 1, 1);
	pool_leave(&pool, 0);
}

static void walk_table(void)
{
	struct rref_info info;
	uint32_t slot, at;

	for (uint32_t i = 0; i < 4; i++) {
		rref_find(&table, ids[i], &slot);
		if (rref_hold(&table, slots[i], ids[i], 1, 1) == 0)
			rref_release(&table, slots[i], ids[i], 1, 1);
		rref_wait(&table, slots[i], ids[i], 1); /* a deadline passed: no sleep */
	}
	for (uint32_t r = 0; r < FUZZ_WORLD; r++) {
		at = rref_collect_take(&table, r);
		for (uint32_t n = 0; at && n < table.capacity; n++) {
			rref_info_at(&table, at - 1, &info);
			rref_count_of(&table, at - 1, r);
			at = rref_collect_next(&table, at - 1);
		}
	}
	rref_sweep_rank(&table, 1);
	rref_sweep_rank(&table, 0);
	for (uint32_t s = 0; s < table.capacity; s++)
		rref_info_at(&table, s, &info);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static int ready;

	if (!ready) {
		setup();
		ready = 1;
	}
	memcpy(pool.base, pool_saved, pool.data_off);
	memcpy(table.base, table_saved, table.size);
	for (size_t i = 0; i + 12 <= size && i < 12 * FUZZ_WRITES; i += 12) {
		uint32_t where;
		uint64_t value;

		memcpy(&where, data + i, sizeof(where));
		memcpy(&value, data + i + 4, sizeof(value));
		scribble(where, value);
	}
	walk_pool(data, size);
	walk_table();
	return 0;
}
