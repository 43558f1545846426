/* ipc_ring on a real segment, producer and consumer in one process, on the
 * smallest ring: empty, full, wrap-around at every 8-byte offset, every
 * record size up to the largest, refusal of larger ones, the prod_waiting
 * hand-shake, and a garbage tail seen as corruption. */
#include <string.h>

#include "shmrpc.h"
#include "ipc/ring.h"
#include "tests/lib/testlib.h"

#define RING SHM_RING_MIN

static struct ipc_ring prod, cons;

/* Record bytes from a tag, so that a record read back names its writer. */
static uint8_t rec_byte(uint32_t tag, uint32_t i)
{
	return (uint8_t)(tag * 131u + i * 7u + 1u);
}

static void push(uint32_t len, uint32_t tag)
{
	uint8_t *p = ipc_ring_reserve(&prod, len);

	CHECK(p, "reserve(%u) failed at tail %llu, head %llu", len,
	      (unsigned long long)prod.pos, (unsigned long long)cons.pos);
	CHECK(p >= prod.data && p + len <= prod.data + RING, "record of %u bytes outside the ring", len);
	for (uint32_t i = 0; i < len; i++)
		p[i] = rec_byte(tag, i);
	ipc_ring_commit(&prod);
}

static void pop(uint32_t len, uint32_t tag)
{
	const uint8_t *rec;
	uint32_t got;

	CHECK(ipc_ring_peek(&cons, &rec, &got) == 1, "no record %u", tag);
	CHECK(got == len, "record %u: %u bytes, expected %u", tag, got, len);
	CHECK(rec >= cons.data && rec + got <= cons.data + RING, "record %u wraps", tag);
	for (uint32_t i = 0; i < len; i++)
		CHECK(rec[i] == rec_byte(tag, i), "record %u: byte %u differs", tag, i);
	ipc_ring_consume(&cons, got);
}

static void check_empty(void)
{
	const uint8_t *rec;
	uint32_t len;

	CHECK(ipc_ring_peek(&cons, &rec, &len) == 0, "ring not empty");
	CHECK(ipc_ring_fill(prod.ctl) == 0, "fill %llu on an empty ring",
	      (unsigned long long)ipc_ring_fill(prod.ctl));
}

/* Fills from an empty ring at offset 0 with 24-byte records (32 with the
 * prefix): exactly RING / 32 fit, then reserve says full. */
static void test_fill_drain(void)
{
	uint32_t n = 0;

	check_empty();
	while (ipc_ring_reserve(&prod, 24)) {
		ipc_ring_commit(&prod);
		n++;
		CHECK(n <= RING / 32, "more records than the ring holds");
	}
	CHECK(n == RING / 32, "%u records fit, expected %u", n, RING / 32);
	CHECK(ipc_ring_fill(prod.ctl) == RING, "fill %llu", (unsigned long long)ipc_ring_fill(prod.ctl));
	CHECK(!ipc_ring_reserve(&prod, 0), "reserve of 0 bytes in a full ring");

	/* prod_waiting: release wakes only a producer that announced itself. */
	CHECK(!ipc_ring_wait_space_prepare(&prod, 24), "space in a full ring");
	for (uint32_t i = 0; i < n; i++) {
		const uint8_t *rec;
		uint32_t len;

		CHECK(ipc_ring_peek(&cons, &rec, &len) == 1 && len == 24, "record %u", i);
		ipc_ring_consume(&cons, len);
		CHECK(ipc_ring_release(&cons) == (i == 0), "release after record %u", i);
	}
	check_empty();
	ipc_ring_wait_space_done(&prod);
}

static void test_release_flag(void)
{
	push(8, 1);
	pop(8, 1);
	CHECK(!ipc_ring_release(&cons), "release without a waiting producer said wake");
	/* Room already there: prepare says so and withdraws the flag. */
	CHECK(ipc_ring_wait_space_prepare(&prod, 8), "no room in an empty ring");
	push(8, 2);
	pop(8, 2);
	CHECK(!ipc_ring_release(&cons), "flag left set by a prepare that found room");
}

