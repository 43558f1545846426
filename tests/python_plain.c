/*
 * A common call's request read in place (worker/python.c,
 * python_request_plain): a bare Python message with no RRefs and no
 * tensors, [bin, [], []].
 *  - what python_msg_value and msgpack-c write for pickles of 0, 1, 255,
 *    256, 65 535 and 65 536 bytes (bin 8, 16 and 32) is read: the pickle
 *    points into the buffer, no RRefs, no tensors, no context;
 *  - each of those cut at every length (a long one: in its first and last
 *    16 bytes), and with a byte more, is refused
 *    (under the sanitizers, a read past the end fails the test: each is
 *    read from a buffer of its exact size);
 *  - a message with an RRef or a tensor, one whose lists are not empty
 *    arrays, one whose bin is a str, another array header, and the
 *    request types that are not a bare message are refused (left to the
 *    decoder), as is a bin's length one more or one less than the bytes.
 */
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "tests/lib/testlib.h"
#include "worker/arena.h"
#include "worker/msg.h"
#include "worker/python.h"
#include "worker/tensor.h"
#include "worker/value.h"

/* Reads the n bytes of b from a buffer of exactly n bytes. */
static bool plain(uint16_t type, const void *b, size_t n, struct python_request *r,
		  unsigned char **copy)
{
	*copy = malloc(n ? n : 1);
	CHECK(*copy, "malloc");
	memcpy(*copy, b, n);
	return python_request_plain(type, *copy, n, r);
}

/* The payload python_msg_value and value_pack make for a pickle of len
 * bytes and no RRefs or tensors, into sb. */
static void payload(size_t len, msgpack_sbuffer *sb)
{
	struct python_msg m = { .data = NULL, .len = len };
	struct tensor_list sent = { 0 };
	struct arena a = { 0 };
	msgpack_packer pk;
	shmrpc_value v;
	char *data = malloc(len ? len : 1);

	CHECK(data, "malloc");
	for (size_t i = 0; i < len; i++)
		data[i] = (char)(i * 7 + 1);
	m.data = data;
	msgpack_sbuffer_init(sb);
	msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
	CHECK_OK(python_msg_value(&m, &a, &v));
	CHECK_OK(value_pack(&pk, &v, &sent));
	tensor_list_forget(&sent);
	arena_free(&a);
	free(data);
}

static void test_written(void)
{
	static const size_t sizes[] = { 0, 1, 255, 256, 65535, 65536 };

	for (size_t k = 0; k < sizeof(sizes) / sizeof(*sizes); k++) {
		size_t len = sizes[k];
		struct python_request r;
		msgpack_sbuffer sb;
		unsigned char *copy, *longer;

		payload(len, &sb);
		CHECK(plain(MSG_PYTHON_CALL, sb.data, sb.size, &r, &copy), "a %zu-byte pickle", len);
		CHECK(r.type == MSG_PYTHON_CALL && r.context_id == -1 && r.msg.len == len &&
		      r.msg.nrrefs == 0 && r.msg.ntensors == 0 && r.msg.rrefs && r.msg.tensors,
		      "a %zu-byte pickle: its request", len);
		CHECK((const unsigned char *)r.msg.data >= copy &&
		      (const unsigned char *)r.msg.data + len <= copy + sb.size,
		      "the pickle points into the buffer");
		for (size_t i = 0; i < len; i++)
			CHECK(((const unsigned char *)r.msg.data)[i] == (unsigned char)(i * 7 + 1),
			      "byte %zu of %zu", i, len);
		free(copy);
		CHECK(plain(MSG_PYTHON_REMOTE_CALL, sb.data, sb.size, &r, &copy) &&
		      r.type == MSG_PYTHON_REMOTE_CALL, "a remote call's message");
		free(copy);
		for (size_t cut = 0; cut < sb.size; cut++) {
			/* Of a long one, its header's cuts and its tail's. */
			if (cut > 16 && cut + 16 < sb.size && sb.size > 300)
				continue;
			CHECK(!plain(MSG_PYTHON_CALL, sb.data, cut, &r, &copy),
			      "a %zu-byte pickle's message cut to %zu of %zu bytes", len, cut,
			      sb.size);
			free(copy);
		}
		longer = malloc(sb.size + 1);
		CHECK(longer, "malloc");
		memcpy(longer, sb.data, sb.size);
		longer[sb.size] = 0x90;
		CHECK(!plain(MSG_PYTHON_CALL, longer, sb.size + 1, &r, &copy), "a byte after it");
		free(copy);
		free(longer);
		msgpack_sbuffer_destroy(&sb);
	}
}

#define BYTES(...) ((const unsigned char[]){ __VA_ARGS__ }), sizeof((const unsigned char[]){ __VA_ARGS__ })

static void refused(const unsigned char *b, size_t n, const char *what)
{
	struct python_request r;
	unsigned char *copy;

	CHECK(!plain(MSG_PYTHON_CALL, b, n, &r, &copy), "%s: refused", what);
	free(copy);
}

static void test_others(void)
{
	struct python_request r;
	unsigned char *copy;

	CHECK(plain(MSG_PYTHON_CALL, BYTES(0x93, 0xc4, 0x01, 0x80, 0x90, 0x90), &r, &copy) &&
	      r.msg.len == 1, "the smallest message with a pickle");
	free(copy);
	refused(BYTES(0x93, 0xc4, 0x01, 0x80, 0x91, 0xc0, 0x90), "a list of one RRef slot");
	refused(BYTES(0x93, 0xc4, 0x01, 0x80, 0x90, 0x91, 0xc0), "a list of one tensor slot");
	refused(BYTES(0x93, 0xc4, 0x01, 0x80, 0x80, 0x90), "a map where the RRefs go");
	refused(BYTES(0x93, 0xa1, 0x80, 0x90, 0x90), "a str for the pickle");
	refused(BYTES(0xdc, 0x00, 0x03, 0xc4, 0x01, 0x80, 0x90, 0x90), "an array 16 header");
	refused(BYTES(0x92, 0xc4, 0x01, 0x80, 0x90), "an array of two");
	refused(BYTES(0x93, 0xc4, 0x02, 0x80, 0x90, 0x90), "a bin one byte longer than its bytes");
	refused(BYTES(0x93, 0xc4, 0x00, 0x80, 0x90, 0x90), "a bin one byte shorter");
	refused(BYTES(0x93, 0xc5, 0xff, 0xff, 0x90, 0x90), "a bin 16 claiming 65 535 bytes");
	refused(BYTES(0x93, 0xc6, 0xff, 0xff, 0xff, 0xff, 0x90, 0x90),
		"a bin 32 claiming 4 GiB");
	/* Types whose payload is no bare message: the decoder's. */
	CHECK(!plain(MSG_FORWARD_AUTOGRAD_REQ, BYTES(0x93, 0xc4, 0x01, 0x80, 0x90, 0x90), &r, &copy),
	      "FORWARD_AUTOGRAD_REQ is no bare message");
	free(copy);
	CHECK(!plain(MSG_PYTHON_RREF_FETCH_CALL, BYTES(0x93, 0xc4, 0x01, 0x80, 0x90, 0x90), &r,
		     &copy), "PYTHON_RREF_FETCH_CALL is no bare message");
	free(copy);
}

int main(void)
{
	test_written();
	test_others();
	printf("python_plain: ok\n");
	return 0;
}
