/*
 * _marshal._dumps in C: a value's message, (pickle, [RRef...], [Tensor...])
 * (docs/PROTOCOL.md). None is the empty pickle; a scalar, or a tuple of
 * scalars, is pickle's alone; one common tensor is the _TENSORS mark and
 * its handle; a tuple of scalars and common tensors is scalar_pickle's,
 * each tensor a BINPERSID of its index (docs/PROTOCOL.md), read by
 * unpickle_tensors (below) and the _Unpickler's persistent_load; anything
 * else goes through this thread's _Pickler, whose
 * reducer_override takes the tensors and RRefs out; a pickle past
 * _INLINE_MAX goes out of line, in the pool. Every value a call returns
 * and every call's arguments that are not simply scalars or tensors come
 * here: in Python the same steps (the type checks, the thread's pickler,
 * its reset, the inline check) took 4.2 µs for a list of three ints, of
 * which pickling was 1.1.
 */
#define Py_LIMITED_API 0x03090000
#include <Python.h>

#include <stdbool.h>

#include "python/module.h"

static struct {
	PyObject *pickler_type; /* _marshal._Pickler, made without arguments */
	PyObject *tensors_mark; /* _marshal._TENSORS */
	PyObject *out_of_line;  /* _marshal._OUT_OF_LINE */
	Py_ssize_t inline_max;  /* _marshal._INLINE_MAX */
	PyObject *dumps;        /* pickle.dumps */
	PyObject *protocol;     /* pickle.HIGHEST_PROTOCOL */
	PyObject *zero;         /* 0, the buffer's start */
	PyObject *from_bytes;   /* _shmrpc.from_bytes */
} d;

static PyObject *s_key, *s_dump, *s_buf, *s_getvalue, *s_clear_memo, *s_seek, *s_truncate,
	*s_rrefs, *s_tensors, *s_grad_tensors, *s_sent;

/* An object of an exact type that can hold no RRef nor tensor
 * (_marshal._IMMUTABLE_TYPES: a subclass may). */
static bool scalar(PyObject *o)
{
	return o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) ||
	       PyComplex_CheckExact(o) || PyUnicode_CheckExact(o) || PyBytes_CheckExact(o);
}

bool scalars(PyObject *tuple)
{
	for (Py_ssize_t i = 0; i < PyTuple_Size(tuple); i++)
		if (!scalar(PyTuple_GetItem(tuple, i)))
			return false;
	return true;
}

/* The message (data, rrefs, tensors), data out of line past inline_max:
 * a copy of it in the pool, the last tensor. Steals its arguments; NULL
 * with an exception set. */
static PyObject *message(PyObject *data, PyObject *rrefs, PyObject *tensors)
{
	PyObject *block;

	if (data && rrefs && tensors && PyBytes_Size(data) > d.inline_max) {
		block = PyObject_CallFunctionObjArgs(d.from_bytes, data, NULL);
		Py_CLEAR(data);
		if (block && !PyList_Append(tensors, block))
			data = new_ref(d.out_of_line);
		Py_XDECREF(block);
	}
	if (!data || !rrefs || !tensors) {
		Py_XDECREF(data);
		Py_XDECREF(rrefs);
		Py_XDECREF(tensors);
		return NULL;
	}
	return Py_BuildValue("(NNN)", data, rrefs, tensors);
}

/* o.name(arg), or o.name() for a NULL arg, once prev (dropped) is not
 * NULL: a new reference, or NULL with an exception set. */
static PyObject *call_after(PyObject *prev, PyObject *o, PyObject *name, PyObject *arg)
{
	if (!prev)
		return NULL;
	Py_DECREF(prev);
	return PyObject_CallMethodObjArgs(o, name, arg, NULL);
}

/* p ready for its next pickle: its memo, buffer and lists emptied (a memo
 * entry would name an object of the last pickle). 0, or -1 with an
 * exception set. */
