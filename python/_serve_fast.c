/*
 * The common Python call served in C: a PYTHON_CALL of a function sent by
 * name, with no arguments or with the pickle of (args, kwargs), no RRefs
 * nor tensors, not profiled. What _serve._serve_plain does for it, each of
 * its decisions made on the same objects (docs/ARCHITECTURE.md, "Where a
 * Python call's time goes", eighth pass): the payload's head looked up in
 * _marshal._named_heads and its _Named's holds() asked in C, the function
 * called from here; the Python the package keeps for the rest (_serve_call
 * in a context or under a server profiler, async_execution's mark, _dumps,
 * _failed) called as _serve_plain calls it. Anything else, and any doubt
 * before the payload is unpickled, leaves the request to the plain
 * handler, nothing run.
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
	PyObject *sys;           /* the module sys, for sys.modules (holds) */
	PyObject *call_method;   /* _calls._call_method: served by _serve_call */
	PyObject *contexts;      /* the module _contexts (_tls.ctx) */
	PyObject *profiler;      /* the module server_profiler (_active) */
	PyObject *loads;         /* pickle.loads */
	PyObject *serve_call;    /* _serve._serve_call */
	PyObject *is_async;      /* _serve._is_async_execution */
	PyObject *waited;        /* _serve._waited */
	PyObject *dumps;         /* _marshal._dumps */
	PyObject *failed;        /* _serve._failed */
};

/* The tuple (owned; NULL: no fast path) and its items. A call served
 * holds the tuple and a copy of the items: the function it runs may set
 * the handlers again (a test's). */
static PyObject *fast_tuple;
static struct fast_objs fast;

/* The attribute names asked, interned once (names_make). */
static PyObject *s_func, *s_module, *s_mod, *s_scope, *s_name, *s_holds, *s_modules, *s_tls,
	*s_ctx, *s_active, *s_dict;

/* The empty pickle: the reply to a result of None (_serve_plain's b""). */
static PyObject *empty_reply;

/* The names above and the empty reply, made once. 0, or -1 with an
 * exception set. */
static int names_make(void)
{
	static const char *const text[] = { "func", "module", "mod", "scope", "name", "holds",
					    "modules", "_tls", "ctx", "_active", "__dict__" };
	PyObject **names[] = { &s_func, &s_module, &s_mod, &s_scope, &s_name, &s_holds,
			       &s_modules, &s_tls, &s_ctx, &s_active, &s_dict };

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!*names[i] && !(*names[i] = PyUnicode_InternFromString(text[i])))
			return -1;
	if (!empty_reply && !(empty_reply = PyBytes_FromStringAndSize(NULL, 0)))
		return -1;
	return 0;
}