static void test_sizes(void)
{
	uint32_t max = ipc_ring_max_record(&prod);

	CHECK(max == RING / 2 - IPC_REC_PREFIX, "max record %u", max);
	for (uint32_t len = 0; len <= max; len++) {
		push(len, len);
		CHECK(ipc_ring_fill(prod.ctl) >= IPC_REC_PREFIX + len, "fill after %u", len);
		pop(len, len);
		ipc_ring_release(&cons);
		check_empty();
	}
	CHECK(!ipc_ring_reserve(&prod, max + 1), "record of max + 1 accepted");
	CHECK(!ipc_ring_reserve(&prod, UINT32_MAX), "record of 4 GiB accepted");
	check_empty();
}

/* Moves the empty ring's position to offset off with filler records, none
 * of which wraps. */
static void move_to(uint32_t off)
{
	uint32_t tag = 0;

	while ((uint32_t)(prod.pos % RING) != off) {
		uint32_t at = (uint32_t)(prod.pos % RING);
		uint32_t step = (off - at) % RING, contig = RING - at;
		uint32_t max = ipc_ring_max_record(&prod) + IPC_REC_PREFIX;

		if (step > contig)
			step = contig;
		if (step > max)
			step = max;
		push(step - IPC_REC_PREFIX, tag);
		pop(step - IPC_REC_PREFIX, tag++);
		ipc_ring_release(&cons);
	}
	check_empty();
}

/* From every 8-byte offset, records of various sizes until one has crossed
 * the end of the ring; when the ring is full the oldest is taken out. */
static void test_wrap(void)
{
	static const uint32_t sizes[] = { 0, 1, 7, 8, 9, 40, 100, 511, 1000, 1500, 2040 };
	const uint32_t nsizes = sizeof(sizes) / sizeof(sizes[0]);

	for (uint32_t off = 0; off < RING; off += 8) {
		uint32_t first = (off / 8) % nsizes, pushed = 0, popped = 0;
		uint64_t lap;

		move_to(off);
		lap = prod.pos / RING;
		while (prod.pos / RING == lap) {
			uint32_t len = sizes[(first + pushed) % nsizes];
			uint8_t *p = ipc_ring_reserve(&prod, len);

			if (!p) {
				CHECK(popped < pushed, "nothing fits in an empty ring at offset %u", off);
				pop(sizes[(first + popped) % nsizes], off + popped);
				popped++;
				ipc_ring_release(&cons);
				continue;
			}
			for (uint32_t i = 0; i < len; i++)
				p[i] = rec_byte(off + pushed, i);
			ipc_ring_commit(&prod);
			pushed++;
		}
		while (popped < pushed) {
			pop(sizes[(first + popped) % nsizes], off + popped);
			popped++;
		}
		ipc_ring_release(&cons);
		check_empty();
	}
}

static void test_corrupt_tail(void)
{
	const uint8_t *rec;
	uint32_t len;

	check_empty();
	/* A tail that is not a whole number of records, and one a lap ahead. */
	atomic_store(&prod.ctl->tail, cons.pos + 12);
	CHECK(ipc_ring_peek(&cons, &rec, &len) == -SHMRPC_ECORRUPT, "odd tail accepted");
	cons.cached = cons.pos;
	atomic_store(&prod.ctl->tail, cons.pos + RING + 8);
	CHECK(ipc_ring_peek(&cons, &rec, &len) == -SHMRPC_ECORRUPT, "tail a lap ahead accepted");
}

int main(void)
{
	struct shm_seg_params sp = { .world_size = 2, .ring_size = RING };
	struct shm_seg seg;

	CHECK_OK(shm_seg_create(&seg, &sp));
	ipc_ring_open(&prod, &seg, 0, 1, true);
	ipc_ring_open(&cons, &seg, 0, 1, false);
	CHECK(prod.size == RING && cons.size == RING, "ring size %u", prod.size);

	test_fill_drain();
	test_release_flag();
	test_sizes();
	test_wrap();
	test_corrupt_tail();

	shm_seg_detach(&seg);
	CHECK(tl_shm_leftovers() == 0, "files left in /dev/shm");
	return 0;
}
