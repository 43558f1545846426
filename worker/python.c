/* Python messages on the wire; see python.h. */
#include <errno.h>
#include <msgpack.h>

#include "common/error.h"
#include "worker/client.h"
#include "worker/link.h"
#include "worker/msg.h"
#include "worker/python.h"
#include "worker/python_api.h"
#include "worker/sbuf.h"
#include "worker/value.h"

static _Atomic(python_handler_fn) handler;

void python_set_handler(python_handler_fn fn)
{
	/* Release: the binding's state before the handler is seen; pairs
	 * with the acquire in python_handler(). */
	atomic_store_explicit(&handler, fn, memory_order_release);
}

python_handler_fn python_handler(void)
{
	return atomic_load_explicit(&handler, memory_order_acquire);
}

int python_msg_value(const struct python_msg *m, struct arena *a, shmrpc_value *out)
{
	/* An empty list has no items to point at (value_pack reads none). */
	shmrpc_value *items = arena_alloc_raw(a, 3 * sizeof(*items));
	shmrpc_value *refs = m->nrrefs ? arena_alloc_raw(a, m->nrrefs * sizeof(*refs)) : NULL;
	shmrpc_value *tens = m->ntensors ? arena_alloc_raw(a, m->ntensors * sizeof(*tens)) : NULL;

	if (!items || (m->nrrefs && !refs) || (m->ntensors && !tens))
		return shmrpc__fail(-ENOMEM, "out of memory encoding a Python message");
	if (m->len > UINT32_MAX)
		return shmrpc__fail(-EMSGSIZE, "a pickle of %zu bytes is too large", m->len);
	for (uint32_t i = 0; i < m->nrrefs; i++)
		refs[i] = shmrpc_rref_value(m->rrefs[i]);
	for (uint32_t i = 0; i < m->ntensors; i++)
		tens[i] = shmrpc_tensor_value(m->tensors[i]);
	items[0] = shmrpc_bytes(m->data, (uint32_t)m->len);
	items[1] = shmrpc_list(refs, m->nrrefs);
	items[2] = shmrpc_list(tens, m->ntensors);
	*out = shmrpc_list(items, 3);
	return 0;
}

/* What a message with no RRefs or no tensors points at: never written (a
 * list of none), not NULL (memcpy's arguments). */
static shmrpc_rref *no_rrefs[1];
static shmrpc_tensor *no_tensors[1];

int python_msg_of(const shmrpc_value *v, struct arena *a, struct python_msg *m)
{
	const shmrpc_value *it = v->u.items;

	if (v->type != SHMRPC_LIST || v->len != 3 || it[0].type != SHMRPC_BYTES ||
	    it[1].type != SHMRPC_LIST || it[2].type != SHMRPC_LIST)
		return shmrpc__fail(-EBADMSG, "a Python message must be [pickle, [RRefs], [tensors]]");
	m->data = it[0].u.p;
	m->len = it[0].len;
	m->nrrefs = it[1].len;
	m->ntensors = it[2].len;
	/* Empty lists, the common case, point at none: no allocation. */
	m->rrefs = m->nrrefs ? arena_alloc(a, m->nrrefs * sizeof(*m->rrefs)) : no_rrefs;
	m->tensors = m->ntensors ? arena_alloc(a, m->ntensors * sizeof(*m->tensors)) : no_tensors;
	if (!m->rrefs || !m->tensors)
		return shmrpc__fail(-ENOMEM, "out of memory decoding a Python message");
	for (uint32_t i = 0; i < m->ntensors; i++) {
		if (it[2].u.items[i].type != SHMRPC_TENSOR)
			return shmrpc__fail(-EBADMSG, "a Python message lists a %s among its tensors",
					    shmrpc_type_name(it[2].u.items[i].type));
		m->tensors[i] = it[2].u.items[i].u.t;
	}
	for (uint32_t i = 0; i < m->nrrefs; i++) {
		if (it[1].u.items[i].type != SHMRPC_RREF)
			return shmrpc__fail(-EBADMSG, "a Python message lists a %s among its RRefs",
					    shmrpc_type_name(it[1].u.items[i].type));
		m->rrefs[i] = it[1].u.items[i].u.r;
	}
	return 0;
}

