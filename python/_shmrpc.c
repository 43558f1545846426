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
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "shmrpc.h"
#include "common/clock.h"
#include "python/module.h"
#include "worker/python_api.h"

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

/* torch's RuntimeError for a call that needs the agent before init_rpc. */
static PyObject *not_initialized(void)
{
	PyErr_SetString(PyExc_RuntimeError,
			"RPC has not been initialized. Call shmrpc.init_rpc first.");
	return NULL;
}

/* Every object of this module wraps one library handle, which it owns. */
typedef struct {
	PyObject_HEAD
	void *h;
} HandleObject;

#define HANDLE(o) (((HandleObject *)(o))->h)

static PyObject *FutureType, *RRefType, *TensorType;

static void release_future(void *h)
{
	shmrpc_future_free(h);
}

static void release_rref(void *h)
{
	shmrpc_rref_free(h);
}

static void release_tensor(void *h)
{
	shmrpc_tensor_free(h);
}

/* A new object of type owning h (released on failure). */
static PyObject *wrap(PyObject *type, void *h, void (*release)(void *))
{
	HandleObject *o = PyObject_New(HandleObject, (PyTypeObject *)type);

	if (!o) {
		release(h);
		return NULL;
	}
	o->h = h;
	return (PyObject *)o;
}

static void dealloc_with(PyObject *self, void (*release)(void *))
{
	PyTypeObject *tp = Py_TYPE(self);

	release(HANDLE(self));
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp); /* heap types: each instance holds its type */
}

static PyObject *rref_wrap(shmrpc_rref *r)
{
	return wrap(RRefType, r, release_rref);
}

/* ---- Tensor: a block of the pool, for DLPack consumers ---- */

static PyObject *tensor_wrap(shmrpc_tensor *t)
{
	return wrap(TensorType, t, release_tensor);
}

static void tensor_dealloc(PyObject *self)
{
	dealloc_with(self, release_tensor);
}

/* A capsule nobody consumed still owns its DLManagedTensor. */
static void capsule_free(PyObject *cap)
{
	DLManagedTensor *m;

	if (!PyCapsule_IsValid(cap, "dltensor"))
		return; /* consumed: renamed "used_dltensor" */
	m = PyCapsule_GetPointer(cap, "dltensor");
	if (m && m->deleter)
		m->deleter(m);
}

/* A CUDA tensor's consumer, which will queue its work on stream (the
 * DLPack protocol's stream argument: None or 1, the legacy default stream;
 * 2, the per-thread default stream; -1, no ordering wanted; else a
 * CUstream of the device), waits for the writes the tensor was sent after.
 * 0 or -1 with an exception set. */
static int consumer_waits(shmrpc_tensor *t, PyObject *stream)
{
	long long s = 0; /* the CUstream: 0 is the legacy default stream */
	int rc;

	if (stream && stream != Py_None) {
		s = PyLong_AsLongLong(stream);
		if (s == -1 && PyErr_Occurred())
			return -1;
		if (s == -1)
			return 0;
		if (s == 0 || s < -1) {
			PyErr_Format(PyExc_ValueError, "__dlpack__: stream %lld is not a CUDA stream "
				     "for DLPack: pass None or 1 for the legacy default stream, 2 for "
				     "the per-thread default stream, -1 for no ordering, or a CUstream",
				     s);
			return -1;
		}
		if (s == 1)
			s = 0;
	}
	rc = shmrpc_tensor_cuda_wait(t, (uintptr_t)s);
	return rc ? (fail(rc), -1) : 0;
}

/* __dlpack__(stream=None): a new reference to the same bytes; for a CUDA
 * tensor, ordered on the consumer's stream (consumer_waits). */
static PyObject *tensor_dlpack(PyObject *self, PyObject *args, PyObject *kw)
{
	static char *names[] = { "stream", NULL };
	PyObject *stream = NULL, *cap;
	const DLTensor *dl = shmrpc_tensor_dl(HANDLE(self));
	DLManagedTensor *m;
	shmrpc_tensor *t;
	int rc;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", names, &stream))
		return NULL;
	if (!dl)
		return fail(-ECONNRESET);
	if (dl->device.device_type == kDLCUDA && consumer_waits(HANDLE(self), stream))
		return NULL;
	rc = shmrpc_tensor_retain(HANDLE(self), &t);
	if (rc == 0 && (rc = shmrpc_tensor_to_dlpack(t, &m)))
		shmrpc_tensor_free(t);
	if (rc)
		return fail(rc);
	if (!(cap = PyCapsule_New(m, "dltensor", capsule_free)))
		m->deleter(m);
	return cap;
}

