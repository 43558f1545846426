/*
 * _shmrpc: the C half of the Python package, on the CPython stable ABI
 * (abi3, Python >= 3.9), linked with libshmrpc's objects.
 *
 * It moves bytes, never Python objects: shmrpc/__init__.py pickles a call
 * (function by reference, args, kwargs) and this module sends it as a
 * PYTHON_CALL or PYTHON_REMOTE_CALL, or inside a distributed autograd
 * context as a FORWARD_AUTOGRAD_REQ wrapping one; shmrpc/autograd.py's
 * backward, cleanup and RRef.backward go as their own request types
 * (worker/python.h). On the callee an executor thread takes the GIL and
 * hands the bytes, the type and the autograd metadata to the Python handler
 * (shmrpc._run_function), whose pickled result comes back as bytes.
 *
 * The GIL: released around everything that waits (init's barrier, a
 * future, to_here, shutdown), taken by executor threads only to run the
 * handler and callbacks; how long they wait for it is recorded (debug_info).
 *
 * This file: the module, and its functions of the agent's life and state.
 * Beside it: _handles.c (objects wrapping library handles), _tensor.c
 * (Tensor), _torch.c (torch CPU tensors to handles and back), _future.c
 * (Future, RRef), _calls.c (call, remote, RRef(value)), _handler.c
 * (requests served), _job.c and _join.c (jobs launched from a process,
 * joining without shmrun). worker/ is reached through
 * worker/python_api.h alone.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmrpc.h"
#include "python/module.h"
#include "worker/python_api.h"

/* ---- module functions ---- */

/* The (name, from, to) triples of maps as entries (PyMem_Free them); the
 * names stay valid while maps lives. NULL with an exception set. */
static struct shmrpc_device_map_entry *device_maps(PyObject *maps, uint32_t *n)
{
	struct shmrpc_device_map_entry *e;
	Py_ssize_t len = PyList_Size(maps);

	e = PyMem_Calloc((size_t)len + 1, sizeof(*e));
	if (!e)
		return (void *)PyErr_NoMemory();
	for (Py_ssize_t i = 0; i < len; i++)
		if (!PyArg_ParseTuple(PyList_GetItem(maps, i), "sii;init: a device map entry is "
				      "(worker name, from, to)", &e[i].worker, &e[i].from, &e[i].to)) {
			PyMem_Free(e);
			return NULL;
		}
	*n = (uint32_t)len;
	return e;
}

/* init(name or None, num_threads, timeout_ms, device maps: [(name, from, to)]) */
static PyObject *mod_init(PyObject *m, PyObject *args)
{
	struct shmrpc_options o = SHMRPC_OPTIONS();
	struct shmrpc_device_map_entry *maps;
	const char *name = NULL;
	PyObject *list = NULL;
	int threads = 0;
	long long timeout = 0;
	int rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "|ziLO!", &name, &threads, &timeout, &PyList_Type, &list))
		return NULL;
	o.name = name;
	o.num_threads = threads;
	o.timeout_ms = (int64_t)timeout;
	maps = list ? device_maps(list, &o.num_device_maps) : NULL;
	if (list && !maps)
		return NULL;
	o.device_maps = maps;
	python_set_handler(run_handler);
	Py_BEGIN_ALLOW_THREADS
	rc = shmrpc_init(&o);
	Py_END_ALLOW_THREADS
	PyMem_Free(maps);
	/* A bad device map is torch's ValueError (_validate_device_maps). */
	if (rc == -EINVAL)
		return PyErr_SetString(PyExc_ValueError, shmrpc_errmsg()), NULL;
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
		int r = rank_named(who);

		rc = r < 0 ? r : shmrpc_get_worker_info_by_rank(r, &wi);
	}
	if (rc)
		return rc == INT_MIN ? NULL : fail(rc);
	return Py_BuildValue("(si)", wi.name, wi.rank);
}

/* rank_of(name) -> rank: worker_info(name)'s rank alone, without the
 * name formatted, nor the tuple (each call made by name asks it). */
static PyObject *mod_rank_of(PyObject *m, PyObject *name)
{
	int r = rank_named(name);

	(void)m;
	if (r < 0)
		return r == INT_MIN ? NULL : fail(r);
	return PyLong_FromLong(r);
}

/* blocking(on): around a wait for a Python Future, which on an executor
 * thread counts it out of the pool meanwhile, so that what completes the
 * Future runs on another (worker/executor.h); nothing on other threads. */
static PyObject *mod_blocking(PyObject *m, PyObject *on)
{
	int v = PyObject_IsTrue(on);

	(void)m;
	if (v < 0)
		return NULL;
	Py_BEGIN_ALLOW_THREADS
	python_blocking(v);
	Py_END_ALLOW_THREADS
	Py_RETURN_NONE;
}

/* take_replies(on): replies taken by the threads that wait for them
 * (worker/link.h), for a data loader's trainer while it iterates. */
