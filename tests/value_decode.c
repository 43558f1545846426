/*
 * The value decoder (worker/value.c), which reads MessagePack itself:
 *  - every form of every type, in each width the format has (positive and
 *    negative fixints, uint/int 8..64 with their signs, float 32 and 64,
 *    str fix/8/16/32, bin 8/16/32, array and map fix/16/32, nil, bools),
 *    from hand-written bytes, and an unsigned integer past int64 refused;
 *  - values nested 64 levels (the encoder's limit) come back whole, and a
 *    message nested deeper is refused with a sentence (msgpack-c's decoder
 *    refused anything past 32 levels that the encoder had sent);
 *  - a valid message cut at every length, and one whose counts claim more
 *    than its bytes, fail with "malformed value" without reading past the
 *    end (under the sanitizers, an over-read fails the test);
 *  - tensors and RRefs where none can travel, and unknown extension
 *    types, fail with a sentence naming them;
 *  - what msgpack-c encodes (value_pack) decodes to the same value.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "shmrpc.h"
#include "tests/lib/testlib.h"
#include "worker/arena.h"
#include "worker/value.h"

/* Decodes the n bytes of b (copied to a buffer of exactly n bytes, so a
 * read past them is an over-read the sanitizers see) into *v; the
 * decoder's return code; *used set on success. */
static int decode(const void *b, size_t n, struct arena *a, shmrpc_value *v, size_t *used)
{
	unsigned char *copy = malloc(n ? n : 1);
	int rc;

	CHECK(copy, "malloc");
	memcpy(copy, b, n);
	rc = value_unpack(copy, n, a, v, used, NULL);
	/* Strings and bytes must be the arena's own copies: the buffer goes. */
	memset(copy, 0xee, n);
	free(copy);
	return rc;
}

#define BYTES(...) ((const unsigned char[]){ __VA_ARGS__ }), sizeof((const unsigned char[]){ __VA_ARGS__ })

static void expect_int(const unsigned char *b, size_t n, int64_t want)
{
	struct arena a = { 0 };
	shmrpc_value v;
	size_t used;

	CHECK_OK(decode(b, n, &a, &v, &used));
	CHECK(used == n && v.type == SHMRPC_INT && v.u.i == want,
	      "0x%02x...: used %zu of %zu, type %u, %lld, want %lld", b[0], used, n, v.type,
	      (long long)v.u.i, (long long)want);
	arena_free(&a);
}

static void expect_fail(const unsigned char *b, size_t n, const char *text)
{
	struct arena a = { 0 };
	shmrpc_value v;
	size_t used;
	int rc = decode(b, n, &a, &v, &used);

	CHECK(rc == -EBADMSG, "0x%02x... (%zu bytes) decoded (rc %d), want \"%s\"", n ? b[0] : 0,
	      n, rc, text);
	CHECK(strstr(shmrpc_errmsg(), text), "0x%02x...: \"%s\", want \"%s\"", n ? b[0] : 0,
	      shmrpc_errmsg(), text);
	arena_free(&a);
}

static void test_integers(void)
{
	expect_int(BYTES(0x00), 0);
	expect_int(BYTES(0x7f), 127);
	expect_int(BYTES(0xe0), -32);
	expect_int(BYTES(0xff), -1);
	expect_int(BYTES(0xcc, 0xff), 255);
	expect_int(BYTES(0xcd, 0xff, 0xfe), 65534);
	expect_int(BYTES(0xce, 0xff, 0xff, 0xff, 0xff), 4294967295ll);
	expect_int(BYTES(0xcf, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff), INT64_MAX);
	expect_int(BYTES(0xd0, 0x80), -128);
	expect_int(BYTES(0xd0, 0x7f), 127);
	expect_int(BYTES(0xd1, 0x80, 0x00), -32768);
	expect_int(BYTES(0xd1, 0x12, 0x34), 0x1234);
	expect_int(BYTES(0xd2, 0x80, 0x00, 0x00, 0x00), INT32_MIN);
	expect_int(BYTES(0xd2, 0xff, 0xff, 0xff, 0xfe), -2);
	expect_int(BYTES(0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0), INT64_MIN);
	expect_int(BYTES(0xd3, 0, 0, 0, 1, 0, 0, 0, 0), 1ll << 32);
	expect_fail(BYTES(0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0), "integer 9223372036854775808 does not fit");
}

