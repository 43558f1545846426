/*
 * The common Python call served in C: a PYTHON_CALL or PYTHON_REMOTE_CALL
 * of a function sent by name, with no arguments, the pickle of (args,
 * kwargs) or common tensors alone (_TENSORS), no RRefs, not profiled; or
 * a proxy's call in the _PROXY form, on a live value kept here. What _serve._serve_plain does for it, each of
 * its decisions made on the same objects (docs/ARCHITECTURE.md, "Where a
 * Python call's time goes", eighth pass): the payload's head looked up in
 * _marshal._named_heads and its _Named's holds() asked in C, the function
 * called from here; the Python the package keeps for the rest (_serve_call
 * in a context or under a server profiler, async_execution's mark, _dumps,
 * _failed) called as _serve_plain calls it. Anything else, and any doubt
 * before the payload is unpickled, leaves the request to the plain
 * handler, nothing run; a pickle that raises is answered here
 * (_unloaded), its code run once.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "python/module.h"

/* What the fast path reads, _serve._fast()'s tuple's items in its order
 * (set_handler), borrowed from the tuple. */
struct fast_objs {
	PyObject *heads;         /* _marshal._named_heads: head bytes -> _Named */
	PyObject *named_type;    /* _marshal._Named */
	PyObject *function_type; /* types.FunctionType */
	PyObject *call_method;   /* _calls._call_method: served by _serve_call */
	PyObject *profiling;     /* server_profiler._active, a list changed in place */
	PyObject *loads;         /* pickle.loads */
	PyObject *serve_call;    /* _serve._serve_call */
	PyObject *is_async;      /* _serve._is_async_execution */
	PyObject *waited;        /* _serve._waited */
	PyObject *dumps;         /* _marshal._dumps */
	PyObject *failed;        /* _serve._failed */
	PyObject *reply;         /* _serve._reply: a remote call's result kept or pickled */
	PyObject *unloaded;      /* _serve._unloaded: the reply to arguments that failed to unpickle */
	PyObject *owned;         /* _calls._owned: RRef id -> the live value this owner keeps */
};

/* The tuple (owned; NULL: no fast path) and its items. A call served
 * holds the tuple and a copy of the items: the function it runs may set
 * the handlers again (a test's). */
static PyObject *fast_tuple;
static struct fast_objs fast;

/* The attribute names asked, interned once (names_make). */
static PyObject *s_func, *s_module, *s_mod, *s_scope, *s_name, *s_dict;

/* A _Named's slots, found on the _Named type that each fast_set is given. */
static struct known_attr n_func = { .name = &s_func },
			 n_module = { .name = &s_module },
			 n_mod = { .name = &s_mod },
			 n_scope = { .name = &s_scope },
			 n_name = { .name = &s_name };
enum { SLOT_FUNC, SLOT_MODULE, SLOT_MOD, SLOT_SCOPE, SLOT_NAME, NAMED_SLOTS };
static struct known_attr *const named_slots[NAMED_SLOTS] = {
	[SLOT_FUNC] = &n_func, [SLOT_MODULE] = &n_module, [SLOT_MOD] = &n_mod,
	[SLOT_SCOPE] = &n_scope, [SLOT_NAME] = &n_name,
};

/* The empty pickle: the reply to a result of None (_serve_plain's b"");
 * what a reply whose value its owner keeps live ends in (_serve_plain's
 * (0, True)). */
static PyObject *empty_reply, *live_tail;

/* The names above and the empty reply, made once. 0, or -1 with an
 * exception set. */
static int names_make(void)
{
	static const char *const text[] = { "func", "module", "mod", "scope", "name", "__dict__" };
	PyObject **names[] = { &s_func, &s_module, &s_mod, &s_scope, &s_name, &s_dict };

	if (intern_names(text, names, sizeof(names) / sizeof(names[0])))
		return -1;
	if ((!empty_reply && !(empty_reply = PyBytes_FromStringAndSize(NULL, 0))) ||
	    (!live_tail && !(live_tail = Py_BuildValue("(iO)", 0, Py_True))))
		return -1;
	return 0;
}

