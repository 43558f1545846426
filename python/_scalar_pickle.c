/*
 * The pickle of a scalar, of a tuple of them, or of a call's (args, {}),
 * written here rather than by pickle.dumps, which makes a Pickler for each
 * (a memo table, a 4 KiB output buffer shrunk at the end: 2 000 to 3 500
 * instructions for a number; this takes a few hundred). Protocol 2
 * opcodes under a protocol 5 header, no frame and no memo, which
 * pickle.loads reads as it reads pickle's own: None, bool, int (64 bits),
 * float, str, bytes, a tuple of them, an empty dict. Anything else (a
 * complex, a larger int, a str that UTF-8 refuses, more than fits in 512
 * bytes) is not written here: the caller asks pickle.dumps.
 *
 * A call's arguments may also hold common tensors (python/_torch.c)
 * beside the scalars: each is written as pickle's BINPERSID of its index
 * among the message's tensors, which the callee's scalar_unpickle_tensors
 * reads from the message, and the package's _Unpickler by its
 * persistent_load (docs/PROTOCOL.md).
 */
#define Py_LIMITED_API 0x03090000
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "python/module.h"

#define PICKLE_MAX 512

struct out {
	unsigned char b[PICKLE_MAX];
	size_t n;
	bool full;
	int (*tensor)(void *ctx, PyObject *v); /* NULL: no tensors */
	void *ctx;
};

static void put(struct out *o, const void *p, size_t n)
{
	if (o->full || n > PICKLE_MAX - o->n) {
		o->full = true;
		return;
	}
	memcpy(o->b + o->n, p, n);
	o->n += n;
}

static void put1(struct out *o, unsigned char c)
{
	put(o, &c, 1);
}

/* n in k bytes, little-endian (pickle's lengths and small ints). */
static void put_le(struct out *o, uint64_t v, size_t k)
{
	unsigned char b[8];

	for (size_t i = 0; i < k; i++)
		b[i] = (unsigned char)(v >> (8 * i));
	put(o, b, k);
}

/* A str or bytes: its opcode by length, then its bytes. */
static void put_sized(struct out *o, unsigned char op1, unsigned char op4, const char *p,
		      Py_ssize_t n)
{
	if (n < 256) {
		put1(o, op1);
		put_le(o, (uint64_t)n, 1);
	} else {
		put1(o, op4);
		put_le(o, (uint64_t)n, 4); /* n < PICKLE_MAX anyway */
	}
	put(o, p, (size_t)n);
}

static void put_int(struct out *o, long long x)
{
	if (x >= 0 && x < 256) {
		put1(o, 'K'); /* BININT1 */
		put_le(o, (uint64_t)x, 1);
	} else if (x >= 0 && x < 65536) {
		put1(o, 'M'); /* BININT2 */
		put_le(o, (uint64_t)x, 2);
	} else if (x >= INT32_MIN && x <= INT32_MAX) {
		put1(o, 'J'); /* BININT: signed */
		put_le(o, (uint64_t)x, 4);
	} else {
		put1(o, 0x8a); /* LONG1: two's complement, little-endian */
		put1(o, 8);
		put_le(o, (uint64_t)x, 8);
	}
}

/* o's pickle appended: true, or false where it is not one this writes
 * (an exception set only for a failure of Python's own). depth: a tuple
 * inside a tuple (a call's args) is written, not deeper. */
