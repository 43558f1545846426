/* What the files of the _shmrpc extension share. */
#ifndef SHMRPC_PYTHON_MODULE_H
#define SHMRPC_PYTHON_MODULE_H

#include <Python.h>
#include <stdbool.h>
#include <stdint.h>

#include "shmrpc.h"
#include "worker/python_api.h"

/* _handles.c: every object of this module wraps one library handle,
 * which it owns. */
typedef struct {
	PyObject_HEAD
	void *h;
} HandleObject;

#define HANDLE(o) (((HandleObject *)(o))->h)

extern PyObject *FutureType, *RRefType, *TensorType;

/* Py_NewRef is not in the 3.9 stable ABI. */
PyObject *new_ref(PyObject *o);
/* getattr(o, name), from a module's dict first where o is a module (a
 * name its type does not define: what Python finds there too, without
 * the type's lookup, about 200 instructions). New reference; NULL with
 * an exception set. */
PyObject *attr_of(PyObject *o, PyObject *name);
/* Each slot[i] not set yet made text[i], interned (the names a file asks,
 * made once). 0, or -1 with an exception set. */
int intern_names(const char *const *text, PyObject **const *slot, size_t n);
/* An attribute or a method of a type, found on the type once and asked of
 * an object of exactly that type without the lookup on its type each
 * time (no instance attribute shadows a data descriptor: a getter, a
 * slot). A getter is called through its type's descr_get slot, where the
 * interpreter gives a static type's slots (3.10 and later); else, and
 * before known_attr_learn, the attribute is looked up as usual. */
struct known_attr {
	PyObject **name;
	bool method;
	PyObject *desc;   /* owned; NULL: looked up */
	descrgetfunc get; /* a getter's; NULL for a method */
	/* A method's C function and its calling convention (METH_NOARGS,
	 * METH_VARARGS, with or without METH_KEYWORDS), called as the
	 * interpreter's method descriptor would, without its call machinery
	 * (about 150 instructions a call); NULL: called through desc. */
	PyCFunction fn;
	int flags;
};
/* a's descriptor on type (in its MRO's dicts, as the interpreter finds
 * an object's attribute). 0, or -1 with an exception set; a getter whose
 * slot the interpreter does not give is left looked up. With sample, an
 * object of exactly type, a method's C function is learnt from it too,
 * when the method is a builtin one of a convention above. */
int known_attr_learn(struct known_attr *a, PyObject *type, PyObject *sample);
/* obj's a (a method's result): a new reference, or NULL with an exception
 * set. */
PyObject *known_attr_get(const struct known_attr *a, PyObject *obj);
/* An exception with shmrpc's text for rc: TimeoutError for timeouts,
 * RuntimeError otherwise (the Python layer re-raises remote ones). */
PyObject *fail(int rc);
/* torch's RuntimeError for a call that needs the agent before init_rpc. */
PyObject *not_initialized(void);
void release_future(void *h);
void release_rref(void *h);
void release_tensor(void *h);
/* An object's dealloc: its handle released, then the object. */
void dealloc_with(PyObject *self, void (*release)(void *));
/* New objects owning their handle (released on failure). */
PyObject *future_wrap(shmrpc_future *f);
PyObject *rref_wrap(shmrpc_rref *r);
PyObject *tensor_wrap(shmrpc_tensor *t);
/* A list of new objects, one per handle (RRefs, or Tensors), each holding
 * a handle of its own; NULL with an exception set. */
PyObject *handle_objects(void *const *h, uint32_t n, bool rrefs);

/* _tensor.c: the helpers of _torch.c. The sizes of dims (a tuple, or
 * torch.Size) into shape: how many, or -1 with an exception set. */
Py_ssize_t shape_of(PyObject *dims, int64_t shape[SHMRPC_TENSOR_MAX_DIMS]);
/* A handle of the contiguous host array at addr: a pool block's without a
 * copy, else copied once. host_tensor: 0 or -errno, its sentence set
 * (fail makes the exception); host_handle: the handle as a Tensor
 * (from_host), NULL with an exception set. */
int host_tensor(uintptr_t addr, DLDataType dtype, int32_t ndim, int64_t *shape,
		shmrpc_tensor **out);
