/*
 * torch CPU tensors to handles and back, for the common tensor of a call
 * or a result (_marshal: a contiguous, non-empty CPU torch.Tensor, not a
 * subclass, of a pool dtype, that needs no autograd): its questions asked
 * and its handle made in one C call, and a received handle made a torch
 * tensor in one, without the Python around each (a tensor echo made 14
 * Python calls per tensor and side for it; docs/ARCHITECTURE.md, "A
 * tensor echo", seventh pass). torch is not linked: its type, its dtypes
 * and its DLPack import are handed over by know_torch, once torch is
 * known to the package.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "shmrpc.h"
#include "python/module.h"

/* torch.Tensor, torch._C._from_dlpack and torch.strided; NULL until
 * know_torch. */
static PyObject *tensor_type, *from_dlpack, *strided;
/* The pool dtypes (torch's dtype objects, one per dtype) and their DLPack
 * dtypes: a tensor's found by pointer, without a dict lookup and a tuple's
 * parse. */
#define POOL_DTYPES 16
static struct {
	PyObject *torch; /* owned */
	DLDataType dl;
} pool_dtypes[POOL_DTYPES];
static int npool_dtypes;
/* Interned attribute names. */
static PyObject *s_is_cpu, *s_requires_grad, *s_dtype, *s_layout, *s_is_contiguous, *s_shape,
	*s_data_ptr, *s_is_neg;

/* The questions the common tensor is asked (torch_plain), found on
 * torch.Tensor once (know_torch: struct known_attr). One that a method
 * set on the tensor itself would shadow is not asked so: torch's RPC
 * reads the tensor in C++, as this does. */
static struct known_attr q_is_cpu = { .name = &s_is_cpu },
			 q_requires_grad = { .name = &s_requires_grad },
			 q_dtype = { .name = &s_dtype },
			 q_shape = { .name = &s_shape },
			 q_is_contiguous = { .name = &s_is_contiguous, .method = true },
			 q_is_neg = { .name = &s_is_neg, .method = true },
			 q_data_ptr = { .name = &s_data_ptr, .method = true };
static struct known_attr *const questions[] = { &q_is_cpu, &q_requires_grad, &q_dtype, &q_shape,
						&q_is_contiguous, &q_is_neg, &q_data_ptr };

/* *slot = a new reference to o, the one it held dropped. */
static void keep(PyObject **slot, PyObject *o)
{
	PyObject *old = *slot;

	*slot = new_ref(o);
	Py_XDECREF(old);
}

/* The pool dtypes of map, {torch dtype: (DLPack code, bits), or False
 * where its tensors are pickled}, into pool_dtypes. 0 or -1 with an
 * exception set. */
static int learn_dtypes(PyObject *map)
{
	PyObject *dtype, *code_bits;
	Py_ssize_t pos = 0;
	unsigned code, bits;
	int n = 0;

	while (PyDict_Next(map, &pos, &dtype, &code_bits)) {
		if (!PyTuple_Check(code_bits))
			continue;
		if (n == POOL_DTYPES) {
			PyErr_Format(PyExc_ValueError, "know_torch: more than %d pool dtypes",
				     POOL_DTYPES);
			return -1;
		}
		if (!PyArg_ParseTuple(code_bits, "II;know_torch: a pool dtype's DLPack is "
				      "(code, bits)", &code, &bits))
			return -1;
		keep(&pool_dtypes[n].torch, dtype);
		pool_dtypes[n++].dl = (DLDataType){ (uint8_t)code, (uint8_t)bits, 1 };
	}
	for (int i = n; i < npool_dtypes; i++)
		Py_CLEAR(pool_dtypes[i].torch);
	npool_dtypes = n;
	return 0;
}

/* know_torch(torch.Tensor, {torch dtype: (code, bits) or False},
 * torch._C._from_dlpack, torch.strided, a CPU tensor): what the functions
 * below need of torch (_marshal._know_torch, which knows every pool dtype
 * then). The tensor's methods give their C functions (known_attr_learn)
 * when it is exactly a torch.Tensor (not one of a dispatch mode's
 * subclasses). */
