/*
 * _shmrpc: the C half of the Python package, on the CPython stable ABI
 * (abi3, Python >= 3.9), linked with libshmrpc's objects.
 *
 * It moves bytes, never Python objects: shmrpc/__init__.py pickles a call
 * (function by reference, args, kwargs) and this module sends it as a
 * PYTHON_CALL or PYTHON_REMOTE_CALL (worker/python.h); on the callee an
 * executor thread takes the GIL and hands the bytes to the Python handler
 * (shmrpc._run_function), whose pickled result comes back as bytes.
 *
 * The GIL: released around everything that waits (init's barrier, a
 * future, to_here, shutdown), taken by executor threads only to run the
 * handler.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "worker/python.h"

static PyObject *handler; /* the Python handler; owned */

/* Py_NewRef is not in the 3.9 stable ABI. */
static PyObject *new_ref(PyObject *o)
{
	Py_INCREF(o);
	return o;
}

/* An exception with shmrpc's text for rc: TimeoutError for timeouts,
 * RuntimeError otherwise (the Python layer re-raises remote ones). */
static PyObject *fail(int rc)
{
	PyErr_SetString(rc == -ETIMEDOUT ? PyExc_TimeoutError : PyExc_RuntimeError,
			shmrpc_errmsg());
	return NULL;
}

static PyObject *RRefType;

typedef struct {
	PyObject_HEAD
	shmrpc_rref *r;
} RRefObject;

/* A new RRef object owning r (freed with r on failure). */
static PyObject *rref_wrap(shmrpc_rref *r)
{
	RRefObject *o = PyObject_New(RRefObject, (PyTypeObject *)RRefType);

	if (!o) {
		shmrpc_rref_free(r);
		return NULL;
	}
	o->r = r;
	return (PyObject *)o;
}

/* (pickle: bytes, [RRef, ...]) from a Python message value; each RRef a
 * handle of its own. */
static PyObject *msg_to_py(const shmrpc_value *v)
{
	struct arena a = { 0 };
	struct python_msg m;
	PyObject *list = NULL, *res = NULL;

	if (!v || python_msg_of(v, &a, &m)) {
		PyErr_SetString(PyExc_RuntimeError, "a Python call came back without a pickled result");
		goto out;
	}
	if (!(list = PyList_New(m.nrrefs)))
		goto out;
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
	res = Py_BuildValue("(y#O)", (const char *)m.data, (Py_ssize_t)m.len, list);
out:
	Py_XDECREF(list);
	arena_free(&a);
	return res;
}

/* A message from (pickle, [RRef...]): borrows the pickle and the handles,
 * valid while the objects live; rrefs malloc'd (free it). */
static int msg_from_py(PyObject *pickled, PyObject *rrefs, struct python_msg *m)
{
	char *buf;
	Py_ssize_t len, n;

	if (PyBytes_AsStringAndSize(pickled, &buf, &len))
		return -1;
	if (!PyList_Check(rrefs)) {
		PyErr_SetString(PyExc_TypeError, "the RRefs of a message must be a list");
		return -1;
	}
	n = PyList_Size(rrefs);
	m->data = buf;
	m->len = (size_t)len;
	m->nrrefs = (uint32_t)n;
	if (!(m->rrefs = malloc((size_t)(n ? n : 1) * sizeof(*m->rrefs)))) {
		PyErr_NoMemory();
		return -1;
	}
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *o = PyList_GetItem(rrefs, i);

		if (!PyObject_TypeCheck(o, (PyTypeObject *)RRefType)) {
			free(m->rrefs);
			PyErr_SetString(PyExc_TypeError, "a message lists something that is no RRef");
			return -1;
		}
		m->rrefs[i] = ((RRefObject *)o)->r;
	}
	return 0;
}

/* ---- the handler, on executor threads ---- */