static PyObject *tensor_dlpack_device(PyObject *self, PyObject *unused)
{
	const DLTensor *dl = shmrpc_tensor_dl(HANDLE(self));

	(void)unused;
	if (!dl)
		return fail(-ECONNRESET);
	return Py_BuildValue("(ii)", (int)dl->device.device_type, (int)dl->device.device_id);
}

/* The tensor's DLTensor when its bytes are host memory; else an exception
 * saying that what (a host-only method) cannot read device memory. */
static const DLTensor *host_dl(PyObject *self, const char *what)
{
	const DLTensor *dl = shmrpc_tensor_dl(HANDLE(self));

	if (!dl)
		return fail(-ECONNRESET), NULL;
	if (dl->device.device_type != kDLCPU) {
		PyErr_Format(PyExc_TypeError, "Tensor.%s reads host memory, and this tensor is in "
			     "CUDA device %d's memory: take it with torch.from_dlpack or "
			     "cupy.from_dlpack (no copy), and copy it to the host there if needed",
			     what, (int)dl->device.device_id);
		return NULL;
	}
	return dl;
}

/* tobytes() -> a copy of the bytes. */
static PyObject *tensor_tobytes(PyObject *self, PyObject *unused)
{
	shmrpc_tensor *t = HANDLE(self);

	(void)unused;
	if (!host_dl(self, "tobytes"))
		return NULL;
	return PyBytes_FromStringAndSize(shmrpc_tensor_data(t), (Py_ssize_t)shmrpc_tensor_nbytes(t));
}

/* data_ptr() -> the address of the bytes: in this process's mapping of the
 * pool, or a CUDA device pointer (torch.Tensor.data_ptr's meaning). */
static PyObject *tensor_data_ptr(PyObject *self, PyObject *unused)
{
	void *p = shmrpc_tensor_data(HANDLE(self));

	(void)unused;
	return p ? PyLong_FromVoidPtr(p) : fail(-ECONNRESET);
}

/* set_cuda_stream(stream): the CUstream (an int, 0: the legacy default
 * stream) on which the tensor's last writes were queued; its sends order
 * their receivers after them. */
static PyObject *tensor_set_cuda_stream(PyObject *self, PyObject *stream)
{
	unsigned long long s = PyLong_AsUnsignedLongLong(stream);
	int rc;

	if (s == (unsigned long long)-1 && PyErr_Occurred())
		return NULL;
	rc = shmrpc_tensor_set_cuda_stream(HANDLE(self), (uintptr_t)s);
	return rc ? fail(rc) : new_ref(Py_None);
}

static PyObject *tensor_pool_offset(PyObject *self, PyObject *unused)
{
	(void)unused;
	return PyLong_FromUnsignedLongLong(shmrpc_tensor_pool_offset(HANDLE(self)));
}

/* numpy's array interface (version 3): np.asarray(t) views the bytes,
 * writable, and keeps t alive as the array's base. (numpy.from_dlpack
 * gives read-only arrays.) */
static PyObject *tensor_array_interface(PyObject *self, void *closure)
{
	const DLTensor *dl = host_dl(self, "__array_interface__");
	static const char kinds[] = { [kDLInt] = 'i', [kDLUInt] = 'u', [kDLFloat] = 'f' };
	PyObject *shape, *res;
	char typestr[16];

	(void)closure;
	if (!dl)
		return NULL;
	if (dl->dtype.code > kDLFloat || dl->dtype.lanes != 1) {
		PyErr_SetString(PyExc_TypeError, "this tensor's dtype has no numpy equivalent");
		return NULL;
	}
	snprintf(typestr, sizeof(typestr), "<%c%u", kinds[dl->dtype.code], dl->dtype.bits / 8);
	if (!(shape = PyTuple_New(dl->ndim)))
		return NULL;
	for (int32_t i = 0; i < dl->ndim; i++)
		PyTuple_SetItem(shape, i, PyLong_FromLongLong(dl->shape[i]));
	res = Py_BuildValue("{s:O,s:s,s:(K,O),s:i}", "shape", shape, "typestr", typestr, "data",
			    (unsigned long long)(uintptr_t)dl->data, Py_False, "version", 3);
	Py_DECREF(shape);
	return res;
}

static PyGetSetDef tensor_getset[] = {
	{ "__array_interface__", tensor_array_interface, NULL, "numpy's array interface", NULL },
	{ NULL, NULL, NULL, NULL, NULL },
};

