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
#include "python/module.h"
#include "worker/python_api.h"

static PyObject *handler; /* the Python handler; owned */

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

/* The handles of a list of objects of type; malloc'd, NULL with an
 * exception set. */
static void **handles_of(PyObject *list, PyObject *type, uint32_t *n)
{
	Py_ssize_t len;
	void **h;

	if (!PyList_Check(list)) {
		PyErr_SetString(PyExc_TypeError, "a message's RRefs and tensors come in lists");
		return NULL;
	}
	len = PyList_Size(list);
	if (!(h = malloc((size_t)(len ? len : 1) * sizeof(*h))))
		return (void **)PyErr_NoMemory();
	for (Py_ssize_t i = 0; i < len; i++) {
		PyObject *o = PyList_GetItem(list, i);

		if (!PyObject_TypeCheck(o, (PyTypeObject *)type)) {
			free(h);
			PyErr_SetString(PyExc_TypeError, "a message lists an object of the wrong type");
			return NULL;
		}
		if (!HANDLE(o)) { /* a Tensor emptied by take_dlpack */
			free(h);
			PyErr_SetString(PyExc_ValueError, "a message lists a Tensor whose reference "
					"went to a DLPack capsule (take_dlpack): send the tensor made "
					"from it");
			return NULL;
		}
		h[i] = HANDLE(o);
	}
	*n = (uint32_t)len;
	return h;
}

/* A message from (pickle, [RRef...], [Tensor...]): borrows the pickle and
 * the handles, valid while the objects live; rrefs and tensors malloc'd
 * (msg_free). */
int msg_from_py(PyObject *pickled, PyObject *rrefs, PyObject *tensors, struct python_msg *m)
{
	char *buf;
	Py_ssize_t len;

	memset(m, 0, sizeof(*m));
	if (PyBytes_AsStringAndSize(pickled, &buf, &len))
		return -1;
	m->data = buf;
	m->len = (size_t)len;
	m->rrefs = (shmrpc_rref **)handles_of(rrefs, RRefType, &m->nrrefs);
	if (!m->rrefs)
		return -1;
	m->tensors = (shmrpc_tensor **)handles_of(tensors, TensorType, &m->ntensors);
	if (!m->tensors) {
		free(m->rrefs);
		return -1;
	}
	return 0;
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

/* A list of new objects, one per handle, each holding a handle of its own. */
static PyObject *objects_of(void *const *h, uint32_t n, bool rrefs)
{
	PyObject *list = PyList_New(n);

	for (uint32_t i = 0; list && i < n; i++) {
		PyObject *o = NULL;

		if (rrefs) {
			shmrpc_rref *r;

			o = shmrpc_rref_retain(h[i], &r) ? fail(-EIO) : rref_wrap(r);
		} else {
			shmrpc_tensor *t;

			o = shmrpc_tensor_retain(h[i], &t) ? fail(-EIO) : tensor_wrap(t);
		}
		if (!o)
			Py_CLEAR(list);
		else
			PyList_SetItem(list, i, o);
	}
	return list;
}

/* out: copies the agent owns of view (the objects go with the GIL). */
static int msg_copy(const struct python_msg *view, struct python_msg *out)
{
	int rc = 0;

	memset(out, 0, sizeof(*out));
	out->len = view->len;
	out->data = malloc(view->len ? view->len : 1);
	out->rrefs = malloc((view->nrrefs ? view->nrrefs : 1) * sizeof(*out->rrefs));
	out->tensors = malloc((view->ntensors ? view->ntensors : 1) * sizeof(*out->tensors));
	if (!out->data || !out->rrefs || !out->tensors)
		rc = -ENOMEM;
	else
		memcpy((void *)out->data, view->data, view->len);
	for (uint32_t i = 0; rc == 0 && i < view->nrrefs; i++)
		if (!(rc = shmrpc_rref_retain(view->rrefs[i], &out->rrefs[out->nrrefs])))
			out->nrrefs++;
	for (uint32_t i = 0; rc == 0 && i < view->ntensors; i++)
		if (!(rc = shmrpc_tensor_retain(view->tensors[i], &out->tensors[out->ntensors])))
			out->ntensors++;
	if (rc) {
		for (uint32_t i = 0; i < out->nrrefs; i++)
			shmrpc_rref_free(out->rrefs[i]);
		for (uint32_t i = 0; i < out->ntensors; i++)
			shmrpc_tensor_free(out->tensors[i]);
		free((void *)out->data);
		msg_free(out);
	}
	return rc;
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

/* The Python handler's arguments: (caller, type, context_id, message_id,
 * retain_graph, pickle, [RRef...], [Tensor...], ops, rref_id, profile),
 * ops being a list to append the ops torch's profiler recorded to, or None
 * (python_handler_fn), profile what the caller's profiler asks (PROFILE_
 * bits: with PROFILE_TORCH, SHAPES and MEMORY are its options), rref_id a remote call's RRef (0 for other requests);
 * it returns (pickle, [RRef...], [Tensor...]) or, answering a
 * FORWARD_AUTOGRAD_REQ, the same and the reply's autograd message id, and
 * for a remote call whose result it keeps live (worker/python.h) the same
 * with that id (0 if none) and True. */
int run_handler(uint32_t caller, const struct python_request *in, struct python_request *out,
		       struct profile_events *ops)
{
	PyGILState_STATE g = gil_take();
	PyObject *res = NULL, *rrefs, *tensors, *pickled, *op_list;
	const struct python_msg *m = &in->msg;
	struct python_msg view;
	long long message_id = 0;
	int live = 0, rc = -EIO;

	/* The handler's input as Python sees it: (bytes, [RRef...], [Tensor...]). */
	rrefs = objects_of((void *const *)m->rrefs, m->nrrefs, true);
	tensors = objects_of((void *const *)m->tensors, m->ntensors, false);
	op_list = ops ? PyList_New(0) : new_ref(Py_None);
	if (rrefs && tensors && op_list && handler)
		res = PyObject_CallFunction(handler, "IHLLOy#OOOKI", caller, in->type,
					    (long long)in->context_id, (long long)in->message_id,
					    in->retain_graph ? Py_True : Py_False,
					    (const char *)m->data, (Py_ssize_t)m->len, rrefs, tensors,
					    op_list, (unsigned long long)in->rref_id,
					    ops ? ops->what : 0u);
	if (res && ops)
		ops_add(op_list, ops);
	Py_XDECREF(rrefs);
	Py_XDECREF(tensors);
	Py_XDECREF(op_list);
	if (res && PyArg_ParseTuple(res, "SOO|Lp", &pickled, &rrefs, &tensors, &message_id, &live) &&
	    msg_from_py(pickled, rrefs, tensors, &view) == 0) {
		out->message_id = (int64_t)message_id;
		out->live = live;
		rc = msg_copy(&view, &out->msg);
		msg_free(&view);
	} else {
		/* The handler catches what the function raises: this is a bug
		 * in it, or no memory. Its text goes back as an EXCEPTION. */
		PyErr_Print();
	}
	Py_XDECREF(res);
	PyGILState_Release(g);
	return rc;
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

static PyObject *releaser; /* the Python live-value release, owned */

/* The live-release hook (worker/rref.h): the Python package drops the
 * object it kept for the RRef id. Any thread: the GIL is taken here. */
static void release_live(uint64_t id)
{
	PyGILState_STATE g;
	PyObject *res;

	if (!releaser)
		return;
	g = gil_take();
	res = PyObject_CallFunction(releaser, "K", (unsigned long long)id);
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
	{ "set_handler", mod_set_handler, METH_O, "the function that runs pickled calls" },
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