bool python_is_request(uint32_t type)
{
	switch (type) {
	case MSG_PYTHON_CALL:
	case MSG_PYTHON_REMOTE_CALL:
	case MSG_FORWARD_AUTOGRAD_REQ:
	case MSG_BACKWARD_AUTOGRAD_REQ:
	case MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ:
	case MSG_RREF_BACKWARD_REQ:
	case MSG_PYTHON_RREF_FETCH_CALL:
		return true;
	default:
		return false;
	}
}

uint16_t python_reply_type(uint16_t type)
{
	switch (type) {
	case MSG_FORWARD_AUTOGRAD_REQ:
	case MSG_BACKWARD_AUTOGRAD_REQ:
	case MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ:
	case MSG_RREF_BACKWARD_REQ:
		return (uint16_t)(type + 1); /* each one's _RESP */
	case MSG_PYTHON_RREF_FETCH_CALL:
		return MSG_PYTHON_RREF_FETCH_RET;
	default:
		return MSG_PYTHON_RET; /* PYTHON_REMOTE_CALL's is stored in the RRef */
	}
}

/* Whether a FORWARD_AUTOGRAD_REQ / _RESP (type) may wrap a message of type
 * wrapped: the Python package's calls and their replies. */
static bool wraps(uint16_t type, int64_t wrapped)
{
	if (type == MSG_FORWARD_AUTOGRAD_REQ)
		return wrapped == MSG_PYTHON_CALL || wrapped == MSG_PYTHON_REMOTE_CALL;
	return wrapped == MSG_PYTHON_RET || wrapped == MSG_REMOTE_RET;
}

/* Whether a message of type is a Python message alone, with nothing
 * around it: the package's calls and replies. */
static bool bare(uint16_t type)
{
	switch (type) {
	case MSG_PYTHON_CALL:
	case MSG_PYTHON_REMOTE_CALL:
	case MSG_PYTHON_RET:
	case MSG_PYTHON_RREF_FETCH_RET:
	case MSG_BACKWARD_AUTOGRAD_RESP:
	case MSG_CLEANUP_AUTOGRAD_CONTEXT_RESP:
	case MSG_RREF_BACKWARD_RESP:
		return true;
	default:
		return false;
	}
}