static PyMethodDef tensor_methods[] = {
	{ "__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_VARARGS | METH_KEYWORDS,
	  "a DLPack capsule of the same bytes" },
	{ "__dlpack_device__", tensor_dlpack_device, METH_NOARGS,
	  "(kDLCPU=1, 0) or (kDLCUDA=2, device)" },
	{ "data_ptr", tensor_data_ptr, METH_NOARGS, "the address of the bytes (host or device)" },
	{ "set_cuda_stream", tensor_set_cuda_stream, METH_O,
	  "set_cuda_stream(CUstream as an int): the stream that wrote a CUDA tensor" },
	{ "pool_offset", tensor_pool_offset, METH_NOARGS, "where the bytes are in the pool" },
	{ "tobytes", tensor_tobytes, METH_NOARGS, "a copy of the bytes" },
	{ NULL, NULL, 0, NULL },
};

static PyType_Slot tensor_slots[] = {
	{ Py_tp_dealloc, tensor_dealloc },
	{ Py_tp_methods, tensor_methods },
	{ Py_tp_getset, tensor_getset },
	{ Py_tp_doc, "A tensor in the job's pool, in CUDA device memory, or (small, sent "
		     "inside the message) in this process's memory (shmrpc_tensor); "
		     "numpy.asarray (host only), torch.from_dlpack and cupy.from_dlpack view "
		     "it without a copy." },
	{ 0, NULL },
};

static PyType_Spec tensor_spec = { "shmrpc._shmrpc.Tensor", sizeof(HandleObject), 0,
				   Py_TPFLAGS_DEFAULT, tensor_slots };

/* (pickle: bytes, [RRef, ...], [Tensor, ...]) from a Python message value
 * (or the FORWARD_AUTOGRAD_RESP that wraps one); each RRef and Tensor a
 * handle of its own. */
static PyObject *msg_to_py(const shmrpc_value *v)
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
		h[i] = HANDLE(o);
	}
	*n = (uint32_t)len;
	return h;
}

/* A message from (pickle, [RRef...], [Tensor...]): borrows the pickle and
 * the handles, valid while the objects live; rrefs and tensors malloc'd
 * (msg_free). */
static int msg_from_py(PyObject *pickled, PyObject *rrefs, PyObject *tensors, struct python_msg *m)
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

