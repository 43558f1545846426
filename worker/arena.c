/* Bump allocator; see arena.h. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "worker/arena.h"

#define CHUNK_MIN 4096u
/* Most arenas hold one small decoded value (a call's arguments, a reply):
 * a first chunk this small comes from malloc's per-thread cache. */
#define CHUNK_FIRST (512u - sizeof(struct arena_chunk))

struct arena_chunk {
	struct arena_chunk *next;
	size_t used, size;
	bool borrowed; /* arena_init's: its owner's memory, not malloc's */
	_Alignas(16) unsigned char data[];
};

_Static_assert(sizeof(struct arena_chunk) == ARENA_CHUNK_HEAD, "arena.h's header size");

void arena_init(struct arena *a, struct arena_first *first)
{
	struct arena_chunk *c = (struct arena_chunk *)first->bytes;

	c->next = NULL;
	c->used = 0;
	c->size = sizeof(first->bytes) - sizeof(*c);
	c->borrowed = true;
	a->head = c;
}

void *arena_alloc_raw(struct arena *a, size_t n)
{
	struct arena_chunk *c = a->head;
	size_t need = (n + 15u) & ~(size_t)15u;
	void *p;

	if (need < n)
		return NULL;
	if (!c || c->size - c->used < need) {
		/* After a borrowed first chunk, a small one still: most values
		 * that outgrow it are not much larger. */
		size_t min = c && !c->borrowed ? CHUNK_MIN : CHUNK_FIRST;
		size_t size = need > min ? need : min;

		if (size > SIZE_MAX - sizeof(*c) || !(c = malloc(sizeof(*c) + size)))
			return NULL;
		c->used = 0;
		c->size = size;
		c->borrowed = false;
		c->next = a->head;
		a->head = c;
	}
	p = c->data + c->used;
	c->used += need;
	return p;
}

void *arena_alloc(struct arena *a, size_t n)
{
	void *p = arena_alloc_raw(a, n);

	if (p)
		memset(p, 0, n);
	return p;
}

void arena_free(struct arena *a)
{
	while (a->head) {
		struct arena_chunk *next = a->head->next;

		if (!a->head->borrowed)
			free(a->head);
		a->head = next;
	}
}
