/* shmrpc_value <-> MessagePack; see value.h. */
#include <errno.h>
#include <pthread.h>
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
 * bytes left. It decides nothing about meaning; it only makes sure that
 * msgpack-c, which allocates a container's slots before reading them, is
 * never handed a count the input cannot back.
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

static int convert(const msgpack_object *o, struct arena *a, shmrpc_value *v,
		   struct tensor_list *got)
{
	switch (o->type) {
	case MSGPACK_OBJECT_NIL:
		*v = shmrpc_nil();
		return 0;
	case MSGPACK_OBJECT_BOOLEAN:
		*v = shmrpc_bool(o->via.boolean);
		return 0;
	case MSGPACK_OBJECT_POSITIVE_INTEGER:
		if (o->via.u64 > INT64_MAX)
			return shmrpc__fail(-EBADMSG, "integer %llu does not fit in int64",
					    (unsigned long long)o->via.u64);
		*v = shmrpc_int((int64_t)o->via.u64);
		return 0;
	case MSGPACK_OBJECT_NEGATIVE_INTEGER:
		*v = shmrpc_int(o->via.i64);
		return 0;
	case MSGPACK_OBJECT_FLOAT32:
	case MSGPACK_OBJECT_FLOAT64:
		*v = shmrpc_float(o->via.f64);
		return 0;
	case MSGPACK_OBJECT_STR: {
		char *s = arena_alloc(a, (size_t)o->via.str.size + 1);

		if (!s)
			return shmrpc__fail(-ENOMEM, "out of memory decoding a string");
		/* An empty one's pointer may be NULL, which memcpy may not get. */
		if (o->via.str.size)
			memcpy(s, o->via.str.ptr, o->via.str.size);
		*v = shmrpc_strn(s, o->via.str.size);
		return 0;
	}
	case MSGPACK_OBJECT_BIN: {
		void *b = arena_alloc(a, o->via.bin.size);

		if (!b && o->via.bin.size)
			return shmrpc__fail(-ENOMEM, "out of memory decoding %u bytes", o->via.bin.size);
		if (o->via.bin.size) /* as a string's */
			memcpy(b, o->via.bin.ptr, o->via.bin.size);
		*v = shmrpc_bytes(b, o->via.bin.size);
		return 0;
	}
	case MSGPACK_OBJECT_ARRAY:
	case MSGPACK_OBJECT_MAP: {
		bool map = o->type == MSGPACK_OBJECT_MAP;
		uint32_t n = map ? o->via.map.size : o->via.array.size;
		shmrpc_value *items = arena_alloc(a, (size_t)n * (map ? 2 : 1) * sizeof(*items));

		if (!items && n)
			return shmrpc__fail(-ENOMEM, "out of memory decoding %u items", n);
		for (uint32_t i = 0; i < n; i++) {
			int rc = map ? convert(&o->via.map.ptr[i].key, a, &items[2 * i], got)
					     : convert(&o->via.array.ptr[i], a, &items[i], got);

			if (rc == 0 && map)
				rc = convert(&o->via.map.ptr[i].val, a, &items[2 * i + 1], got);
			if (rc)
				return rc;
		}
		*v = map ? shmrpc_map(items, n) : shmrpc_list(items, n);
		return 0;
	}
	case MSGPACK_OBJECT_EXT:
		if (is_tensor_ext(o->via.ext.type) && got) {
			shmrpc_tensor *t;
			int rc = o->via.ext.type == VALUE_EXT_TENSOR_INLINE
					 ? tensor_unpack_inline(o->via.ext.ptr, o->via.ext.size, &t)
					 : tensor_unpack(o->via.ext.ptr, o->via.ext.size, got->land,
							 o->via.ext.type == VALUE_EXT_TENSOR_COVERED
								 ? got->pinned : NULL, &t);

			/* A covered one must be a CPU tensor (as the sender
			 * chose it): a CUDA one's event wants its pin. */
			if (rc == 0 && o->via.ext.type == VALUE_EXT_TENSOR_COVERED && t->dev) {
				shmrpc_tensor_free(t);
				rc = shmrpc__fail(-EBADMSG, "a reply marked a CUDA tensor as its "
						  "request's (only CPU pool tensors can be)");
			}
			if (rc == 0 && (rc = tensor_list_add(got, t)))
				shmrpc_tensor_free(t);
			if (rc == 0) {
				got->ncovered += o->via.ext.type == VALUE_EXT_TENSOR_COVERED;
				*v = shmrpc_tensor_value(t);
			}
			return rc;
		}
		if (o->via.ext.type == VALUE_EXT_RREF && got) {
			shmrpc_rref *r;
			/* The operations come with the first shmrpc_init (carry.h). */
			int rc = !rref_ops.unpack
					 ? shmrpc__fail(-ENOTSUP, "an RRef came in, but no RPC agent "
							"has started in this process")
					 : rref_ops.unpack(o->via.ext.ptr, o->via.ext.size, got->take, &r);

			if (rc == 0 && (rc = tensor_list_add_rref(got, r)))
				rref_ops.free(r);
			if (rc == 0)
				*v = shmrpc_rref_value(r);
			return rc;
		}
		if (is_tensor_ext(o->via.ext.type) || o->via.ext.type == VALUE_EXT_RREF)
			return shmrpc__fail(-EBADMSG, "a %s where none can travel",
					    o->via.ext.type == VALUE_EXT_RREF ? "RRef" : "tensor");
		return shmrpc__fail(-EBADMSG, "unknown MessagePack extension type %d",
				    o->via.ext.type);
	default:
		return shmrpc__fail(-EBADMSG, "unknown MessagePack object type %d", (int)o->type);
	}
}

/* Each thread decodes into a zone of its own, kept between calls: a fresh
 * zone per value costs a malloc and a free of msgpack's 8 KiB chunk, on
 * every request and every reply. The values are copied out (convert), so
 * the zone is cleared right after. */
static pthread_key_t zone_key;
static pthread_once_t zone_once = PTHREAD_ONCE_INIT;

static void zone_free(void *z)
{
	msgpack_zone_free(z);
}

static void zone_key_make(void)
{
	pthread_key_create(&zone_key, zone_free);
}

static msgpack_zone *thread_zone(void)
{
	msgpack_zone *z;

	pthread_once(&zone_once, zone_key_make);
	z = pthread_getspecific(zone_key);
	if (!z && (z = msgpack_zone_new(MSGPACK_ZONE_CHUNK_SIZE)) &&
	    pthread_setspecific(zone_key, z)) {
		msgpack_zone_free(z);
		z = NULL;
	}
	return z;
}

int value_unpack(const void *buf, size_t len, struct arena *a, shmrpc_value *out, size_t *used,
		 struct tensor_list *got)
{
	msgpack_zone *zone = thread_zone();
	msgpack_object obj;
	size_t off = 0;
	int rc;

	if (check(buf, len, &off, 0))
		return shmrpc__fail(-EBADMSG, "malformed value: %zu bytes that are not MessagePack "
				    "or whose lengths run past the end", len);
	*used = off;
	off = 0;
	if (!zone)
		return shmrpc__fail(-ENOMEM, "out of memory decoding a value");
	if (msgpack_unpack(buf, *used, &off, zone, &obj) != MSGPACK_UNPACK_SUCCESS)
		rc = shmrpc__fail(-EBADMSG, "malformed value (%zu bytes)", *used);
	else
		rc = convert(&obj, a, out, got);
	msgpack_zone_clear(zone);
	return rc;
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