static void msg_free(struct python_msg *m)
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
static PyGILState_STATE gil_take(void)
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
static int run_handler(uint32_t caller, const struct python_request *in, struct python_request *out,
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

/* ---- Future ---- */

static PyObject *future_wrap(shmrpc_future *f)
{
	return wrap(FutureType, f, release_future);
}

static void future_dealloc(PyObject *self)
{
	dealloc_with(self, release_future);
}

/* wait(timeout_ms=-1) -> bytes */
static PyObject *future_wait(PyObject *self, PyObject *args)
{
	shmrpc_future *f = HANDLE(self);
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

/* Runs a Python callable once the future completes (an executor thread). */
static void run_callback(shmrpc_future *f, void *arg)
{
	PyGILState_STATE g = gil_take();
	PyObject *res = PyObject_CallObject(arg, NULL);

	(void)f;
	if (!res)
		PyErr_Print(); /* the Python layer catches its callbacks' errors */
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
	rc = shmrpc_future_then(HANDLE(self), run_callback, fn);
	if (rc) {
		Py_DECREF(fn);
		return fail(rc);
	}
	return new_ref(Py_None);
}

static PyMethodDef future_methods[] = {
	{ "add_done_callback", future_add_done_callback, METH_O,
	  "calls fn() on an executor thread once the call has completed" },
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

/* call(dst, pickle, [RRef...], [Tensor...], timeout_ms, kind=None, fn=None,
 * type=PYTHON_CALL, context_id=-1, message_id=0, retain_graph=False, *,
 * torch_profile=0) -> Future; kind and fn name it for the profiler;
 * type is PYTHON_CALL or one of distributed autograd's requests
 * (worker/python.h says which of the other arguments each one carries);
 * torch_profile: profiled for torch's profiler (Future.profiled) when
 * nonzero, with its profile's options as PROFILE_SHAPES, PROFILE_MEMORY. */
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
	if (!PyArg_ParseTupleAndKeywords(args, kw, "iSOOL|zzHLLp$I", names, &dst, &pickled, &rrefs,
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
 * type=PYTHON_REMOTE_CALL, context_id=-1, message_id=0, *,
 * torch_profile=0) -> RRef; type is PYTHON_REMOTE_CALL or, inside a
 * distributed autograd context (context_id, message_id), FORWARD_AUTOGRAD_REQ
 * wrapping one; torch_profile as call()'s (RRef.profiled). */
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
	if (!PyArg_ParseTupleAndKeywords(args, kw, "iSOOL|zHLL$I", names, &dst, &pickled, &rrefs,
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

/* from_dlpack(obj) -> Tensor: obj's bytes in the pool (taken without a copy
 * when they are a whole pool block already, copied once otherwise; up to
 * SHMRPC_INLINE_MAX bytes copied into this process's memory instead, to
 * travel inline), or CUDA device memory as it is. obj speaks DLPack, or is the capsule its
 * __dlpack__ gave (for a caller that passes the stream argument). */
static PyObject *mod_from_dlpack(PyObject *m, PyObject *obj)
{
	PyObject *cap = PyCapsule_CheckExact(obj) ? new_ref(obj)
						   : PyObject_CallMethod(obj, "__dlpack__", NULL);
	DLManagedTensor *dm;
	shmrpc_tensor *t;
	int rc;

	(void)m;
	if (!cap)
		return NULL;
	if (!(dm = PyCapsule_GetPointer(cap, "dltensor"))) {
		Py_DECREF(cap);
		return NULL;
	}
	rc = shmrpc_tensor_from_dlpack(dm, &t);
	if (rc == 0)
		PyCapsule_SetName(cap, "used_dltensor"); /* consumed: its deleter ran */
	Py_DECREF(cap);
	return rc ? fail(rc) : tensor_wrap(t);
}

/* from_bytes(bytes) -> Tensor: a copy of the bytes in a new pool block
 * (uint8), for data too large for a frame. */
static PyObject *mod_from_bytes(PyObject *m, PyObject *obj)
{
	shmrpc_tensor *t;
	char *buf;
	Py_ssize_t len;
	int64_t shape[1];
	int rc;

	(void)m;
	if (PyBytes_AsStringAndSize(obj, &buf, &len))
		return NULL;
	shape[0] = len;
	rc = shmrpc_tensor_alloc((DLDataType){ kDLUInt, 8, 1 }, 1, shape, &t);
	if (rc)
		return fail(rc);
	memcpy(shmrpc_tensor_data(t), buf, (size_t)len);
	return tensor_wrap(t);
}

/* empty(shape, code, bits) -> Tensor: a new block of the pool. */
static PyObject *mod_empty(PyObject *m, PyObject *args)
{
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
	PyObject *dims;
	unsigned code, bits;
	shmrpc_tensor *t;
	Py_ssize_t n;
	int rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "OII", &dims, &code, &bits))
		return NULL;
	if (!PyTuple_Check(dims) || (n = PyTuple_Size(dims)) > SHMRPC_TENSOR_MAX_DIMS) {
		PyErr_Format(PyExc_ValueError, "a shape is a tuple of at most %d sizes",
			     SHMRPC_TENSOR_MAX_DIMS);
		return NULL;
	}
	for (Py_ssize_t i = 0; i < n; i++)
		if ((shape[i] = PyLong_AsLongLong(PyTuple_GetItem(dims, i))) == -1 && PyErr_Occurred())
			return NULL;
	rc = shmrpc_tensor_alloc((DLDataType){ (uint8_t)code, (uint8_t)bits, 1 }, (int32_t)n, shape,
				 &t);
	return rc ? fail(rc) : tensor_wrap(t);
}

/* Copies n bytes to dst, which nobody reads soon, with non-temporal stores
 * where the CPU has them: they skip the read of each destination line that
 * a cached store makes first (read for ownership) and leave the cache to
 * the sources, so a copy larger than the cache moves a third less memory. */
static void copy_streaming(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
	size_t head = (size_t)(-(uintptr_t)dst & 15);

	if (head > n)
		head = n;
	memcpy(dst, src, head);
	dst += head, src += head, n -= head;
	for (; n >= 64; dst += 64, src += 64, n -= 64) {
		const __m128i *s = (const __m128i *)(const void *)src;
		__m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
		__m128i c = _mm_loadu_si128(s + 2), d = _mm_loadu_si128(s + 3);

		_mm_stream_si128((__m128i *)(void *)dst, a);
		_mm_stream_si128((__m128i *)(void *)dst + 1, b);
		_mm_stream_si128((__m128i *)(void *)dst + 2, c);
		_mm_stream_si128((__m128i *)(void *)dst + 3, d);
	}
	/* The stores are weakly ordered: fenced before whatever publishes the
	 * bytes (the reply that hands the block over). */
	_mm_sfence();
#endif
	memcpy(dst, src, n);
}

/* stack_rows(tensor, [address, ...], row_bytes): writes the rows (each
 * row_bytes at its address, e.g. a batch's contiguous samples) one after
 * the other into tensor's block with streaming stores, the GIL released:
 * the data loader's collate of a batch too large to stay in the cache
 * until the trainer reads it (shmrpc.data). */
static PyObject *mod_stack_rows(PyObject *m, PyObject *args)
{
	PyObject *obj, *addrs;
	unsigned long long row;
	Py_ssize_t n;
	uintptr_t *src;
	char *dst;

	(void)m;
	if (!PyArg_ParseTuple(args, "O!OK", (PyTypeObject *)TensorType, &obj, &addrs, &row))
		return NULL;
	if (!PyList_Check(addrs)) {
		PyErr_SetString(PyExc_TypeError, "stack_rows: the rows' addresses come in a list");
		return NULL;
	}
	n = PyList_Size(addrs);
	if (row && (uint64_t)n > shmrpc_tensor_nbytes(HANDLE(obj)) / row) {
		PyErr_Format(PyExc_ValueError, "stack_rows: %zd rows of %llu bytes overflow a "
			     "tensor of %llu bytes", n, row,
			     (unsigned long long)shmrpc_tensor_nbytes(HANDLE(obj)));
		return NULL;
	}
	if (!(src = malloc((size_t)(n ? n : 1) * sizeof(*src))))
		return PyErr_NoMemory();
	for (Py_ssize_t i = 0; i < n; i++) {
		src[i] = (uintptr_t)PyLong_AsVoidPtr(PyList_GetItem(addrs, i));
		if (PyErr_Occurred()) {
			free(src);
			return NULL;
		}
	}
	dst = shmrpc_tensor_data(HANDLE(obj));
	Py_BEGIN_ALLOW_THREADS
	for (Py_ssize_t i = 0; i < n; i++)
		copy_streaming(dst + (size_t)i * row, (const char *)src[i], (size_t)row);
	Py_END_ALLOW_THREADS
	free(src);
	return new_ref(Py_None);
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
	uint64_t takes = atomic_load_explicit(&gil_takes, memory_order_relaxed);
	uint64_t wait_ns = atomic_load_explicit(&gil_wait_ns, memory_order_relaxed);

	(void)m, (void)unused;
	if (python_gauges(&g))
		return not_initialized();
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
	{ "rref_local", mod_rref_local, METH_VARARGS,
	  "rref_local(pickled, live) -> RRef: RRef(value) on this worker, ready at once" },
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
	{ "set_handler", mod_set_handler, METH_O, "the function that runs pickled calls" },
	{ "set_live_release", mod_set_live_release, METH_O,
	  "set_live_release(fn): fn(rref_id) drops an owned RRef's live value once it went" },
	{ "rank", mod_rank, METH_NOARGS, "this worker's rank" },
	{ "world_size", mod_world_size, METH_NOARGS, "the number of workers" },
	{ "worker_info", mod_worker_info, METH_O, "worker_info(name|rank|None) -> (name, rank)" },
	{ "peer_gone", mod_peer_gone, METH_O,
	  "peer_gone(rank) -> None while rank is in the job, else (died, why)" },
	{ "call", (PyCFunction)(void (*)(void))mod_call, METH_VARARGS | METH_KEYWORDS,
	  "call(dst, pickle, [RRef...], [Tensor...], timeout_ms, kind, fn, type, context_id, "
	  "message_id, retain_graph, *, torch_profile=0) -> Future" },
	{ "remote", (PyCFunction)(void (*)(void))mod_remote, METH_VARARGS | METH_KEYWORDS,
	  "remote(dst, pickle, [RRef...], [Tensor...], timeout_ms, fn, type, context_id, "
	  "message_id, *, torch_profile=0) -> RRef" },
	{ "from_dlpack", mod_from_dlpack, METH_O,
	  "from_dlpack(obj or capsule) -> Tensor in the pool or on a CUDA device" },
	{ "empty", mod_empty, METH_VARARGS, "empty(shape, code, bits) -> Tensor in the pool" },
	{ "from_bytes", mod_from_bytes, METH_O, "from_bytes(b) -> a copy of b in the pool" },
	{ "stack_rows", mod_stack_rows, METH_VARARGS,
	  "stack_rows(tensor, [address...], row_bytes): the rows, streamed into tensor's block" },
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
	FutureType = PyType_FromSpec(&future_spec);
	RRefType = PyType_FromSpec(&rref_spec);
	TensorType = PyType_FromSpec(&tensor_spec);
	if (!FutureType || !RRefType || !TensorType ||
	    PyModule_AddObject(m, "Future", new_ref(FutureType)) ||
	    PyModule_AddObject(m, "Tensor", new_ref(TensorType)) ||
	    PyModule_AddObject(m, "RRef", new_ref(RRefType)) || module_add_job(m) ||
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