/* module.h says what fast_set and fast_serve return. */
int fast_set(PyObject *objs)
{
	struct known_attr learnt[NAMED_SLOTS];
	struct fast_objs got = { 0 };
	size_t i;

	if (objs && (names_make() ||
		     !PyArg_ParseTuple(objs, "O!O!O!OO!OOOOOOOOO!:set_handler's fast path",
				       &PyDict_Type, &got.heads, &PyType_Type, &got.named_type,
				       &PyType_Type, &got.function_type, &got.call_method,
				       &PyList_Type, &got.profiling, &got.loads, &got.serve_call,
				       &got.is_async, &got.waited, &got.dumps, &got.failed,
				       &got.reply, &got.unloaded, &PyDict_Type, &got.owned)))
		return -1;
	/* Learnt aside, then kept: a refused type leaves the path in effect
	 * reading its own type's slots. */
	for (i = 0; objs && i < NAMED_SLOTS; i++) {
		learnt[i] = (struct known_attr){ .name = named_slots[i]->name,
						 .method = named_slots[i]->method };
		if (known_attr_learn(&learnt[i], got.named_type, NULL)) {
			while (i--)
				Py_XDECREF(learnt[i].desc);
			return -1;
		}
	}
	for (i = 0; objs && i < NAMED_SLOTS; i++) {
		Py_XDECREF(named_slots[i]->desc);
		*named_slots[i] = learnt[i];
	}
	Py_XINCREF(objs); /* before the old one goes: it may be the same */
	Py_XDECREF(fast_tuple);
	fast_tuple = objs;
	fast = got;
	return 0;
}

/* The length of the by-name head that payload starts with (_BY_NAME,
 * module, NUL, qualified name, NUL: up to the second NUL, as _unpack_call
 * cuts it), or 0 if it starts with none. */
static size_t head_len(const char *p, size_t len)
{
	const char *first = len && p[0] == '\x01' ? memchr(p, 0, len) : NULL;
	const char *second = first ? memchr(first + 1, 0, len - (size_t)(first + 1 - p)) : NULL;

	return second ? (size_t)(second + 1 - p) : 0;
}

/* Whether what follows a head of len bytes is served here: nothing (a call
 * without arguments), or a pickle of protocol 2 or later, as _pack_call
 * writes one: PROTO first and STOP last, so neither _TENSORS nor _PROXY
 * nor the out-of-line mark, and a payload _unpack_call gives to
 * pickle.loads itself (its shortcuts look at a payload's last byte, a NUL
 * or _TENSORS). */
static bool args_served(const char *p, size_t len, size_t head)
{
	return head == len || ((unsigned char)p[head] == 0x80 && p[len - 1] == '.');
}

/* Whether the payload is a head of len bytes and the mark of arguments
 * that are common tensors alone (_marshal._TENSORS), the message's
 * tensors: _unpack_call's shortcut, which takes them as torch tensors
 * (here once torch is known, tensors_taken). */
static bool tensors_form(const char *p, size_t len, size_t head)
{
	return head + 1 == len && p[head] == TENSORS_MARK && torch_known();
}

/* The (args, {}) of a call of common tensors alone: the message's
 * tensors as torch tensors, as _from_handles gives them, each taking its
 * handle's reference over (torch_of_handles: the message's handles are
 * spent, and the plain handler cannot read them after). New reference;
 * NULL with an exception set, answered as the plain handler answers what
 * _from_handles raises (_unloaded). */
static PyObject *tensors_taken(const struct python_msg *m)
{
	PyObject *args = torch_of_handles(m->tensors, m->ntensors, true), *call = NULL, *kwargs;

	if (args && (kwargs = PyDict_New())) {
		call = PyTuple_Pack(2, args, kwargs);
		Py_DECREF(kwargs);
	}
	Py_XDECREF(args);
	return call;
}

/* The last head looked up, its _Named in _named_heads (NULL: none there)
 * and that _Named's slots (SLOT_FUNC...; set when it is made, never
 * changed), kept under the GIL: a call's head is most often the last
 * one's, and then neither a bytes object is made, nor the dict asked
 * (its bytes compared and hashed once more), nor the slots read: about
 * 750 instructions a call. The _Named kept is the dict's for that head
 * while it holds: _unpack_call replaces an entry only once it no longer
 * holds, and two that hold name the one function the name finds. */
static struct {
	PyObject *head;
	PyObject *named;
	PyObject *slot[NAMED_SLOTS];
} last;

/* last emptied but for head, which becomes head (a new reference). What
 * it held goes after: a deallocation that runs code finds it consistent. */
static void last_set(PyObject *head)
{
	PyObject *old[NAMED_SLOTS + 2] = { last.head, last.named };

	memcpy(old + 2, last.slot, sizeof(last.slot));
	last.head = head;
	last.named = NULL;
	memset(last.slot, 0, sizeof(last.slot));
	for (size_t i = 0; i < NAMED_SLOTS + 2; i++)
		Py_XDECREF(old[i]);
}