static int reset(PyObject *p)
{
	PyObject *buf = PyObject_GetAttr(p, s_buf), *r;
	int rc = -1;

	if (!buf)
		return -1;
	r = PyObject_CallMethodObjArgs(p, s_clear_memo, NULL);
	r = call_after(r, buf, s_seek, d.zero);
	r = call_after(r, buf, s_truncate, NULL);
	if (r) {
		PyObject *rrefs = PyList_New(0), *tensors = PyList_New(0);

		rc = rrefs && tensors && !PyObject_SetAttr(p, s_rrefs, rrefs) &&
				     !PyObject_SetAttr(p, s_tensors, tensors) &&
				     !PyObject_SetAttr(p, s_grad_tensors, Py_None)
			     ? 0 : -1;
		Py_XDECREF(rrefs);
		Py_XDECREF(tensors);
	}
	Py_XDECREF(r);
	Py_DECREF(buf);
	return rc;
}

/* pickler_reset(p): _Pickler.reset's work. */
static PyObject *mod_pickler_reset(PyObject *m, PyObject *p)
{
	(void)m;
	return reset(p) ? NULL : new_ref(Py_None);
}

/* This thread's idle _Pickler, taken out of the thread's dict while it
 * pickles (a _dumps inside a _dumps, from an object's own __reduce__,
 * makes one of its own), or a new one. New reference; NULL with an
 * exception set. */
static PyObject *pickler_take(void)
{
	PyObject *td = PyThreadState_GetDict(), *p;

	if (td && (p = PyDict_GetItemWithError(td, s_key))) {
		Py_INCREF(p);
		if (!PyDict_DelItem(td, s_key))
			return p;
		Py_DECREF(p);
		return NULL;
	}
	return PyErr_Occurred() ? NULL : PyObject_CallObject(d.pickler_type, NULL);
}

/* p, reset, back in the thread's dict for the next pickle (steals p). An
 * error pending (the dump's) stays the one raised. */
static void pickler_give_back(PyObject *p)
{
	PyObject *type, *value, *tb, *td;

	PyErr_Fetch(&type, &value, &tb);
	if (reset(p) || !(td = PyThreadState_GetDict()) || PyDict_SetItem(td, s_key, p))
		PyErr_Clear(); /* the next pickle makes a new one */
	PyErr_Restore(type, value, tb);
	Py_DECREF(p);
}

/* obj's message through this thread's _Pickler. */
static PyObject *pickled(PyObject *obj)
{
	PyObject *p = pickler_take(), *r, *grad = NULL, *buf, *data = NULL, *rrefs = NULL,
		 *tensors = NULL;

	if (!p)
		return NULL;
	if ((r = PyObject_CallMethodObjArgs(p, s_dump, obj, NULL)) &&
	    (grad = PyObject_GetAttr(p, s_grad_tensors)) && grad != Py_None)
		r = call_after(r, grad, s_sent, NULL);
	if (r && grad && (buf = PyObject_GetAttr(p, s_buf))) {
		data = PyObject_CallMethodObjArgs(buf, s_getvalue, NULL);
		Py_DECREF(buf);
		if (data) {
			rrefs = PyObject_GetAttr(p, s_rrefs);
			tensors = PyObject_GetAttr(p, s_tensors);
		}
	}
	Py_XDECREF(r);
	Py_XDECREF(grad);
	pickler_give_back(p); /* new lists for it: rrefs and tensors are ours */
	if (!data)
		return NULL;
	return message(data, rrefs, tensors);
}

/* The message of tuple obj when scalar_pickle_tensors writes it (above);
 * Py_None where it does not; NULL with an exception set. */
static PyObject *tuple_message(PyObject *obj)
{
	struct torch_taken tk = { .n = 0 };
	PyObject *data = scalar_pickle_tensors(NULL, obj, torch_tensor_index, &tk), *list = NULL;

	if (data && data != Py_None)
		list = PyList_New(tk.n);
	for (uint32_t i = 0; i < tk.n; i++) {
		PyObject *w;

		if (!list)
			shmrpc_tensor_free(tk.t[i]);
		else if ((w = tensor_wrap(tk.t[i]))) /* which frees it if it fails */
			PyList_SetItem(list, i, w);  /* steals w */
		else
			Py_CLEAR(list); /* the handles wrapped so far go with it */
	}
	if (!data || data == Py_None)
		return data;
	if (!list) {
		Py_DECREF(data);
		return NULL;
	}
	return message(data, PyList_New(0), list);
}

