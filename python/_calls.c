/* Calls sent from Python: call() (rpc_sync, rpc_async, autograd's), remote(), RRef(value). */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "python/module.h"
#include "worker/python_api.h"

/* The rank of the worker named by the str name: >= 0, shmrpc's -errno,
 * or INT_MIN with Python's error set (name is no str, or no worker's: a
 * NUL inside it would end the C string early, and "worker1\0x" would
 * name worker1 where torch finds no such worker). */
int rank_named(PyObject *name)
{
	/* The last name found and its rank, in agent job (python_agent_job):
	 * a call by name most often names the last call's worker, by the same
	 * str object, and then neither its UTF-8 is made nor the workers'
	 * names read (about 300 instructions a call). Under the GIL. */
	static struct {
		PyObject *name;
		int rank;
		uint64_t job;
	} last;
	uint64_t job = python_agent_job();
	PyObject *utf8;
	Py_ssize_t n;
	char *s;
	int r;

	if (job && job == last.job && name == last.name)
		return last.rank;
	if (!(utf8 = PyUnicode_AsUTF8String(name)))
		return INT_MIN;
	if (PyBytes_AsStringAndSize(utf8, &s, &n)) {
		r = INT_MIN;
	} else if (memchr(s, '\0', (size_t)n)) {
		PyErr_Format(PyExc_RuntimeError, "no worker named \"%U\" in this job", name);
		r = INT_MIN;
	} else {
		r = python_rank_named(s);
	}
	Py_DECREF(utf8);
	if (r >= 0 && job) {
		PyObject *old = last.name;

		last.name = new_ref(name);
		last.rank = r;
		last.job = job;
		Py_XDECREF(old); /* a str's deallocation runs no code */
	}
	return r;
}

/* call(dst, pickle, [RRef...], [Tensor...], timeout_ms, kind=None, fn=None,
 * type=PYTHON_CALL, context_id=-1, message_id=0, retain_graph=False,
 * torch_profile=0) -> Future; kind and fn name it for the profiler;
 * type is PYTHON_CALL or one of distributed autograd's requests
 * (worker/python.h says which of the other arguments each one carries);
 * torch_profile: profiled for torch's profiler (Future.profiled) when
 * nonzero, with its profile's options as PROFILE_SHAPES, PROFILE_MEMORY.
 * Every argument may be positional: a call given no keyword skips the
 * lookup of each name left in a keyword dict (a string made and a dict
 * lookup per name: 4.5 % of a Python rpc_sync caller's time when
 * torch_profile was a keyword-only argument, given every time). */
static PyObject *mod_call(PyObject *m, PyObject *args, PyObject *kw)
{
	static char *names[] = { "dst", "pickle", "rrefs", "tensors", "timeout_ms", "kind", "fn",
				 "type", "context_id", "message_id", "retain_graph",
				 "torch_profile", NULL };
	struct python_request rq = { .type = MSG_PYTHON_CALL, .wrapped = MSG_PYTHON_CALL };
	shmrpc_future *f = NULL;
	PyObject *pickled, *rrefs, *tensors;
	const char *kind = NULL, *fn = NULL;
	long long timeout, context_id = -1, message_id = 0;
	unsigned torch = 0;
	int dst, retain = 0, rc;

	(void)m;
	if (!PyArg_ParseTupleAndKeywords(args, kw, "iSOOL|zzHLLpI", names, &dst, &pickled, &rrefs,
					 &tensors, &timeout, &kind, &fn, &rq.type, &context_id,
					 &message_id, &retain, &torch) ||
	    msg_from_py(pickled, rrefs, tensors, &rq.msg))
		return NULL;
	rq.context_id = (int64_t)context_id;
	rq.message_id = (int64_t)message_id;
	rq.retain_graph = retain;
	python_call_begin(kind, fn, torch, kind && !strcmp(kind, "rpc_sync"));
	/* The GIL stays: msg borrows from the objects (and a send is short). */
	rc = python_request_async(dst, &rq, (int64_t)timeout, &f);
	python_call_end();
	msg_free(&rq.msg);
	return rc ? fail(rc) : future_wrap(f);
}

/* remote(dst, pickle, [RRef...], [Tensor...], timeout_ms, fn=None,
 * type=PYTHON_REMOTE_CALL, context_id=-1, message_id=0, torch_profile=0)
 * -> RRef, every argument positional or not, as call()'s; type is
 * PYTHON_REMOTE_CALL or, inside a distributed autograd context
 * (context_id, message_id), FORWARD_AUTOGRAD_REQ wrapping one;
 * torch_profile as call()'s (RRef.profiled). */
static PyObject *mod_remote(PyObject *m, PyObject *args, PyObject *kw)
{
	static char *names[] = { "dst", "pickle", "rrefs", "tensors", "timeout_ms", "fn", "type",
				 "context_id", "message_id", "torch_profile", NULL };
	struct python_request rq = { .type = MSG_PYTHON_REMOTE_CALL,
				     .wrapped = MSG_PYTHON_REMOTE_CALL };
	shmrpc_rref *r = NULL;
	PyObject *pickled, *rrefs, *tensors;
	const char *fn = NULL;
	long long timeout, context_id = -1, message_id = 0;
	unsigned torch = 0;
	int dst, rc;

	(void)m;
	if (!PyArg_ParseTupleAndKeywords(args, kw, "iSOOL|zHLLI", names, &dst, &pickled, &rrefs,
					 &tensors, &timeout, &fn, &rq.type, &context_id,
					 &message_id, &torch) ||
	    msg_from_py(pickled, rrefs, tensors, &rq.msg))
		return NULL;
	rq.context_id = (int64_t)context_id;
	rq.message_id = (int64_t)message_id;
	python_call_begin("rpc_remote", fn, torch, false);
	rc = python_remote(dst, &rq, (int64_t)timeout, &r);
	python_call_end();
	msg_free(&rq.msg);
	return rc ? fail(rc) : rref_wrap(r);
}

