/* Future and RRef: a call's result, and a remote value, as Python objects. */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "python/module.h"
#include "worker/python_api.h"

static void future_dealloc(PyObject *self)
{
	dealloc_with(self, release_future);
}

/*
 * The frames of this thread that may run a call's completion hook
 * (run_callback) themselves: wait(), whose thread runs it when the call
 * completes (future_hook), and add_done_callback, which runs it at once
 * for a call done already. What a hook raises there that is no Exception
 * (a KeyboardInterrupt: Ctrl-C lands on the main thread, which now runs
 * the user's done-callbacks; a SystemExit) is raised by that frame, as
 * the Python Future's own settling in wait() raises it, not printed and
 * lost: an executor thread, which ran every hook before, never met one.
 */
static _Thread_local unsigned hook_frames;
static _Thread_local PyObject *hook_raised[3]; /* type, value, traceback */

/* The end of a frame that may have run hooks: -1 with what one raised
 * set, else 0. */
static int hook_frame_end(void)
{
	hook_frames--;
	if (!hook_raised[0])
		return 0;
	PyErr_Restore(hook_raised[0], hook_raised[1], hook_raised[2]);
	hook_raised[0] = hook_raised[1] = hook_raised[2] = NULL;
	return -1;
}

/* wait(timeout_ms=-1) -> bytes */
static PyObject *future_wait(PyObject *self, PyObject *args)
{
	shmrpc_future *f = HANDLE(self);
	long long timeout = -1;
	int rc;

	if (!PyArg_ParseTuple(args, "|L", &timeout))
		return NULL;
	hook_frames++;
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_future_wait(f, (int64_t)timeout);
	Py_END_ALLOW_THREADS
	if (hook_frame_end())
		return NULL;
	return rc ? fail(rc) : msg_to_py(shmrpc_future_value(f));
}

static PyObject *future_done(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyBool_FromLong(shmrpc_future_done(HANDLE(self)));
}

/* profiled_call's readers of a Future's and an RRef's handle. */
static bool future_profiled_of(void *h, struct python_profiled *p)
{
	return python_profiled(h, p);
}

static bool rref_profiled_of(void *h, struct python_profiled *p)
{
	return python_rref_profiled(h, p);
}

/* A call made for torch's profiler (worker/profile.h), once it has
 * completed (waited for; it ends by its reply, its timeout or its callee's
 * death): (key, sent_ns, done_ns, [(name, start_ns, end_ns, rank, thread),
 * ...]), the callee's events (none if it failed); None for another call. */
static PyObject *profiled_call(void *h, bool (*profiled)(void *h, struct python_profiled *p))
{
	struct python_profiled p;
	const struct profile_events *pe;
	PyObject *list;
	bool is;

	Py_BEGIN_ALLOW_THREADS
	is = profiled(h, &p);
	Py_END_ALLOW_THREADS
	if (!is)
		return new_ref(Py_None);
	pe = p.events;
	list = PyList_New(pe ? pe->n : 0);
	for (uint32_t i = 0; list && pe && i < pe->n; i++) {
		const struct profile_event_rec *e = &pe->ev[i];
		PyObject *t = Py_BuildValue("(sKKIKzL)", e->name, (unsigned long long)e->start_ns,
					    (unsigned long long)e->end_ns, e->rank,
					    (unsigned long long)e->thread, e->shapes,
					    (long long)e->cpu_mem);

		if (!t)
			Py_CLEAR(list);
		else
			PyList_SetItem(list, i, t);
	}
	return list ? Py_BuildValue("(sKKN)", p.key, (unsigned long long)p.sent_ns,
				    (unsigned long long)p.done_ns, list)
		    : NULL;
}

static PyObject *future_profiled(PyObject *self, PyObject *unused)
{
	(void)unused;
	return profiled_call(HANDLE(self), future_profiled_of);
}

/* Runs a Python callable once the future completes: on the thread waiting
 * for it, if one is, else on an executor (python_future_hook). */
static void run_callback(shmrpc_future *f, void *arg)
{
	PyGILState_STATE g = gil_take();
	PyObject *res = PyObject_CallObject(arg, NULL);

	(void)f;
	if (!res) {
		/* The Python layer catches its callbacks' Exceptions; one frame
		 * raises one other error (hook_frames), the rest are printed. */
		if (hook_frames && !hook_raised[0] && !PyErr_ExceptionMatches(PyExc_Exception))
			PyErr_Fetch(&hook_raised[0], &hook_raised[1], &hook_raised[2]);
		else
			PyErr_Print();
	}
	Py_XDECREF(res);
	Py_DECREF((PyObject *)arg);
	PyGILState_Release(g);
}