/* module.h says what fast_set and fast_serve return. */
int fast_set(PyObject *objs)
{
	struct fast_objs got = { 0 };

	if (objs && (names_make() ||
		     !PyArg_ParseTuple(objs, "O!O!O!O!OO!O!OOOOOO:set_handler's fast path",
				       &PyDict_Type, &got.heads, &PyType_Type, &got.named_type,
				       &PyType_Type, &got.function_type, &PyModule_Type, &got.sys,
				       &got.call_method, &PyModule_Type, &got.contexts,
				       &PyModule_Type, &got.profiler, &got.loads, &got.serve_call,
				       &got.is_async, &got.waited, &got.dumps, &got.failed)))
		return -1;
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

/* Whether named (a _Named) still finds its function func, as holds()
 * says: for a name without a dot (scope, the module's dict), sys.modules
 * still has that module under its name, and the dict that function under
 * its name, asked here; a dotted name, which _resolve walks, asks holds()
 * itself. 1, 0, or -1 with an exception set. */
static int holds(const struct fast_objs *f, PyObject *named, PyObject *func)
{
	PyObject *scope = PyObject_GetAttr(named, s_scope);
	PyObject *module = PyObject_GetAttr(named, s_module), *mod = PyObject_GetAttr(named, s_mod);
	PyObject *name = PyObject_GetAttr(named, s_name);
	PyObject *modules = PyObject_GetAttr(f->sys, s_modules), *said;
	int rc = scope && module && mod && name && modules ? 0 : -1;

	if (rc == 0 && scope == Py_None) {
		said = PyObject_CallMethodObjArgs(named, s_holds, NULL);
		rc = said ? PyObject_IsTrue(said) : -1;
		Py_XDECREF(said);
	} else if (rc == 0 && PyDict_CheckExact(scope) && PyDict_CheckExact(modules)) {
		rc = PyDict_GetItemWithError(modules, module) == mod &&
		     PyDict_GetItemWithError(scope, name) == func ? 1 : PyErr_Occurred() ? -1 : 0;
	}
	Py_XDECREF(scope);
	Py_XDECREF(module);
	Py_XDECREF(mod);
	Py_XDECREF(name);
	Py_XDECREF(modules);
	return rc;
}

/* The function the head (len bytes at p) names, as _unpack_call finds it:
 * its _Named in _named_heads, which holds. New reference; NULL with no
 * exception where Python must look (a head not cached or no longer
 * holding, an error: cleared, the plain handler meets it again). */
static PyObject *named_func(const struct fast_objs *f, const char *p, size_t len)
{
	PyObject *head = PyBytes_FromStringAndSize(p, (Py_ssize_t)len);
	PyObject *named = head ? PyDict_GetItemWithError(f->heads, head) : NULL, *func = NULL;

	Py_XINCREF(named); /* borrowed from a dict that the lookups below may change */
	if (named && Py_TYPE(named) == (PyTypeObject *)f->named_type &&
	    (func = PyObject_GetAttr(named, s_func)) && holds(f, named, func) != 1)
		Py_CLEAR(func);
	Py_XDECREF(named);
	Py_XDECREF(head);
	PyErr_Clear();
	return func;
}

/* The (args, kwargs) pickled in len bytes at p, a tuple and a dict of
 * exact types, as _pack_call pickles them. New reference; NULL with no
 * exception for anything else, or a pickle that fails (cleared: the plain
 * handler unpickles it again and answers as it does). */
static PyObject *call_loaded(const struct fast_objs *f, const char *p, size_t len)
{
	PyObject *data = PyBytes_FromStringAndSize(p, (Py_ssize_t)len);
	PyObject *call = data ? PyObject_CallFunctionObjArgs(f->loads, data, NULL) : NULL;

	Py_XDECREF(data);
	if (call && (!PyTuple_CheckExact(call) || PyTuple_Size(call) != 2 ||
		     !PyTuple_CheckExact(PyTuple_GetItem(call, 0)) ||
		     !PyDict_CheckExact(PyTuple_GetItem(call, 1))))
		Py_CLEAR(call);
	PyErr_Clear();
	return call;
}

/* Whether _serve_plain serves a call of func through _serve_call: func
 * is _call_method, this thread is in a distributed autograd context
 * (_contexts._tls.ctx not None), or a server profiler records
 * (server_profiler._active), each asked only if the one before is not so,
 * as Python's `or`. 1, 0, or -1 with an exception set. */
static int general_way(const struct fast_objs *f, PyObject *func)
{
	PyObject *tls, *ctx, *active;
	int rc;

	if (func == f->call_method)
		return 1;
	if (!(tls = PyObject_GetAttr(f->contexts, s_tls)))
		return -1;
	ctx = PyObject_GetAttr(tls, s_ctx);
	Py_DECREF(tls);
	if (!ctx || ctx != Py_None) {
		Py_XDECREF(ctx);
		return ctx ? 1 : -1;
	}
	Py_DECREF(ctx);
	if (!(active = PyObject_GetAttr(f->profiler, s_active)))
		return -1;
	rc = PyObject_IsTrue(active);
	Py_DECREF(active);
	return rc;
}

/* result, or, for a function that may carry async_execution's mark (not a
 * plain function, or one with attributes: _serve_plain's test, made after
 * the call as there) and does (_is_async_execution), the value of the
 * Future it returned (_waited). Steals result; NULL with an exception
 * set. */
static PyObject *async_waited(const struct fast_objs *f, PyObject *func, PyObject *result)
{
	PyObject *dict = NULL, *mark = NULL, *value;
	int maybe = Py_TYPE(func) != (PyTypeObject *)f->function_type;

	if (!maybe)
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

/* _serve_call(func, args, kwargs, caller, None, None), call being
 * (args, kwargs), or NULL for a call without arguments, given as () and
 * {} as _unpack_call gives them: the reply to a call in a context, under a
 * server profiler, or of _call_method. New reference; NULL with an
 * exception set. */
static PyObject *general_reply(const struct fast_objs *f, uint32_t caller, PyObject *func,
			       PyObject *call)
{
	PyObject *args = call ? new_ref(PyTuple_GetItem(call, 0)) : PyTuple_New(0);
	PyObject *kwargs = call ? new_ref(PyTuple_GetItem(call, 1)) : PyDict_New();
	PyObject *who = PyLong_FromUnsignedLong(caller), *reply = NULL;

	if (args && kwargs && who)
		reply = PyObject_CallFunctionObjArgs(f->serve_call, func, args, kwargs, who, Py_None,
						     Py_None, NULL);
	Py_XDECREF(args);
	Py_XDECREF(kwargs);
	Py_XDECREF(who);
	return reply;
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

/* The reply to the call of func (call: as called's), as _serve_plain's try
 * block makes it: _serve_call's where general_way says so; else the
 * function's result, waited for if async_execution's (async_waited), the
 * empty pickle for None, _dumps' otherwise. _serve_plain's last test, a
 * reply of _LIVE, is not made: only a remote call's can be one. New
 * reference; NULL with an exception set. */
static PyObject *call_reply(const struct fast_objs *f, uint32_t caller, PyObject *func,
			    PyObject *call)
{
	PyObject *result, *reply;
	int general = general_way(f, func);

	if (general)
		return general > 0 ? general_reply(f, caller, func, call) : NULL;
	if ((result = called(func, call)))
		result = async_waited(f, func, result);
	if (result == Py_None) {
		Py_DECREF(result);
		return new_ref(empty_reply);
	}
	reply = result ? PyObject_CallFunctionObjArgs(f->dumps, result, NULL) : NULL;
	Py_XDECREF(result);
	return reply;
}

/* _failed(e) of the exception pending (what the function raised: the
 * callee prints it, and the caller gets its type, text and traceback), as
 * _serve_plain's except clause answers, the traceback set on it as that
 * clause sets it (3.11's interpreter has set it already; the stable ABI
 * runs on older ones). New reference; NULL with an exception set if
 * _failed raises, as the plain handler would then. */
static PyObject *failed_reply(const struct fast_objs *f)
{
	PyObject *type, *value, *tb, *reply;

	PyErr_Fetch(&type, &value, &tb);
	PyErr_NormalizeException(&type, &value, &tb);
	if (tb)
		PyException_SetTraceback(value, tb);
	reply = PyObject_CallFunctionObjArgs(f->failed, value, NULL);
	Py_XDECREF(type);
	Py_XDECREF(value);
	Py_XDECREF(tb);
	return reply;
}

int fast_serve(uint32_t caller, const struct python_request *in,
	       const struct profile_events *ops, PyObject **reply)
{
	const struct python_msg *m = &in->msg;
	const struct fast_objs f = fast;
	const char *p = m->data;
	PyObject *hold = fast_tuple, *func, *call = NULL;
	size_t head = 0;

	if (!hold || ops || in->type != MSG_PYTHON_CALL || in->rref_id || m->nrrefs ||
	    m->ntensors || !(head = head_len(p, m->len)) || !args_served(p, m->len, head))
		return 0;
	Py_INCREF(hold);
	if (!(func = named_func(&f, p, head)) ||
	    (head < m->len && !(call = call_loaded(&f, p + head, m->len - head)))) {
		Py_XDECREF(func);
		Py_DECREF(hold);
		return 0;
	}
	if (!(*reply = call_reply(&f, caller, func, call)))
		*reply = failed_reply(&f);
	Py_XDECREF(call);
	Py_DECREF(func);
	Py_DECREF(hold);
	return 1;
}