static int run_handler(uint32_t caller, const struct python_msg *in, struct python_msg *out)
{
	PyGILState_STATE g = PyGILState_Ensure();
	PyObject *res = NULL, *list, *pickled, *rrefs;
	struct python_msg view;
	int rc = -EIO;

	/* The handler's input as Python sees it: (bytes, [RRef...]). */
	list = PyList_New(in->nrrefs);
	for (uint32_t i = 0; list && i < in->nrrefs; i++) {
		shmrpc_rref *r;
		PyObject *o = shmrpc_rref_retain(in->rrefs[i], &r) ? NULL : rref_wrap(r);

		if (!o) {
			Py_CLEAR(list);
			break;
		}
		PyList_SetItem(list, i, o);
	}
	if (list && handler)
		res = PyObject_CallFunction(handler, "Iy#O", caller, (const char *)in->data,
					    (Py_ssize_t)in->len, list);
	Py_XDECREF(list);
	if (res && PyArg_ParseTuple(res, "SO", &pickled, &rrefs) &&
	    msg_from_py(pickled, rrefs, &view) == 0) {
		/* Copies the agent owns: the objects go with the GIL. */
		out->len = view.len;
		out->nrrefs = 0;
		out->data = malloc(view.len ? view.len : 1);
		out->rrefs = malloc((view.nrrefs ? view.nrrefs : 1) * sizeof(*out->rrefs));
		if (out->data && out->rrefs) {
			memcpy((void *)out->data, view.data, view.len);
			rc = 0;
			for (uint32_t i = 0; rc == 0 && i < view.nrrefs; i++)
				rc = shmrpc_rref_retain(view.rrefs[i], &out->rrefs[out->nrrefs++]);
			if (rc)
				out->nrrefs--;
		}
		free(view.rrefs);
		if (rc) {
			for (uint32_t i = 0; i < out->nrrefs; i++)
				shmrpc_rref_free(out->rrefs[i]);
			free((void *)out->data);
			free(out->rrefs);
			rc = -ENOMEM;
		}
	} else {
		/* The handler catches what the function raises: this is a bug
		 * in it, or no memory. Its text goes back as an EXCEPTION. */
		PyErr_Print();
	}
	Py_XDECREF(res);
	PyGILState_Release(g);
	return rc;
}

/* ---- Future ---- */

typedef struct {
	PyObject_HEAD
	shmrpc_future *f;
} FutureObject;

static PyObject *FutureType;

static PyObject *future_wrap(shmrpc_future *f)
{
	FutureObject *o = PyObject_New(FutureObject, (PyTypeObject *)FutureType);

	if (!o) {
		shmrpc_future_free(f);
		return NULL;
	}
	o->f = f;
	return (PyObject *)o;
}

static void future_dealloc(PyObject *self)
{
	PyTypeObject *tp = Py_TYPE(self);

	shmrpc_future_free(((FutureObject *)self)->f);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp);
}

/* wait(timeout_ms=-1) -> bytes */
static PyObject *future_wait(PyObject *self, PyObject *args)
{
	shmrpc_future *f = ((FutureObject *)self)->f;
	long long timeout = -1;
	int rc;

	if (!PyArg_ParseTuple(args, "|L", &timeout))
		return NULL;
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_future_wait(f, (int64_t)timeout);
	Py_END_ALLOW_THREADS
	return rc ? fail(rc) : msg_to_py(shmrpc_future_value(f));
}

static PyObject *future_done(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyBool_FromLong(shmrpc_future_done(((FutureObject *)self)->f));
}

static PyMethodDef future_methods[] = {
	{ "wait", future_wait, METH_VARARGS, "wait(timeout_ms=-1) -> (pickle, [RRef...])" },
	{ "done", future_done, METH_NOARGS, "whether the call has completed" },
	{ NULL, NULL, 0, NULL },
};

static PyType_Slot future_slots[] = {
	{ Py_tp_dealloc, future_dealloc },
	{ Py_tp_methods, future_methods },
	{ Py_tp_doc, "A call in flight (shmrpc_future)." },
	{ 0, NULL },
};

static PyType_Spec future_spec = { "shmrpc._shmrpc.Future", sizeof(FutureObject), 0,
				   Py_TPFLAGS_DEFAULT, future_slots };

/* ---- RRef ---- */

static void rref_dealloc(PyObject *self)
{
	PyTypeObject *tp = Py_TYPE(self);

	shmrpc_rref_free(((RRefObject *)self)->r);
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp);
}