static PyObject *mod_know_torch(PyObject *m, PyObject *args)
{
	PyObject *type, *map, *fn, *layout, *sample;

	(void)m;
	if (!PyArg_ParseTuple(args, "O!O!OOO", &PyType_Type, &type, &PyDict_Type, &map, &fn,
			      &layout, &sample))
		return NULL;
	if (!PyCallable_Check(fn)) {
		PyErr_SetString(PyExc_TypeError, "know_torch: torch's DLPack import is not callable");
		return NULL;
	}
	if (learn_dtypes(map))
		return NULL;
	if ((PyObject *)Py_TYPE(sample) != type)
		sample = NULL;
	for (size_t i = 0; i < sizeof(questions) / sizeof(*questions); i++)
		if (known_attr_learn(questions[i], type, sample))
			return NULL;
	keep(&tensor_type, type);
	keep(&from_dlpack, fn);
	keep(&strided, layout);
	return new_ref(Py_None);
}

/* Whether v, a new reference (an attribute's value, a method's result),
 * is want: 1, 0, or -1 when v is NULL (its exception set). */
static int is(PyObject *v, PyObject *want)
{
	int yes;

	if (!v)
		return -1;
	yes = v == want;
	Py_DECREF(v);
	return yes;
}

static int is_true(PyObject *v)
{
	return is(v, Py_True);
}

/* obj's DLPack dtype when it is a pool dtype's tensor: 1, 0 (another
 * dtype), or -1 with an exception set. */
static int pool_dtype(PyObject *obj, DLDataType *dt)
{
	PyObject *d = known_attr_get(&q_dtype, obj);
	int i;

	if (!d)
		return -1;
	for (i = 0; i < npool_dtypes && pool_dtypes[i].torch != d; i++)
		;
	Py_DECREF(d); /* torch keeps its dtypes; the pointer is only compared */
	if (i == npool_dtypes)
		return 0;
	*dt = pool_dtypes[i].dl;
	return 1;
}

/* After a question to torch tensor obj raised (a sparse CSR tensor has no
 * is_contiguous, no sparse or MKL-DNN tensor a data_ptr): 0, the error
 * dropped, when obj is not strided (no bytes to hand over: torch pickles
 * it), else -1 with it. Its layout asked only then, which costs the
 * common tensor nothing. */
static int unstrided(PyObject *obj)
{
	PyObject *type, *value, *tb;
	int ok;

	PyErr_Fetch(&type, &value, &tb);
	if ((ok = is(PyObject_GetAttr(obj, s_layout), strided)) == 0) {
		Py_XDECREF(type);
		Py_XDECREF(value);
		Py_XDECREF(tb);
		return 0;
	}
	if (ok < 0)
		PyErr_Clear(); /* the first error is the one to tell */
	PyErr_Restore(type, value, tb);
	return -1;
}

/* What makes the handle of a common tensor (above). */
struct plain {
	PyObject *obj; /* the tensor (torch_handles: borrowed from its tuple) */
	uintptr_t addr;
	DLDataType dtype;
	int32_t ndim;
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
};

/* Whether obj is the common tensor (above), *p its description if so: 1,
 * 0, or -1 with an exception set. The checks cheapest first; obj's numel()
 * is its shape's product. */