static PyObject *future_add_done_callback(PyObject *self, PyObject *fn)
{
	int rc;

	if (!PyCallable_Check(fn)) {
		PyErr_SetString(PyExc_TypeError, "the callback must be callable");
		return NULL;
	}
	Py_INCREF(fn);
	hook_frames++;
	rc = python_future_hook(HANDLE(self), run_callback, fn);
	if (hook_frame_end())
		return NULL; /* fn ran, and went */
	if (rc) {
		Py_DECREF(fn);
		return fail(rc);
	}
	return new_ref(Py_None);
}

static PyMethodDef future_methods[] = {
	{ "add_done_callback", future_add_done_callback, METH_O,
	  "calls fn() once the call has completed: on a thread in wait() if one is, else "
	  "on an executor thread (fn takes no lock such a waiter may hold)" },
	{ "wait", future_wait, METH_VARARGS, "wait(timeout_ms=-1) -> (pickle, [RRef...], [Tensor...])" },
	{ "done", future_done, METH_NOARGS, "whether the call has completed" },
	{ "profiled", future_profiled, METH_NOARGS,
	  "a call made for torch's profiler, once completed: (key, sent_ns, done_ns, events)" },
	{ NULL, NULL, 0, NULL },
};

static PyType_Slot future_slots[] = {
	{ Py_tp_dealloc, future_dealloc },
	{ Py_tp_methods, future_methods },
	{ Py_tp_doc, "A call in flight (shmrpc_future)." },
	{ 0, NULL },
};

static PyType_Spec future_spec = { "shmrpc._shmrpc.Future", sizeof(HandleObject), 0,
				   Py_TPFLAGS_DEFAULT, future_slots };

/* ---- RRef ---- */

static void rref_dealloc(PyObject *self)
{
	dealloc_with(self, release_rref);
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
	rc = shmrpc_rref_to_here(HANDLE(self), (int64_t)timeout, &f);
	Py_END_ALLOW_THREADS
	if (rc)
		return fail(rc);
	res = msg_to_py(shmrpc_future_value(f));
	shmrpc_future_free(f);
	return res;
}

static PyObject *rref_id(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyLong_FromUnsignedLongLong(python_rref_id(HANDLE(self)));
}

static PyObject *rref_owner(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyLong_FromLong(shmrpc_rref_owner(HANDLE(self)));
}

static PyObject *rref_owner_name(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyUnicode_FromString(shmrpc_rref_owner_name(HANDLE(self)));
}

static PyObject *rref_is_owner(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyBool_FromLong(shmrpc_rref_is_owner(HANDLE(self)));
}

static PyObject *rref_confirmed(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyBool_FromLong(shmrpc_rref_confirmed_by_owner(HANDLE(self)));
}

static PyObject *rref_profiled(PyObject *self, PyObject *unused)
{
	(void)unused;
	return profiled_call(HANDLE(self), rref_profiled_of);
}

static PyObject *rref_str(PyObject *self)
{
	char buf[256];

	shmrpc_rref_str(HANDLE(self), buf, sizeof(buf));
	return PyUnicode_FromString(buf);
}

static PyMethodDef rref_methods[] = {
	{ "to_here", rref_to_here, METH_VARARGS, "to_here(timeout_ms=-1) -> (pickle, [RRef...], [Tensor...])" },
	{ "id", rref_id, METH_NOARGS, "the RRef's id (the key of its live value on the owner)" },
	{ "owner", rref_owner, METH_NOARGS, "the owner's rank" },
	{ "owner_name", rref_owner_name, METH_NOARGS, "the owner's name" },
	{ "is_owner", rref_is_owner, METH_NOARGS, "whether this worker owns it" },
	{ "confirmed_by_owner", rref_confirmed, METH_NOARGS, "whether the owner knows of it" },
	{ "profiled", rref_profiled, METH_NOARGS,
	  "remote() made for torch's profiler, once completed: as Future.profiled" },
	{ NULL, NULL, 0, NULL },
};

static PyType_Slot rref_slots[] = {
	{ Py_tp_dealloc, rref_dealloc },
	{ Py_tp_methods, rref_methods },
	{ Py_tp_str, rref_str },
	{ Py_tp_doc, "A reference counted in the job's RRef table (shmrpc_rref)." },
	{ 0, NULL },
};

static PyType_Spec rref_spec = { "shmrpc._shmrpc.RRef", sizeof(HandleObject), 0, Py_TPFLAGS_DEFAULT,
				 rref_slots };
int module_add_future(PyObject *m)
{
	FutureType = PyType_FromSpec(&future_spec);
	RRefType = PyType_FromSpec(&rref_spec);
	if (!FutureType || !RRefType || PyModule_AddObject(m, "Future", new_ref(FutureType)))
		return -1;
	return PyModule_AddObject(m, "RRef", new_ref(RRefType));
}
