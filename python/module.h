/* What the files of the _shmrpc extension share. */
#ifndef SHMRPC_PYTHON_MODULE_H
#define SHMRPC_PYTHON_MODULE_H

#include <Python.h>

/* _job.c: adds the Job type to the module; 0 or -1 with an exception. */
int module_add_job(PyObject *m);
/* _join.c: adds join() and leave(); 0 or -1 with an exception. */
int module_add_join(PyObject *m);

#endif
