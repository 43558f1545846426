/*
 * An arena's borrowed first chunk (worker/arena.c, arena_init):
 *  - what fits in it comes from it (no malloc), 16-byte aligned, zeroed by
 *    arena_alloc;
 *  - what does not fit comes from malloc, and the borrowed bytes are not
 *    overwritten by it;
 *  - arena_free frees malloc's chunks and leaves the borrowed one alone
 *    (under the sanitizers a free of it fails the test), and the arena
 *    works again afterwards, from malloc;
 *  - an arena zeroed with { 0 } works as before, from malloc.
 */
#include <stdint.h>
#include <string.h>

#include "tests/lib/testlib.h"
#include "worker/arena.h"

static bool inside(const struct arena_first *first, const void *p, size_t n)
{
	const unsigned char *b = first->bytes, *q = p;

	return q >= b && q + n <= b + sizeof(first->bytes);
}

static void test_borrowed(void)
{
	struct arena_first first;
	struct arena a;
	unsigned char *p, *q, *big;
	size_t used = 0;

	memset(&first, 0xa5, sizeof(first));
	arena_init(&a, &first);
	CHECK((p = arena_alloc(&a, 40)), "a small allocation");
	CHECK(inside(&first, p, 40) && (uintptr_t)p % 16 == 0, "the first chunk's, aligned");
	for (size_t i = 0; i < 40; i++)
		CHECK(p[i] == 0, "arena_alloc zeroes (byte %zu is 0x%02x)", i, p[i]);
	memset(p, 0x11, 40);
	used += 48;
	/* Fill the borrowed chunk to its end, in 16-byte pieces. */
	while (used + 16 <= ARENA_FIRST_BYTES - ARENA_CHUNK_HEAD) {
		CHECK((q = arena_alloc_raw(&a, 16)) && inside(&first, q, 16), "piece at %zu", used);
		memset(q, 0x22, 16);
		used += 16;
	}
	CHECK((big = arena_alloc(&a, 1000)), "an allocation past the first chunk");
	CHECK(!inside(&first, big, 1), "it comes from malloc");
	memset(big, 0x33, 1000);
	for (size_t i = 0; i < 40; i++)
		CHECK(p[i] == 0x11, "the borrowed bytes are left as written");
	arena_free(&a);
	/* The borrowed chunk is ours again; the arena, emptied, mallocs. */
	memset(&first, 0, sizeof(first));
	CHECK((p = arena_alloc(&a, 8)) && !inside(&first, p, 8), "after arena_free: malloc's");
	arena_free(&a);
}

static void test_zeroed(void)
{
	struct arena a = { 0 };
	unsigned char *p;

	for (int i = 0; i < 100; i++) {
		CHECK((p = arena_alloc(&a, 100)) && (uintptr_t)p % 16 == 0, "allocation %d", i);
		for (int j = 0; j < 100; j++)
			CHECK(p[j] == 0, "zeroed");
		memset(p, 0x44, 100);
	}
	arena_free(&a);
	CHECK(a.head == NULL, "an arena freed is empty");
}

int main(void)
{
	test_borrowed();
	test_zeroed();
	printf("arena_first: ok\n");
	return 0;
}
