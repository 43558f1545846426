/*
 * A Python request, on an executor thread: its message as Python objects,
 * the GIL, the package's handler, and the result copied back; the release
 * of an RRef's live value.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

#include "shmrpc.h"
#include "common/clock.h"
#include "common/error.h"
#include "python/module.h"
#include "worker/python_api.h"

/* (pickle: bytes, [RRef, ...], [Tensor, ...]) from a Python message value
 * (or the FORWARD_AUTOGRAD_RESP that wraps one); each RRef and Tensor a
 * handle of its own. */
PyObject *msg_to_py(const shmrpc_value *v)
{
	struct arena a = { 0 };
	struct python_msg m;
	PyObject *list = NULL, *tlist = NULL, *res = NULL;

	if (!v || python_reply_of(v, &a, &m)) {
		PyErr_SetString(PyExc_RuntimeError, "a Python call came back without a pickled result");
		goto out;
	}
	if (!(list = PyList_New(m.nrrefs)) || !(tlist = PyList_New(m.ntensors)))
		goto out;
	for (uint32_t i = 0; i < m.ntensors; i++) {
		shmrpc_tensor *t;
		PyObject *o;

		if (shmrpc_tensor_retain(m.tensors[i], &t)) {
			fail(-EIO);
			goto out;
		}
		if (!(o = tensor_wrap(t)))
			goto out;
		PyList_SetItem(tlist, i, o); /* steals o */
	}
	for (uint32_t i = 0; i < m.nrrefs; i++) {
		shmrpc_rref *r;
		PyObject *o;

		if (shmrpc_rref_retain(m.rrefs[i], &r)) {
			fail(-EIO);
			goto out;
		}
		if (!(o = rref_wrap(r)))
			goto out;
		PyList_SetItem(list, i, o); /* steals o */
	}
	res = Py_BuildValue("(y#OO)", (const char *)m.data, (Py_ssize_t)m.len, list, tlist);
out:
	Py_XDECREF(list);
	Py_XDECREF(tlist);
	arena_free(&a);
	return res;
}

/* *out = the handles of a list of objects of type, in a (NULL:
 * malloc'd), *n of them; none for an empty list (*out NULL, as a
 * received message's empty lists). 0, or -1 with an exception set. */
static int handles_of(PyObject *list, PyObject *type, struct arena *a, void ***out, uint32_t *n)
{
	Py_ssize_t len;
	void **h;

	if (!PyList_Check(list)) {
		PyErr_SetString(PyExc_TypeError, "a message's RRefs and tensors come in lists");
		return -1;
	}
	*out = NULL;
	*n = 0;
	if (!(len = PyList_Size(list)))
		return 0;
	if (!(h = a ? arena_alloc(a, (size_t)len * sizeof(*h)) : malloc((size_t)len * sizeof(*h)))) {
		PyErr_NoMemory();
		return -1;
	}
	for (Py_ssize_t i = 0; i < len; i++) {
		PyObject *o = PyList_GetItem(list, i);

		if (!PyObject_TypeCheck(o, (PyTypeObject *)type)) {
			if (!a)
				free(h);
			PyErr_SetString(PyExc_TypeError, "a message lists an object of the wrong type");
			return -1;
		}
		if (!HANDLE(o)) { /* a Tensor emptied by take_dlpack */
			if (!a)
				free(h);
			PyErr_SetString(PyExc_ValueError, "a message lists a Tensor whose reference "
					"went to a DLPack capsule (take_dlpack): send the tensor made "
					"from it");
			return -1;
		}
		h[i] = HANDLE(o);
	}
	*out = h;
	*n = (uint32_t)len;
	return 0;
}

/* A message from (pickle, [RRef...], [Tensor...]): borrows the pickle and
 * the handles, valid while the objects live; rrefs and tensors in a, or
 * malloc'd (msg_free) if a is NULL. 0, or -1 with an exception set. */
static int msg_view(PyObject *pickled, PyObject *rrefs, PyObject *tensors, struct arena *a,
		    struct python_msg *m)
{
	void **r, **t;
	char *buf;
	Py_ssize_t len;

