/* shmrpc_value <-> MessagePack; see value.h. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "worker/carry.h"
#include "worker/tensor.h"
#include "worker/value.h"

const char *shmrpc_type_name(uint32_t type)
{
	static const char *const names[] = { "nil", "bool", "int", "float", "str",
					     "bytes", "list", "map", "tensor", "rref" };

	return type < sizeof(names) / sizeof(names[0]) ? names[type] : "unknown";
}

static int pack(msgpack_packer *pk, const shmrpc_value *v, int depth, struct tensor_list *sent)
{
	if (depth > VALUE_MAX_DEPTH)
		return shmrpc__fail(-EINVAL, "a value nests deeper than %d levels", VALUE_MAX_DEPTH);
	switch (v->type) {
	case SHMRPC_NIL:
		return msgpack_pack_nil(pk);
	case SHMRPC_BOOL:
		return v->u.b ? msgpack_pack_true(pk) : msgpack_pack_false(pk);
	case SHMRPC_INT:
		return msgpack_pack_int64(pk, v->u.i);
	case SHMRPC_FLOAT:
		return msgpack_pack_double(pk, v->u.f);
	case SHMRPC_STR:
		return msgpack_pack_str_with_body(pk, v->u.s, v->len);
	case SHMRPC_BYTES:
		return msgpack_pack_bin_with_body(pk, v->u.p, v->len);
	case SHMRPC_LIST:
	case SHMRPC_MAP: {
		uint32_t n = v->type == SHMRPC_MAP ? 2 * v->len : v->len;
		int rc = v->type == SHMRPC_MAP ? msgpack_pack_map(pk, v->len)
					       : msgpack_pack_array(pk, v->len);

		for (uint32_t i = 0; i < n && rc == 0; i++)
			rc = pack(pk, &v->u.items[i], depth + 1, sent);
		return rc;
	}
	case SHMRPC_TENSOR:
		if (!sent)
			return shmrpc__fail(-EINVAL, "a tensor cannot travel in this message");
		if (!v->u.t)
			return shmrpc__fail(-EINVAL, "a tensor value without a tensor");
		return tensor_pack(pk, v->u.t, sent);
	case SHMRPC_RREF:
		if (!sent)
			return shmrpc__fail(-EINVAL, "an RRef cannot travel in this message");
		if (!v->u.r)
			return shmrpc__fail(-EINVAL, "an RRef value without an RRef");
		return rref_ops.pack(pk, v->u.r) ?: tensor_list_add_rref(sent, v->u.r);
	default:
		return shmrpc__fail(-EINVAL, "a value of unknown type %u cannot be sent", v->type);
	}
}

int value_pack(msgpack_packer *pk, const shmrpc_value *v, struct tensor_list *sent)
{
	int rc = pack(pk, v, 0, sent);

	/* msgpack-c reports a failed buffer write as -1. */
	return rc == -1 ? shmrpc__fail(-ENOMEM, "out of memory encoding a value") : rc;
}

static uint64_t be(const uint8_t *p, int n)
{
	uint64_t v = 0;

	for (int i = 0; i < n; i++)
		v = v << 8 | p[i];
	return v;
}

/*
 * Walks one MessagePack object at *off, checking every length against the
 * bytes left. It decides nothing about meaning; it makes sure that the
 * decoder, which allocates a container's slots before reading them, is
 * never handed a count the input cannot back, and that a value malformed
 * anywhere is refused before any of it is made (a tensor's handle taken).
 */
