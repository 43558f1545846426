/*
 * Whether this thread is inside a distributed autograd context, for the
 * common call's C (python/_calls.c, python/_serve_fast.c): the setter of
 * _contexts._ThreadState.ctx, the only way that attribute is written, says
 * so here. Asking the threading.local itself cost a getattr through its
 * per-thread dict on every call, each side: about 220 instructions on the
 * caller and 420 on the callee (callgrind), against a thread-local read.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>

#include "python/module.h"

static __thread bool in_context;

bool thread_in_context(void)
{
	return in_context;
}

static PyObject *mod_set_in_context(PyObject *self, PyObject *flag)
{
	int on = PyObject_IsTrue(flag);

	(void)self;
	if (on < 0)
		return NULL;
	in_context = on;
	Py_RETURN_NONE;
}

static PyMethodDef in_context_functions[] = {
	{ "set_in_context", mod_set_in_context, METH_O,
	  "set_in_context(flag): whether this thread is inside a distributed autograd context "
	  "(_contexts._ThreadState.ctx's setter)" },
	{ NULL, NULL, 0, NULL },
};

int module_add_in_context(PyObject *m)
{
	return PyModule_AddFunctions(m, in_context_functions);
}