	memset(m, 0, sizeof(*m));
	if (PyBytes_AsStringAndSize(pickled, &buf, &len))
		return -1;
	m->data = buf;
	m->len = (size_t)len;
	if (handles_of(rrefs, RRefType, a, &r, &m->nrrefs))
		return -1;
	if (handles_of(tensors, TensorType, a, &t, &m->ntensors)) {
		if (!a)
			free(r);
		m->nrrefs = 0;
		return -1;
	}
	m->rrefs = (shmrpc_rref **)r;
	m->tensors = (shmrpc_tensor **)t;
	return 0;
}

int msg_from_py(PyObject *pickled, PyObject *rrefs, PyObject *tensors, struct python_msg *m)
{
	return msg_view(pickled, rrefs, tensors, NULL, m);
}

void msg_free(struct python_msg *m)
{
	free(m->rrefs);
	free(m->tensors);
}

/* ---- the handler, on executor threads ---- */

/* How often executor threads took the GIL and how long they waited for it
 * (torch's agent.gil_average_wait_time_us). Relaxed: two independent
 * counters, read by debug_info, which may see one a little ahead. */
static _Atomic uint64_t gil_takes, gil_wait_ns;

/* Whether this thread keeps its Python thread state (gil_take). */
static _Thread_local bool state_kept;

/*
 * PyGILState_Ensure, timed. A thread Python did not start (an executor
 * thread) keeps the thread state its first take makes, for its life.
 * One made and freed on every take cost about 10 µs of every call served,
 * and left pybind11 (torch) with a freed one: it caches the state of the
 * thread that first imports it (a callee that did not import torch does
 * so on an executor thread when the first tensor arrives) and reuses it
 * there, crashing a later call. That is some KiB per executor thread,
 * which the interpreter frees at its end. (A thread Python started has
 * its state for its life already.)
 */
PyGILState_STATE gil_take(void)
{
	uint64_t t0 = shmrpc_now_ns();
	PyGILState_STATE g = PyGILState_Ensure();

	if (!state_kept) {
		state_kept = true;
		(void)PyGILState_Ensure(); /* never released: the state stays */
	}
	atomic_fetch_add_explicit(&gil_wait_ns, shmrpc_now_ns() - t0, memory_order_relaxed);
	atomic_fetch_add_explicit(&gil_takes, 1, memory_order_relaxed);
	return g;
}

/* The handle of objs[i], a reply's Tensor that nothing else reaches (alone:
 * the reply and its list of tensors are held by the handler's caller alone;
 * the Tensor by that list alone), taken from it for the agent: its
 * reference handed over instead of copied (a handle's zalloc, a pool
 * reference and its holder record, then their undoing when the object
 * goes, which it does as soon as the reply is read). The Tensor is left
 * empty, as take_dlpack leaves one, for the instant before it goes. NULL when
 * something else may still use it: it keeps its reference, and the agent
 * gets one of its own. */
static shmrpc_tensor *tensor_given(PyObject *objs, uint32_t i, bool alone)
{
	PyObject *o = PyList_GetItem(objs, i);
	shmrpc_tensor *t = HANDLE(o);

	if (!alone || Py_REFCNT(o) != 1)
		return NULL;
	HANDLE(o) = NULL;
	return t;
}

/* m, a view (msg_view) in a of a reply whose tensors are the Tensors of
 * objs, made the agent's: its pickle copied into a (the one copy before
 * the reply's frame), each handle replaced by one the agent frees once
 * sent, the Tensor's own where nothing else reaches it (tensor_given:
 * alone says whether the reply and objs are held by nothing else), a new
 * one otherwise. -ENOMEM or -EIO with none taken: a handle given over goes
 * back to its Tensor. */
static int msg_keep(struct python_msg *m, PyObject *objs, bool alone, struct arena *a)
{
	void *data = arena_alloc(a, m->len ? m->len : 1);
	uint32_t nr = 0, nt = 0;
	int rc = data ? 0 : -ENOMEM;

	while (rc == 0 && nr < m->nrrefs) {
		shmrpc_rref *r;

		if (!(rc = shmrpc_rref_retain(m->rrefs[nr], &r)))
			m->rrefs[nr++] = r;
	}
	while (rc == 0 && nt < m->ntensors) {
		shmrpc_tensor *t = tensor_given(objs, nt, alone);

		if (t || !(rc = shmrpc_tensor_retain(m->tensors[nt], &t)))
			m->tensors[nt++] = t;
	}
	if (rc) {
		for (uint32_t i = 0; i < nr; i++)
			shmrpc_rref_free(m->rrefs[i]);
		for (uint32_t i = 0; i < nt; i++) {
			PyObject *o = PyList_GetItem(objs, i);

			if (HANDLE(o)) /* a new handle: msg_view found none empty */
				shmrpc_tensor_free(m->tensors[i]);
			else
				HANDLE(o) = m->tensors[i];
		}
		m->nrrefs = m->ntensors = 0;
		return rc;
	}
	memcpy(data, m->data, m->len);
	m->data = data;
	return 0;
}