static int check(const uint8_t *p, size_t len, size_t *off, int depth)
{
	uint8_t t;
	uint64_t n = 0, body = 0;
	int count_bytes = 0;
	bool container = false, map = false;

	if (depth > VALUE_MAX_DEPTH || *off >= len)
		return -1;
	t = p[(*off)++];
	if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3)
		return 0;
	if ((t & 0xf0) == 0x80 || (t & 0xf0) == 0x90) {
		container = true;
		map = (t & 0xf0) == 0x80;
		n = t & 0x0f;
	} else if ((t & 0xe0) == 0xa0) {
		body = t & 0x1f;
	} else {
		switch (t) {
		case 0xc4: case 0xd9: count_bytes = 1; break;
		case 0xc5: case 0xda: count_bytes = 2; break;
		case 0xc6: case 0xdb: count_bytes = 4; break;
		case 0xc7: count_bytes = 1; body = 1; break; /* + ext type byte */
		case 0xc8: count_bytes = 2; body = 1; break;
		case 0xc9: count_bytes = 4; body = 1; break;
		case 0xcc: case 0xd0: body = 1; break;
		case 0xcd: case 0xd1: body = 2; break;
		case 0xca: case 0xce: case 0xd2: body = 4; break;
		case 0xcb: case 0xcf: case 0xd3: body = 8; break;
		case 0xd4: body = 2; break;
		case 0xd5: body = 3; break;
		case 0xd6: body = 5; break;
		case 0xd7: body = 9; break;
		case 0xd8: body = 17; break;
		case 0xdc: case 0xde: container = true; count_bytes = 2; map = t == 0xde; break;
		case 0xdd: case 0xdf: container = true; count_bytes = 4; map = t == 0xdf; break;
		default: return -1; /* 0xc1: never used */
		}
		if (count_bytes) {
			if (len - *off < (size_t)count_bytes)
				return -1;
			n = be(p + *off, count_bytes);
			*off += (size_t)count_bytes;
			if (!container)
				body += n;
		}
	}
	if (!container)
		return body > len - *off ? -1 : (*off += body, 0);
	if (map)
		n *= 2;
	/* Each element takes at least one byte. */
	if (n > len - *off)
		return -1;
	for (uint64_t i = 0; i < n; i++)
		if (check(p, len, off, depth + 1))
			return -1;
	return 0;
}

static bool is_tensor_ext(int8_t type)
{
	return type == VALUE_EXT_TENSOR || type == VALUE_EXT_TENSOR_INLINE ||
	       type == VALUE_EXT_TENSOR_COVERED;
}

/* An extension's value: a tensor or an RRef where got takes them. */
static int decode_ext(int8_t type, const char *body, uint32_t size, shmrpc_value *v,
		      struct tensor_list *got)
{
	if (is_tensor_ext(type) && got) {
		shmrpc_tensor *t;
		int rc = type == VALUE_EXT_TENSOR_INLINE
				 ? tensor_unpack_inline(body, size, &t)
				 : tensor_unpack(body, size, got->land,
						 type == VALUE_EXT_TENSOR_COVERED ? got->pinned : NULL, &t);

		/* A covered one must be a CPU tensor (as the sender chose
		 * it): a CUDA one's event wants its pin. */
		if (rc == 0 && type == VALUE_EXT_TENSOR_COVERED && t->dev) {
			shmrpc_tensor_free(t);
			rc = shmrpc__fail(-EBADMSG, "a reply marked a CUDA tensor as its request's "
					  "(only CPU pool tensors can be)");
		}
		if (rc == 0 && (rc = tensor_list_add(got, t)))
			shmrpc_tensor_free(t);
		if (rc == 0) {
			got->ncovered += type == VALUE_EXT_TENSOR_COVERED;
			*v = shmrpc_tensor_value(t);
		}
		return rc;
	}
	if (type == VALUE_EXT_RREF && got) {
		shmrpc_rref *r;
		/* The operations come with the first shmrpc_init (carry.h). */
		int rc = !rref_ops.unpack ? shmrpc__fail(-ENOTSUP, "an RRef came in, but no RPC "
							 "agent has started in this process")
					  : rref_ops.unpack(body, size, got->take, &r);

		if (rc == 0 && (rc = tensor_list_add_rref(got, r)))
			rref_ops.free(r);
		if (rc == 0)
			*v = shmrpc_rref_value(r);
		return rc;
	}
	if (is_tensor_ext(type) || type == VALUE_EXT_RREF)
		return shmrpc__fail(-EBADMSG, "%s where none can travel",
				    type == VALUE_EXT_RREF ? "an RRef" : "a tensor");
	return shmrpc__fail(-EBADMSG, "unknown MessagePack extension type %d", type);
}

/* Where decode reads: [p, p+len), at off. */
struct reader {
	const uint8_t *p;
	size_t len, off;
	/* The values made room for so far, the outermost included: each
	 * begins at a byte of its own, so a message check() walked has no
	 * more than len of them. */
	size_t slots;
	struct arena *a;
	struct tensor_list *got;
};

/* The bytes changed under us since check() walked them (a writer still
 * at work on shared memory): decode never reads past len either way. */
static int torn(const struct reader *r)
{
	return shmrpc__fail(-EBADMSG, "malformed value: its %zu bytes changed while it was "
			    "decoded", r->len);
}