/* rref_local(pickled, live) -> RRef: RRef(value) here, ready at once
 * (python_rref_local): its value the pickle, or, live, the package's own
 * object, which it keeps under the RRef's id from now on. */
static PyObject *mod_rref_local(PyObject *m, PyObject *args)
{
	const char *pickled;
	Py_ssize_t len;
	int live, rc;
	shmrpc_rref *r;

	(void)m;
	if (!PyArg_ParseTuple(args, "y#p", &pickled, &len, &live))
		return NULL;
	if ((size_t)len > UINT32_MAX) {
		PyErr_SetString(PyExc_ValueError, "RRef(value): the value's pickle is over 4 GiB");
		return NULL;
	}
	rc = python_rref_local(pickled, (uint32_t)len, live, &r);
	return rc ? fail(rc) : rref_wrap(r);
}

/* ---- rpc_sync's common call, made in C ---- */

/*
 * rpc_sync, rpc_async and remote() (to, func, args, kwargs, timeout) as
 * shmrpc/_calls.py makes them, for the call most programs make: a
 * module's function sent by name, with arguments in a tuple and keywords
 * in a dict (none, scalars and common tensors packed here, any others by
 * _marshal._pack_args, as the Python path packs them), the default
 * timeout, outside a distributed autograd context, not recorded by torch's
 * profiler, under the default pickler, to a worker named by a str or an
 * int. Each of these is read from the package's own state as its Python
 * reads it (rpc_sync_setup gives the objects), so the two paths cannot
 * disagree; any other call returns the package's sentinel with nothing
 * done, and the Python path makes it. The Python path ran 12 Python
 * functions on an empty call's caller (docs/ARCHITECTURE.md).
 */
static struct {
	PyObject *general;	 /* returned for a call the Python path makes */
	PyObject *marshal;	 /* shmrpc._marshal: _pack_args, _proxy_func */
	PyObject *function_type; /* types.FunctionType */
	PyObject *named;	 /* _marshal._named(func) -> _Named or None */
	PyObject *pack_args;	 /* _marshal._pack_args(named, args, kwargs) */
	PyObject *proxy_func;	 /* _marshal._proxy_func: the proxies' _calls._call_method */
	PyObject *result;	 /* _marshal._result(msg) */
	PyObject *remote_exc;	 /* _core.RemoteException */
	PyObject *not_sent;	 /* _calls._NotSent */
	PyObject *timed_out;	 /* _core._RpcTimeout */
	PyObject *dumps, *loads; /* pickle's */
	PyObject *protocol;	 /* pickle.HIGHEST_PROTOCOL */
	PyObject *no_kwargs;	 /* {}, the kwargs pickled beside scalars */
	PyObject *no_args;	 /* (), args=None's */
	PyObject *funcs;	 /* {func: entry}, see func_entry */
	PyObject *torch_on;	 /* torch.autograd._profiler_enabled, once torch is met */
	PyObject *rref_type;	 /* _calls.RRef */
	PyObject *object_new;	 /* object.__new__, which makes an RRef without __init__ */
} fast;

/* How many calls rpc_sync and rpc_remote made here, and RRef values
 * rref_value read (common_calls, for the tests that check which calls
 * take this path); under the GIL. */
static unsigned long long common_count;

/* The attribute names read on each call, interned once. */
static PyObject *s_module, *s_qualname, *s_torch, *s_r;

/* Whether the package's state lets a call be the common one: initialized,
 * no timeout of _set_rpc_timeout's, the default pickler checked. The
 * package says so at each change (_core._state_changed, set_call_state),
 * rather than C reading its four module attributes on every call (about
 * 600 instructions). Under the GIL. */
static bool call_state_common;

/* What an RRef's value is when its owner keeps it live (_marshal._LIVE,
 * worker/python.h): a user's to_here asks the owner for it. */
#define LIVE_MARK '\x02'

/* A function's entry in fast.funcs: its _Named (named), what _Named knows
 * of it (head, the payload's reference; tensors_head, a call of tensors
 * alone's; module and name, the reference; mod and scope, the module and
 * its dict that must still find the function, scope None where the name
 * has a dot; qualname, the function's __qualname__, which name is but for
 * a builtin found by a shorter one), and fn, its name for the profiler
 * (_func_name's, qualname) in UTF-8. */
enum { E_NAMED, E_HEAD, E_TENSORS_HEAD, E_MODULE, E_MOD, E_SCOPE, E_NAME, E_QUALNAME, E_FN, E_N };

/* A Python function's __module__ and __qualname__, read through their
 * descriptors on types.FunctionType (learnt at rpc_sync_setup): data
 * descriptors, which nothing in a function's __dict__ shadows, so the
 * value is getattr's, without its lookup on the type (about 70
 * instructions each). */
static struct known_attr f_module = { .name = &s_module }, f_qualname = { .name = &s_qualname };

/* Whether o's attribute (a, or by name where a is NULL) is want: 1, 0, or
 * -1 with an exception. */
static int attr_is(PyObject *o, const struct known_attr *a, PyObject *name, PyObject *want)
{
	PyObject *v = a ? known_attr_get(a, o) : attr_of(o, name);

	if (!v)
		return -1;
	Py_DECREF(v); /* only its identity is compared */
	return v == want;
}

/* A new entry from named, a _Named; NULL with an exception set, also
 * for a name with a NUL in it: the Python path refuses that name
 * (call()'s fn, a C string: "embedded null character"), and here it would
 * end the profiler's name early, and the payload's head would name
 * another function (the callee reads the name up to its first NUL). */