/* dumps(obj) -> (pickle, [RRef...], [Tensor...]): above. */
static PyObject *mod_dumps(PyObject *m, PyObject *obj)
{
	PyObject *h;

	(void)m;
	if (!d.pickler_type) {
		PyErr_SetString(PyExc_RuntimeError, "dumps before dumps_setup");
		return NULL;
	}
	if (obj == Py_None)
		return message(PyBytes_FromStringAndSize("", 0), PyList_New(0), PyList_New(0));
	if (scalar(obj) || (PyTuple_CheckExact(obj) && scalars(obj))) {
		PyObject *data = scalar_pickle(NULL, obj);

		if (data == Py_None) {
			Py_DECREF(data);
			data = PyObject_CallFunctionObjArgs(d.dumps, obj, d.protocol, NULL);
		}
		return message(data, PyList_New(0), PyList_New(0));
	}
	if (!(h = torch_handle_of(obj)))
		return NULL;
	if (h != Py_None)
		return message(new_ref(d.tensors_mark), PyList_New(0), Py_BuildValue("[N]", h));
	Py_DECREF(h);
	if (PyTuple_CheckExact(obj) && torch_known()) {
		if ((h = tuple_message(obj)) != Py_None)
			return h;
		Py_DECREF(h);
	}
	return pickled(obj);
}

/* inline(data, rrefs, tensors) -> the message, data out of line past
 * _INLINE_MAX (_marshal._inline). */
static PyObject *mod_inline(PyObject *m, PyObject *a)
{
	PyObject *data, *rrefs, *tensors;

	(void)m;
	if (!PyArg_ParseTuple(a, "SO!O!:inline", &data, &PyList_Type, &rrefs, &PyList_Type,
			      &tensors))
		return NULL;
	return message(new_ref(data), new_ref(rrefs), new_ref(tensors));
}

/* scalars(t) -> whether the tuple t holds scalars alone (_marshal._scalars). */
static PyObject *mod_scalars(PyObject *m, PyObject *t)
{
	(void)m;
	if (!PyTuple_Check(t)) {
		PyErr_SetString(PyExc_TypeError, "scalars() takes a tuple");
		return NULL;
	}
	return PyBool_FromLong(scalars(t));
}

/* scalar_pickle(obj) -> its pickle written here, or None where
 * pickle.dumps must write it (for the tests). */
static PyObject *mod_scalar_pickle(PyObject *m, PyObject *obj)
{
	(void)m;
	return scalar_pickle(NULL, obj);
}

/* scalar_unpickle(b) -> (True, its value) where scalar_unpickle reads
 * the pickle b, else (False, None) (for the tests). */
static PyObject *mod_scalar_unpickle(PyObject *m, PyObject *b)
{
	PyObject *v;

	(void)m;
	if (!PyBytes_Check(b)) {
		PyErr_SetString(PyExc_TypeError, "scalar_unpickle() takes bytes");
		return NULL;
	}
	v = scalar_unpickle(PyBytes_AsString(b), (size_t)PyBytes_Size(b));
	if (!v)
		return PyErr_Occurred() ? NULL : Py_BuildValue("(OO)", Py_False, Py_None);
	return Py_BuildValue("(ON)", Py_True, v);
}

/* A BINPERSID of a pickle read by unpickle_tensors: the torch tensor of
 * the Tensor at index of list ctx, its handle retained. */
static PyObject *listed_tensor(void *ctx, long long index)
{
	PyObject *list = ctx, *t;

	if (index < 0 || index >= PyList_Size(list))
		return NULL;
	t = PyList_GetItem(list, (Py_ssize_t)index);
	return PyObject_TypeCheck(t, (PyTypeObject *)TensorType) && HANDLE(t)
		       ? torch_of_handle(HANDLE(t)) : NULL;
}

