/*
 * The spare blocks of common/spare.h:
 *  - an empty cache gives a new block; a block put back is the next one
 *    taken, and of SPARE_SLOTS + 1 put back, SPARE_SLOTS come back and
 *    the last is freed;
 *  - two threads that take and put the same blocks at once never hold
 *    one block both: each writes its mark into the blocks it holds and
 *    finds it there still before it puts them back.
 * Under AddressSanitizer the cache holds nothing (SPARE_SLOTS 0), so that
 * a use after free is still reported: each take is a malloc, and that is
 * checked instead (its leak checker sees every block freed).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/spare.h"
#include "tests/lib/testlib.h"

#define BLOCK 160
#define ROUNDS 200000
#define HELD 3

static struct spare cache;

static void *churn(void *arg)
{
	uintptr_t mark = (uintptr_t)arg;
	void *held[HELD];

	for (int r = 0; r < ROUNDS; r++) {
		for (int i = 0; i < HELD; i++) {
			CHECK((held[i] = spare_take(&cache, BLOCK)) != NULL, "spare_take");
			memset(held[i], (int)mark, BLOCK);
		}
		for (int i = 0; i < HELD; i++) {
			const unsigned char *b = held[i];

			CHECK(b[0] == mark && b[BLOCK - 1] == mark,
			      "a block held by one thread was handed to another (round %d)", r);
			spare_put(&cache, held[i]);
		}
	}
	return NULL;
}

int main(void)
{
	void *blocks[SPARE_SLOTS + 1], *again[SPARE_SLOTS + 1];
	pthread_t th[2];
	int back = 0;

	for (int i = 0; i <= SPARE_SLOTS; i++)
		CHECK((blocks[i] = spare_take(&cache, BLOCK)) != NULL, "spare_take");
	spare_put(&cache, blocks[0]);
	again[0] = spare_take(&cache, BLOCK);
	CHECK(SPARE_SLOTS == 0 || again[0] == blocks[0], "the block put back is the next taken");
	blocks[0] = again[0];
	for (int i = 0; i <= SPARE_SLOTS; i++)
		spare_put(&cache, blocks[i]); /* the last finds every slot full: freed */
	for (int i = 0; i <= SPARE_SLOTS; i++) {
		CHECK((again[i] = spare_take(&cache, BLOCK)) != NULL, "spare_take");
		for (int j = 0; j <= SPARE_SLOTS; j++)
			back += again[i] == blocks[j] && j < SPARE_SLOTS;
	}
	CHECK(back == SPARE_SLOTS, "%d of the %d blocks the slots hold came back", back,
	      SPARE_SLOTS);
	for (int i = 0; i <= SPARE_SLOTS; i++)
		spare_put(&cache, again[i]);

	for (uintptr_t t = 0; t < 2; t++)
		CHECK(pthread_create(&th[t], NULL, churn, (void *)(t + 1)) == 0, "pthread_create");
	for (int t = 0; t < 2; t++)
		CHECK(pthread_join(th[t], NULL) == 0, "pthread_join");
	for (int i = 0; i < SPARE_SLOTS; i++) /* what the slots hold, for the leak checker */
		free(spare_take(&cache, BLOCK));
	printf("spare_slots: ok (%d slots)\n", SPARE_SLOTS);
	return 0;
}