static PyObject *entry_new(PyObject *named)
{
	static const char *slots[] = { "head", "tensors_head", "module", "mod", "scope", "name",
				       "qualname" };
	PyObject *e = PyTuple_New(E_N), *fn;

	if (!e)
		return NULL;
	PyTuple_SetItem(e, E_NAMED, new_ref(named)); /* steals the new reference */
	for (int i = E_HEAD; i < E_FN; i++) {
		PyObject *v = PyObject_GetAttrString(named, slots[i - E_HEAD]);

		if (!v) {
			Py_DECREF(e);
			return NULL;
		}
		PyTuple_SetItem(e, i, v);
	}
	if (!(fn = PyUnicode_AsUTF8String(PyTuple_GetItem(e, E_QUALNAME)))) {
		Py_DECREF(e);
		return NULL;
	}
	PyTuple_SetItem(e, E_FN, fn);
	/* A builtin's names are C strings: only a function's may hold a NUL,
	 * and its qualname is its name. */
	if (memchr(PyBytes_AsString(fn), '\0', (size_t)PyBytes_Size(fn))) {
		PyErr_SetString(PyExc_ValueError, "embedded null character");
		Py_CLEAR(e);
	}
	return e;
}

/* Whether entry e of func still holds, as _Named.holds asks (the module
 * in sys.modules and its name in the module's dict still find func; a
 * dotted name by holds itself) and func still has the names it was
 * entered under (a reassigned __qualname__ would make _named look under
 * the new one; a builtin's cannot be reassigned): 1, 0, or -1. */
static int entry_holds(PyObject *e, PyObject *func)
{
	int r = name_holds(PyTuple_GetItem(e, E_NAMED), PyTuple_GetItem(e, E_MODULE),
			   PyTuple_GetItem(e, E_MOD), PyTuple_GetItem(e, E_SCOPE),
			   PyTuple_GetItem(e, E_NAME), func);

	bool function = (PyObject *)Py_TYPE(func) == fast.function_type;

	if (r == 1 &&
	    (r = attr_is(func, function ? &f_module : NULL, s_module,
			 PyTuple_GetItem(e, E_MODULE))) == 1 &&
	    function)
		r = attr_is(func, &f_qualname, s_qualname, PyTuple_GetItem(e, E_QUALNAME));
	return r;
}

/* func's entry (a new reference) when it is a function sent by a name
 * that still finds it, made from _marshal._named the first time; NULL
 * otherwise, or with an exception set. The entries are bounded: functions
 * made anew under one name (each entered once) clear them at 256. The
 * entry is held, not borrowed from fast.funcs: _named and a dotted name's
 * holds run Python code (a class's __getattribute__, a switch to another
 * thread) that may make calls which clear the dict or replace the entry,
 * and the caller uses it after that. */
static PyObject *func_entry(PyObject *func)
{
	PyObject *e = PyDict_GetItemWithError(fast.funcs, func), *named;

	if (e) {
		Py_INCREF(e);
	} else if (!PyErr_Occurred()) {
		if (!(named = PyObject_CallFunctionObjArgs(fast.named, func, NULL)))
			return NULL;
		e = named == Py_None ? NULL : entry_new(named);
		Py_DECREF(named);
		if (!e)
			return NULL;
		if (PyDict_Size(fast.funcs) >= 256)
			PyDict_Clear(fast.funcs);
		if (PyDict_SetItem(fast.funcs, func, e)) {
			Py_DECREF(e);
			return NULL;
		}
	}
	if (e && entry_holds(e, func) != 1)
		Py_CLEAR(e);
	return e;
}

/* Whether torch's profiler may record a call made now: torch is loaded
 * and its profiler on in this thread (the Python path asks the rest,
 * profiler.torch_profiling, which may still send it unprofiled): 1, 0,
 * -1. torch, once met, stays: a module taken out of sys.modules is still
 * the one whose profiler a program's torch calls go to. */
static int torch_may_profile(void)
{
	PyObject *torch, *autograd, *on;
	int r;

	if (!fast.torch_on) {
		torch = PyDict_GetItemWithError(PyImport_GetModuleDict(), s_torch);
		if (!torch || torch == Py_None)
			return PyErr_Occurred() ? -1 : 0;
		if ((autograd = PyObject_GetAttrString(torch, "autograd")))
			fast.torch_on = PyObject_GetAttrString(autograd, "_profiler_enabled");
		Py_XDECREF(autograd);
		if (!fast.torch_on)
			return -1;
	}
	if (!(on = PyObject_CallObject(fast.torch_on, NULL)))
		return -1;
	r = PyObject_IsTrue(on);
	Py_DECREF(on);
	return r;
}

/* The rank of to, a str or an int (not a bool), or -1 for any other (a
 * WorkerInfo, a name no worker has: the Python path words its error). */
static int rank_to(PyObject *to)
{
	long r;

	if (PyUnicode_CheckExact(to)) {
		r = rank_named(to);
		if (r == INT_MIN)
			PyErr_Clear();
		return r < 0 ? -1 : (int)r;
	}
	if (!PyLong_CheckExact(to))
		return -1;
	r = PyLong_AsLong(to);
	if (r == -1 && PyErr_Occurred())
		PyErr_Clear();
	return r < 0 || r > INT_MAX ? -1 : (int)r;
}

/* Whether a call made now with this timeout is the common one: timeout
 * unset, the package's state common (call_state_common), no autograd
 * context in this thread, torch's profiler off: 1, 0, -1. */
static int state_common(PyObject *timeout)
{
	int r;

	if (timeout != Py_None && !(PyFloat_CheckExact(timeout) && PyFloat_AsDouble(timeout) == -1.0))
		return 0;
	if (!call_state_common || thread_in_context())
		return 0;
	return (r = torch_may_profile()) < 0 ? -1 : !r;
}

/* set_call_state(common): what the package's state now says (_core.
 * _state_changed). */
static PyObject *mod_set_call_state(PyObject *m, PyObject *common)
{
	int r = PyObject_IsTrue(common);

	(void)m;
	if (r < 0)
		return NULL;
	call_state_common = r;
	return new_ref(Py_None);
}