/* The ops the handler appended to list, (name, start_ns, end_ns, thread,
 * rank or -1 for this worker[, input shapes as JSON or None, bytes of
 * memory]) each, into ops (a malformed one is left out: the handler is
 * ours). */
static void ops_add(PyObject *list, struct profile_events *ops)
{
	for (Py_ssize_t i = 0; i < PyList_Size(list); i++) {
		unsigned long long start, end, thread;
		const char *name, *shapes = NULL;
		long long mem = 0;
		int rank;

		if (PyArg_ParseTuple(PyList_GetItem(list, i), "sKKKi|zL", &name, &start, &end, &thread,
				     &rank, &shapes, &mem))
			profile_events_add(ops, name, start, end, thread,
					   rank < 0 ? PROFILE_HERE : (uint32_t)rank, shapes, mem);
		else
			PyErr_Clear();
	}
}

/*
 * The general handler's arguments: (caller, type, context_id, message_id,
 * retain_graph, pickle, [RRef...], [Tensor...], ops, rref_id, profile),
 * ops being a list to append the ops torch's profiler recorded to, or None
 * (python_handler_fn), profile what the caller's profiler asks (PROFILE_
 * bits: with PROFILE_TORCH, SHAPES and MEMORY are its options), rref_id a
 * remote call's RRef (0 for other requests).
 */
static PyObject *call_general(PyObject *fn, uint32_t caller, const struct python_request *in,
			      PyObject *rrefs, PyObject *tensors, struct profile_events *ops)
{
	const struct python_msg *m = &in->msg;
	PyObject *op_list = ops ? PyList_New(0) : new_ref(Py_None), *res = NULL;

	if (op_list)
		res = PyObject_CallFunction(fn, "IHLLOy#OOOKI", caller, in->type,
					    (long long)in->context_id, (long long)in->message_id,
					    in->retain_graph ? Py_True : Py_False,
					    (const char *)m->data, (Py_ssize_t)m->len, rrefs, tensors,
					    op_list, (unsigned long long)in->rref_id,
					    ops ? ops->what : 0u);
	if (res && ops)
		ops_add(op_list, ops);
	Py_XDECREF(op_list);
	return res;
}

/*
 * The plain handler's: (caller, type, pickle, [RRef...], [Tensor...],
 * rref_id), for a PYTHON_CALL or PYTHON_REMOTE_CALL not profiled for
 * torch's profiler: most requests. Called without a format: the
 * arguments go on the stack (vectorcall, which the stable ABI of 3.9
 * reaches only this way), no tuple made.
 */
static PyObject *call_plain(PyObject *fn, uint32_t caller, const struct python_request *in,
			    PyObject *rrefs, PyObject *tensors)
{
	PyObject *who = PyLong_FromUnsignedLong(caller), *type = PyLong_FromLong(in->type);
	PyObject *pickle = PyBytes_FromStringAndSize(in->msg.data, (Py_ssize_t)in->msg.len);
	PyObject *rref = PyLong_FromUnsignedLongLong(in->rref_id), *res = NULL;

	if (who && type && pickle && rref)
		res = PyObject_CallFunctionObjArgs(fn, who, type, pickle, rrefs, tensors, rref, NULL);
	Py_XDECREF(who);
	Py_XDECREF(type);
	Py_XDECREF(pickle);
	Py_XDECREF(rref);
	return res;
}

/*
 * A handler's reply, read into out (its message in a, msg_keep): the
 * pickle alone (bytes: no RRefs nor tensors, what most calls return), or
 * (pickle, [RRef...], [Tensor...]), or, answering a FORWARD_AUTOGRAD_REQ,
 * the same and the reply's autograd message id, and for a remote call
 * whose result it keeps live (worker/python.h) the same with that id (0
 * if none) and True. -1 with an exception set if it is none of these.
 */