static void test_scalars(void)
{
	static const unsigned char f32[] = { 0xca, 0x3f, 0xc0, 0x00, 0x00 }; /* 1.5f */
	static const unsigned char f64[] = { 0xcb, 0xc0, 0x09, 0x21, 0xfb, 0x54, 0x44, 0x2d, 0x18 };
	static const unsigned char forms[] = { 0xc0, 0xc2, 0xc3 };
	struct arena a = { 0 };
	shmrpc_value v;
	size_t used;

	CHECK_OK(decode(f32, sizeof(f32), &a, &v, &used));
	CHECK(v.type == SHMRPC_FLOAT && v.u.f == 1.5 && used == 5, "float32: %u %g", v.type, v.u.f);
	CHECK_OK(decode(f64, sizeof(f64), &a, &v, &used));
	CHECK(v.type == SHMRPC_FLOAT && v.u.f == -3.141592653589793, "float64: %.17g", v.u.f);
	CHECK_OK(decode(&forms[0], 1, &a, &v, &used));
	CHECK(v.type == SHMRPC_NIL, "nil: %u", v.type);
	CHECK_OK(decode(&forms[1], 1, &a, &v, &used));
	CHECK(v.type == SHMRPC_BOOL && !v.u.b, "false");
	CHECK_OK(decode(&forms[2], 1, &a, &v, &used));
	CHECK(v.type == SHMRPC_BOOL && v.u.b, "true");
	arena_free(&a);
}

/* A string or bytes of n bytes with header h[hn], decoded. */
static void expect_body(const unsigned char *h, size_t hn, uint32_t n, uint32_t type)
{
	unsigned char *b = malloc(hn + n);
	struct arena a = { 0 };
	shmrpc_value v;
	size_t used;

	CHECK(b, "malloc");
	memcpy(b, h, hn);
	for (uint32_t i = 0; i < n; i++)
		b[hn + i] = (unsigned char)('a' + i % 26);
	CHECK_OK(decode(b, hn + n, &a, &v, &used));
	CHECK(v.type == type && v.len == n && used == hn + n, "0x%02x: type %u len %u", h[0],
	      v.type, v.len);
	for (uint32_t i = 0; i < n; i++)
		CHECK(((const unsigned char *)v.u.p)[i] == 'a' + i % 26, "0x%02x: byte %u", h[0], i);
	if (type == SHMRPC_STR)
		CHECK(v.u.s[n] == '\0', "0x%02x: a string ends with a NUL", h[0]);
	arena_free(&a);
	free(b);
}

static void test_bodies(void)
{
	expect_body(BYTES(0xa0), 0, SHMRPC_STR);
	expect_body(BYTES(0xbf), 31, SHMRPC_STR);
	expect_body(BYTES(0xd9, 200), 200, SHMRPC_STR);
	expect_body(BYTES(0xda, 0x01, 0x00), 256, SHMRPC_STR);
	expect_body(BYTES(0xdb, 0x00, 0x01, 0x00, 0x01), 65537, SHMRPC_STR);
	expect_body(BYTES(0xc4, 0), 0, SHMRPC_BYTES);
	expect_body(BYTES(0xc4, 3), 3, SHMRPC_BYTES);
	expect_body(BYTES(0xc5, 0x01, 0x00), 256, SHMRPC_BYTES);
	expect_body(BYTES(0xc6, 0x00, 0x01, 0x00, 0x01), 65537, SHMRPC_BYTES);
}