int python_request_value(const struct python_request *r, struct arena *a, shmrpc_value *out)
{
	shmrpc_value *items, *rref, msg;
	uint32_t n = 0;
	int rc;

	if (bare(r->type))
		return python_msg_value(&r->msg, a, out);
	if (!(items = arena_alloc(a, 5 * sizeof(*items))))
		return shmrpc__fail(-ENOMEM, "out of memory encoding a Python message");
	switch (r->type) {
	case MSG_FORWARD_AUTOGRAD_REQ:
	case MSG_FORWARD_AUTOGRAD_RESP:
		/* [context_id, message_id, wrapped type, the wrapped payload's
		 * values]: PYTHON_REMOTE_CALL's are two, REMOTE_RET's nil. */
		if (!wraps(r->type, r->wrapped))
			return shmrpc__fail(-EINVAL, "%s cannot wrap a %s", worker_msg_name(r->type),
					    worker_msg_name(r->wrapped) ?: "message of no known type");
		items[n++] = shmrpc_int(r->context_id);
		items[n++] = shmrpc_int(r->message_id);
		items[n++] = shmrpc_int(r->wrapped);
		if (r->wrapped == MSG_REMOTE_RET) {
			items[n++] = shmrpc_nil();
			break;
		}
		if (r->wrapped == MSG_PYTHON_REMOTE_CALL) {
			if (!(rref = arena_alloc(a, 2 * sizeof(*rref))))
				return shmrpc__fail(-ENOMEM, "out of memory encoding a Python message");
			rref[0] = shmrpc_int((int64_t)r->rref_id);
			rref[1] = shmrpc_int(r->rref_slot);
			items[n++] = shmrpc_list(rref, 2);
		}
		if ((rc = python_msg_value(&r->msg, a, &msg)))
			return rc;
		items[n++] = msg;
		break;
	case MSG_BACKWARD_AUTOGRAD_REQ:
		/* [context_id, message_id, gradients] */
		if ((rc = python_msg_value(&r->msg, a, &msg)))
			return rc;
		items[n++] = shmrpc_int(r->context_id);
		items[n++] = shmrpc_int(r->message_id);
		items[n++] = msg;
		break;
	case MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ:
		items[n++] = shmrpc_int(r->context_id);
		break;
	case MSG_RREF_BACKWARD_REQ:
	case MSG_PYTHON_RREF_FETCH_CALL:
		/* [rref, context_id, retain_graph]; a fetch's without the last */
		if (r->msg.nrrefs != 1)
			return shmrpc__fail(-EINVAL, "%s names one RRef, not %u",
					    worker_msg_name(r->type), r->msg.nrrefs);
		items[n++] = shmrpc_rref_value(r->msg.rrefs[0]);
		items[n++] = shmrpc_int(r->context_id);
		if (r->type == MSG_RREF_BACKWARD_REQ)
			items[n++] = shmrpc_bool(r->retain_graph);
		break;
	default:
		return shmrpc__fail(-EINVAL, "message type %u is no Python message", r->type);
	}
	*out = shmrpc_list(items, n);
	return 0;
}

/* An id on the wire: a context's or a message's, never negative. */
static bool wire_id(const shmrpc_value *v, int64_t *id)
{
	if (v->type != SHMRPC_INT || v->u.i < 0)
		return false;
	*id = v->u.i;
	return true;
}

/* A PYTHON_REMOTE_CALL's header [rref_id, slot] into r. */
static bool rref_header_of(const shmrpc_value *v, struct python_request *r)
{
	const shmrpc_value *it = v->u.items;

	if (v->type != SHMRPC_LIST || v->len != 2 || it[0].type != SHMRPC_INT ||
	    it[1].type != SHMRPC_INT || it[1].u.i < 0 || it[1].u.i > UINT32_MAX)
		return false;
	r->rref_id = (uint64_t)it[0].u.i;
	r->rref_slot = (uint32_t)it[1].u.i;
	return true;
}

bool python_request_plain(uint16_t type, const void *buf, size_t len, struct python_request *r)
{
	const uint8_t *p = buf;
	size_t n, at;

	/* 0x93: an array of 3; a bin of 8, 16 or 32 bits of length; 0x90 0x90:
	 * two empty arrays, ending the payload: as msgpack-c's packer writes
	 * them (python_msg_value). Another form of the same value (a longer
	 * array header) is the decoder's to read. */
	if (!bare(type) || len < 5 || p[0] != 0x93)
		return false;
	switch (p[1]) {
	case 0xc4:
		n = p[2];
		at = 3;
		break;
	case 0xc5:
		n = (size_t)p[2] << 8 | p[3];
		at = 4;
		break;
	case 0xc6:
		if (len < 8)
			return false;
		n = (size_t)p[2] << 24 | (size_t)p[3] << 16 | (size_t)p[4] << 8 | p[5];
		at = 6;
		break;
	default:
		return false;
	}
	if (len - at < 2 || n != len - at - 2 || p[at + n] != 0x90 || p[at + n + 1] != 0x90)
		return false;
	*r = (struct python_request){ .type = type, .context_id = -1,
				      .msg = { .data = p + at, .len = n, .rrefs = no_rrefs,
					       .tensors = no_tensors } };
	return true;
}