/* to_here(timeout_ms=-1) -> bytes */
static PyObject *rref_to_here(PyObject *self, PyObject *args)
{
	shmrpc_future *f = NULL;
	long long timeout = SHMRPC_TIMEOUT_DEFAULT;
	PyObject *res;
	int rc;

	if (!PyArg_ParseTuple(args, "|L", &timeout))
		return NULL;
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_rref_to_here(((RRefObject *)self)->r, (int64_t)timeout, &f);
	Py_END_ALLOW_THREADS
	if (rc)
		return fail(rc);
	res = msg_to_py(shmrpc_future_value(f));
	shmrpc_future_free(f);
	return res;
}

static PyObject *rref_owner(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyLong_FromLong(shmrpc_rref_owner(((RRefObject *)self)->r));
}

static PyObject *rref_owner_name(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyUnicode_FromString(shmrpc_rref_owner_name(((RRefObject *)self)->r));
}

static PyObject *rref_is_owner(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyBool_FromLong(shmrpc_rref_is_owner(((RRefObject *)self)->r));
}

static PyObject *rref_confirmed(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyBool_FromLong(shmrpc_rref_confirmed_by_owner(((RRefObject *)self)->r));
}

static PyObject *rref_str(PyObject *self)
{
	char buf[256];

	shmrpc_rref_str(((RRefObject *)self)->r, buf, sizeof(buf));
	return PyUnicode_FromString(buf);
}

static PyMethodDef rref_methods[] = {
	{ "to_here", rref_to_here, METH_VARARGS, "to_here(timeout_ms=-1) -> (pickle, [RRef...])" },
	{ "owner", rref_owner, METH_NOARGS, "the owner's rank" },
	{ "owner_name", rref_owner_name, METH_NOARGS, "the owner's name" },
	{ "is_owner", rref_is_owner, METH_NOARGS, "whether this worker owns it" },
	{ "confirmed_by_owner", rref_confirmed, METH_NOARGS, "whether the owner knows of it" },
	{ NULL, NULL, 0, NULL },
};

static PyType_Slot rref_slots[] = {
	{ Py_tp_dealloc, rref_dealloc },
	{ Py_tp_methods, rref_methods },
	{ Py_tp_str, rref_str },
	{ Py_tp_doc, "A reference counted in the job's RRef table (shmrpc_rref)." },
	{ 0, NULL },
};

static PyType_Spec rref_spec = { "shmrpc._shmrpc.RRef", sizeof(RRefObject), 0, Py_TPFLAGS_DEFAULT,
				 rref_slots };

/* ---- module functions ---- */

/* init(name or None, num_threads, timeout_ms) */
static PyObject *mod_init(PyObject *m, PyObject *args)
{
	struct shmrpc_options o = { 0 };
	const char *name = NULL;
	int threads = 0;
	long long timeout = 0;
	int rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "|ziL", &name, &threads, &timeout))
		return NULL;
	o.name = name;
	o.num_threads = threads;
	o.timeout_ms = (int64_t)timeout;
	python_set_handler(run_handler);
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_init(&o);
	Py_END_ALLOW_THREADS
	return rc ? fail(rc) : new_ref(Py_None);
}

/* shutdown(graceful, timeout_ms) */
static PyObject *mod_shutdown(PyObject *m, PyObject *args)
{
	int graceful = 1;
	long long timeout = 0;
	int rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "|pL", &graceful, &timeout))
		return NULL;
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_shutdown(graceful, (int64_t)timeout);
	Py_END_ALLOW_THREADS
	return rc ? fail(rc) : new_ref(Py_None);
}

static PyObject *mod_set_handler(PyObject *m, PyObject *fn)
{
	(void)m;
	if (!PyCallable_Check(fn)) {
		PyErr_SetString(PyExc_TypeError, "the handler must be callable");
		return NULL;
	}
	Py_XDECREF(handler);
	handler = new_ref(fn);
	return new_ref(Py_None);
}

static PyObject *mod_rank(PyObject *m, PyObject *unused)
{
	int r = shmrpc_rank();

	(void)m, (void)unused;
	return r < 0 ? fail(r) : PyLong_FromLong(r);
}

static PyObject *mod_world_size(PyObject *m, PyObject *unused)
{
	int n = shmrpc_world_size();

	(void)m, (void)unused;
	return n < 0 ? fail(n) : PyLong_FromLong(n);
}