static void test_containers(void)
{
	/* [1, {"k": nil}, [], {}] in fix forms, then the same in 16- and
	 * 32-bit forms. */
	static const unsigned char fix[] = { 0x94, 0x01, 0x81, 0xa1, 'k', 0xc0, 0x90, 0x80 };
	static const unsigned char wide[] = { 0xdd, 0, 0, 0, 4, 0x01, 0xde, 0, 1, 0xa1, 'k', 0xc0,
					      0xdc, 0, 0, 0xdf, 0, 0, 0, 0 };
	const unsigned char *forms[] = { fix, wide };
	size_t sizes[] = { sizeof(fix), sizeof(wide) };

	for (int i = 0; i < 2; i++) {
		struct arena a = { 0 };
		shmrpc_value v;
		size_t used;

		CHECK_OK(decode(forms[i], sizes[i], &a, &v, &used));
		CHECK(used == sizes[i] && v.type == SHMRPC_LIST && v.len == 4, "form %d: %u/%u", i,
		      v.type, v.len);
		CHECK(v.u.items[0].type == SHMRPC_INT && v.u.items[0].u.i == 1, "form %d: [0]", i);
		CHECK(v.u.items[1].type == SHMRPC_MAP && v.u.items[1].len == 1 &&
		      v.u.items[1].u.items[0].type == SHMRPC_STR &&
		      !strcmp(v.u.items[1].u.items[0].u.s, "k") &&
		      v.u.items[1].u.items[1].type == SHMRPC_NIL, "form %d: [1]", i);
		CHECK(v.u.items[2].type == SHMRPC_LIST && v.u.items[2].len == 0, "form %d: [2]", i);
		CHECK(v.u.items[3].type == SHMRPC_MAP && v.u.items[3].len == 0, "form %d: [3]", i);
		arena_free(&a);
	}
	/* Every byte begins a value ([[[]], {}, nil]): as many values as
	 * bytes is what a message can hold, and is taken. */
	{
		static const unsigned char dense[] = { 0x93, 0x91, 0x90, 0x80, 0xc0 };
		struct arena a = { 0 };
		shmrpc_value v;
		size_t used;

		CHECK_OK(decode(dense, sizeof(dense), &a, &v, &used));
		CHECK(used == sizeof(dense) && v.type == SHMRPC_LIST && v.len == 3 &&
		      v.u.items[0].type == SHMRPC_LIST && v.u.items[0].len == 1 &&
		      v.u.items[2].type == SHMRPC_NIL, "dense: %u/%u", v.type, v.len);
		arena_free(&a);
	}
	/* Counts the bytes cannot back: refused before anything is made. */
	expect_fail(BYTES(0xdd, 0xff, 0xff, 0xff, 0xff, 0x01), "malformed value");
	expect_fail(BYTES(0xdf, 0x10, 0x00, 0x00, 0x00, 0x01, 0x01), "malformed value");
	expect_fail(BYTES(0xdb, 0xff, 0xff, 0xff, 0xff, 'a'), "malformed value");
	expect_fail(BYTES(0xc1), "malformed value");
}

/* A list nested depth levels around an int, packed as the agent packs. */
static int pack_nested(int depth, msgpack_sbuffer *sb)
{
	shmrpc_value *levels = calloc((size_t)depth + 1, sizeof(*levels));
	msgpack_packer pk;
	int rc;

	CHECK(levels, "calloc");
	levels[depth] = shmrpc_int(42);
	for (int i = depth - 1; i >= 0; i--)
		levels[i] = shmrpc_list(&levels[i + 1], 1);
	msgpack_sbuffer_init(sb);
	msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
	rc = value_pack(&pk, &levels[0], NULL);
	free(levels);
	return rc;
}

static void test_depth(void)
{
	for (int depth = 30; depth <= VALUE_MAX_DEPTH; depth++) {
		msgpack_sbuffer sb;
		struct arena a = { 0 };
		shmrpc_value v;
		size_t used;
		int level = 0;

		CHECK_OK(pack_nested(depth, &sb));
		CHECK_OK(decode(sb.data, sb.size, &a, &v, &used));
		for (; v.type == SHMRPC_LIST; level++) {
			CHECK(v.len == 1, "depth %d: level %d has %u items", depth, level, v.len);
			v = v.u.items[0];
		}
		CHECK(level == depth && v.type == SHMRPC_INT && v.u.i == 42,
		      "depth %d: %d levels, then type %u", depth, level, v.type);
		arena_free(&a);
		msgpack_sbuffer_destroy(&sb);
	}
	{
		msgpack_sbuffer sb;
		unsigned char *deep;
		int n = VALUE_MAX_DEPTH + 2;

		CHECK(pack_nested(VALUE_MAX_DEPTH + 1, &sb) == -EINVAL &&
		      strstr(shmrpc_errmsg(), "nests deeper than 64"), "packed too deep: %s",
		      shmrpc_errmsg());
		msgpack_sbuffer_destroy(&sb);
		/* The same written by hand: 65 one-item lists around a nil. */
		CHECK((deep = malloc((size_t)n)), "malloc");
		memset(deep, 0x91, (size_t)n - 1);
		deep[n - 1] = 0xc0;
		expect_fail(deep, (size_t)n, "malformed value");
		free(deep);
	}
}