/* Makes last the head's (len bytes at p): its _Named and slots when
 * _named_heads has one of the _Named type. 0, or -1 with an exception
 * set (last then names no _Named). */
static int last_look_up(const struct fast_objs *f, const char *p, size_t len)
{
	PyObject *head = PyBytes_FromStringAndSize(p, (Py_ssize_t)len), *named, *slot[NAMED_SLOTS];

	if (!head)
		return -1;
	last_set(head);
	if (!(named = PyDict_GetItemWithError(f->heads, head)))
		return PyErr_Occurred() ? -1 : 0;
	if (Py_TYPE(named) != (PyTypeObject *)f->named_type)
		return 0;
	/* The slots of the exact _Named type: member descriptors, whose reads
	 * run no code, so last stays the head's meanwhile. */
	for (size_t i = 0; i < NAMED_SLOTS; i++) {
		if (!(slot[i] = known_attr_get(named_slots[i], named))) {
			while (i--)
				Py_DECREF(slot[i]);
			return -1;
		}
	}
	last.named = new_ref(named); /* borrowed from the dict */
	memcpy(last.slot, slot, sizeof(slot));
	return 0;
}

/* The function the head (len bytes at p) names, as _unpack_call finds it:
 * its _Named in _named_heads, which holds (name_holds, from its slots).
 * New reference; NULL with no exception where Python must look (a head
 * not cached or no longer holding, an error: cleared, the plain handler
 * meets it again). */
static PyObject *named_func(const struct fast_objs *f, const char *p, size_t len)
{
	PyObject *named, *got[NAMED_SLOTS], *func = NULL;
	int rc;

	if (!(last.head && PyBytes_Size(last.head) == (Py_ssize_t)len &&
	      memcmp(PyBytes_AsString(last.head), p, len) == 0 && last.named) &&
	    last_look_up(f, p, len)) {
		PyErr_Clear();
		return NULL;
	}
	if (!last.named)
		return NULL;
	/* Held here: name_holds may run code (a dotted name's holds) that
	 * looks another head up. */
	named = new_ref(last.named);
	for (size_t i = 0; i < NAMED_SLOTS; i++)
		got[i] = new_ref(last.slot[i]);
	rc = name_holds(named, got[SLOT_MODULE], got[SLOT_MOD], got[SLOT_SCOPE], got[SLOT_NAME],
			got[SLOT_FUNC]);
	if (rc == 1)
		func = new_ref(got[SLOT_FUNC]);
	Py_DECREF(named);
	for (size_t i = 0; i < NAMED_SLOTS; i++)
		Py_DECREF(got[i]);
	PyErr_Clear();
	return func;
}

/* call when it is a call's (args, kwargs), a tuple and a dict of exact
 * types, else NULL (its reference dropped). */
static PyObject *call_checked(PyObject *call)
{
	if (call && (!PyTuple_CheckExact(call) || PyTuple_Size(call) != 2 ||
		     !PyTuple_CheckExact(PyTuple_GetItem(call, 0)) ||
		     !PyDict_CheckExact(PyTuple_GetItem(call, 1))))
		Py_CLEAR(call);
	return call;
}

/* The (args, kwargs) pickled in len bytes at p, a tuple and a dict of
 * exact types, as _pack_call pickles them. New reference; NULL with no
 * exception where the pickle was not read (its bytes not copied), or
 * for another value (the plain handler unpickles it again); NULL with
 * the exception set where the pickle raised it: the call is answered
 * here (_unloaded), since the plain handler would run the code its
 * objects name a second time. */
static PyObject *call_loaded(const struct fast_objs *f, const char *p, size_t len)
{
	PyObject *data, *call = scalar_unpickle(p, len);

	if (!call && !PyErr_Occurred()) {
		if (!(data = PyBytes_FromStringAndSize(p, (Py_ssize_t)len))) {
			PyErr_Clear();
			return NULL;
		}
		call = PyObject_CallFunctionObjArgs(f->loads, data, NULL);
		Py_DECREF(data);
	} else if (!call) {
		PyErr_Clear(); /* no memory: the plain handler tries again */
		return NULL;
	}
	return call_checked(call);
}

/* The (args, {}) of a call of scalars and common tensors (_calls.c's
 * mixed_payload), from the len bytes after the head at p, its tensors
 * the message's. New reference; NULL with no exception where it is
 * another pickle (the pickler's: the plain handler reads it). */
