/* Python messages on the wire; see python.h. */
#include <errno.h>
#include <msgpack.h>

#include "common/error.h"
#include "worker/agent.h"
#include "worker/msg.h"
#include "worker/python.h"
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
	shmrpc_value *items = arena_alloc(a, 3 * sizeof(*items));
	shmrpc_value *refs = arena_alloc(a, (m->nrrefs ? m->nrrefs : 1) * sizeof(*refs));
	shmrpc_value *tens = arena_alloc(a, (m->ntensors ? m->ntensors : 1) * sizeof(*tens));

	if (!items || !refs || !tens)
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
	m->rrefs = arena_alloc(a, (m->nrrefs ? m->nrrefs : 1) * sizeof(*m->rrefs));
	m->tensors = arena_alloc(a, (m->ntensors ? m->ntensors : 1) * sizeof(*m->tensors));
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

int python_rpc_async(int dst, const struct python_msg *m, int64_t timeout_ms, shmrpc_future **out)
{
	struct agent *ag = worker_agent;
	struct tensor_list sent = { 0 };
	struct arena a = { 0 };
	msgpack_sbuffer sb;
	msgpack_packer pk;
	shmrpc_value v;
	int rc;

	*out = NULL;
	if (!ag)
		return shmrpc__fail(-ENOTCONN, "the RPC agent is not running: call init_rpc first");
	msgpack_sbuffer_init(&sb);
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	rc = python_msg_value(m, &a, &v) ?: value_pack(&pk, &v, &sent);
	if (rc)
		tensor_list_forget(&sent);
	else
		rc = client_request(ag, dst, MSG_PYTHON_CALL, &sb, &sent, timeout_ms,
				    "call a Python function", out);
	msgpack_sbuffer_destroy(&sb);
	arena_free(&a);
	return rc;
}