static bool scalar_put(struct out *o, PyObject *v, int depth)
{
	int k;

	if (v == Py_None) {
		put1(o, 'N');
	} else if (PyBool_Check(v)) {
		put1(o, v == Py_True ? 0x88 : 0x89); /* NEWTRUE, NEWFALSE */
	} else if (PyLong_CheckExact(v)) {
		int overflow;
		long long x = PyLong_AsLongLongAndOverflow(v, &overflow);

		if (overflow || (x == -1 && PyErr_Occurred()))
			return false;
		put_int(o, x);
	} else if (PyFloat_CheckExact(v)) {
		double d = PyFloat_AsDouble(v);
		uint64_t bits;
		unsigned char b[8];

		memcpy(&bits, &d, sizeof(bits));
		for (int i = 0; i < 8; i++) /* BINFLOAT: big-endian IEEE 754 */
			b[i] = (unsigned char)(bits >> (56 - 8 * i));
		put1(o, 'G');
		put(o, b, 8);
	} else if (PyUnicode_CheckExact(v)) {
		PyObject *u;

		/* More characters than the budget has bytes: pickle's, not
		 * encoded here first (a large str's UTF-8 cost more than
		 * pickling it). */
		if (PyUnicode_GetLength(v) > PICKLE_MAX)
			return false;
		if (!(u = PyUnicode_AsUTF8String(v))) {
			/* a lone surrogate: pickle writes it its own way */
			PyErr_Clear();
			return false;
		}
		put_sized(o, 0x8c, 'X', PyBytes_AsString(u), PyBytes_Size(u)); /* SHORT_BINUNICODE, BINUNICODE */
		Py_DECREF(u);
	} else if (PyBytes_CheckExact(v)) {
		put_sized(o, 'C', 'B', PyBytes_AsString(v), PyBytes_Size(v)); /* SHORT_BINBYTES, BINBYTES */
	} else if (PyDict_CheckExact(v) && PyDict_Size(v) == 0) {
		put1(o, '}'); /* EMPTY_DICT */
	} else if (PyTuple_CheckExact(v) && depth < 2) {
		Py_ssize_t n = PyTuple_Size(v);

		if (n == 0) {
			put1(o, ')'); /* EMPTY_TUPLE */
			return true;
		}
		if (n > 3)
			put1(o, '('); /* MARK */
		for (Py_ssize_t i = 0; i < n; i++) /* no further once past the budget */
			if (o->full || !scalar_put(o, PyTuple_GetItem(v, i), depth + 1))
				return false;
		put1(o, n == 1 ? 0x85 : n == 2 ? 0x86 : n == 3 ? 0x87 : 't'); /* TUPLE1-3, TUPLE */
	} else if (o->tensor && (k = o->tensor(o->ctx, v)) >= 0) {
		put_int(o, k);
		put1(o, 'Q'); /* BINPERSID */
	} else {
		return false;
	}
	return true;
}

PyObject *scalar_pickle(PyObject *head, PyObject *v)
{
	return scalar_pickle_tensors(head, v, NULL, NULL);
}

PyObject *scalar_pickle_tensors(PyObject *head, PyObject *v, int (*tensor)(void *ctx, PyObject *v),
				void *ctx)
{
	struct out o = { .n = 0, .tensor = tensor, .ctx = ctx };
	Py_ssize_t hlen = head ? PyBytes_Size(head) : 0;
	PyObject *out;

	put1(&o, 0x80); /* PROTO 5 */
	put1(&o, 5);
	if (!scalar_put(&o, v, 0))
		return PyErr_Occurred() ? NULL : new_ref(Py_None);
	put1(&o, '.'); /* STOP */
	if (o.full)
		return new_ref(Py_None);
	if (!(out = PyBytes_FromStringAndSize(NULL, hlen + (Py_ssize_t)o.n)))
		return NULL;
	if (hlen)
		memcpy(PyBytes_AsString(out), PyBytes_AsString(head), (size_t)hlen);
	memcpy(PyBytes_AsString(out) + hlen, o.b, o.n);
	return out;
}

/* The k-byte little-endian number at p, sign-extended from its top bit
 * where sign. */
static int64_t get_le(const unsigned char *p, size_t k, bool sign)
{
	uint64_t v = 0;

	for (size_t i = 0; i < k; i++)
		v |= (uint64_t)p[i] << (8 * i);
	if (sign && k && k < 8 && (p[k - 1] & 0x80))
		v |= ~(uint64_t)0 << (8 * k);
	return (int64_t)v;
}

/* A tuple of the n values on top of the stack (taking their references). */
static PyObject *tuple_of(PyObject **top, Py_ssize_t n)
{
	PyObject *t = PyTuple_New(n);

	for (Py_ssize_t i = 0; i < n; i++)
		if (t)
			PyTuple_SetItem(t, i, top[i]); /* steals */
		else
			Py_DECREF(top[i]);
	return t;
}

#define STACK_MAX 32

PyObject *scalar_unpickle(const void *data, size_t len)
{
	return scalar_unpickle_tensors(data, len, NULL, NULL);
}