/* A common call's tensors: its arguments' handles (torch_tensors_of),
 * its own; in few for up to four. */
struct call_tensors {
	shmrpc_tensor **t;
	uint32_t n;
	shmrpc_tensor *few[4];
};

/* ct's handles freed (a handle the request's pin took over is spent: its
 * free drops nothing), ct left empty. */
static void call_tensors_free(struct call_tensors *ct)
{
	for (uint32_t i = 0; i < ct->n; i++)
		shmrpc_tensor_free(ct->t[i]);
	if (ct->t != ct->few)
		PyMem_Free(ct->t);
	ct->t = NULL;
	ct->n = 0;
}

/* The tensors of args, made into ct (empty: ct->n 0) when every argument
 * is the common tensor: 1, 0 (none made), -1 with an exception set. */
static int call_tensors_of(PyObject *args, struct call_tensors *ct)
{
	Py_ssize_t n = PyTuple_Size(args);
	int ok;

	ct->t = n <= (Py_ssize_t)(sizeof(ct->few) / sizeof(*ct->few)) ? ct->few
		: PyMem_Malloc((size_t)n * sizeof(*ct->t));
	if (!ct->t) {
		PyErr_NoMemory();
		return -1;
	}
	if ((ok = torch_tensors_of(args, ct->t)) == 1)
		ct->n = (uint32_t)n;
	else
		call_tensors_free(ct);
	return ok;
}

/* A common call's message: payload, its bytes (for a call of func's
 * entry e: head, then what the arguments add), and its tensors, either
 * handles made here (ct: the call's own, given) or the RRefs and tensors
 * of _marshal._pack_args's (data, rrefs, tensors) (packed: the message
 * borrows their handles and has arrays of its own); a proxy's call's one
 * RRef (rref, the handle of held, the C RRef object). */
struct call_args {
	PyObject *payload;
	PyObject *packed;
	struct call_tensors ct;
	PyObject *held;
	shmrpc_rref *rref;
	struct python_msg msg;
};

/* ca's references and arrays dropped. */
static void call_args_free(struct call_args *ca)
{
	Py_CLEAR(ca->payload);
	Py_CLEAR(ca->held);
	if (ca->packed) {
		msg_free(&ca->msg);
		Py_CLEAR(ca->packed);
	}
	call_tensors_free(&ca->ct);
}

/* The pickle of (args, {}) after head when it fits in the frame (past
 * _marshal._INLINE_MAX it travels in the pool: Py_None, for _pack_args);
 * NULL with an exception set. */
static PyObject *scalars_payload(PyObject *head, PyObject *args)
{
	PyObject *pair = PyTuple_Pack(2, args, fast.no_kwargs), *data, *out;
	Py_ssize_t hlen = PyBytes_Size(head), dlen;

	if (!pair)
		return NULL;
	out = scalar_pickle(head, pair); /* within the frame: fits in 512 bytes */
	if (out == Py_None) {
		Py_DECREF(out);
		data = PyObject_CallFunctionObjArgs(fast.dumps, pair, fast.protocol, NULL);
		out = NULL;
		if (data) {
			dlen = PyBytes_Size(data);
			out = dlen > 16 * 1024 ? new_ref(Py_None)
					       : PyBytes_FromStringAndSize(NULL, hlen + dlen);
			if (out && out != Py_None) {
				memcpy(PyBytes_AsString(out), PyBytes_AsString(head), (size_t)hlen);
				memcpy(PyBytes_AsString(out) + hlen, PyBytes_AsString(data),
				       (size_t)dlen);
			}
			Py_DECREF(data);
		}
	}
	Py_DECREF(pair);
	return out;
}

/* The payload of a call of common tensors beside what scalar_pickle
 * writes (scalars, tuples of them, an empty dict): head, and the pickle
 * of (args, {}) with each tensor a BINPERSID of its index, its handle in
 * ct (none, for arguments that scalars() refuses and scalar_pickle
 * writes: the callee reads them as scalars'); Py_None (ct empty) where the
 * arguments are not those, or do not fit in scalar_pickle's budget; NULL
 * with an exception set (ct empty). */
static PyObject *mixed_payload(PyObject *head, PyObject *args, struct call_tensors *ct)
{
	_Static_assert(sizeof(ct->few) / sizeof(*ct->few) >= TORCH_TAKEN_MAX, "ct holds them");
	struct torch_taken tk = { .n = 0 };
	PyObject *pair = PyTuple_Pack(2, args, fast.no_kwargs), *out;

	if (!pair)
		return NULL;
	out = scalar_pickle_tensors(head, pair, torch_tensor_index, &tk);
	Py_DECREF(pair);
	ct->t = ct->few;
	memcpy(ct->few, tk.t, tk.n * sizeof(*tk.t));
	ct->n = tk.n;
	if (out == Py_None || !out)
		call_tensors_free(ct);
	return out;
}

/* ca from _marshal._pack_args(named, args, kwargs): 0, or -1 with an
 * exception set. */
static int packed_args(PyObject *named, PyObject *args, PyObject *kwargs, struct call_args *ca)
{
	PyObject *p = PyObject_CallFunctionObjArgs(fast.pack_args, named, args, kwargs, NULL);

	if (!p)
		return -1;
	if (!PyTuple_CheckExact(p) || PyTuple_Size(p) != 3 || !PyBytes_CheckExact(PyTuple_GetItem(p, 0))) {
		PyErr_SetString(PyExc_TypeError, "_pack_args gave no (data, rrefs, tensors)");
		Py_DECREF(p);
		return -1;
	}
	if (msg_from_py(PyTuple_GetItem(p, 0), PyTuple_GetItem(p, 1), PyTuple_GetItem(p, 2),
			&ca->msg)) {
		Py_DECREF(p);
		return -1;
	}
	ca->packed = p;
	ca->payload = new_ref(PyTuple_GetItem(p, 0));
	return 0;
}