static PyObject *mod_take_replies(PyObject *m, PyObject *on)
{
	int v = PyObject_IsTrue(on), rc;

	(void)m;
	if (v < 0)
		return NULL;
	Py_BEGIN_ALLOW_THREADS
	rc = python_take_replies(v);
	Py_END_ALLOW_THREADS
	if (rc) {
		PyErr_SetString(PyExc_RuntimeError, "the RPC agent is not running");
		return NULL;
	}
	Py_RETURN_NONE;
}

static PyObject *mod_profile_start(PyObject *m, PyObject *unused)
{
	(void)m, (void)unused;
	shmrpc_profile_start();
	return new_ref(Py_None);
}

/* profile_stop() -> [(name, rank, parent, start_ns, end_ns), ...] */
static PyObject *mod_profile_stop(PyObject *m, PyObject *unused)
{
	shmrpc_profile *p;
	PyObject *list;
	int rc;

	(void)m, (void)unused;
	if ((rc = shmrpc_profile_stop(&p)))
		return fail(rc);
	list = PyList_New(shmrpc_profile_count(p));
	for (uint32_t i = 0; list && i < shmrpc_profile_count(p); i++) {
		const struct shmrpc_profile_event *e = shmrpc_profile_event(p, i);
		PyObject *t = Py_BuildValue("(siiKK)", e->name, e->rank, e->parent,
					    (unsigned long long)e->start_ns,
					    (unsigned long long)e->end_ns);

		if (!t)
			Py_CLEAR(list);
		else
			PyList_SetItem(list, i, t);
	}
	shmrpc_profile_free(p);
	return list;
}

static PyObject *mod_on_executor(PyObject *m, PyObject *unused)
{
	(void)m, (void)unused;
	return PyBool_FromLong(python_on_executor());
}

/* peer_gone(rank) -> None while rank is in the job, else (died, why):
 * whether it died rather than left, and why it is gone ("worker 1 (w1)
 * died: ...", "... has left the job") as a call to it would fail: what
 * api._all_gather's waits watch. */
static PyObject *mod_peer_gone(PyObject *m, PyObject *rank)
{
	char why[256];
	long r = PyLong_AsLong(rank);
	bool gone = false, died = false;
	uint32_t world = 0;
	int rc;

	(void)m;
	if (r == -1 && PyErr_Occurred())
		return NULL;
	rc = python_peer_gone(r < INT32_MIN || r > INT32_MAX ? -1 : (int)r, &gone, &died, why,
			      sizeof(why), &world);
	if (rc == -ENOTCONN)
		return not_initialized();
	if (rc)
		return PyErr_Format(PyExc_ValueError, "no worker of rank %ld: the job has %u "
				    "workers", r, world);
	if (!gone)
		Py_RETURN_NONE;
	return Py_BuildValue("(Ns)", PyBool_FromLong(died), why);
}

/* debug_info() -> {key: int}: this worker's agent gauges from its slot
 * (torch's names where torch has them), the executor threads' GIL waits
 * and torch's RRef counts. */
static PyObject *mod_debug_info(PyObject *m, PyObject *unused)
{
	struct python_gauges g;
	uint64_t takes, wait_ns;

	(void)m, (void)unused;
	if (python_gauges(&g))
		return not_initialized();
	module_gil_stats(&takes, &wait_ns);
#define GAUGE(f) (unsigned long long)g.f
	return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
			     "agent.thread_pool_size", GAUGE(thread_pool_size),
			     "agent.num_idle_threads", GAUGE(num_idle_threads),
			     "agent.client_active_calls", GAUGE(client_active_calls),
			     "agent.server_active_calls", GAUGE(server_active_calls),
			     "agent.server_pending_calls", GAUGE(server_pending_calls),
			     "agent.calls_served", GAUGE(calls_served),
			     "agent.gil_average_wait_time_us",
			     (unsigned long long)(takes ? wait_ns / takes / 1000 : 0),
			     "agent.gil_acquisitions", (unsigned long long)takes,
			     "agent.gil_wait_time_ns", (unsigned long long)wait_ns,
			     "num_owner_rrefs", GAUGE(owner_rrefs),
			     "num_pending_futures", GAUGE(pending_owner_rrefs),
			     "num_forks", GAUGE(forks),
			     "num_pending_users", GAUGE(pending_users));
#undef GAUGE
}

/* rref_drop_users(): torch's _delete_all_user_and_unforked_owner_rrefs
 * (worker/rref.h), a graceful shutdown's step before its leak check. */
static PyObject *mod_rref_drop_users(PyObject *m, PyObject *unused)
{
	int rc;

	(void)m, (void)unused;
	Py_BEGIN_ALLOW_THREADS
	rc = python_rref_drop_users();
	Py_END_ALLOW_THREADS
	if (rc)
		return not_initialized();
	Py_RETURN_NONE;
}

/* rref_leaks() -> str: torch's leak check, one line per RRef of ours that
 * another worker still holds ("" when none). */