PyObject *host_handle(uintptr_t addr, DLDataType dtype, int32_t ndim, int64_t *shape);
/* A DLPack capsule holding a host Tensor's own reference, the Tensor left
 * empty (take_dlpack). NULL with an exception set. */
PyObject *take_capsule(PyObject *obj);
/* A DLPack capsule owning dm (deleted if none can be made). NULL with an
 * exception set. */
PyObject *capsule_of(DLManagedTensor *dm);

/* _torch.c: torch_handle(obj) from C: obj's handle when it is the common
 * tensor, else None; NULL with an exception set. */
PyObject *torch_handle_of(PyObject *obj);
/* obj's handle, as torch_handle_of's, for a reply to a request whose
 * tensors are req[n], no Tensor made: where obj is the common tensor on
 * the bytes of one of them (the same address, dtype and shape: an echo),
 * that one's handle without a reference of its own (python_tensor_echoed:
 * the reply carries it covered, and the caller's request pin keeps the
 * block). 1 with *out set, 0 where obj is not the common tensor (it is
 * pickled), -1 with an exception set. */
int torch_reply_tensor(PyObject *obj, shmrpc_tensor *const *req, uint32_t n, shmrpc_tensor **out);
/* The handles of args, a call's tuple of n, when every argument is the
 * common tensor, each given once: 1 with out[n] made (the caller's);
 * 0 when one is not, none made; -1 with an exception set, none left.
 * torch_handles_of: torch_handles(args) from C, the same as a list of
 * Tensors, or None; NULL with an exception set. */
int torch_tensors_of(PyObject *args, shmrpc_tensor **out);
PyObject *torch_handles_of(PyObject *args);
/* take_torch(handles) from C: the torch tensors (a tuple) of a received
 * message's list of host handles, each taking its handle's reference;
 * NULL with an exception set (also before torch is known). */
PyObject *take_torch_of(PyObject *handles);
/* The torch tensors (a tuple) of a received message's n host handles h,
 * each with a reference of its own: h's, which take gives away (the
 * message's handles spent: python_tensor_take), or one retained; NULL
 * with an exception set (also before torch is known). */
PyObject *torch_of_handles(shmrpc_tensor *const *h, uint32_t n, bool take);
/* The torch tensor of received host handle h, with a reference of its own
 * (h's retained: the message keeps its handle); NULL with an exception
 * set (also before torch is known). */
PyObject *torch_of_handle(shmrpc_tensor *h);
/* scalar_unpickle_tensors's source of a received message's tensors: the
 * torch tensor of tensor index of msg (a struct python_msg), its handle
 * retained (the message keeps its own: a pickle left unread is read
 * whole by Python); NULL for an index it has not. */
PyObject *torch_of_msg_tensor(void *msg, long long index);
/* The common tensors (above) of a pickle that scalar_pickle_tensors
 * writes, given handles by torch_tensor_index, its question (module.h):
 * obj's index when it is the common tensor, its handle made in t. At most
 * TORCH_TAKEN_MAX; a tensor met twice is not sent so (-2: the pickler
 * sends it once, and the receiver gets one object twice, as torch's). */
#define TORCH_TAKEN_MAX 4
struct torch_taken {
	shmrpc_tensor *t[TORCH_TAKEN_MAX];
	PyObject *objs[TORCH_TAKEN_MAX]; /* borrowed, compared only */
	uint32_t n;
};
int torch_tensor_index(void *ctx, PyObject *obj);
/* Whether torch is known (know_torch ran): take_torch_of works. */
bool torch_known(void);

/* _dumps.c: whether the tuple t holds only scalars of exact types that
 * hold no RRef nor tensor (None, bool, int, float, complex, str, bytes):
 * _marshal._scalars. */
bool scalars(PyObject *t);

/* _scalar_pickle.c: head (bytes, or NULL for none) followed by the pickle
 * of v, a scalar, a tuple of them or a call's (args, {}), written without
 * pickle.dumps: a new bytes object; Py_None where v is not one it writes
 * (pickle.dumps must); NULL with an exception set. */