/* b, the concatenation of the n parts: a new bytes object, or NULL with
 * an exception set. */
static PyObject *bytes_of(const void *const *part, const Py_ssize_t *len, int n)
{
	Py_ssize_t all = 0;
	PyObject *b;
	char *at;

	for (int i = 0; i < n; i++)
		all += len[i];
	if (!(b = PyBytes_FromStringAndSize(NULL, all)))
		return NULL;
	at = PyBytes_AsString(b);
	for (int i = 0; i < n; i++) {
		memcpy(at, part[i], (size_t)len[i]);
		at += len[i];
	}
	return b;
}

/* A proxy's call, args (name, rref, scalars...) of the proxies' function,
 * in the _PROXY form as _pack_args writes it (_marshal._proxied says
 * when): head, the mark, the method's name, a NUL, then the pickle of the
 * other arguments' tuple or nothing; the RRef the message's one. 1 with
 * ca's payload and RRef made, 0 where args do not take that form, -1 with
 * an exception set. */
static int proxy_args(PyObject *head, PyObject *args, struct call_args *ca)
{
	Py_ssize_t n = PyTuple_Size(args);
	PyObject *name = n >= 2 ? PyTuple_GetItem(args, 0) : NULL, *rest = NULL, *utf8 = NULL;
	PyObject *data = NULL, *r = NULL;
	int rc = -1;

	if (!name || !PyUnicode_CheckExact(name) ||
	    (PyObject *)Py_TYPE(PyTuple_GetItem(args, 1)) != fast.rref_type)
		return 0;
	if (!(rest = PyTuple_GetSlice(args, 2, n)) || !(utf8 = PyUnicode_AsUTF8String(name)))
		goto out;
	rc = 0;
	if (!scalars(rest) || memchr(PyBytes_AsString(utf8), 0, (size_t)PyBytes_Size(utf8)) ||
	    !(r = PyObject_GetAttr(PyTuple_GetItem(args, 1), s_r)) ||
	    !PyObject_TypeCheck(r, (PyTypeObject *)RRefType) || !HANDLE(r))
		goto out; /* _pack_args packs it otherwise, and says what is wrong */
	rc = -1;
	if (n == 2)
		data = PyBytes_FromStringAndSize(NULL, 0);
	else if ((data = scalar_pickle(NULL, rest)) == Py_None) {
		Py_DECREF(data);
		data = PyObject_CallFunctionObjArgs(fast.dumps, rest, fast.protocol, NULL);
	}
	if (data) {
		const void *part[] = { PyBytes_AsString(head), "\x04", PyBytes_AsString(utf8), "",
				       PyBytes_AsString(data) };
		const Py_ssize_t len[] = { PyBytes_Size(head), 1, PyBytes_Size(utf8), 1,
					   PyBytes_Size(data) };

		if ((ca->payload = bytes_of(part, len, 5))) {
			ca->held = new_ref(r);
			ca->rref = HANDLE(r);
			rc = 1;
		}
	}
out:
	if (rc < 0 && !PyErr_Occurred())
		rc = 0;
	Py_XDECREF(rest);
	Py_XDECREF(utf8);
	Py_XDECREF(data);
	Py_XDECREF(r);
	if (rc == 0)
		PyErr_Clear();
	return rc;
}

/* The arguments of a call of func's entry e, made into ca as _pack_call
 * makes them: none, head; scalars alone, head and the pickle of (args,
 * {}); common tensors alone, tensors_head and their handles; scalars and
 * common tensors, head and that pickle with the tensors by index
 * (mixed_payload: what _pack_args's _dumps writes too); any other,
 * _pack_args's. 0, or -1 with an exception set (for the Python path to
 * raise in its own words when it is a Python one: it makes the call
 * again), ca empty. */
static int call_args_of(PyObject *func, PyObject *e, PyObject *args, PyObject *kwargs,
			struct call_args *ca)
{
	PyObject *head = PyTuple_GetItem(e, E_HEAD);
	int ok = 0;

	*ca = (struct call_args){ 0 };
	if (kwargs == Py_None || PyDict_Size(kwargs) == 0) {
		if (PyTuple_Size(args) == 0)
			ca->payload = new_ref(head);
		else if (func == fast.proxy_func && (ok = proxy_args(head, args, ca)) != 0) {
			if (ok < 0)
				return -1;
		} else if (scalars(args)) {
			if (!(ca->payload = scalars_payload(head, args)))
				return -1;
			if (ca->payload == Py_None)
				Py_CLEAR(ca->payload);
		} else if ((ok = call_tensors_of(args, &ca->ct)) == 1) {
			ca->payload = new_ref(PyTuple_GetItem(e, E_TENSORS_HEAD));
		} else if (ok < 0) {
			return -1;
		} else if (torch_known()) {
			if (!(ca->payload = mixed_payload(head, args, &ca->ct)))
				return -1;
			if (ca->payload == Py_None)
				Py_CLEAR(ca->payload);
		}
	}
	if (!ca->payload)
		return packed_args(PyTuple_GetItem(e, E_NAMED), args, kwargs, ca);
	ca->msg = (struct python_msg){ .data = PyBytes_AsString(ca->payload),
				       .len = (size_t)PyBytes_Size(ca->payload),
				       .rrefs = ca->held ? &ca->rref : NULL,
				       .nrrefs = ca->held ? 1 : 0,
				       .tensors = ca->ct.t,
				       .ntensors = ca->ct.n };
	return 0;
}

/* The error set now replaced by make(*its args), or make(str(it)) when
 * by_text, raised as the Python path raises it inside its except with
 * `from None` (_send_call's _NotSent, _core._c_wait's _RpcTimeout): its
 * __context__ the error replaced, its __cause__ None, the context
 * suppressed. Set by PyErr_Restore: PyErr_SetObject would make its
 * context the exception the caller is handling, and show that one with
 * it. Always leaves an error set (make's own if that failed). */