static PyObject *mixed_loaded(const struct python_msg *m, size_t head)
{
	PyObject *call = scalar_unpickle_tensors(m->data + head, m->len - head, torch_of_msg_tensor,
						 (void *)m);

	PyErr_Clear(); /* no memory: the plain handler tries again */
	return call_checked(call);
}

/* Whether this thread is in a distributed autograd context
 * (_contexts._tls.ctx not None) or a server profiler records
 * (server_profiler._active), the second asked only if the first is not
 * so, as Python's `or`: then _serve_plain serves a call through
 * _serve_call. 1, 0, or -1 with an exception set. */
static int in_context_or_profiled(const struct fast_objs *f)
{
	Py_ssize_t n;

	if (thread_in_context())
		return 1;
	/* The list itself, not the module's attribute: no dict lookup. */
	return (n = PyList_Size(f->profiling)) < 0 ? -1 : n > 0;
}

/* Whether _serve_plain serves a call of func through _serve_call: func
 * is _call_method (a proxy's call not in the _PROXY form), or
 * in_context_or_profiled. 1, 0, or -1 with an exception set. */
static int general_way(const struct fast_objs *f, PyObject *func)
{
	return func == f->call_method ? 1 : in_context_or_profiled(f);
}

/* result, or, for a function that may carry async_execution's mark (not a
 * plain function, or one with attributes: _serve_plain's test, made after
 * the call as there; a builtin holds no attributes) and does
 * (_is_async_execution), the value of the Future it returned (_waited).
 * Steals result; NULL with an exception set. */
static PyObject *async_waited(const struct fast_objs *f, PyObject *func, PyObject *result)
{
	PyObject *dict = NULL, *mark = NULL, *value;
	int maybe = !PyCFunction_Check(func);

	if (maybe && Py_TYPE(func) == (PyTypeObject *)f->function_type)
		maybe = (dict = PyObject_GetAttr(func, s_dict)) ? PyObject_IsTrue(dict) : -1;
	if (maybe > 0)
		maybe = (mark = PyObject_CallFunctionObjArgs(f->is_async, func, NULL))
			? PyObject_IsTrue(mark) : -1;
	Py_XDECREF(dict);
	Py_XDECREF(mark);
	if (maybe == 0)
		return result;
	value = maybe > 0 ? PyObject_CallFunctionObjArgs(f->waited, result, NULL) : NULL;
	Py_DECREF(result);
	return value;
}

/* _serve_call(func, args, kwargs, caller, None, None, rref_id), call
 * being (args, kwargs), or NULL for a call without arguments, given as ()
 * and {} as _unpack_call gives them: the reply to a call in a context,
 * under a server profiler, or of _call_method (rref_id: a remote call's
 * RRef, 0 for a call). New reference; NULL with an exception set. */
static PyObject *general_reply(const struct fast_objs *f, uint32_t caller, PyObject *func,
			       PyObject *call, uint64_t rref_id)
{
	PyObject *args = call ? new_ref(PyTuple_GetItem(call, 0)) : PyTuple_New(0);
	PyObject *kwargs = call ? new_ref(PyTuple_GetItem(call, 1)) : PyDict_New();
	PyObject *who = PyLong_FromUnsignedLong(caller), *reply = NULL;
	PyObject *rref = PyLong_FromUnsignedLongLong(rref_id);

	if (args && kwargs && who && rref)
		reply = PyObject_CallFunctionObjArgs(f->serve_call, func, args, kwargs, who, Py_None,
						     Py_None, rref, NULL);
	Py_XDECREF(args);
	Py_XDECREF(kwargs);
	Py_XDECREF(who);
	Py_XDECREF(rref);
	return reply;
}

/* The reply of result, not None, to request m: for a remote call
 * (rref_id) _reply's (its pickle, or the live mark with the value kept
 * here); for a call of a common tensor its handle as *tensor, no reply
 * made (what _dumps gives, the mark and the handle; asked here once torch
 * is known; one of m's tensors sent back is described without a
 * reference: torch_reply_tensor), or else _dumps' reply. Steals result;
 * new reference, or NULL: with *tensor set, or with an exception set. */
static PyObject *result_reply(const struct fast_objs *f, PyObject *result, uint64_t rref_id,
			      const struct python_msg *m, shmrpc_tensor **tensor)
{
	PyObject *reply = NULL, *id;

	if (rref_id) {
		if ((id = PyLong_FromUnsignedLongLong(rref_id)))
			reply = PyObject_CallFunctionObjArgs(f->reply, result, id, NULL);
		Py_XDECREF(id);
	} else if (!torch_known() || !torch_reply_tensor(result, m->tensors, m->ntensors, tensor)) {
		reply = PyObject_CallFunctionObjArgs(f->dumps, result, NULL);
	}
	Py_DECREF(result);
	return reply;
}

