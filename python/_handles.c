/* The module's objects: each wraps one library handle, which it owns. */
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

/* Py_NewRef is not in the 3.9 stable ABI. */
PyObject *new_ref(PyObject *o)
{
	Py_INCREF(o);
	return o;
}

int intern_names(const char *const *text, PyObject **const *slot, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!*slot[i] && !(*slot[i] = PyUnicode_InternFromString(text[i])))
			return -1;
	return 0;
}

PyObject *attr_of(PyObject *o, PyObject *name)
{
	PyObject *v;

	if (PyModule_CheckExact(o) && (v = PyDict_GetItemWithError(PyModule_GetDict(o), name)))
		return new_ref(v);
	return PyErr_Occurred() ? NULL : PyObject_GetAttr(o, name);
}

/* The C function of sample's builtin method a (a->fn, a->flags), where
 * its convention is one known_attr_get calls; else left through desc. 0,
 * or -1 with an exception set. */
static int learn_function(struct known_attr *a, PyObject *sample)
{
	PyObject *bound = PyObject_GetAttr(sample, *a->name);
	int flags;

	if (!bound)
		return -1;
	if (PyCFunction_Check(bound) && PyCFunction_GetSelf(bound) == sample) {
		flags = PyCFunction_GetFlags(bound) & ~METH_COEXIST;
		if (flags == METH_NOARGS || flags == METH_VARARGS ||
		    flags == (METH_VARARGS | METH_KEYWORDS)) {
			a->fn = PyCFunction_GetFunction(bound);
			a->flags = flags;
		}
	}
	Py_DECREF(bound);
	return 0;
}

/* name in the dicts of type's MRO, where the interpreter finds an
 * attribute of type's objects (getattr on the type itself gives the
 * type's own attribute for a name such as __module__ or __qualname__,
 * not the descriptor its objects' come from). A new reference, or NULL
 * with an exception set (AttributeError: none has it). */
static PyObject *type_lookup(PyObject *type, PyObject *name)
{
	PyObject *mro = PyObject_GetAttrString(type, "__mro__"), *found = NULL;

	if (!mro)
		return NULL;
	for (Py_ssize_t i = 0; PyTuple_Check(mro) && i < PyTuple_Size(mro); i++) {
		PyObject *dict = PyObject_GetAttrString(PyTuple_GetItem(mro, i), "__dict__");

		if (!dict)
			break;
		found = PyObject_GetItem(dict, name);
		Py_DECREF(dict);
		if (found || !PyErr_ExceptionMatches(PyExc_KeyError))
			break;
		PyErr_Clear();
	}
	Py_DECREF(mro);
	if (!found && !PyErr_Occurred())
		PyErr_Format(PyExc_AttributeError, "no attribute %R on the objects of %R", name, type);
	return found;
}

int known_attr_learn(struct known_attr *a, PyObject *type, PyObject *sample)
{
	PyObject *desc = type_lookup(type, *a->name);

	if (!desc)
		return -1;
	Py_CLEAR(a->desc);
	a->get = NULL;
	a->fn = NULL;
	if (!a->method) {
		/* PyType_GetSlot takes static types from 3.10 on; 3.9 raises. */
		a->get = (descrgetfunc)PyType_GetSlot(Py_TYPE(desc), Py_tp_descr_get);
		if (!a->get) {
			PyErr_Clear();
			Py_DECREF(desc);
			return 0;
		}
	} else if (sample && learn_function(a, sample)) {
		Py_DECREF(desc);
		return -1;
	}
	a->desc = desc;
	return 0;
}

/* The empty tuple a METH_VARARGS function is given. */
static PyObject *no_args;

PyObject *known_attr_get(const struct known_attr *a, PyObject *obj)
{
	if (a->get)
		return a->get(a->desc, obj, (PyObject *)Py_TYPE(obj));
	if (a->fn) {
		/* The function pointer's type is its convention's (flags). */
		if (a->flags == METH_NOARGS)
			return a->fn(obj, NULL);
		if (!no_args && !(no_args = PyTuple_New(0)))
			return NULL;
		return a->flags & METH_KEYWORDS
			       ? ((PyCFunctionWithKeywords)(void (*)(void))a->fn)(obj, no_args, NULL)
			       : a->fn(obj, no_args);
	}
	if (a->desc)
		return PyObject_CallFunctionObjArgs(a->desc, obj, NULL);
	return a->method ? PyObject_CallMethodObjArgs(obj, *a->name, NULL)
			 : PyObject_GetAttr(obj, *a->name);
}

/* An exception with shmrpc's text for rc: TimeoutError for timeouts,
 * RuntimeError otherwise (the Python layer re-raises remote ones). */
PyObject *fail(int rc)
{
	PyErr_SetString(rc == -ETIMEDOUT ? PyExc_TimeoutError : PyExc_RuntimeError,
			shmrpc_errmsg());
	return NULL;
}

/* torch's RuntimeError for a call that needs the agent before init_rpc. */
PyObject *not_initialized(void)
{
	PyErr_SetString(PyExc_RuntimeError,
			"RPC has not been initialized. Call shmrpc.init_rpc first.");
	return NULL;
}

PyObject *FutureType, *RRefType, *TensorType;

void release_future(void *h)
{
	shmrpc_future_free(h);
}

void release_rref(void *h)
{
	shmrpc_rref_free(h);
}

void release_tensor(void *h)
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

void dealloc_with(PyObject *self, void (*release)(void *))
{
	PyTypeObject *tp = Py_TYPE(self);

	release(HANDLE(self));
	((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
	Py_DECREF(tp); /* heap types: each instance holds its type */
}

PyObject *rref_wrap(shmrpc_rref *r)
{
	return wrap(RRefType, r, release_rref);
}

/* ---- Tensor: a block of the pool, for DLPack consumers ---- */

PyObject *tensor_wrap(shmrpc_tensor *t)
{
	return wrap(TensorType, t, release_tensor);
}

/* ---- Future ---- */

PyObject *future_wrap(shmrpc_future *f)
{
	return wrap(FutureType, f, release_future);
}

PyObject *handle_objects(void *const *h, uint32_t n, bool rrefs)
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
