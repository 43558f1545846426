/* Calls sent from Python: call() (rpc_sync, rpc_async, autograd's), remote(), RRef(value). */
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
static PyMethodDef call_functions[] = {
	{ "call", (PyCFunction)(void (*)(void))mod_call, METH_VARARGS | METH_KEYWORDS,
	  "call(dst, pickle, [RRef...], [Tensor...], timeout_ms, kind, fn, type, context_id, "
	  "message_id, retain_graph, torch_profile=0) -> Future" },
	{ "remote", (PyCFunction)(void (*)(void))mod_remote, METH_VARARGS | METH_KEYWORDS,
	  "remote(dst, pickle, [RRef...], [Tensor...], timeout_ms, fn, type, context_id, "
	  "message_id, torch_profile=0) -> RRef" },
	{ "rref_local", mod_rref_local, METH_VARARGS,
	  "rref_local(pickled, live) -> RRef: RRef(value) on this worker, ready at once" },
	{ NULL, NULL, 0, NULL },
};

int module_add_calls(PyObject *m)
{
	return PyModule_AddFunctions(m, call_functions);
}