static int torch_plain(PyObject *obj, struct plain *p)
{
	PyObject *dims, *ptr;
	Py_ssize_t n;
	int ok;

	if (!tensor_type || (PyObject *)Py_TYPE(obj) != tensor_type)
		return 0;
	if ((ok = is_true(known_attr_get(&q_is_cpu, obj))) != 1)
		return ok;
	if ((ok = is_true(known_attr_get(&q_requires_grad, obj))) != 0)
		return ok < 0 ? -1 : 0;
	if ((ok = pool_dtype(obj, &p->dtype)) != 1 ||
	    (ok = is_true(known_attr_get(&q_is_contiguous, obj))) != 1)
		return ok < 0 ? unstrided(obj) : ok;
	/* A negative view (x.conj().imag) holds the bytes of what it negates:
	 * resolved first, on the pickler's path (_marshal._to_pool). */
	if ((ok = is_true(known_attr_get(&q_is_neg, obj))) != 0)
		return ok < 0 ? -1 : 0;
	if (!(dims = known_attr_get(&q_shape, obj)))
		return -1;
	/* More sizes than a handle holds: the pickler's path sends it flat. */
	if (PyTuple_Check(dims) && PyTuple_Size(dims) > SHMRPC_TENSOR_MAX_DIMS) {
		Py_DECREF(dims);
		return 0;
	}
	n = shape_of(dims, p->shape);
	Py_DECREF(dims);
	if (n < 0)
		return -1;
	for (Py_ssize_t i = 0; i < n; i++)
		if (p->shape[i] == 0) /* empty: pickled (the pool's import takes them for strided) */
			return 0;
	p->ndim = (int32_t)n;
	if (!(ptr = known_attr_get(&q_data_ptr, obj)))
		return unstrided(obj);
	p->addr = (uintptr_t)PyLong_AsVoidPtr(ptr);
	Py_DECREF(ptr);
	if (PyErr_Occurred())
		return -1;
	/* No storage (a ZeroTensor): the pickler's path gives it bytes. */
	return p->addr != 0;
}

/* torch_handle(obj) -> obj's handle, or None when obj is not the common
 * tensor (it is then pickled). */
PyObject *torch_handle_of(PyObject *obj)
{
	struct plain p;
	int ok = torch_plain(obj, &p);

	return ok == 1 ? host_handle(p.addr, p.dtype, p.ndim, p.shape)
	       : ok == 0 ? new_ref(Py_None) : NULL;
}

int torch_reply_tensor(PyObject *obj, shmrpc_tensor *const *req, uint32_t n, shmrpc_tensor **out)
{
	struct plain p;
	int ok = torch_plain(obj, &p), rc;
	uint32_t i;

	if (ok != 1)
		return ok;
	for (i = 0; i < n; i++) {
		const DLTensor *dl = shmrpc_tensor_dl(req[i]);

		if (dl && dl->device.device_type == kDLCPU && (uintptr_t)dl->data == p.addr &&
		    dl->dtype.code == p.dtype.code && dl->dtype.bits == p.dtype.bits &&
		    dl->dtype.lanes == p.dtype.lanes && dl->ndim == p.ndim &&
		    !memcmp(dl->shape, p.shape, (size_t)p.ndim * sizeof(*p.shape)))
			break;
	}
	rc = i < n ? python_tensor_echoed(req[i], out)
		   : host_tensor(p.addr, p.dtype, p.ndim, p.shape, out);
	if (rc) {
		fail(rc);
		return -1;
	}
	return 1;
}

int torch_tensor_index(void *ctx, PyObject *obj)
{
	struct torch_taken *tk = ctx;
	struct plain p;
	int ok, rc;

	if (tk->n == TORCH_TAKEN_MAX)
		return -2;
	for (uint32_t i = 0; i < tk->n; i++)
		if (tk->objs[i] == obj)
			return -2;
	if ((ok = torch_plain(obj, &p)) != 1)
		return ok < 0 ? -1 : -2;
	if ((rc = host_tensor(p.addr, p.dtype, p.ndim, p.shape, &tk->t[tk->n]))) {
		fail(rc);
		return -1;
	}
	tk->objs[tk->n] = obj;
	return (int)tk->n++;
}

static PyObject *mod_torch_handle(PyObject *m, PyObject *obj)
{
	(void)m;
	return torch_handle_of(obj);
}

/* A call's arguments that travel without a pickle (_marshal._TENSORS):
 * all are asked before any handle is made, since a plain tensor's handle
 * is a copy, wasted if a later argument is pickled. A tensor given twice
 * goes by the pickler, which sends it once and the callee gets one object
 * twice, as torch's (each handle here becomes a tensor of its own). */
