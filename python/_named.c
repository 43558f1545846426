/*
 * Whether a function sent by name is still found by that name: what
 * _marshal._Named.holds asks, in C, for both sides' common call (the
 * caller's python/_calls.c, the callee's python/_serve_fast.c).
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "python/module.h"

/* sys.modules as Python reads it (borrowed): the module sys's dict, kept,
 * looked up for "modules" at each call (PySys_GetObject would make the
 * key's str each time). NULL with an exception set. */
static PyObject *sys_modules(void)
{
	static PyObject *sys, *key;
	PyObject *dict;

	if (!sys && !(sys = PyImport_ImportModule("sys")))
		return NULL;
	if (!key && !(key = PyUnicode_InternFromString("modules")))
		return NULL;
	if (!(dict = PyModule_GetDict(sys)))
		return NULL;
	return PyDict_GetItemWithError(dict, key);
}

int name_holds(PyObject *named, PyObject *module, PyObject *mod, PyObject *scope,
	       PyObject *name, PyObject *func)
{
	PyObject *modules, *found;
	int r;

	if (scope == Py_None) { /* a dotted name: _resolve walks it */
		if (!(found = PyObject_CallMethod(named, "holds", NULL)))
			return -1;
		r = PyObject_IsTrue(found);
		Py_DECREF(found);
		return r;
	}
	/* Another mapping than a dict, or another scope, is for the Python
	 * path to ask. */
	if (!(modules = sys_modules()))
		return PyErr_Occurred() ? -1 : 0;
	if (!PyDict_CheckExact(modules) || !PyDict_CheckExact(scope))
		return 0;
	found = PyDict_GetItemWithError(modules, module);
	if (found == mod)
		found = PyDict_GetItemWithError(scope, name);
	return found == func ? 1 : PyErr_Occurred() ? -1 : 0;
}