static void raise_from_none(PyObject *make, bool by_text)
{
	PyObject *type, *value, *tb, *args = NULL, *text, *exc = NULL;

	PyErr_Fetch(&type, &value, &tb);
	PyErr_NormalizeException(&type, &value, &tb);
	if (tb)
		PyException_SetTraceback(value, tb);
	if (!by_text) {
		args = PyObject_GetAttrString(value, "args");
	} else if ((text = PyObject_Str(value))) {
		args = PyTuple_Pack(1, text);
		Py_DECREF(text);
	}
	if (args)
		exc = PyObject_CallObject(make, args);
	if (exc) {
		PyException_SetContext(exc, value); /* steals value */
		PyException_SetCause(exc, NULL);    /* and suppresses the context */
		PyErr_Restore(new_ref((PyObject *)Py_TYPE(exc)), exc, NULL);
	} else {
		Py_XDECREF(value);
	}
	Py_XDECREF(args);
	Py_XDECREF(type);
	Py_XDECREF(tb);
}

/* The call's message sent (kind, rpc_sync's or rpc_async's, for the
 * profiler): its Future in *f, or -1 with _calls' errors set (_NotSent for
 * a RuntimeError, as _send_call words it). */
static int common_send(const char *kind, int dst, PyObject *e, const struct call_args *ca,
		       shmrpc_future **f)
{
	/* give: the handles made here are the call's own, freed after the send. */
	struct python_request rq = { .type = MSG_PYTHON_CALL, .wrapped = MSG_PYTHON_CALL,
				     .context_id = -1, .give = !ca->packed, .msg = ca->msg };
	int rc;

	python_call_begin(kind, PyBytes_AsString(PyTuple_GetItem(e, E_FN)), 0,
			  !strcmp(kind, "rpc_sync"));
	rc = python_request_async(dst, &rq, SHMRPC_TIMEOUT_DEFAULT, f);
	python_call_end();
	if (!rc)
		return 0;
	fail(rc);
	if (PyErr_ExceptionMatches(PyExc_RuntimeError))
		raise_from_none(fast.not_sent, true);
	return -1;
}

/* The torch tensor that a value of one common tensor is (_marshal._TENSORS:
 * the mark, no pickle, one handle), from its message m, as _result gives
 * it; NULL with an exception set. */
static PyObject *tensor_value(const struct python_msg *m, bool take)
{
	PyObject *tuple = torch_of_handles(m->tensors, 1, take), *t = NULL;

	if (tuple)
		t = new_ref(PyTuple_GetItem(tuple, 0));
	Py_XDECREF(tuple);
	return t;
}

/* The value of the completed call or fetch f, as _marshal._result gives
 * it: the empty pickle None, a bare pickle unpickled here, one common
 * tensor taken here, a tuple of scalars and common tensors read here
 * (_dumps.c), anything else (RRefs, other tensors, a
 * RemoteException to raise) by _result itself; the live mark (an RRef's
 * value its owner keeps, _marshal._LIVE) is fast.general, no error set.
 * take: f is the caller's alone, and read once (rpc_sync's): its tensor
 * gives its reference to the torch tensor (torch_of_handles). */
static PyObject *reply_value(shmrpc_future *f, bool take)
{
	const shmrpc_value *v = shmrpc_future_value(f);
	struct arena a = { 0 };
	struct python_msg m;
	PyObject *data, *value = NULL, *msg;
	bool ok = v && python_reply_of(v, &a, &m) == 0, bare = ok && !m.nrrefs && !m.ntensors;
	bool tensor = ok && !m.nrrefs && m.ntensors == 1 && m.len == 1 &&
		      *(const char *)m.data == TENSORS_MARK && torch_known();
	/* A tuple of scalars and common tensors (_dumps.c): read here where it
	 * is that alone, else by _result. */
	bool mixed = ok && !m.nrrefs && m.ntensors && !tensor && m.len &&
		     *(const unsigned char *)m.data == 0x80 && torch_known();
	int is_exc;

	if (bare && !m.len)
		value = new_ref(Py_None);
	else if (bare && m.len == 1 && *(const char *)m.data == LIVE_MARK)
		value = new_ref(fast.general);
	else if (bare && !(value = scalar_unpickle(m.data, m.len)) && !PyErr_Occurred() &&
		 (data = PyBytes_FromStringAndSize(m.data, (Py_ssize_t)m.len))) {
		value = PyObject_CallFunctionObjArgs(fast.loads, data, NULL);
		Py_DECREF(data);
	} else if (tensor) {
		value = tensor_value(&m, take);
	} else if (mixed) {
		value = scalar_unpickle_tensors(m.data, m.len, torch_of_msg_tensor, &m);
		PyErr_Clear(); /* no memory: _result tries again */
	}
	arena_free(&a);
	if (tensor || (mixed && value))
		return value;
	if (bare) {
		if (!value || value == fast.general ||
		    (is_exc = PyObject_IsInstance(value, fast.remote_exc)) == 0)
			return value;
		Py_DECREF(value);
		if (is_exc < 0)
			return NULL;
	}
	if (!(msg = msg_to_py(v)))
		return NULL;
	value = PyObject_CallFunctionObjArgs(fast.result, msg, NULL);
	Py_DECREF(msg);
	return value;
}

/* After a question of the C path failed, Python's error (if any)
 * cleared, for the Python path to ask again and raise what failed in its
 * own words: 0. Or left set when it is no Exception: -1. A
 * KeyboardInterrupt (a signal's handler, run in the Python code asked:
 * _named, a dotted name's holds) or a SystemExit would not come again
 * when the Python path asks, and the program's interrupt would be lost. */
static int python_path_asks(void)
{
	if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
		return -1;
	PyErr_Clear();
	return 0;
}