int torch_tensors_of(PyObject *args, shmrpc_tensor **out)
{
	struct plain few[4], *p = few;
	Py_ssize_t n, i, j;
	int ok = 1, rc;

	if (!PyTuple_Check(args)) {
		PyErr_SetString(PyExc_TypeError, "torch_handles: a call's arguments come in a tuple");
		return -1;
	}
	n = PyTuple_Size(args);
	if (n > (Py_ssize_t)(sizeof(few) / sizeof(*few)) && !(p = PyMem_Malloc((size_t)n * sizeof(*p)))) {
		PyErr_NoMemory();
		return -1;
	}
	for (i = 0; i < n && ok == 1; i++) {
		PyObject *obj = p[i].obj = PyTuple_GetItem(args, i);

		for (j = 0; j < i && p[j].obj != obj; j++)
			;
		ok = j < i ? 0 : torch_plain(obj, &p[i]);
	}
	for (i = 0; ok == 1 && i < n; i++)
		if ((rc = host_tensor(p[i].addr, p[i].dtype, p[i].ndim, p[i].shape, &out[i]))) {
			while (i--)
				shmrpc_tensor_free(out[i]);
			fail(rc);
			ok = -1;
		}
	if (p != few)
		PyMem_Free(p);
	return ok;
}

/* torch_handles(args: tuple) -> [handle...] of args when every one is the
 * common tensor, each given once, else None (torch_tensors_of's, as
 * Tensors). */
PyObject *torch_handles_of(PyObject *args)
{
	shmrpc_tensor *few[4], **t = few;
	Py_ssize_t n = PyTuple_Check(args) ? PyTuple_Size(args) : 0, i;
	PyObject *list;
	int ok;

	if (n > (Py_ssize_t)(sizeof(few) / sizeof(*few)) && !(t = PyMem_Malloc((size_t)n * sizeof(*t))))
		return PyErr_NoMemory();
	ok = torch_tensors_of(args, t);
	list = ok == 0 ? new_ref(Py_None) : ok == 1 ? PyList_New(n) : NULL;
	for (i = 0; ok == 1 && i < n; i++) {
		PyObject *h;

		if (!list)
			shmrpc_tensor_free(t[i]);
		else if ((h = tensor_wrap(t[i]))) /* which frees t[i] if it fails */
			PyList_SetItem(list, i, h); /* steals h */
		else
			Py_CLEAR(list); /* the handles wrapped so far go with it */
	}
	if (t != few)
		PyMem_Free(t);
	return list;
}

static PyObject *mod_torch_handles(PyObject *m, PyObject *args)
{
	(void)m;
	return torch_handles_of(args);
}

/* Whether torch is known (know_torch ran): take_torch_of works. */
bool torch_known(void)
{
	return from_dlpack != NULL;
}

static PyObject *not_known(void)
{
	PyErr_SetString(PyExc_RuntimeError, "take_torch: torch is not known to shmrpc yet "
			"(_marshal._know_torch runs first)");
	return NULL;
}

/* torch's tensor of DLPack capsule cap (NULL: its error is set), which it
 * consumes; cap's reference dropped. NULL with an exception set. */
static PyObject *torch_of_capsule(PyObject *cap)
{
	PyObject *t = cap ? PyObject_CallFunctionObjArgs(from_dlpack, cap, NULL) : NULL;

	Py_XDECREF(cap);
	return t;
}

/* take_torch(handles: list) -> (torch tensor...) of received host handles,
 * each holding its handle's own reference (take_capsule: the handles are
 * the message's, used once, and left empty). A tuple: a call's arguments
 * as they are. NULL with an exception set (also before torch is known). */
PyObject *take_torch_of(PyObject *handles)
{
	Py_ssize_t n;
	PyObject *tuple;

	if (!from_dlpack)
		return not_known();
	if (!PyList_Check(handles)) {
		PyErr_SetString(PyExc_TypeError, "take_torch: a message's tensors come in a list");
		return NULL;
	}
	n = PyList_Size(handles);
	if (!(tuple = PyTuple_New(n)))
		return NULL;
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *t = torch_of_capsule(take_capsule(PyList_GetItem(handles, i)));

		if (!t) {
			Py_DECREF(tuple); /* the tensors made so far free their blocks */
			return NULL;
		}
		PyTuple_SetItem(tuple, i, t); /* steals t */
	}
	return tuple;
}