PyObject *scalar_unpickle_tensors(const void *data, size_t len,
				  PyObject *(*tensor)(void *ctx, long long index), void *ctx)
{
	const unsigned char *p = data;
	PyObject *stack[STACK_MAX], *v;
	int sp = 0, marks[8], nm = 0;
	size_t i = 2, n;

	/* Protocols 2 to 5: pickle.loads refuses a later one (ValueError). */
	if (len < 3 || p[0] != 0x80 || p[1] < 2 || p[1] > 5)
		return NULL;
	while (i < len) {
		unsigned char op = p[i++];
		size_t left = len - i;

		switch (op) {
		case 0x95: /* FRAME: pickle.loads refuses one longer than the rest */
			/* With tensors, none: the plain handler's _Unpickler reads
			 * from a file, frame by frame, and an opcode across a
			 * frame's end is read otherwise there (mixed_payload
			 * writes no FRAME). */
			if (tensor || left < 8 || (uint64_t)get_le(p + i, 8, false) > left - 8)
				goto unread;
			i += 8;
			continue;
		case 0x94: /* MEMOIZE, BINPUT, LONG_BINPUT: no BINGET reads the memo here, */
		case 'q':  /* but pickle.loads refuses one with nothing above the mark, */
		case 'r':  /* and grows its memo to the index (a large one: MemoryError) */
			n = op == 0x94 ? 0 : op == 'q' ? 1 : 4;
			if (left < n || sp == (nm ? marks[nm - 1] : 0) ||
			    (op == 'r' && get_le(p + i, 4, false) > 0xffff))
				goto unread;
			i += n;
			continue;
		case '.':
			if (sp != 1 || nm || i != len)
				goto unread;
			return stack[0];
		case 'N':
			v = new_ref(Py_None);
			break;
		case 0x88:
		case 0x89:
			v = new_ref(op == 0x88 ? Py_True : Py_False);
			break;
		case 'K':
		case 'M':
		case 'J':
			n = op == 'K' ? 1 : op == 'M' ? 2 : 4;
			if (left < n)
				goto unread;
			v = PyLong_FromLongLong(get_le(p + i, n, op == 'J'));
			i += n;
			break;
		case 0x8a: /* LONG1 */
			if (left < 1 || (n = p[i]) > 8 || left - 1 < n)
				goto unread;
			v = PyLong_FromLongLong(get_le(p + i + 1, n, true));
			i += 1 + n;
			break;
		case 'G': {
			uint64_t bits = 0;
			double d;

			if (left < 8)
				goto unread;
			for (int k = 0; k < 8; k++)
				bits = bits << 8 | p[i + k];
			memcpy(&d, &bits, sizeof(d));
			v = PyFloat_FromDouble(d);
			i += 8;
			break;
		}
		case 0x8c: /* SHORT_BINUNICODE */
		case 'X':  /* BINUNICODE */
		case 'C':  /* SHORT_BINBYTES */
		case 'B': { /* BINBYTES */
			size_t k = op == 0x8c || op == 'C' ? 1 : 4;

			if (left < k || left - k < (n = (size_t)get_le(p + i, k, false)))
				goto unread;
			i += k;
			v = op == 0x8c || op == 'X'
				    ? PyUnicode_DecodeUTF8((const char *)p + i, (Py_ssize_t)n, "surrogatepass")
				    : PyBytes_FromStringAndSize((const char *)p + i, (Py_ssize_t)n);
			i += n;
			break;
		}
		case ')':
			v = PyTuple_New(0);
			break;
		case '}':
			v = PyDict_New();
			break;
		case 0x85:
		case 0x86:
		case 0x87:
			n = (size_t)(op - 0x84);
			if ((size_t)(sp - (nm ? marks[nm - 1] : 0)) < n)
				goto unread;
			sp -= (int)n;
			v = tuple_of(stack + sp, (Py_ssize_t)n);
			break;
		case 'Q': { /* BINPERSID: a tensor of the message, by its index */
			long long index;

			if (!tensor || sp == (nm ? marks[nm - 1] : 0) || !PyLong_CheckExact(stack[sp - 1]))
				goto unread;
			index = PyLong_AsLongLong(stack[sp - 1]);
			if (index == -1 && PyErr_Occurred())
				goto unread;
			Py_DECREF(stack[--sp]);
			v = tensor(ctx, index);
			break;
		}
		case '(':
			if (nm == (int)(sizeof(marks) / sizeof(*marks)))
				goto unread;
			marks[nm++] = sp;
			continue;
		case 't':
			if (!nm)
				goto unread;
			n = (size_t)(sp - marks[--nm]);
			sp -= (int)n;
			v = tuple_of(stack + sp, (Py_ssize_t)n);
			break;
		default:
			goto unread;
		}
		if (!v || sp == STACK_MAX) {
			Py_XDECREF(v);
			goto unread;
		}
		stack[sp++] = v;
	}
unread:
	while (sp)
		Py_DECREF(stack[--sp]);
	if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError))
		PyErr_Clear(); /* malformed (an invalid UTF-8): pickle.loads says it */
	return NULL;
}