static int reply_read(PyObject *res, struct arena *a, struct python_request *out)
{
	static PyObject *no_list; /* an empty list standing for none */
	PyObject *pickled = res, *rrefs, *tensors;
	Py_ssize_t n = 0;
	int rc;

	if (!no_list && !(no_list = PyList_New(0)))
		return -1;
	rrefs = tensors = no_list;
	if (!PyBytes_Check(res)) {
		if (!PyTuple_Check(res) || ((n = PyTuple_Size(res)) != 3 && n != 5)) {
			PyErr_SetString(PyExc_TypeError, "the handler returned neither a pickle nor "
					"(pickle, RRefs, tensors[, message id, live])");
			return -1;
		}
		pickled = PyTuple_GetItem(res, 0);
		rrefs = PyTuple_GetItem(res, 1);
		tensors = PyTuple_GetItem(res, 2);
	}
	if (n == 5) {
		long long id = PyLong_AsLongLong(PyTuple_GetItem(res, 3));
		int live = PyObject_IsTrue(PyTuple_GetItem(res, 4));

		if ((id == -1 && PyErr_Occurred()) || live < 0)
			return -1;
		out->message_id = id;
		out->live = live;
	}
	if (msg_view(pickled, rrefs, tensors, a, &out->msg)) {
		memset(&out->msg, 0, sizeof(out->msg)); /* none of its handles are ours */
		return -1;
	}
	/* res, the handler's result, is held by run_handler alone when its
	 * count is 1 (a tuple holds its items itself). */
	if ((rc = msg_keep(&out->msg, tensors,
			   Py_REFCNT(res) == 1 && Py_REFCNT(tensors) == 1, a)) == 0)
		return 0;
	fail(rc);
	return -1;
}

/* Whether the plain handler serves in (call_plain). */
static bool plain_request(const struct python_request *in, const struct profile_events *ops)
{
	return !ops && (in->type == MSG_PYTHON_CALL || in->type == MSG_PYTHON_REMOTE_CALL);
}

static PyObject *handler, *plain; /* the general and plain handlers; owned */

/* A handler that failed (it catches what the function raises: a bug in
 * it, a reply of the wrong shape, or no memory): the pending exception's
 * repr as this thread's error, which the caller gets in the EXCEPTION,
 * and the exception printed here. -EIO. */
static int handler_failed(void)
{
	PyObject *type, *value, *tb, *text = NULL, *utf8 = NULL;
	int rc;

	PyErr_Fetch(&type, &value, &tb);
	PyErr_NormalizeException(&type, &value, &tb);
	if (value && (text = PyObject_Repr(value)))
		utf8 = PyUnicode_AsUTF8String(text);
	if (!utf8)
		PyErr_Clear(); /* the text's own failure: the sentence says less */
	rc = shmrpc__fail(-EIO, "the callee's Python handler failed: %s",
			  utf8 ? PyBytes_AsString(utf8)
			  : type ? "its error has no text" : "no handler is set (init_rpc has not run)");
	Py_XDECREF(utf8);
	Py_XDECREF(text);
	PyErr_Restore(type, value, tb);
	if (type)
		PyErr_Print();
	return rc;
}

/* The package's handler's reply to in: the request's RRefs and tensors as
 * objects, then the plain handler or the general one. New reference;
 * NULL with an exception set. */
static PyObject *handler_reply(uint32_t caller, const struct python_request *in,
			       struct profile_events *ops)
{
	const struct python_msg *m = &in->msg;
	PyObject *res = NULL, *rrefs, *tensors;

	rrefs = handle_objects((void *const *)m->rrefs, m->nrrefs, true);
	tensors = handle_objects((void *const *)m->tensors, m->ntensors, false);
	if (rrefs && tensors && handler)
		res = plain_request(in, ops) ? call_plain(plain, caller, in, rrefs, tensors)
					     : call_general(handler, caller, in, rrefs, tensors, ops);
	Py_XDECREF(rrefs);
	Py_XDECREF(tensors);
	return res;
}

/* out, the reply of a common tensor alone (_marshal._TENSORS), t: its
 * handle, taken; its list in a. 0, or -ENOMEM with t freed. */