/* Every prefix of a valid message is refused; the whole is taken. */
static void test_truncations(void)
{
	shmrpc_value items[6], inner[2];
	msgpack_sbuffer sb;
	msgpack_packer pk;
	static const char blob[300] = { 1, 2, 3 };

	inner[0] = shmrpc_str("key");
	inner[1] = shmrpc_float(2.5);
	items[0] = shmrpc_int(-70000);
	items[1] = shmrpc_str("a string of some length, past a fixstr's thirty-one bytes");
	items[2] = shmrpc_bytes(blob, sizeof(blob));
	items[3] = shmrpc_map(inner, 1);
	items[4] = shmrpc_bool(true);
	items[5] = shmrpc_int(1ll << 40);
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	CHECK_OK(value_pack(&pk, &(shmrpc_value){ SHMRPC_LIST, 6, { .items = items } }, NULL));
	for (size_t n = 0; n < sb.size; n++)
		expect_fail((const unsigned char *)sb.data, n, "malformed value");
	{
		struct arena a = { 0 };
		shmrpc_value v;
		size_t used;

		CHECK_OK(decode(sb.data, sb.size, &a, &v, &used));
		CHECK(used == sb.size && v.type == SHMRPC_LIST && v.len == 6, "whole: %u/%u",
		      v.type, v.len);
		CHECK(v.u.items[0].u.i == -70000 && !strcmp(v.u.items[1].u.s, items[1].u.s) &&
		      v.u.items[2].len == sizeof(blob) && !memcmp(v.u.items[2].u.p, blob, sizeof(blob)) &&
		      !strcmp(v.u.items[3].u.items[0].u.s, "key") &&
		      v.u.items[3].u.items[1].u.f == 2.5 && v.u.items[4].u.b &&
		      v.u.items[5].u.i == 1ll << 40, "whole: the values differ");
		arena_free(&a);
	}
	/* Bytes after the value are not its own: used says where it ends. */
	{
		unsigned char *more = malloc(sb.size + 3);
		struct arena a = { 0 };
		shmrpc_value v;
		size_t used;

		CHECK(more, "malloc");
		memcpy(more, sb.data, sb.size);
		memset(more + sb.size, 0xc0, 3);
		CHECK_OK(decode(more, sb.size + 3, &a, &v, &used));
		CHECK(used == sb.size, "used %zu of a %zu-byte value", used, sb.size);
		arena_free(&a);
		free(more);
	}
	msgpack_sbuffer_destroy(&sb);
}

static void test_extensions(void)
{
	expect_fail(BYTES(0xd4, VALUE_EXT_TENSOR, 0), "a tensor where none can travel");
	expect_fail(BYTES(0xd5, VALUE_EXT_TENSOR_INLINE, 0, 0), "a tensor where none can travel");
	expect_fail(BYTES(0xc7, 1, VALUE_EXT_TENSOR_COVERED, 0), "a tensor where none can travel");
	expect_fail(BYTES(0xd6, VALUE_EXT_RREF, 0, 0, 0, 0), "an RRef where none can travel");
	expect_fail(BYTES(0xc8, 0, 2, 0x7f, 1, 2), "unknown MessagePack extension type 127");
	expect_fail(BYTES(0xd8, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
		    "unknown MessagePack extension type -1");
	/* An extension whose body runs past the end. */
	expect_fail(BYTES(0xc9, 0, 0, 0, 9, 5, 0), "malformed value");
	expect_fail(BYTES(0xd7, 5, 0, 0), "malformed value");
}

int main(void)
{
	test_integers();
	test_scalars();
	test_bodies();
	test_containers();
	test_depth();
	test_truncations();
	test_extensions();
	printf("value_decode: ok\n");
	return 0;
}