/* Whether the call of the arguments a, (to, func[, args, kwargs,
 * timeout]) as rpc_sync, rpc_async and remote() take them, is the common
 * one: 1, its destination, func's entry (a new reference) and its
 * arguments (ca) out, and it is counted. Otherwise nothing is done: 0, no
 * error left, the Python path makes the call; or -1 with an error that is
 * no Exception (python_path_asks). */
static int call_common(PyObject *a, const char *name, int *dst, PyObject **e,
		       struct call_args *ca)
{
	PyObject *to, *func, *args = Py_None, *kwargs = Py_None, *timeout = Py_None;

	*e = NULL;
	*ca = (struct call_args){ 0 };
	if (!fast.general || !PyArg_UnpackTuple(a, name, 2, 5, &to, &func, &args, &kwargs, &timeout) ||
	    (args != Py_None && !PyTuple_CheckExact(args)) ||
	    (kwargs != Py_None && !PyDict_CheckExact(kwargs)) ||
	    ((PyObject *)Py_TYPE(func) != fast.function_type && !PyCFunction_Check(func)) ||
	    state_common(timeout) != 1 ||
	    (*dst = rank_to(to)) < 0 || !(*e = func_entry(func)) ||
	    call_args_of(func, *e, args == Py_None ? fast.no_args : args, kwargs, ca)) {
		Py_CLEAR(*e);
		return python_path_asks();
	}
	common_count++;
	return 1;
}

/* rc, a wait's failure, raised as _core._c_wait raises it (a timeout as
 * _RpcTimeout): NULL. */
static PyObject *wait_failed(int rc)
{
	fail(rc);
	if (PyErr_ExceptionMatches(PyExc_TimeoutError))
		raise_from_none(fast.timed_out, false);
	return NULL;
}

/* The common call of the arguments a sent (kind: rpc_sync or rpc_async):
 * 1 with its Future in *f; 0 for a call the Python path makes; -1 with an
 * exception set. */
static int common_call(PyObject *a, const char *kind, shmrpc_future **f)
{
	struct call_args ca;
	PyObject *e;
	int dst, rc;

	if ((rc = call_common(a, kind, &dst, &e, &ca)) <= 0)
		return rc;
	rc = common_send(kind, dst, e, &ca, f);
	Py_DECREF(e);
	call_args_free(&ca);
	return rc ? -1 : 1;
}

/* rpc_sync(to, func, args, kwargs, timeout) -> the result, or the
 * sentinel of rpc_sync_setup for a call the Python path makes. */
static PyObject *mod_rpc_sync(PyObject *m, PyObject *a)
{
	PyObject *res;
	shmrpc_future *f;
	int rc;

	(void)m;
	if ((rc = common_call(a, "rpc_sync", &f)) <= 0)
		return rc ? NULL : new_ref(fast.general);
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_future_wait(f, -1);
	Py_END_ALLOW_THREADS
	if ((res = rc ? wait_failed(rc) : reply_value(f, true)) == fast.general) {
		Py_CLEAR(res);
		PyErr_SetString(PyExc_RuntimeError, "a Python call's reply was an RRef's live mark");
	}
	shmrpc_future_free(f);
	return res;
}

/* rpc_async_call(to, func, args, kwargs, timeout) -> the call in flight (a
 * C Future, as call() gives it), or rpc_sync_setup's sentinel for a call
 * the Python path makes (shmrpc/_calls.py, rpc_async, wraps either). */
static PyObject *mod_rpc_async_call(PyObject *m, PyObject *a)
{
	shmrpc_future *f;
	int rc;

	(void)m;
	if ((rc = common_call(a, "rpc_async", &f)) <= 0)
		return rc ? NULL : new_ref(fast.general);
	return future_wrap(f);
}

/* rpc_remote(to, func, args, kwargs, timeout) -> an RRef (shmrpc's
 * Python RRef, as _marshal._rref_of makes one), or rpc_sync_setup's
 * sentinel for a call the Python path makes (shmrpc/_calls.py, remote). */
static PyObject *mod_rpc_remote(PyObject *m, PyObject *a)
{
	struct python_request rq = { .type = MSG_PYTHON_REMOTE_CALL,
				     .wrapped = MSG_PYTHON_REMOTE_CALL, .context_id = -1 };
	struct call_args ca;
	PyObject *e, *handle, *rref = NULL;
	shmrpc_rref *r;
	int dst, rc;

	(void)m;
	if ((rc = call_common(a, "rpc_remote", &dst, &e, &ca)) <= 0)
		return rc ? NULL : new_ref(fast.general);
	rq.msg = ca.msg;
	python_call_begin("rpc_remote", PyBytes_AsString(PyTuple_GetItem(e, E_FN)), 0, false);
	rc = python_remote(dst, &rq, SHMRPC_TIMEOUT_DEFAULT, &r);
	python_call_end();
	if (rc)
		fail(rc);
	Py_DECREF(e);
	call_args_free(&ca);
	if (rc || !(handle = rref_wrap(r)))
		return NULL;
	if ((rref = PyObject_CallFunctionObjArgs(fast.object_new, fast.rref_type, NULL)) &&
	    PyObject_SetAttr(rref, s_r, handle))
		Py_CLEAR(rref);
	Py_DECREF(handle);
	return rref;
}

/* rref_value(handle, timeout) -> a user's RRef's value (RRef.to_here),
 * read here when the RRef is not this worker's own, the timeout is the
 * default and the value came as a bare pickle; else rpc_sync_setup's
 * sentinel (before anything was done, or for a live value the owner keeps:
 * the Python path reads it again and fetches it). */