/* n big-endian bytes at the reader, or false when fewer are left. */
static bool take_be(struct reader *r, int n, uint64_t *out)
{
	if (r->len - r->off < (size_t)n)
		return false;
	*out = be(r->p + r->off, n);
	r->off += (size_t)n;
	return true;
}

/* size bytes at the reader, copied into the arena with a NUL after them
 * (a string's terminator, harmless after bytes). */
static int copy_body(struct reader *r, uint64_t size, const char *what, void **out)
{
	char *s;

	if (size > r->len - r->off)
		return torn(r);
	if (!(s = arena_alloc_raw(r->a, (size_t)size + 1)))
		return shmrpc__fail(-ENOMEM, "out of memory decoding %s of %llu bytes", what,
				    (unsigned long long)size);
	memcpy(s, r->p + r->off, (size_t)size);
	s[size] = '\0';
	r->off += (size_t)size;
	*out = s;
	return 0;
}

static int decode(struct reader *r, shmrpc_value *v, int depth);

/* n items (2n for a map) of a container into v. */
static int decode_items(struct reader *r, uint64_t n, bool map, shmrpc_value *v, int depth)
{
	uint64_t slots = map ? 2 * n : n;
	shmrpc_value *items;

	/* Each item takes at least one byte. The bytes left bound one
	 * container, not all: bytes changed since check() could have each of
	 * 64 nested containers claim them all again, so all the slots of the
	 * value together are held to len as well. */
	if (slots > r->len - r->off || slots > r->len - r->slots)
		return torn(r);
	r->slots += (size_t)slots;
	/* Not zeroed: each slot is decoded before v holds them, and a
	 * failed value is never read. */
	items = arena_alloc_raw(r->a, (size_t)slots * sizeof(*items));
	if (!items && slots)
		return shmrpc__fail(-ENOMEM, "out of memory decoding %llu items",
				    (unsigned long long)n);
	for (uint64_t i = 0; i < slots; i++) {
		int rc = decode(r, &items[i], depth + 1);

		if (rc)
			return rc;
	}
	*v = map ? shmrpc_map(items, (uint32_t)n) : shmrpc_list(items, (uint32_t)n);
	return 0;
}

/*
 * One MessagePack object at the reader into v, as msgpack-c reads it: a
 * float32 widened, an integer of any width that fits int64, strings and
 * bytes copied into the arena, extensions by decode_ext. check() has
 * walked the same bytes; every length is still checked against them.
 */
