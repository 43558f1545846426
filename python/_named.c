/*
 * Whether a function sent by name is still found by that name: what
 * _marshal._Named.holds asks, in C, for both sides' common call (the
 * caller's python/_calls.c, the callee's python/_serve_fast.c).
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "python/module.h"

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
	/* sys.modules: the interpreter's dict of modules (borrowed), which
	 * the import system fills, without a lookup of "modules" in sys's
	 * dict. A program that rebinds sys.modules to another dict (which
	 * CPython does not support: imports would use both) could see the two
	 * paths disagree on a name; neither runs a function other than the one
	 * the module's dict names. */
	if (!(modules = PyImport_GetModuleDict()))
		return PyErr_Occurred() ? -1 : 0;
	/* Another mapping than a dict, or another scope, is for the Python
	 * path to ask. */
	if (!PyDict_CheckExact(modules) || !PyDict_CheckExact(scope))
		return 0;
	found = PyDict_GetItemWithError(modules, module);
	if (found == mod)
		found = PyDict_GetItemWithError(scope, name);
	return found == func ? 1 : PyErr_Occurred() ? -1 : 0;
}