int python_request_of(uint16_t type, const shmrpc_value *v, struct arena *a,
		      struct python_request *r)
{
	const shmrpc_value *it = v->u.items;
	const char *name = worker_msg_name(type);

	*r = (struct python_request){ .type = type, .context_id = -1,
				      .msg = { .data = "" } /* "", not NULL: Python's bytes */ };
	if (bare(type))
		return python_msg_of(v, a, &r->msg);
	switch (type) {
	case MSG_FORWARD_AUTOGRAD_REQ:
	case MSG_FORWARD_AUTOGRAD_RESP:
		if (v->type != SHMRPC_LIST || v->len < 4 || !wire_id(&it[0], &r->context_id) ||
		    !wire_id(&it[1], &r->message_id) || it[2].type != SHMRPC_INT ||
		    !wraps(type, it[2].u.i))
			break;
		r->wrapped = (uint16_t)it[2].u.i;
		if (r->wrapped == MSG_PYTHON_REMOTE_CALL && v->len == 5 && rref_header_of(&it[3], r))
			return python_msg_of(&it[4], a, &r->msg);
		if (r->wrapped == MSG_REMOTE_RET && v->len == 4 && it[3].type == SHMRPC_NIL)
			return 0;
		if ((r->wrapped == MSG_PYTHON_CALL || r->wrapped == MSG_PYTHON_RET) && v->len == 4)
			return python_msg_of(&it[3], a, &r->msg);
		break;
	case MSG_BACKWARD_AUTOGRAD_REQ:
		if (v->type != SHMRPC_LIST || v->len != 3 || !wire_id(&it[0], &r->context_id) ||
		    !wire_id(&it[1], &r->message_id))
			break;
		return python_msg_of(&it[2], a, &r->msg);
	case MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ:
		if (v->type != SHMRPC_LIST || v->len != 1 || !wire_id(&it[0], &r->context_id))
			break;
		return 0;
	case MSG_RREF_BACKWARD_REQ:
		if (v->type != SHMRPC_LIST || v->len != 3 || it[0].type != SHMRPC_RREF ||
		    !wire_id(&it[1], &r->context_id) || it[2].type != SHMRPC_BOOL ||
		    !(r->msg.rrefs = arena_alloc(a, sizeof(*r->msg.rrefs))))
			break;
		r->msg.rrefs[0] = it[0].u.r;
		r->msg.nrrefs = 1;
		r->retain_graph = it[2].u.b;
		return 0;
	case MSG_PYTHON_RREF_FETCH_CALL:
		/* [rref, context_id]: -1 for none, as the sender's context_id */
		if (v->type != SHMRPC_LIST || v->len != 2 || it[0].type != SHMRPC_RREF ||
		    it[1].type != SHMRPC_INT || it[1].u.i < -1 ||
		    !(r->msg.rrefs = arena_alloc(a, sizeof(*r->msg.rrefs))))
			break;
		r->msg.rrefs[0] = it[0].u.r;
		r->msg.nrrefs = 1;
		r->context_id = it[1].u.i;
		return 0;
	default:
		return shmrpc__fail(-EINVAL, "message type %u is no Python message", type);
	}
	return shmrpc__fail(-EBADMSG, "a malformed %s came in", name);
}

int python_reply_of(const shmrpc_value *v, struct arena *a, struct python_msg *m)
{
	struct python_request r;
	int rc;

	if (v->type == SHMRPC_LIST && v->len == 4) {
		rc = python_request_of(MSG_FORWARD_AUTOGRAD_RESP, v, a, &r);
		*m = r.msg;
		return rc;
	}
	return python_msg_of(v, a, m);
}

/* Requests sent, by type (for tests and inspectors). Relaxed: counters. */
static _Atomic uint64_t sent_count[MSG_TYPE_END];

uint64_t python_sent(uint16_t type)
{
	return type < MSG_TYPE_END ? atomic_load_explicit(&sent_count[type], memory_order_relaxed)
				   : 0;
}