static PyObject *mod_rref_leaks(PyObject *m, PyObject *unused)
{
	char text[4096];

	(void)m, (void)unused;
	if (python_rref_leaks(text, sizeof(text)))
		return not_initialized();
	return PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
}

/* The request types call() and remote() send. */
static const uint16_t call_types[] = { MSG_PYTHON_CALL, MSG_PYTHON_REMOTE_CALL,
				       MSG_FORWARD_AUTOGRAD_REQ, MSG_BACKWARD_AUTOGRAD_REQ,
				       MSG_CLEANUP_AUTOGRAD_CONTEXT_REQ, MSG_RREF_BACKWARD_REQ,
				       MSG_PYTHON_RREF_FETCH_CALL };

/* sent_counts() -> {type name: int}: the requests call() and remote() sent,
 * by message type (for tests: which types autograd's traffic used). */
static PyObject *mod_sent_counts(PyObject *m, PyObject *unused)
{
	PyObject *counts = PyDict_New();

	(void)m, (void)unused;
	for (size_t i = 0; counts && i < sizeof(call_types) / sizeof(call_types[0]); i++) {
		PyObject *n = PyLong_FromUnsignedLongLong(python_sent(call_types[i]));

		if (!n || PyDict_SetItemString(counts, worker_msg_name(call_types[i]), n))
			Py_CLEAR(counts);
		Py_XDECREF(n);
	}
	return counts;
}

static PyMethodDef mod_methods[] = {
	{ "rref_drop_users", mod_rref_drop_users, METH_NOARGS,
	  "rref_drop_users(): every reference held on other workers' RRefs goes now" },
	{ "rref_leaks", mod_rref_leaks, METH_NOARGS,
	  "rref_leaks() -> str: the RRefs this worker owns that others still hold" },
	{ "debug_info", mod_debug_info, METH_NOARGS,
	  "debug_info() -> {key: int}: agent gauges and GIL waits (shmrpc._get_debug_info)" },
	{ "sent_counts", mod_sent_counts, METH_NOARGS,
	  "sent_counts() -> {type name: int}: the requests sent, by message type" },
	{ "on_executor", mod_on_executor, METH_NOARGS, "whether this is an executor thread" },
	{ "profile_start", mod_profile_start, METH_NOARGS, "profile this process's calls" },
	{ "profile_stop", mod_profile_stop, METH_NOARGS, "stop; the events recorded" },
	{ "blocking", mod_blocking, METH_O, "around a Future's wait: count an executor thread out" },
	{ "take_replies", mod_take_replies, METH_O,
	  "take_replies(on): replies wake nobody while no thread waits; waiters poll" },
	{ "init", mod_init, METH_VARARGS, "init(name, num_threads, timeout_ms, device_maps): shmrpc_init" },
	{ "shutdown", mod_shutdown, METH_VARARGS, "shutdown(graceful, timeout_ms)" },
	{ "rank", mod_rank, METH_NOARGS, "this worker's rank" },
	{ "world_size", mod_world_size, METH_NOARGS, "the number of workers" },
	{ "worker_info", mod_worker_info, METH_O, "worker_info(name|rank|None) -> (name, rank)" },
	{ "rank_of", mod_rank_of, METH_O, "rank_of(name) -> rank" },
	{ "peer_gone", mod_peer_gone, METH_O,
	  "peer_gone(rank) -> None while rank is in the job, else (died, why)" },
	{ NULL, NULL, 0, NULL },
};

static struct PyModuleDef module = { PyModuleDef_HEAD_INIT, "shmrpc._shmrpc",
				     "The C half of shmrpc's Python package.", -1, mod_methods,
				     NULL, NULL, NULL, NULL };

/* The request types the package sends and serves, as module constants. */
static int add_types(PyObject *m)
{
	for (size_t i = 0; i < sizeof(call_types) / sizeof(call_types[0]); i++)
		if (PyModule_AddIntConstant(m, worker_msg_name(call_types[i]), call_types[i]))
			return -1;
	return 0;
}

PyMODINIT_FUNC PyInit__shmrpc(void);
PyMODINIT_FUNC PyInit__shmrpc(void)
{
	PyObject *m = PyModule_Create(&module);

	if (!m)
		return NULL;
	if (module_add_future(m) || module_add_tensor(m) || module_add_torch(m) ||
	    module_add_handler(m) || module_add_in_context(m) || module_add_calls(m) || module_add_dumps(m) || module_add_job(m) ||
	    PyModule_AddIntConstant(m, "TIMEOUT_DEFAULT", SHMRPC_TIMEOUT_DEFAULT) ||
	    PyModule_AddIntConstant(m, "PROFILE_TORCH", PROFILE_TORCH) ||
	    PyModule_AddIntConstant(m, "PROFILE_SHAPES", PROFILE_SHAPES) ||
	    PyModule_AddIntConstant(m, "PROFILE_MEMORY", PROFILE_MEMORY) ||
	    add_types(m)) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}