static int reply_tensor(shmrpc_tensor *t, struct arena *a, struct python_request *out)
{
	static const char mark = TENSORS_MARK;
	shmrpc_tensor **list = arena_alloc(a, sizeof(*list));

	if (!list) {
		shmrpc_tensor_free(t);
		return shmrpc__fail(-ENOMEM, "out of memory replying with a tensor");
	}
	list[0] = t;
	out->msg = (struct python_msg){ .data = &mark, .len = 1, .tensors = list, .ntensors = 1 };
	return 0;
}

/* The handler (python_handler_fn) on an executor thread: the GIL, the
 * reply of the fast path (python/_serve_fast.c: a Python object, or a
 * tensor's handle) or else of the package's handler, the reply into the
 * call's arena. */
int run_handler(uint32_t caller, const struct python_request *in, struct python_request *out,
		struct profile_events *ops, struct arena *a)
{
	PyGILState_STATE g = gil_take();
	shmrpc_tensor *tensor = NULL;
	PyObject *res;
	int rc;

	if (!fast_serve(caller, in, ops, &res, &tensor))
		res = handler_reply(caller, in, ops);
	if (tensor)
		rc = reply_tensor(tensor, a, out);
	else
		rc = res && reply_read(res, a, out) == 0 ? 0 : handler_failed();
	Py_XDECREF(res);
	PyGILState_Release(g);
	return rc;
}

/* set_handler(general, plain[, fast]): the functions that serve requests
 * (call_general's arguments and call_plain's), and what the fast path
 * reads (fast_set), which serves the common call as plain would: without
 * it, as for a plain handler of a test's own, plain serves every call it
 * is given. */
static PyObject *mod_set_handler(PyObject *m, PyObject *args)
{
	PyObject *fn, *fn_plain, *objs = NULL;

	(void)m;
	if (!PyArg_ParseTuple(args, "OO|O!", &fn, &fn_plain, &PyTuple_Type, &objs))
		return NULL;
	if (!PyCallable_Check(fn) || !PyCallable_Check(fn_plain)) {
		PyErr_SetString(PyExc_TypeError, "the handlers must be callable");
		return NULL;
	}
	if (fast_set(objs))
		return NULL;
	Py_XDECREF(handler);
	Py_XDECREF(plain);
	handler = new_ref(fn);
	plain = new_ref(fn_plain);
	return new_ref(Py_None);
}

static PyObject *releaser; /* the Python live-value release, owned */

/* The live-release hook (worker/rref.h): the Python package drops the
 * object it kept for the RRef id. Any thread: the GIL is taken here. */
static void release_live(uint64_t id)
{
	PyGILState_STATE g;
	PyObject *key, *res = NULL;

	if (!releaser)
		return;
	g = gil_take();
	if ((key = PyLong_FromUnsignedLongLong(id)))
		res = PyObject_CallFunctionObjArgs(releaser, key, NULL);
	Py_XDECREF(key);
	if (!res)
		PyErr_Print(); /* a failing __del__ is the program's; the RRef went */
	Py_XDECREF(res);
	PyGILState_Release(g);
}

/* set_live_release(fn): fn(rref_id) drops the live value kept for an RRef
 * this worker owns, once the RRef has gone. */
static PyObject *mod_set_live_release(PyObject *m, PyObject *fn)
{
	(void)m;
	if (!PyCallable_Check(fn)) {
		PyErr_SetString(PyExc_TypeError, "the release function must be callable");
		return NULL;
	}
	Py_XDECREF(releaser);
	releaser = new_ref(fn);
	python_set_live_release(release_live);
	return new_ref(Py_None);
}
static PyMethodDef handler_functions[] = {
	{ "set_handler", mod_set_handler, METH_VARARGS,
	  "set_handler(general, plain[, fast]): the functions that serve requests (plain: most "
	  "calls; fast: _serve._fast(), what serves the commonest of those in C as plain "
	  "would)" },
	{ "set_live_release", mod_set_live_release, METH_O,
	  "set_live_release(fn): fn(rref_id) drops an owned RRef's live value once it went" },
	{ NULL, NULL, 0, NULL },
};

void module_gil_stats(uint64_t *takes, uint64_t *wait_ns)
{
	/* Relaxed: two independent counters (above). */
	*takes = atomic_load_explicit(&gil_takes, memory_order_relaxed);
	*wait_ns = atomic_load_explicit(&gil_wait_ns, memory_order_relaxed);
}

int module_add_handler(PyObject *m)
{
	return PyModule_AddFunctions(m, handler_functions);
}