/* worker_info(name or rank or None) -> (name, rank) */
static PyObject *mod_worker_info(PyObject *m, PyObject *who)
{
	struct shmrpc_worker_info wi;
	int rc;

	(void)m;
	if (who == Py_None) {
		rc = shmrpc_get_worker_info(NULL, &wi);
	} else if (PyLong_Check(who)) {
		long r = PyLong_AsLong(who);

		if (r == -1 && PyErr_Occurred())
			return NULL;
		rc = shmrpc_get_worker_info_by_rank((int)r, &wi);
	} else {
		PyObject *utf8 = PyUnicode_AsUTF8String(who);

		if (!utf8)
			return NULL;
		rc = shmrpc_get_worker_info(PyBytes_AsString(utf8), &wi);
		Py_DECREF(utf8);
	}
	return rc ? fail(rc) : Py_BuildValue("(si)", wi.name, wi.rank);
}

/* call(dst, pickle, [RRef...], timeout_ms) -> Future */
static PyObject *mod_call(PyObject *m, PyObject *args)
{
	shmrpc_future *f = NULL;
	struct python_msg msg;
	PyObject *pickled, *rrefs;
	long long timeout;
	int dst, rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "iSOL", &dst, &pickled, &rrefs, &timeout) ||
	    msg_from_py(pickled, rrefs, &msg))
		return NULL;
	/* The GIL stays: msg borrows from the objects (and a send is short). */
	rc = python_rpc_async(dst, &msg, (int64_t)timeout, &f);
	free(msg.rrefs);
	return rc ? fail(rc) : future_wrap(f);
}

/* remote(dst, pickle, [RRef...], timeout_ms) -> RRef */
static PyObject *mod_remote(PyObject *m, PyObject *args)
{
	shmrpc_rref *r = NULL;
	struct python_msg msg;
	PyObject *pickled, *rrefs;
	long long timeout;
	int dst, rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "iSOL", &dst, &pickled, &rrefs, &timeout) ||
	    msg_from_py(pickled, rrefs, &msg))
		return NULL;
	rc = python_remote(dst, &msg, (int64_t)timeout, &r);
	free(msg.rrefs);
	return rc ? fail(rc) : rref_wrap(r);
}

static PyMethodDef mod_methods[] = {
	{ "init", mod_init, METH_VARARGS, "init(name, num_threads, timeout_ms): shmrpc_init" },
	{ "shutdown", mod_shutdown, METH_VARARGS, "shutdown(graceful, timeout_ms)" },
	{ "set_handler", mod_set_handler, METH_O, "the function that runs pickled calls" },
	{ "rank", mod_rank, METH_NOARGS, "this worker's rank" },
	{ "world_size", mod_world_size, METH_NOARGS, "the number of workers" },
	{ "worker_info", mod_worker_info, METH_O, "worker_info(name|rank|None) -> (name, rank)" },
	{ "call", mod_call, METH_VARARGS, "call(dst, pickle, [RRef...], timeout_ms) -> Future" },
	{ "remote", mod_remote, METH_VARARGS, "remote(dst, pickle, [RRef...], timeout_ms) -> RRef" },
	{ NULL, NULL, 0, NULL },
};

static struct PyModuleDef module = { PyModuleDef_HEAD_INIT, "shmrpc._shmrpc",
				     "The C half of shmrpc's Python package.", -1, mod_methods,
				     NULL, NULL, NULL, NULL };

PyMODINIT_FUNC PyInit__shmrpc(void);
PyMODINIT_FUNC PyInit__shmrpc(void)
{
	PyObject *m = PyModule_Create(&module);

	if (!m)
		return NULL;
	FutureType = PyType_FromSpec(&future_spec);
	RRefType = PyType_FromSpec(&rref_spec);
	if (!FutureType || !RRefType || PyModule_AddObject(m, "Future", new_ref(FutureType)) ||
	    PyModule_AddObject(m, "RRef", new_ref(RRefType)) ||
	    PyModule_AddIntConstant(m, "TIMEOUT_DEFAULT", SHMRPC_TIMEOUT_DEFAULT)) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}