static PyObject *mod_rref_value(PyObject *m, PyObject *a)
{
	PyObject *handle, *timeout, *res;
	shmrpc_future *f = NULL;
	int rc;

	(void)m;
	if (!PyArg_UnpackTuple(a, "rref_value", 2, 2, &handle, &timeout))
		return NULL;
	if (!fast.general || !PyObject_TypeCheck(handle, (PyTypeObject *)RRefType) ||
	    !HANDLE(handle) || shmrpc_rref_is_owner(HANDLE(handle)) ||
	    state_common(timeout) != 1)
		return python_path_asks() ? NULL : new_ref(fast.general);
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_rref_to_here(HANDLE(handle), SHMRPC_TIMEOUT_DEFAULT, &f);
	Py_END_ALLOW_THREADS
	if ((res = rc ? wait_failed(rc) : reply_value(f, false)) && res != fast.general)
		common_count++;
	shmrpc_future_free(f);
	return res;
}

static PyObject *mod_common_calls(PyObject *m, PyObject *unused)
{
	(void)m, (void)unused;
	return PyLong_FromUnsignedLongLong(common_count);
}

/* rpc_sync_setup(general, marshal, function_type,
 * named, result, remote_exc, not_sent, timed_out, dumps, loads, protocol,
 * rref_type, object_new): the package's objects that rpc_sync, rpc_remote
 * and rref_value read (fast, above), once at import. */
static PyObject *mod_rpc_sync_setup(PyObject *m, PyObject *a)
{
	static const char *const names[] = { "__module__", "__qualname__", "torch", "_r" };
	PyObject **const interned[] = { &s_module, &s_qualname, &s_torch, &s_r };
	PyObject *o[13];

	(void)m;
	if (fast.general) {
		PyErr_SetString(PyExc_RuntimeError, "rpc_sync_setup runs once");
		return NULL;
	}
	if (!PyArg_UnpackTuple(a, "rpc_sync_setup", 13, 13, &o[0], &o[1], &o[2], &o[3], &o[4],
			       &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &o[12]))
		return NULL;
	if (intern_names(names, interned, sizeof(names) / sizeof(*names)))
		return NULL;
	if (!(fast.no_kwargs = PyDict_New()) ||
	    !(fast.no_args = PyTuple_New(0)) || !(fast.funcs = PyDict_New()))
		return NULL;
	fast.marshal = new_ref(o[1]);
	fast.function_type = new_ref(o[2]);
	if (!PyType_Check(fast.function_type)) {
		PyErr_SetString(PyExc_TypeError, "rpc_sync_setup: function_type is a type");
		return NULL;
	}
	if (known_attr_learn(&f_module, fast.function_type, NULL) ||
	    known_attr_learn(&f_qualname, fast.function_type, NULL))
		return NULL;
	fast.named = new_ref(o[3]);
	if (!(fast.pack_args = PyObject_GetAttrString(fast.marshal, "_pack_args")) ||
	    !(fast.proxy_func = PyObject_GetAttrString(fast.marshal, "_proxy_func")))
		return NULL;
	fast.result = new_ref(o[4]);
	fast.remote_exc = new_ref(o[5]);
	fast.not_sent = new_ref(o[6]);
	fast.timed_out = new_ref(o[7]);
	fast.dumps = new_ref(o[8]);
	fast.loads = new_ref(o[9]);
	fast.protocol = new_ref(o[10]);
	fast.rref_type = new_ref(o[11]);
	fast.object_new = new_ref(o[12]);
	fast.general = new_ref(o[0]); /* last: rpc_sync works from now on */
	return new_ref(Py_None);
}

static PyMethodDef call_functions[] = {
	{ "call", (PyCFunction)(void (*)(void))mod_call, METH_VARARGS | METH_KEYWORDS,
	  "call(dst, pickle, [RRef...], [Tensor...], timeout_ms, kind, fn, type, context_id, "
	  "message_id, retain_graph, torch_profile=0) -> Future" },
	{ "remote", (PyCFunction)(void (*)(void))mod_remote, METH_VARARGS | METH_KEYWORDS,
	  "remote(dst, pickle, [RRef...], [Tensor...], timeout_ms, fn, type, context_id, "
	  "message_id, torch_profile=0) -> RRef" },
	{ "rref_local", mod_rref_local, METH_VARARGS,
	  "rref_local(pickled, live) -> RRef: RRef(value) on this worker, ready at once" },
	{ "rpc_sync", mod_rpc_sync, METH_VARARGS,
	  "rpc_sync(to, func, args, kwargs, timeout) -> result: the common call made here, or "
	  "rpc_sync_setup's sentinel for shmrpc._calls.rpc_sync to make it" },
	{ "rpc_async_call", mod_rpc_async_call, METH_VARARGS,
	  "rpc_async_call(to, func, args, kwargs, timeout) -> the common call in flight (a Future "
	  "of this module), or rpc_sync_setup's sentinel" },
	{ "rpc_remote", mod_rpc_remote, METH_VARARGS,
	  "rpc_remote(to, func, args, kwargs, timeout) -> RRef: remote()'s common call made here, "
	  "or rpc_sync_setup's sentinel" },
	{ "rref_value", mod_rref_value, METH_VARARGS,
	  "rref_value(rref, timeout) -> a user's RRef value (to_here) read here, or "
	  "rpc_sync_setup's sentinel" },
	{ "common_calls", mod_common_calls, METH_NOARGS,
	  "common_calls() -> how many calls and RRef reads were made in C (for tests)" },
	{ "rpc_sync_setup", mod_rpc_sync_setup, METH_VARARGS,
	  "rpc_sync_setup(general, marshal, function_type, named, result, remote_exc, not_sent, "
	  "timed_out, dumps, loads, protocol, rref_type, object_new): what rpc_sync, rpc_remote "
	  "and rref_value read" },
	{ "set_call_state", mod_set_call_state, METH_O,
	  "set_call_state(common): whether the package's state (initialized, no timeout override, "
	  "the default pickler checked) lets a call be the common one made in C" },
	{ NULL, NULL, 0, NULL },
};

int module_add_calls(PyObject *m)
{
	return PyModule_AddFunctions(m, call_functions);
}
