/*
 * Tensor: a block of the pool (or a CUDA allocation), for DLPack
 * consumers; and the functions that make one.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "shmrpc.h"
#include "python/module.h"
#include "worker/python_api.h"

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

/* The handle of a Tensor object, or NULL with an exception set when its
 * reference went into a DLPack capsule (take_dlpack). */
static shmrpc_tensor *held(PyObject *self)
{
	shmrpc_tensor *t = HANDLE(self);

	if (!t)
		PyErr_SetString(PyExc_ValueError, "this shmrpc Tensor gave its reference to a DLPack "
				"capsule (take_dlpack): use the tensor made from that capsule");
	return t;
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
	const DLTensor *dl;
	DLManagedTensor *m;
	shmrpc_tensor *t;
	int rc;

	if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", names, &stream) || !held(self))
		return NULL;
	if (!(dl = shmrpc_tensor_dl(HANDLE(self))))
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

/* A DLPack capsule that takes over t's own reference: t is empty afterwards
 * (held() refuses it). For a received host tensor made into a torch tensor
 * at once (take_torch, _torch.c): __dlpack__ would take a reference of its
 * own (a handle, a count and a holder record) that t's release then drops.
 * NULL with an exception set. */
PyObject *take_capsule(PyObject *obj)
{
	const DLTensor *dl;
	DLManagedTensor *dm;
	int rc;

	if (!PyObject_TypeCheck(obj, (PyTypeObject *)TensorType)) {
		PyErr_SetString(PyExc_TypeError, "take_dlpack: an shmrpc Tensor is needed");
		return NULL;
	}
	if (!held(obj))
		return NULL;
	dl = shmrpc_tensor_dl(HANDLE(obj));
	if (!dl || dl->device.device_type != kDLCPU) {
		PyErr_SetString(PyExc_TypeError, "take_dlpack: a host tensor is needed (a CUDA "
				"tensor's consumer names its stream: __dlpack__(stream))");
		return NULL;
	}
	if ((rc = shmrpc_tensor_to_dlpack(HANDLE(obj), &dm)))
		return fail(rc);
	HANDLE(obj) = NULL; /* dm owns t now */
	return capsule_of(dm);
}

/* A DLPack capsule of dm, which it owns from now on (dm deleted if the
 * capsule cannot be made). NULL with an exception set. */
PyObject *capsule_of(DLManagedTensor *dm)
{
	PyObject *cap = PyCapsule_New(dm, "dltensor", capsule_free);

	if (!cap)
		dm->deleter(dm);
	return cap;
}

/* take_dlpack(t) -> take_capsule(t). */
static PyObject *mod_take_dlpack(PyObject *m, PyObject *obj)
{
	(void)m;
	return take_capsule(obj);
}

static PyObject *tensor_dlpack_device(PyObject *self, PyObject *unused)
{
	const DLTensor *dl;

	(void)unused;
	if (!held(self))
		return NULL;
	if (!(dl = shmrpc_tensor_dl(HANDLE(self))))
		return fail(-ECONNRESET);
	return Py_BuildValue("(ii)", (int)dl->device.device_type, (int)dl->device.device_id);
}

/* The tensor's DLTensor when its bytes are host memory; else an exception
 * saying that what (a host-only method) cannot read device memory. */
static const DLTensor *host_dl(PyObject *self, const char *what)
{
	const DLTensor *dl;

	if (!held(self))
		return NULL;
	if (!(dl = shmrpc_tensor_dl(HANDLE(self))))
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
	void *p;

	(void)unused;
	if (!held(self))
		return NULL;
	p = shmrpc_tensor_data(HANDLE(self));
	return p ? PyLong_FromVoidPtr(p) : fail(-ECONNRESET);
}

/* set_cuda_stream(stream): the CUstream (an int, 0: the legacy default
 * stream) on which the tensor's last writes were queued; its sends order
 * their receivers after them. */
static PyObject *tensor_set_cuda_stream(PyObject *self, PyObject *stream)
{
	unsigned long long s = PyLong_AsUnsignedLongLong(stream);
	int rc;

	if ((s == (unsigned long long)-1 && PyErr_Occurred()) || !held(self))
		return NULL;
	rc = shmrpc_tensor_set_cuda_stream(HANDLE(self), (uintptr_t)s);
	return rc ? fail(rc) : new_ref(Py_None);
}

static PyObject *tensor_pool_offset(PyObject *self, PyObject *unused)
{
	(void)unused;
	return held(self) ? PyLong_FromUnsignedLongLong(shmrpc_tensor_pool_offset(HANDLE(self)))
			  : NULL;
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

/* The sizes of dims (a tuple, or a subclass: torch.Size) into shape: how
 * many, or -1 with an exception set. */
Py_ssize_t shape_of(PyObject *dims, int64_t shape[SHMRPC_TENSOR_MAX_DIMS])
{
	Py_ssize_t n;

	if (!PyTuple_Check(dims) || (n = PyTuple_Size(dims)) > SHMRPC_TENSOR_MAX_DIMS) {
		PyErr_Format(PyExc_ValueError, "a shape is a tuple of at most %d sizes",
			     SHMRPC_TENSOR_MAX_DIMS);
		return -1;
	}
	for (Py_ssize_t i = 0; i < n; i++)
		if ((shape[i] = PyLong_AsLongLong(PyTuple_GetItem(dims, i))) == -1 && PyErr_Occurred())
			return -1;
	return n;
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
	if (!PyArg_ParseTuple(args, "OII", &dims, &code, &bits) || (n = shape_of(dims, shape)) < 0)
		return NULL;
	rc = shmrpc_tensor_alloc((DLDataType){ (uint8_t)code, (uint8_t)bits, 1 }, (int32_t)n, shape,
				 &t);
	return rc ? fail(rc) : tensor_wrap(t);
}

/* A handle (host_tensor) or a Tensor (host_handle) of the contiguous host
 * array of dtype and shape at addr (which its owner keeps alive during the
 * call): taken without a copy when it is a whole pool block, else copied
 * once. torch's DLPack export makes a view of the tensor (as_strided) and
 * a capsule, and its deleter frees them: most of what sending a tensor
 * cost (docs/ARCHITECTURE.md, "A tensor echo"). host_tensor: 0 or -errno, its sentence set; host_handle: NULL
 * with an exception set. */
int host_tensor(uintptr_t addr, DLDataType dtype, int32_t ndim, int64_t *shape,
		shmrpc_tensor **out)
{
	/* No deleter: the array stays its owner's. No strides: compact. */
	return shmrpc_tensor_from_dlpack(
		&(DLManagedTensor){ .dl_tensor = { .data = (void *)addr,
						    .device = { kDLCPU, 0 },
						    .ndim = ndim,
						    .dtype = dtype,
						    .shape = shape } },
		out);
}

PyObject *host_handle(uintptr_t addr, DLDataType dtype, int32_t ndim, int64_t *shape)
{
	shmrpc_tensor *t;
	int rc = host_tensor(addr, dtype, ndim, shape, &t);

	return rc ? fail(rc) : tensor_wrap(t);
}

/* from_host(address, code, bits, shape) -> Tensor: host_handle of a CPU
 * torch tensor's data_ptr(), DLPack dtype and shape. */
static PyObject *mod_from_host(PyObject *m, PyObject *args)
{
	int64_t shape[SHMRPC_TENSOR_MAX_DIMS];
	unsigned long long addr;
	unsigned code, bits;
	PyObject *dims;
	Py_ssize_t n;

	(void)m;
	if (!PyArg_ParseTuple(args, "KIIO", &addr, &code, &bits, &dims) ||
	    (n = shape_of(dims, shape)) < 0)
		return NULL;
	return host_handle((uintptr_t)addr, (DLDataType){ (uint8_t)code, (uint8_t)bits, 1 },
			   (int32_t)n, shape);
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
	shmrpc_tensor *keep;
	uintptr_t *src;
	char *dst;
	int rc;

	(void)m;
	if (!PyArg_ParseTuple(args, "O!OK", (PyTypeObject *)TensorType, &obj, &addrs, &row) ||
	    !held(obj))
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
	/* A reference of our own while the GIL is free: another thread may
	 * meanwhile give obj's to a capsule (take_dlpack) and drop it. */
	if ((rc = shmrpc_tensor_retain(HANDLE(obj), &keep))) {
		free(src);
		return fail(rc);
	}
	dst = shmrpc_tensor_data(keep);
	Py_BEGIN_ALLOW_THREADS
	for (Py_ssize_t i = 0; i < n; i++)
		copy_streaming(dst + (size_t)i * row, (const char *)src[i], (size_t)row);
	Py_END_ALLOW_THREADS
	shmrpc_tensor_free(keep);
	free(src);
	return new_ref(Py_None);
}
static PyMethodDef tensor_functions[] = {
	{ "from_dlpack", mod_from_dlpack, METH_O,
	  "from_dlpack(obj or capsule) -> Tensor in the pool or on a CUDA device" },
	{ "empty", mod_empty, METH_VARARGS, "empty(shape, code, bits) -> Tensor in the pool" },
	{ "take_dlpack", mod_take_dlpack, METH_O,
	  "take_dlpack(Tensor) -> a DLPack capsule holding the Tensor's reference (emptied)" },
	{ "from_host", mod_from_host, METH_VARARGS,
	  "from_host(address, code, bits, shape) -> Tensor: a contiguous host array's bytes" },
	{ "from_bytes", mod_from_bytes, METH_O, "from_bytes(b) -> a copy of b in the pool" },
	{ "stack_rows", mod_stack_rows, METH_VARARGS,
	  "stack_rows(tensor, [address...], row_bytes): the rows, streamed into tensor's block" },
	{ NULL, NULL, 0, NULL },
};

int module_add_tensor(PyObject *m)
{
	TensorType = PyType_FromSpec(&tensor_spec);
	if (!TensorType || PyModule_AddFunctions(m, tensor_functions))
		return -1;
	return PyModule_AddObject(m, "Tensor", new_ref(TensorType));
}