/* The torch tensor of received host handle h, with a reference of its
 * own: h's (take: python_tensor_take, h spent) or one retained, the new
 * handle given to the capsule torch consumes. No Tensor object between,
 * as take_torch's handles are (a call's arguments and a reply's value,
 * read in C: python/_serve_fast.c, _calls.c). NULL with an exception
 * set. */
static PyObject *torch_of(shmrpc_tensor *h, bool take)
{
	const DLTensor *dl = shmrpc_tensor_dl(h);
	DLManagedTensor *dm;
	shmrpc_tensor *t;
	int rc;

	if (!dl || dl->device.device_type != kDLCPU) {
		PyErr_SetString(PyExc_TypeError, "take_torch: a host tensor is needed (a CUDA "
				"tensor's consumer names its stream: __dlpack__(stream))");
		return NULL;
	}
	if ((rc = take ? python_tensor_take(h, &t) : shmrpc_tensor_retain(h, &t)))
		return fail(rc);
	if ((rc = shmrpc_tensor_to_dlpack(t, &dm))) {
		shmrpc_tensor_free(t);
		return fail(rc);
	}
	return torch_of_capsule(capsule_of(dm));
}

PyObject *torch_of_handle(shmrpc_tensor *h)
{
	return from_dlpack ? torch_of(h, false) : not_known();
}

PyObject *torch_of_msg_tensor(void *msg, long long index)
{
	const struct python_msg *m = msg;

	return index >= 0 && (uint64_t)index < m->ntensors ? torch_of_handle(m->tensors[index])
							    : NULL;
}

PyObject *torch_of_handles(shmrpc_tensor *const *h, uint32_t n, bool take)
{
	PyObject *tuple;

	if (!from_dlpack)
		return not_known();
	if (!(tuple = PyTuple_New(n)))
		return NULL;
	for (uint32_t i = 0; i < n; i++) {
		PyObject *t = torch_of(h[i], take);

		if (!t) {
			Py_DECREF(tuple); /* the tensors made so far free their blocks */
			return NULL;
		}
		PyTuple_SetItem(tuple, i, t); /* steals t */
	}
	return tuple;
}

static PyObject *mod_take_torch(PyObject *m, PyObject *handles)
{
	(void)m;
	return take_torch_of(handles);
}

static PyMethodDef torch_functions[] = {
	{ "know_torch", mod_know_torch, METH_VARARGS,
	  "know_torch(torch.Tensor, {dtype: (code, bits)}, torch._C._from_dlpack, torch.strided, "
	  "a CPU tensor)" },
	{ "torch_handle", mod_torch_handle, METH_O,
	  "torch_handle(obj) -> Tensor of a contiguous CPU torch tensor of a pool dtype, or None" },
	{ "torch_handles", mod_torch_handles, METH_O,
	  "torch_handles(args) -> [Tensor...] when every argument is such a tensor, or None" },
	{ "take_torch", mod_take_torch, METH_O,
	  "take_torch([Tensor...]) -> (torch tensor...), each taking its handle's reference" },
	{ NULL, NULL, 0, NULL },
};

int module_add_torch(PyObject *m)
{
	if (!(s_is_cpu = PyUnicode_InternFromString("is_cpu")) ||
	    !(s_requires_grad = PyUnicode_InternFromString("requires_grad")) ||
	    !(s_dtype = PyUnicode_InternFromString("dtype")) ||
	    !(s_layout = PyUnicode_InternFromString("layout")) ||
	    !(s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) ||
	    !(s_shape = PyUnicode_InternFromString("shape")) ||
	    !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
	    !(s_is_neg = PyUnicode_InternFromString("is_neg")) ||
	    PyModule_AddIntConstant(m, "TENSOR_MAX_DIMS", SHMRPC_TENSOR_MAX_DIMS))
		return -1;
	return PyModule_AddFunctions(m, torch_functions);
}