/* reply, and (0, True) after it when it is a live value's (its pickle the
 * live mark, _marshal._LIVE), as _serve_plain's last line adds: the C
 * half then keeps the RRef's value here. Steals reply; NULL stays NULL. */
static PyObject *live_marked(PyObject *reply)
{
	PyObject *data, *marked;

	if (!reply || !PyTuple_Check(reply) || PyTuple_Size(reply) < 1)
		return reply;
	data = PyTuple_GetItem(reply, 0);
	if (!PyBytes_Check(data) || PyBytes_Size(data) != 1 || PyBytes_AsString(data)[0] != '\x02')
		return reply;
	marked = PySequence_Concat(reply, live_tail);
	Py_DECREF(reply);
	return marked;
}

/* func(*args, **(kwargs or {})), call being (args, kwargs) or NULL for
 * none: an empty dict passes no keyword, as none does. New reference;
 * NULL with an exception set. */
static PyObject *called(PyObject *func, PyObject *call)
{
	PyObject *kwargs;

	if (!call)
		return PyObject_CallNoArgs(func);
	kwargs = PyTuple_GetItem(call, 1);
	return PyObject_Call(func, PyTuple_GetItem(call, 0), PyDict_Size(kwargs) ? kwargs : NULL);
}

/* The reply to request m of func's result (stolen; NULL with an
 * exception set: NULL): waited for if async_execution's (async_waited),
 * the empty pickle for None, result_reply's otherwise (a common tensor's
 * as *tensor); a live value's marked (live_marked). New reference; NULL
 * with *tensor set or with an exception set. */
static PyObject *answer(const struct fast_objs *f, PyObject *func, PyObject *result,
			uint64_t rref_id, const struct python_msg *m, shmrpc_tensor **tensor)
{
	if (result)
		result = async_waited(f, func, result);
	if (result == Py_None) {
		Py_DECREF(result);
		return new_ref(empty_reply);
	}
	return result ? live_marked(result_reply(f, result, rref_id, m, tensor)) : NULL;
}

/* The reply to request m, the call of func (call: as called's; rref_id a remote
 * call's RRef, or 0), as _serve_plain's try block makes it: _serve_call's
 * where general_way says so; else the function's result, waited for if
 * async_execution's (async_waited), the empty pickle for None,
 * result_reply's otherwise (a common tensor's as *tensor); a live value's
 * marked (live_marked). New reference; NULL with *tensor set or with an
 * exception set. */
static PyObject *call_reply(const struct fast_objs *f, uint32_t caller, PyObject *func,
			    PyObject *call, uint64_t rref_id, const struct python_msg *m,
			    shmrpc_tensor **tensor)
{
	int general = general_way(f, func);

	if (general)
		return live_marked(general > 0 ? general_reply(f, caller, func, call, rref_id)
					       : NULL);
	return answer(f, func, called(func, call), rref_id, m, tensor);
}

/* answer(e) of the exception pending: _failed's (what the function
 * raised: the callee prints it, and the caller gets its type, text and
 * traceback), as _serve_plain's except clause answers, or _unloaded's
 * (the arguments' pickle raised it), the traceback set on it as that
 * clause sets it (3.11's interpreter has set it already; the stable ABI
 * runs on older ones). New reference; NULL with an exception set if
 * answer raises, as the plain handler would then. */
static PyObject *failed_reply(PyObject *answer)
{
	PyObject *type, *value, *tb, *reply;

	PyErr_Fetch(&type, &value, &tb);
	PyErr_NormalizeException(&type, &value, &tb);
	if (tb)
		PyException_SetTraceback(value, tb);
	reply = PyObject_CallFunctionObjArgs(answer, value, NULL);
	Py_XDECREF(type);
	Py_XDECREF(value);
	Py_XDECREF(tb);
	return reply;
}

/* Where the payload after a head of head bytes is a proxy's call in the
 * _PROXY form (_marshal._PROXY: the mark, the method's name, a NUL, then
 * nothing or the pickle of the other arguments), the offset of that NUL;
 * else 0. */