static int decode(struct reader *r, shmrpc_value *v, int depth)
{
	uint64_t n;
	uint8_t t;
	void *body;
	int rc, width;

	if (depth > VALUE_MAX_DEPTH || r->off >= r->len)
		return torn(r);
	t = r->p[r->off++];
	if (t <= 0x7f || t >= 0xe0) {
		*v = shmrpc_int((int8_t)t);
		return 0;
	}
	switch (t & 0xf0) {
	case 0x80:
		return decode_items(r, t & 0x0f, true, v, depth);
	case 0x90:
		return decode_items(r, t & 0x0f, false, v, depth);
	case 0xa0:
	case 0xb0:
		n = t & 0x1f;
		goto str;
	}
	switch (t) {
	case 0xc0:
		*v = shmrpc_nil();
		return 0;
	case 0xc2:
	case 0xc3:
		*v = shmrpc_bool(t == 0xc3);
		return 0;
	case 0xc4: case 0xc5: case 0xc6: /* bin 8, 16, 32 */
		if (!take_be(r, 1 << (t - 0xc4), &n))
			return torn(r);
		if ((rc = copy_body(r, n, "bytes", &body)))
			return rc;
		*v = shmrpc_bytes(body, (uint32_t)n);
		return 0;
	case 0xc7: case 0xc8: case 0xc9: /* ext 8, 16, 32: size, type, body */
		if (!take_be(r, 1 << (t - 0xc7), &n))
			return torn(r);
		goto ext;
	case 0xca: { /* float 32 */
		uint32_t bits;
		float f;

		if (!take_be(r, 4, &n))
			return torn(r);
		bits = (uint32_t)n;
		memcpy(&f, &bits, sizeof(f));
		*v = shmrpc_float(f);
		return 0;
	}
	case 0xcb: { /* float 64 */
		double d;

		if (!take_be(r, 8, &n))
			return torn(r);
		memcpy(&d, &n, sizeof(d));
		*v = shmrpc_float(d);
		return 0;
	}
	case 0xcc: case 0xcd: case 0xce: case 0xcf: /* uint 8, 16, 32, 64 */
		if (!take_be(r, 1 << (t - 0xcc), &n))
			return torn(r);
		if (n > INT64_MAX)
			return shmrpc__fail(-EBADMSG, "integer %llu does not fit in int64",
					    (unsigned long long)n);
		*v = shmrpc_int((int64_t)n);
		return 0;
	case 0xd0: case 0xd1: case 0xd2: case 0xd3: /* int 8, 16, 32, 64 */
		width = 1 << (t - 0xd0);
		if (!take_be(r, width, &n))
			return torn(r);
		/* Sign-extended from its width. */
		*v = shmrpc_int(width == 8 ? (int64_t)n
					   : (int64_t)(n << (64 - 8 * width)) >> (64 - 8 * width));
		return 0;
	case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: /* fixext 1..16 */
		n = 1u << (t - 0xd4);
		goto ext;
	case 0xd9: case 0xda: case 0xdb: /* str 8, 16, 32 */
		if (!take_be(r, 1 << (t - 0xd9), &n))
			return torn(r);
		goto str;
	case 0xdc: case 0xdd: /* array 16, 32 */
		if (!take_be(r, t == 0xdc ? 2 : 4, &n))
			return torn(r);
		return decode_items(r, n, false, v, depth);
	case 0xde: case 0xdf: /* map 16, 32 */
		if (!take_be(r, t == 0xde ? 2 : 4, &n))
			return torn(r);
		return decode_items(r, n, true, v, depth);
	default: /* 0xc1: never used */
		return torn(r);
	}
str:
	if ((rc = copy_body(r, n, "a string", &body)))
		return rc;
	*v = shmrpc_strn(body, (uint32_t)n);
	return 0;
ext:
	/* The type byte, then n bytes (whose size fits uint32: at most 32 bits). */
	if (r->len - r->off < 1 || n > r->len - r->off - 1)
		return torn(r);
	r->off += 1 + (size_t)n;
	return decode_ext((int8_t)r->p[r->off - n - 1], (const char *)r->p + r->off - n,
			  (uint32_t)n, v, r->got);
}

int value_unpack(const void *buf, size_t len, struct arena *a, shmrpc_value *out, size_t *used,
		 struct tensor_list *got)
{
	struct reader r = { .p = buf, .len = len, .slots = 1, .a = a, .got = got };
	size_t off = 0;

	if (check(buf, len, &off, 0))
		return shmrpc__fail(-EBADMSG, "malformed value: %zu bytes that are not MessagePack "
				    "or whose lengths run past the end", len);
	*used = off;
	r.len = off;
	return decode(&r, out, 0);
}

static bool sig_accepts(char want, const shmrpc_value *v)
{
	switch (want) {
	case 'v': return true;
	case 'n': return v->type == SHMRPC_NIL;
	case 'b': return v->type == SHMRPC_BOOL;
	case 'i': return v->type == SHMRPC_INT;
	case 'f': return v->type == SHMRPC_FLOAT || v->type == SHMRPC_INT;
	case 's': return v->type == SHMRPC_STR;
	case 'y': return v->type == SHMRPC_BYTES;
	case 'l': return v->type == SHMRPC_LIST;
	case 'm': return v->type == SHMRPC_MAP;
	case 't': return v->type == SHMRPC_TENSOR;
	case 'r': return v->type == SHMRPC_RREF;
	default: return false;
	}
}

static const char *sig_name(char want)
{
	static const char letters[] = "nbifsylmtrv";
	static const char *const names[] = { "nil", "bool", "int", "float", "str",
					     "bytes", "list", "map", "tensor", "rref", "any" };
	const char *at = strchr(letters, want);

	return at && want ? names[at - letters] : "?";
}

int value_check_sig(const char *fn, const char *sig, const shmrpc_value *args, uint32_t nargs)
{
	size_t want;

	if (!sig)
		return 0;
	want = strlen(sig);
	if (want != nargs)
		return shmrpc__fail(-EINVAL, "%s() takes %zu argument%s but %u %s given", fn, want,
				    want == 1 ? "" : "s", nargs, nargs == 1 ? "was" : "were");
	for (uint32_t i = 0; i < nargs; i++)
		if (!sig_accepts(sig[i], &args[i]))
			return shmrpc__fail(-EINVAL, "%s(): argument %u must be %s, not %s", fn, i + 1,
					    sig_name(sig[i]), shmrpc_type_name(args[i].type));
	return 0;
}
