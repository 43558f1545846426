/*
 * A thread's spare encoding buffer (worker/sbuf.c):
 *  - a buffer closed is the next one opened on that thread (same storage,
 *    empty), and msgpack-c writes into it as into its own;
 *  - a buffer opened while another is open starts empty, and of two
 *    closed, one is kept and the other freed (under the sanitizers a leak
 *    or a double free fails the test);
 *  - a buffer grown past SBUF_KEEP is freed, not kept;
 *  - another thread has its own spare, freed when that thread ends (the
 *    leak checker would see it otherwise).
 */
#include <msgpack.h>
#include <pthread.h>
#include <string.h>

#include "tests/lib/testlib.h"
#include "worker/sbuf.h"

static void write_bytes(msgpack_sbuffer *sb, size_t n)
{
	static char chunk[4096];

	memset(chunk, 0x5a, sizeof(chunk));
	while (n) {
		size_t k = n < sizeof(chunk) ? n : sizeof(chunk);

		CHECK(msgpack_sbuffer_write(sb, chunk, k) == 0, "msgpack_sbuffer_write");
		n -= k;
	}
}

static void *one_thread(void *arg)
{
	msgpack_sbuffer sb;
	char *kept;

	(void)arg;
	sbuf_open(&sb);
	CHECK(sb.data == NULL && sb.size == 0, "a new thread's first buffer starts empty");
	write_bytes(&sb, 100);
	kept = sb.data;
	sbuf_close(&sb);
	sbuf_open(&sb);
	CHECK(sb.data == kept && sb.size == 0, "the thread's spare comes back");
	sbuf_close(&sb);
	return NULL; /* its spare is freed with the thread */
}

int main(void)
{
	msgpack_sbuffer a, b;
	char *kept;
	pthread_t th;

	sbuf_open(&a);
	write_bytes(&a, 300);
	CHECK(a.size == 300, "written");
	kept = a.data;
	sbuf_close(&a);
	CHECK(a.data == NULL && a.size == 0 && a.alloc == 0, "a closed buffer is empty");

	sbuf_open(&a);
	CHECK(a.data == kept && a.size == 0 && a.alloc >= 300, "the spare is the next buffer");
	sbuf_open(&b);
	CHECK(b.data == NULL && b.size == 0, "one opened inside another's use starts empty");
	write_bytes(&b, 10);
	write_bytes(&a, 10);
	sbuf_close(&b); /* kept */
	sbuf_close(&a); /* freed: the spare is taken */
	sbuf_open(&a);
	CHECK(a.data != NULL && a.data != kept, "the first closed is the spare");
	write_bytes(&a, SBUF_KEEP + 1);
	sbuf_close(&a); /* too large: freed */
	sbuf_open(&a);
	CHECK(a.data == NULL, "a buffer grown past SBUF_KEEP is not kept");
	sbuf_close(&a);

	CHECK(pthread_create(&th, NULL, one_thread, NULL) == 0, "pthread_create");
	CHECK(pthread_join(th, NULL) == 0, "pthread_join");
	printf("sbuf_spare: ok\n");
	return 0;
}