static size_t proxy_form(const char *p, size_t len, size_t head)
{
	const char *nul;

	if (head + 1 >= len || p[head] != '\x04' ||
	    !(nul = memchr(p + head + 1, 0, len - head - 1)))
		return 0;
	return args_served(p, len, (size_t)(nul + 1 - p)) ? (size_t)(nul - p) : 0;
}

/* A proxy's call (rref.rpc_sync().method(args), the _PROXY form ending at
 * name_end) served as _serve_plain serves it through _serve_call and
 * _call: the method of the live value this owner keeps (_calls._owned)
 * looked up and called with the scalars sent, async_execution's honoured
 * (answer). A value not kept there (not stored yet, or not live), a
 * context, a server profiler, arguments the C reader leaves to pickle:
 * the plain handler's. 1 when served (as fast_serve), 0 when nothing ran. */
static int proxy_serve(const struct fast_objs *f, const struct python_request *in, size_t head,
		       size_t name_end, PyObject **reply, shmrpc_tensor **tensor)
{
	const struct python_msg *m = &in->msg;
	const char *p = m->data;
	size_t rest = name_end + 1;
	PyObject *func = named_func(f, p, head), *id = NULL, *value = NULL, *name = NULL;
	PyObject *args = NULL, *method;

	if (func == f->call_method && in_context_or_profiled(f) == 0 &&
	    (id = PyLong_FromUnsignedLongLong(python_rref_id(m->rrefs[0]))) &&
	    (value = PyDict_GetItemWithError(f->owned, id)) &&
	    (name = PyUnicode_DecodeUTF8(p + head + 1, (Py_ssize_t)(name_end - head - 1), NULL)))
		args = rest == m->len ? PyTuple_New(0) : scalar_unpickle(p + rest, m->len - rest);
	Py_XDECREF(func);
	Py_XDECREF(id);
	if (!args || !PyTuple_CheckExact(args)) {
		Py_XDECREF(name);
		Py_XDECREF(args);
		PyErr_Clear(); /* the plain handler meets it again */
		return 0;
	}
	Py_INCREF(value); /* borrowed from a dict the method may change */
	method = PyObject_GetAttr(value, name);
	*reply = answer(f, method, method ? PyObject_Call(method, args, NULL) : NULL, in->rref_id,
			m, tensor);
	if (!*reply && !*tensor)
		*reply = failed_reply(f->failed);
	Py_XDECREF(method);
	Py_DECREF(value);
	Py_DECREF(name);
	Py_DECREF(args);
	return 1;
}

int fast_serve(uint32_t caller, const struct python_request *in,
	       const struct profile_events *ops, PyObject **reply, shmrpc_tensor **tensor)
{
	const struct python_msg *m = &in->msg;
	const struct fast_objs f = fast;
	const char *p = m->data;
	PyObject *hold = fast_tuple, *func, *call = NULL;
	size_t head = 0, name_end;
	bool tensors, mixed;
	int served;

	*tensor = NULL;
	if (!hold || ops || (in->type != MSG_PYTHON_CALL && in->type != MSG_PYTHON_REMOTE_CALL) ||
	    !(head = head_len(p, m->len)))
		return 0;
	if (m->nrrefs == 1 && !m->ntensors && (name_end = proxy_form(p, m->len, head))) {
		Py_INCREF(hold);
		served = proxy_serve(&f, in, head, name_end, reply, tensor);
		Py_DECREF(hold);
		return served;
	}
	if (m->nrrefs)
		return 0;
	tensors = m->ntensors && tensors_form(p, m->len, head);
	mixed = !tensors && m->ntensors && head < m->len && torch_known();
	if (!tensors && ((m->ntensors && !mixed) || !args_served(p, m->len, head)))
		return 0;
	Py_INCREF(hold);
	if (!(func = named_func(&f, p, head)) ||
	    (!tensors && head < m->len &&
	     !(call = mixed ? mixed_loaded(m, head) : call_loaded(&f, p + head, m->len - head)) &&
	     !PyErr_Occurred())) {
		Py_XDECREF(func);
		Py_DECREF(hold);
		return 0;
	}
	if (tensors) /* last: the plain handler could not read them after */
		call = tensors_taken(m);
	if (PyErr_Occurred()) /* the arguments' pickle or their take raised it */
		*reply = failed_reply(f.unloaded);
	else if (!(*reply = call_reply(&f, caller, func, call, in->rref_id, m, tensor)) && !*tensor)
		*reply = failed_reply(f.failed);
	Py_XDECREF(call);
	Py_DECREF(func);
	Py_DECREF(hold);
	return 1;
}