PyObject *scalar_pickle(PyObject *head, PyObject *v);
/* The value of the pickle data[len] where it holds only what scalar_pickle
 * writes (pickle's FRAME and MEMOIZE too): a new reference; NULL with no
 * exception where it holds anything else or is malformed (pickle.loads
 * must read it, and say what is wrong), NULL with MemoryError set. */
PyObject *scalar_unpickle(const void *data, size_t len);
/* scalar_pickle with tensors: tensor(ctx, obj) is asked of each object
 * that is no scalar, and answers the index among the message's tensors
 * that it gave obj (written as BINPERSID), or < 0: -2 where obj is not
 * one it sends so (the pickle is not written: Py_None), -1 with an
 * exception set (NULL). */
PyObject *scalar_pickle_tensors(PyObject *head, PyObject *v, int (*tensor)(void *ctx, PyObject *v),
				void *ctx);
/* scalar_unpickle with the message's tensors: tensor(ctx, index) answers
 * a BINPERSID (a new reference; NULL: the pickle is left unread, as one
 * this does not read). */
PyObject *scalar_unpickle_tensors(const void *data, size_t len,
				  PyObject *(*tensor)(void *ctx, long long index), void *ctx);

/* _handler.c: a message as Python objects and back. */
PyObject *msg_to_py(const shmrpc_value *v);
int msg_from_py(PyObject *pickled, PyObject *rrefs, PyObject *tensors, struct python_msg *m);
void msg_free(struct python_msg *m);
/* The GIL, taken by a thread of the library (an executor's). */
PyGILState_STATE gil_take(void);
/* The handler python_set_handler installs (shmrpc_init's). */
int run_handler(uint32_t caller, const struct python_request *in, struct python_request *out,
		struct profile_events *ops, struct arena *a);

/* A value, or a call's arguments, of common tensors alone, no pickle
 * (_marshal._TENSORS, docs/PROTOCOL.md). */
#define TENSORS_MARK '\x03'

/* _serve_fast.c: the common Python call served in C, as the plain
 * handler (_serve._serve_plain) would serve it. fast_set: the objects it
 * reads (_serve._fast()'s tuple), or NULL for no fast path; 0, or -1 with
 * an exception set. fast_serve: 1 when it served in (*reply the handler's
 * reply, or NULL with an exception set where the plain handler would have
 * raised, or NULL with *tensor set: the reply is that common tensor alone,
 * TENSORS_MARK and its handle, no object made), 0 when it ran nothing and
 * the handlers must serve it. */
int fast_set(PyObject *objs);
int fast_serve(uint32_t caller, const struct python_request *in,
	       const struct profile_events *ops, PyObject **reply, shmrpc_tensor **tensor);

/* _handler.c: how often executor threads took the GIL, and how long they
 * waited. */
void module_gil_stats(uint64_t *takes, uint64_t *wait_ns);

/* _named.c: whether a function sent by name still finds func, as
 * _marshal._Named.holds asks, from the _Named's fields: for a name
 * without a dot (scope, its module's dict), sys.modules still maps module
 * to mod and scope maps name to func; a dotted one (scope None) asks
 * named.holds() itself. 1, 0 (also where sys.modules or scope is no dict:
 * the Python path asks), or -1 with an exception set. */
int name_holds(PyObject *named, PyObject *module, PyObject *mod, PyObject *scope,
	       PyObject *name, PyObject *func);

/* _in_context.c: whether this thread is inside a distributed autograd
 * context (_contexts._tls.ctx is not None), as its setter last said. */
bool thread_in_context(void);

/* _calls.c: the rank of the worker named by the str name: >= 0, shmrpc's
 * -errno, or INT_MIN with Python's error set. */
int rank_named(PyObject *name);

/* Each file adds its types and functions to the module; 0 or -1 with an
 * exception. */
int module_add_calls(PyObject *m);
int module_add_dumps(PyObject *m);
int module_add_future(PyObject *m);
int module_add_handler(PyObject *m);
int module_add_in_context(PyObject *m);
int module_add_tensor(PyObject *m);
int module_add_torch(PyObject *m);
/* _job.c: adds the Job type to the module. */
int module_add_job(PyObject *m);
/* _join.c: adds join() and leave(). */
int module_add_join(PyObject *m);

#endif