/* unpickle_tensors(b, tensors) -> (True, value) where scalar_unpickle_tensors
 * reads the pickle b of a message whose tensors are the list tensors,
 * else (False, None): the _Unpickler must (_marshal._loads). */
static PyObject *mod_unpickle_tensors(PyObject *m, PyObject *a)
{
	PyObject *b, *tensors, *v;

	(void)m;
	if (!PyArg_ParseTuple(a, "SO!:unpickle_tensors", &b, &PyList_Type, &tensors))
		return NULL;
	v = scalar_unpickle_tensors(PyBytes_AsString(b), (size_t)PyBytes_Size(b), listed_tensor,
				    tensors);
	if (!v)
		return PyErr_Occurred() ? NULL : Py_BuildValue("(OO)", Py_False, Py_None);
	return Py_BuildValue("(ON)", Py_True, v);
}

/* dumps_setup(pickler_type, tensors_mark, out_of_line, inline_max, dumps,
 * protocol, from_bytes): _marshal's objects, once at its import. */
static PyObject *mod_dumps_setup(PyObject *m, PyObject *a)
{
	static const char *const names[] = { "shmrpc.pickler", "dump", "buf", "getvalue",
		"clear_memo", "seek", "truncate", "rrefs", "tensors", "grad_tensors", "sent" };
	PyObject **const interned[] = { &s_key, &s_dump, &s_buf, &s_getvalue, &s_clear_memo,
		&s_seek, &s_truncate, &s_rrefs, &s_tensors, &s_grad_tensors, &s_sent };
	PyObject *o[7];

	(void)m;
	if (d.pickler_type) {
		PyErr_SetString(PyExc_RuntimeError, "dumps_setup runs once");
		return NULL;
	}
	if (!PyArg_ParseTuple(a, "OSSnOOO:dumps_setup", &o[0], &o[1], &o[2], &d.inline_max, &o[4],
			      &o[5], &o[6]))
		return NULL;
	if (intern_names(names, interned, sizeof(names) / sizeof(*names)))
		return NULL;
	d.tensors_mark = new_ref(o[1]);
	d.out_of_line = new_ref(o[2]);
	d.dumps = new_ref(o[4]);
	d.protocol = new_ref(o[5]);
	d.from_bytes = new_ref(o[6]);
	if (!(d.zero = PyLong_FromLong(0)))
		return NULL;
	d.pickler_type = new_ref(o[0]); /* last: dumps works from now on */
	return new_ref(Py_None);
}

static PyMethodDef dumps_functions[] = {
	{ "dumps", mod_dumps, METH_O,
	  "dumps(obj) -> (pickle, [RRef...], [Tensor...]): a value's message (_marshal._dumps)" },
	{ "inline", mod_inline, METH_VARARGS,
	  "inline(data, rrefs, tensors) -> the message, data out of line past _INLINE_MAX" },
	{ "scalar_pickle", mod_scalar_pickle, METH_O,
	  "scalar_pickle(obj) -> the pickle of a scalar or a tuple of them written here, or None" },
	{ "scalar_unpickle", mod_scalar_unpickle, METH_O,
	  "scalar_unpickle(b) -> (True, value) where read here, else (False, None)" },
	{ "unpickle_tensors", mod_unpickle_tensors, METH_VARARGS,
	  "unpickle_tensors(b, tensors) -> (True, value) where read here, else (False, None)" },
	{ "scalars", mod_scalars, METH_O, "scalars(t) -> whether the tuple t holds scalars alone" },
	{ "pickler_reset", mod_pickler_reset, METH_O,
	  "pickler_reset(p): a _Pickler's memo, buffer and lists emptied" },
	{ "dumps_setup", mod_dumps_setup, METH_VARARGS,
	  "dumps_setup(pickler_type, tensors_mark, out_of_line, inline_max, dumps, protocol, "
	  "from_bytes): what dumps reads" },
	{ NULL, NULL, 0, NULL },
};

int module_add_dumps(PyObject *m)
{
	return PyModule_AddFunctions(m, dumps_functions);
}
