/* A thread's spare encoding buffer; see sbuf.h. */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

#include "worker/sbuf.h"

struct sbuf_spare {
	char *data;
	size_t alloc;
};

/* The spare, by a key whose destructor frees it when its thread ends (a
 * thread-local variable's would be lost then). */
static pthread_key_t spare_key;
static bool have_key;
static pthread_once_t spare_once = PTHREAD_ONCE_INIT;

static void spare_free(void *p)
{
	struct sbuf_spare *s = p;

	free(s->data);
	free(s);
}

static void spare_key_make(void)
{
	have_key = pthread_key_create(&spare_key, spare_free) == 0;
}

/* This thread's spare, made on first use; NULL without one (no key, no
 * memory): its buffers then start empty, as msgpack-c's do. */
static struct sbuf_spare *thread_spare(void)
{
	struct sbuf_spare *s;

	pthread_once(&spare_once, spare_key_make);
	if (!have_key)
		return NULL;
	if ((s = pthread_getspecific(spare_key)))
		return s;
	if (!(s = calloc(1, sizeof(*s))))
		return NULL;
	if (pthread_setspecific(spare_key, s)) {
		free(s);
		return NULL;
	}
	return s;
}

void sbuf_open(msgpack_sbuffer *sb)
{
	struct sbuf_spare *s = thread_spare();

	msgpack_sbuffer_init(sb);
	if (s && s->data) {
		sb->data = s->data;
		sb->alloc = s->alloc;
		s->data = NULL;
		s->alloc = 0;
	}
}

void sbuf_close(msgpack_sbuffer *sb)
{
	struct sbuf_spare *s = thread_spare();

	if (s && !s->data && sb->data && sb->alloc <= SBUF_KEEP) {
		s->data = sb->data;
		s->alloc = sb->alloc;
	} else {
		free(sb->data);
	}
	msgpack_sbuffer_init(sb);
}