void python_count_sent(uint16_t type)
{
	if (type < MSG_TYPE_END)
		atomic_fetch_add_explicit(&sent_count[type], 1, memory_order_relaxed);
}

/* As the receiver would (wire_id), in torch's words. */
static int context_check(const struct python_request *r)
{
	if (r->context_id < 0)
		return shmrpc__fail(-EINVAL, "Could not find autograd context with id: %lld",
				    (long long)r->context_id);
	return 0;
}

int python_request_async(int dst, const struct python_request *r, int64_t timeout_ms,
			 shmrpc_future **out)
{
	struct agent *ag;
	struct tensor_list sent = { .give = r->give };
	struct arena_first first;
	struct arena a;
	msgpack_sbuffer sb;
	msgpack_packer pk;
	shmrpc_value v;
	const char *what;
	int rc;

	*out = NULL;
	if ((rc = agent_running(&ag)))
		return rc;
	switch (r->type) {
	case MSG_PYTHON_CALL:
		what = "call a Python function";
		break;
	case MSG_FORWARD_AUTOGRAD_REQ:
		/* A remote call's RRef is made with its request: python_remote. */
		if (r->wrapped != MSG_PYTHON_CALL)
			return shmrpc__fail(-EINVAL, "python_request_async sends a FORWARD_AUTOGRAD_REQ "
					    "wrapping a PYTHON_CALL only");
		what = "call a Python function";
		break;
	case MSG_BACKWARD_AUTOGRAD_REQ:
		what = "send gradients";
		break;
	case MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ:
		what = "release an autograd context";
		break;
	case MSG_RREF_BACKWARD_REQ:
		what = "run RRef.backward";
		break;
	case MSG_PYTHON_RREF_FETCH_CALL:
		what = "fetch an RRef's value";
		break;
	default:
		return shmrpc__fail(-EINVAL, "the Python package sends no request of type %u",
				    r->type);
	}
	if (r->type != MSG_PYTHON_CALL && r->type != MSG_PYTHON_RREF_FETCH_CALL &&
	    (rc = context_check(r)))
		return rc;
	arena_init(&a, &first);
	sbuf_open(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	rc = python_request_value(r, &a, &v) ?: value_pack(&pk, &v, &sent);
	if (rc)
		tensor_list_forget(&sent);
	else
		rc = client_request(ag, dst, r->type, &sb, &sent, timeout_ms, what, out);
	if (rc == 0)
		python_count_sent(r->type);
	sbuf_close(&sb);
	arena_free(&a);
	return rc;
}

int python_remote_pack(msgpack_packer *pk, const struct python_request *r, uint64_t id,
		       uint32_t slot, struct tensor_list *sent)
{
	struct python_request wrapper = *r;
	struct arena a = { 0 };
	shmrpc_value v;
	int rc;

	switch (r->type) {
	case MSG_PYTHON_REMOTE_CALL:
		/* [rref_id, slot], then the call */
		if (msgpack_pack_array(pk, 2) || msgpack_pack_uint64(pk, id) ||
		    msgpack_pack_uint32(pk, slot))
			return shmrpc__fail(-ENOMEM, "out of memory encoding a remote call");
		rc = python_msg_value(&r->msg, &a, &v);
		break;
	case MSG_FORWARD_AUTOGRAD_REQ:
		if (r->wrapped != MSG_PYTHON_REMOTE_CALL)
			return shmrpc__fail(-EINVAL, "remote() sends a FORWARD_AUTOGRAD_REQ wrapping a "
					    "PYTHON_REMOTE_CALL only");
		wrapper.rref_id = id;
		wrapper.rref_slot = slot;
		rc = context_check(r) ?: python_request_value(&wrapper, &a, &v);
		break;
	default:
		return shmrpc__fail(-EINVAL, "remote() sends no request of type %u", r->type);
	}
	if (rc == 0)
		rc = value_pack(pk, &v, sent);
	arena_free(&a);
	return rc;
}
