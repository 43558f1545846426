"""How values travel: the pickler of calls and results (torch's default
RPC pickler's rules: functions by reference), tensors handed over beside
the pickle through the pool or as CUDA IPC handles, RRefs by their C
handles, a call's payload and a result's RemoteException. Below the
calls and the server; it knows the RRef class through set_rref_type
(shmrpc._calls sets it when imported).
"""
import contextlib
import io
import pickle
import sys
import threading
import types
import weakref

from . import _contexts, _core, _shmrpc
from ._core import RemoteException, _not_supported

# The RRef class (shmrpc._calls'): RRefs are pickled by their C handle and
# made again from it. () until set: nothing is an instance of it.
_rref_type = ()


def set_rref_type(cls):
    global _rref_type
    _rref_type = cls


def _rref_of(handle):
    """An RRef of a C handle (as the unpickler makes one): what
    RRef(_c=handle) makes, without __init__'s call and keyword."""
    rref = _new_object(_rref_type)
    rref._r = handle
    return rref


_new_object = object.__new__


# The torch dtypes whose CPU tensors go through the pool, with their DLPack
# (code, bits): kDLInt 0, kDLUInt 1, kDLFloat 2.
_POOL_TORCH_DTYPES = {"torch.int8": (0, 8), "torch.int16": (0, 16), "torch.int32": (0, 32),
                      "torch.int64": (0, 64), "torch.uint8": (1, 8), "torch.float16": (2, 16),
                      "torch.float32": (2, 32), "torch.float64": (2, 64)}


_KDLCUDA = 2  # DLPack's device type of CUDA memory
# DLPack's code of a dtype by its kind's letter: numpy's dtype.kind, a
# torch dtype name's first ("int", "uint", "float"; _data_collate).
_DLPACK_CODES = {"i": 0, "u": 1, "f": 2}

# How the objects of a type are sent, asked once per type (_type_kind).
_NOT_ARRAY, _NUMPY, _TORCH, _DLPACK = range(4)


_TYPE_KINDS = {}
# Per torch dtype: its DLPack (code, bits) when a CPU tensor of it goes
# through the pool, else False.
_TORCH_DTYPE_OK = {}


# torch's DLPack import (a C function), once a torch tensor was seen.
_from_dlpack = None
_torch_strided = None  # torch.strided then: the layout whose bytes a handle holds


def _know_torch(torch):
    global _from_dlpack, _from_handles, _torch_strided
    # torch.utils.dlpack.from_dlpack without its Python wrapper, which asks
    # a capsule nothing.
    _from_dlpack = torch._C._from_dlpack
    _torch_strided = torch.strided
    # Known before the first tensor: _torch_handle asks this map alone, so
    # the first tensor of a dtype would otherwise be pickled (_tensor_kind
    # fills the map) and only the later ones go by the fast path.
    for name, code_bits in _POOL_TORCH_DTYPES.items():
        _TORCH_DTYPE_OK[getattr(torch, name[len("torch."):])] = code_bits
    # The common tensor's fast path, in C (python/_torch.c), which takes
    # the pool dtypes from the map now: before, _torch_handle gives None
    # for every object.
    _shmrpc.know_torch(torch.Tensor, _TORCH_DTYPE_OK, _from_dlpack, torch.strided,
                       torch.empty(0, device="cpu"))
    _from_handles = _shmrpc.take_torch  # no Python call around it from now on


def _type_kind(t):
    """numpy and torch are recognised by their type's module and name
    (importing neither); another type by whether it speaks DLPack (CuPy's
    arrays...)."""
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        return _NUMPY
    # A Parameter is not handed over itself: pickled by its own reduce, as
    # torch's RPC pickler does (its dispatch table names torch.Tensor alone),
    # it arrives a Parameter, its data (a Tensor) handed over.
    if t.__module__.startswith("torch") and getattr(t, "__name__", "") == "Tensor":
        if _from_dlpack is None:
            _know_torch(sys.modules["torch"])
        return _TORCH
    if hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__"):
        return _DLPACK
    return _NOT_ARRAY


def _tensor_kind(obj):
    """'np', 'torch' or 'cuda' for an array the pickler hands over, else
    None. On the pickler's path for every object that is not of a plain
    type: one dictionary lookup for most."""
    t = type(obj)
    how = _TYPE_KINDS.get(t)
    if how is None:
        how = _TYPE_KINDS[t] = _type_kind(t)
    if how == _NOT_ARRAY:
        return None
    # Only number types go through the pool (DLPack has no bool in numpy
    # and torch 1.13, numpy no bfloat16); the others, and empty arrays (the
    # pool's DLPack import takes them for strided), are pickled.
    if how == _NUMPY:
        # Of another byte order, or a long double (none in DLPack):
        # pickled, arriving as it was.
        d = obj.dtype
        return "np" if d.kind in "iuf" and d.itemsize <= 8 and obj.size and d.isnative else None
    if how == _TORCH:
        if obj.layout is not _torch_strided:
            return None  # sparse or MKL-DNN: no strided bytes to hand over; torch pickles it
        if obj.is_cpu:
            ok = _TORCH_DTYPE_OK.get(obj.dtype)
            if ok is None:
                ok = _TORCH_DTYPE_OK[obj.dtype] = _POOL_TORCH_DTYPES.get(str(obj.dtype), False)
            return "torch" if ok and obj.numel() else None
        if obj.is_cuda:
            # Any dtype torch's DLPack takes: never copied to the host.
            return "cuda" if obj.numel() else None
        raise _not_supported(f"sending a torch tensor on device {obj.device.type} "
                             "(CPU and CUDA tensors are)")
    return "cuda" if obj.__dlpack_device__()[0] == _KDLCUDA else None


def _to_pool(kind, obj):
    """obj's bytes as a tensor handle: a pool block (without a copy when obj
    already views a whole pool block, as what came from shmrpc does, else
    copied once; a small one copied into this process's memory instead, to
    travel inline), or CUDA device memory as it is (CUDA IPC, no copy)."""
    if kind == "np":
        import numpy as np
        obj = np.ascontiguousarray(obj)
        if obj.flags.writeable:
            return _shmrpc.from_dlpack(obj)
        # numpy's DLPack export refuses a read-only array (np.frombuffer's
        # of bytes): its bytes by address, as a torch tensor's.
        return _shmrpc.from_host(obj.ctypes.data, _DLPACK_CODES[obj.dtype.kind],
                                 obj.dtype.itemsize * 8, obj.shape)
    if kind == "torch":
        if obj.requires_grad or not obj.is_contiguous() or obj.is_neg() or not obj.data_ptr():
            obj = _resolved(obj)
        return _plain_handle(obj)
    if type(obj) is _shmrpc.Tensor:
        return obj  # received: passed on as it is (the producer's memory)
    if type(obj).__module__.startswith("torch"):
        import torch
        received = _received_cuda.get(obj.data_ptr())
        if received is not None and _whole(obj, received[0]()):
            # Passed on: another worker's memory, which only its handle can
            # describe (a mapping has no IPC handle of its own).
            t = received[1]
        else:
            obj = _resolved(obj)
            if _received_cuda and _in_received(obj):
                raise _not_supported("sending a part, or another dtype's view, of a CUDA "
                                     "tensor received from another worker (send it whole, "
                                     "or a .clone())")
            t = _shmrpc.from_dlpack(obj)
        # Its receivers wait for the work queued so far on torch's current
        # stream of the device: the kernels that wrote it.
        t.set_cuda_stream(torch.cuda.current_stream(obj.device).cuda_stream)
        return t
    # Another producer (CuPy...): stream 1 asks it to order its writes
    # before the legacy default stream, where the send records its event.
    return _shmrpc.from_dlpack(obj.__dlpack__(stream=1))


# The torch CUDA tensors received, by device address: (a weak reference to
# the tensor, its handle), for the handle to be sent again when the tensor
# is passed on. Dropped with the tensor.
_received_cuda = {}


def _resolved(obj):
    """torch tensor obj as contiguous bytes of its values, without autograd:
    a conjugate or negative view's (x.conj(), x.conj().imag) made real,
    since its bytes are those of what it views, and neither torch 1.13's
    DLPack export nor a data_ptr() says the bit; a tensor without storage
    (a ZeroTensor, data_ptr() 0) given bytes."""
    obj = obj.detach().resolve_conj().resolve_neg().contiguous()
    return obj if obj.data_ptr() or not obj.numel() else obj.clone()


def _with_bit(obj):
    """True when torch tensor obj is a strided conjugate or negative view
    that needs no grad (resolved, one that needs grad would arrive without
    it, which torch's reduce sends)."""
    return (obj.layout is _torch_strided and not obj.requires_grad
            and (obj.is_conj() or obj.is_neg()))


def _whole(obj, received):
    """True when torch tensor obj is all of received's bytes, as received's
    dtype and values."""
    return (received is not None and obj.dtype == received.dtype
            and obj.numel() == received.numel() and obj.is_contiguous()
            and not obj.is_conj() and not obj.is_neg())


def _in_received(obj):
    """True when torch tensor obj's bytes are in a CUDA tensor received."""
    p = obj.data_ptr()
    for ref, _ in list(_received_cuda.values()):
        r = ref()
        if r is not None and r.data_ptr() <= p < r.data_ptr() + r.numel() * r.element_size():
            return True
    return False


def _remember_received(tensor, handle):
    ptr = tensor.data_ptr()

    def forget(ref):
        if _received_cuda.get(ptr, (None,))[0] is ref:  # not a later tensor at ptr
            del _received_cuda[ptr]
    _received_cuda[ptr] = (weakref.ref(tensor, forget), handle)
    return tensor


_torch_cuda = None  # torch, once known to have CUDA; False where it has not


def _receiving_torch():
    """torch when the process can take CUDA tensors as torch tensors."""
    global _torch_cuda
    if _torch_cuda is None:
        try:
            import torch
            _torch_cuda = torch if torch.cuda.is_available() else False
        except ImportError:
            _torch_cuda = False
    return _torch_cuda


def _from_pool(kind, t):
    if kind == "np":
        import numpy as np
        return np.asarray(t)  # writable (numpy.from_dlpack's arrays are not)
    if kind == "cuda":
        # Without torch's CUDA the handle itself: it speaks DLPack, for
        # cupy.from_dlpack or a later torch. Never copied to the host.
        torch = _receiving_torch()
        return torch.from_dlpack(t) if torch else t
    if _from_dlpack is None:
        import torch
        _know_torch(torch)
    # The capsule given, not the handle: torch then skips its questions to
    # the producer (device, stream). Holds t's reference.
    return _from_dlpack(t.__dlpack__())


# The common tensor, which its handle describes whole: a contiguous,
# non-empty CPU torch.Tensor (not a subclass) of a pool dtype that needs no
# autograd. The fast path of the pickler and of _TENSORS: _torch_handle(obj)
# is its handle, or None for any other object; _torch_handles(args) the
# handles of a tuple of them, or None (python/_torch.c: the questions to the
# tensor and its handle in one C call, docs/ARCHITECTURE.md, "A tensor
# echo", seventh pass).
_torch_handle = _shmrpc.torch_handle
_torch_handles = _shmrpc.torch_handles


def _plain_handle(obj):
    # Its address, dtype and shape rather than torch's DLPack export, which
    # makes a view of the tensor and a capsule for each (docs/ARCHITECTURE.md,
    # "A tensor echo"); obj is alive, contiguous and of a pool dtype.
    code, bits = _TORCH_DTYPE_OK[obj.dtype]
    return _shmrpc.from_host(obj.data_ptr(), code, bits, obj.shape)


def _from_handles(tensors):
    """The torch tensors (a tuple) of _TENSORS' handles (_from_pool's
    "torch"), each holding its handle's reference (take_torch: the handles
    are the message's, used once). This function only until torch is
    known: _know_torch binds the name to take_torch itself."""
    import torch
    _know_torch(torch)
    return _shmrpc.take_torch(tensors)


# A value, or a call's arguments, that is only such tensors travels as
# this mark and their handles, without a pickle (docs/PROTOCOL.md): a
# value is the one tensor, a call's arguments are the tensors in order,
# no keywords. A pickle starts with its PROTO opcode, 0x80.
_TENSORS = b"\x03"


class _Loading(threading.local):
    """unpickler: the _Unpickler loading on this thread now, whose message's
    tensors and RRefs _ref finds (None outside _loads)."""
    unpickler = None


_loading = _Loading()


def _ref(pid):
    """An RRef or a tensor of the message being loaded, as the pickle names
    it: _Pickler writes each as a call of this function with its id."""
    u = _loading.unpickler
    if u is None:
        raise pickle.UnpicklingError("this pickle names shmrpc's RRefs or tensors: only "
                                     "shmrpc loads it, with its message")
    return u.ref(pid)


class _Pickler(pickle.Pickler):
    """torch's default RPC pickler: functions by reference. RRefs and
    tensors go beside the pickle (which names them by index, a call of
    _ref): the agent forks an RRef (the receiver gets a reference of its
    own) and hands a tensor over through the pool (the receiver sees the
    same bytes), or a small one not in the pool inside the message (a copy
    of its own). A tensor that requires grad travels detached, with its
    autograd metadata (shmrpc.autograd). The pickler asks reducer_override
    only for objects of no builtin type, after its memo: numbers, strings
    and the containers of builtin types cost no Python call (a persistent_id
    hook was asked for each object: a list of three ints cost 6.5 us
    against pickle's 1.1), and an object met again is the memo's, sent
    once and arriving as one object, as torch's pickler memoizes it."""

    def __init__(self):
        self.buf = io.BytesIO()
        super().__init__(self.buf, protocol=pickle.HIGHEST_PROTOCOL)
        # Ready for the next pickle (_dumps reuses a thread's pickler:
        # making one costs more than pickling a few numbers with it): rrefs
        # and tensors empty lists, grad_tensors None (an
        # _contexts._Outgoing from the first tensor that requires grad).
        _shmrpc.pickler_reset(self)

    def reducer_override(self, obj):
        handle = _torch_handle(obj)
        if handle is not None:
            # Its handle has its shape, so its id is the bare index.
            self.tensors.append(handle)
            return _ref, (len(self.tensors) - 1,)
        if isinstance(obj, _rref_type):
            self.rrefs.append(obj._r)
            return _ref, (("rref", len(self.rrefs) - 1),)
        kind = _tensor_kind(obj)
        if not kind:
            if _TYPE_KINDS.get(type(obj)) == _TORCH and _with_bit(obj):
                # torch's own reduce (a tensor of a dtype the pool does
                # not take: complex, bfloat16...) sends the storage of a
                # conjugate or negative view without its bit: its values
                # instead.
                return _resolved(obj).__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return NotImplemented
        # Any DLPack producer may be sent: it may have no .shape.
        shape = getattr(obj, "shape", None)
        shape = None if shape is None else tuple(shape)
        data = obj
        if kind == "torch" and not obj.is_contiguous() and not obj.is_neg() and obj.data_ptr():
            # As torch's: a view's whole storage and its strides (a
            # .contiguous() or .clone() sends only its elements). A
            # negative view's storage is not its values, and a ZeroTensor
            # has none: each goes resolved (_to_pool), a tensor of its own.
            shape = {"size": shape, "stride": obj.stride(), "offset": obj.storage_offset()}
            data = obj.detach().new_empty(0).set_(obj.storage())
        elif kind != "cuda" and len(shape) > _shmrpc.TENSOR_MAX_DIMS:
            # More sizes than a handle holds: flat, given its shape back
            # on arrival (_Unpickler), as a view's storage is.
            data = obj.reshape(-1)
        self.tensors.append(_to_pool(kind, data))
        pid = (kind, len(self.tensors) - 1, shape)
        if kind != "np" and getattr(obj, "requires_grad", False):
            if self.grad_tensors is None:
                self.grad_tensors = _contexts._Outgoing()
            pid += (self.grad_tensors.add(obj),)
        return _ref, (pid,)


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf, rrefs, tensors, grad_mode):
        super().__init__(buf)
        self.rrefs = rrefs
        self.tensors = tensors
        self.grad_mode = grad_mode  # how a tensor sent requiring grad arrives (_contexts._Incoming)
        self.grad_tensors = None  # an _contexts._Incoming, at the first tensor that required grad

    def load(self):
        outer, _loading.unpickler = _loading.unpickler, self
        try:
            return super().load()
        finally:
            _loading.unpickler = outer

    def persistent_load(self, pid):
        """A BINPERSID: a tuple of scalars and common tensors, a call's
        arguments or a value (python/_calls.c, mixed_payload; _dumps.c,
        tuple_message), names each tensor by its index."""
        if type(pid) is not int or not 0 <= pid < len(self.tensors):
            raise pickle.UnpicklingError(f"no tensor {pid!r} in this message")
        return _from_pool("torch", self.tensors[pid])

    def ref(self, pid):
        """What _Pickler named pid: each is met once (the memo has the rest)."""
        if type(pid) is int:  # a CPU torch tensor of its handle's shape (_Pickler)
            return _from_pool("torch", self.tensors[pid])
        if pid[0] == "rref":
            return _rref_of(self.rrefs[pid[1]])
        return self._tensor(pid)

    def _tensor(self, pid):
        handle = self.tensors[pid[1]]
        t = _from_pool(pid[0], handle)
        if type(t) is _shmrpc.Tensor:  # a handle keeps its shape
            if len(pid) > 3:
                raise _not_supported("receiving a CUDA tensor that requires grad where torch "
                                     "has no CUDA")
            return t
        if isinstance(pid[2], dict):  # a view, sent with its storage (_Pickler)
            t = t.as_strided(pid[2]["size"], pid[2]["stride"], pid[2]["offset"])
        elif pid[2] is not None and t.shape != pid[2]:  # mostly the shape it has
            t = t.reshape(pid[2])
        if len(pid) > 3:
            if self.grad_tensors is None:
                self.grad_tensors = _contexts._Incoming(self.grad_mode)
            t = self.grad_tensors.add(t, pid[3])
        if pid[0] == "cuda":
            _remember_received(t, handle)  # the tensor as the program gets it
        return t


# A pickle larger than this travels in the pool (copied in once and out
# once) rather than in the frame, whose payload is bounded by the ring.
_INLINE_MAX = 16 * 1024


_OUT_OF_LINE = b"\x00shmrpc: the pickle is the last tensor"


# _scalars(values): whether the tuple values holds only scalars of
# _IMMUTABLE_TYPES, which can hold no RRef nor tensor (exact types: a
# subclass may).
# _dumps(obj) -> (pickle, [C RRef...], [C Tensor...]) for the agent: None
# is b"", scalars pickle's alone, one common tensor _TENSORS and its
# handle, anything else this thread's _Pickler's (python/_dumps.c).
# _inline(data, rrefs, tensors): the message of a pickle, in the frame or
# past _INLINE_MAX in the pool (the last tensor, data _OUT_OF_LINE).
_shmrpc.dumps_setup(_Pickler, _TENSORS, _OUT_OF_LINE, _INLINE_MAX, pickle.dumps,
                    pickle.HIGHEST_PROTOCOL, _shmrpc.from_bytes)
_dumps = _shmrpc.dumps
_unpickle_tensors = _shmrpc.unpickle_tensors
_inline = _shmrpc.inline
_scalars = _shmrpc.scalars


def _loads(msg, grad_mode="result"):
    data, rrefs, tensors = msg
    if not data:
        return None
    if not rrefs and not tensors:  # nothing beside the pickle: C's unpickler alone
        return pickle.loads(data)
    if data == _TENSORS:
        return _from_handles(tensors)[0]
    if not rrefs and data[:1] == b"\x80":
        # A tuple of scalars and common tensors, as _dumps writes it: read
        # in C where it is that alone (no Unpickler object).
        read, value = _unpickle_tensors(data, tensors)
        if read:
            return value
    if data == _OUT_OF_LINE:
        data = tensors[-1].tobytes()
    u = _Unpickler(io.BytesIO(data), rrefs, tensors, grad_mode)
    value = u.load()
    if u.grad_tensors is not None:
        u.grad_tensors.received()
    return value


def empty(shape, dtype="float32", like="numpy"):
    """An uninitialised array in the job's tensor pool: sending it hands the
    same bytes to the callee (what it writes, the caller sees). like:
    "numpy" or "torch"."""
    import numpy as np
    dt = np.dtype(dtype)
    codes = {"i": 0, "u": 1, "f": 2, "b": 1}
    if dt.kind not in codes:
        raise TypeError(f"shmrpc.empty: dtype {dt} is not a number type")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    t = _shmrpc.empty(shape, codes[dt.kind], dt.itemsize * 8)
    return _from_pool("np" if like == "numpy" else "torch", t)


# What an RRef stores for a value its owner keeps live (worker/python.h):
# a user's to_here() that reads it asks the owner for the value.
_LIVE = b"\x02"


_IMMUTABLE_TYPES = frozenset((type(None), bool, int, float, complex, str, bytes))


def _immutable(value):
    """Whether no code can change value: None, numbers, strings, bytes, and
    tuples and frozensets of them (exact types: a subclass may add state)."""
    t = type(value)
    if t in _IMMUTABLE_TYPES:
        return True
    return (t is tuple or t is frozenset) and all(_immutable(v) for v in value)


def _result(msg, grad_mode="result"):
    """Unpickles a result; a RemoteException is raised as its own type."""
    data = msg[0]
    if not data:
        return None  # most results: nothing to unpickle (_dumps)
    if data == _TENSORS:  # a tensor (_dumps): no RemoteException
        return _from_handles(msg[2])[0]
    value = _loads(msg, grad_mode)
    if isinstance(value, RemoteException):
        exc_type = value.exception_type
        # As torch's: the escapes of repr(e) in the text (newlines...) undone.
        text = value.msg.encode("latin-1", "backslashreplace").decode("unicode_escape")
        try:
            exc = exc_type(text)
        except Exception:
            exc = RuntimeError(text)
        raise exc
    return value


# A call's payload is the pickle of (func, args, kwargs), or, for a plain
# function that pickle would send by reference anyway, that reference
# written out: _BY_NAME, module, NUL, qualified name, NUL, then the pickle
# of (args, kwargs), or nothing when there are none (docs/PROTOCOL.md).
# Neither side then pickles the function, and an empty call pickles
# nothing. A reference resolves as pickle's load resolves it (_resolve).
_BY_NAME = b"\x01"


_finder = pickle.Unpickler(io.BytesIO(pickle.dumps(None, protocol=5)))
_finder.load()  # now at protocol 5: its find_class takes dotted names


def _resolve(module, name):
    """What pickle's load finds for (module, name): a loaded module's
    attribute, looked up here (pickle's find_class costs 0.5 µs: an
    import and an audit event each time); anything else by find_class
    itself, which imports the module and words the errors."""
    obj = sys.modules.get(module)
    if obj is not None:
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            pass
    return _finder.find_class(module, name)


# The types of the functions that may go by name (_by_name).
_BY_NAME_TYPES = (types.FunctionType, types.BuiltinFunctionType)


def _by_name(func):
    """func's reference (module, name) if it is a function that pickle
    would send by reference and the name finds func itself, else None.
    A builtin may be one too: a module's function (math.sqrt), or one of
    torch's operators, found as torch.add though its qualified name is
    _VariableFunctionsClass.add (torch puts them in its module); a
    builtin bound to an object ([].append) is not. The callee finds the
    same object under that name."""
    if type(func) is types.FunctionType:
        names = (func.__qualname__,)
    elif type(func) is types.BuiltinFunctionType and (
            func.__self__ is None or type(func.__self__) is types.ModuleType):
        names = (func.__qualname__, func.__name__)
    else:
        return None
    module = func.__module__
    for name in names:
        try:
            if _resolve(module, name) is func:
                return module, name
        except Exception:
            pass
    return None


class _Named:
    """What a function sent by name costs to find once: its reference's
    bytes (the payload's head), and the module dict and name that must
    still find the function itself for the reference to hold (where the
    name has no dot; a dotted one is looked up again every time); and
    its qualified name, for the profiler (_func_name), the same as name
    but for a builtin found by a shorter one (torch.add)."""
    __slots__ = ("func", "head", "tensors_head", "module", "mod", "scope", "name", "qualname")

    def __init__(self, func, module, name):
        self.func = func
        self.qualname = func.__qualname__
        self.head = b"".join((_BY_NAME, module.encode(), b"\0", name.encode(), b"\0"))
        self.tensors_head = self.head + _TENSORS  # the head of a call of tensors alone
        self.module = module
        self.mod = sys.modules.get(module)
        self.scope = None if "." in name or self.mod is None else vars(self.mod)
        self.name = name

    def holds(self):
        """Whether the reference still finds func, as pickle would look it
        up now (a module's attribute can be rebound, or the module
        replaced in sys.modules)."""
        if self.scope is not None:
            return (sys.modules.get(self.module) is self.mod
                    and self.scope.get(self.name) is self.func)
        try:
            return _resolve(self.module, self.name) is self.func
        except Exception:
            return False


# The _Named of functions sent by name, by the function's (module,
# qualified name) on the caller's side and by payload head on the
# callee's: one entry per name
# (a function that replaces another under its name replaces its entry),
# and only names that find their function, so neither grows with lambdas,
# closures or rebound names.
_named_funcs = {}
_named_heads = {}


def _named(func):
    """func's _Named if pickle would send it by reference and the name
    finds func itself, else None."""
    key = (func.__module__, func.__qualname__)
    named = _named_funcs.get(key)
    if named is not None and named.func is func and named.holds():
        return named
    ref = _by_name(func)
    if ref is None:
        return None
    named = _named_funcs[key] = _Named(func, *ref)
    return named


def _pack_call(func, args, kwargs, dst=None):
    """The call's payload (above). dst is not used: the autograd context
    travels in the message (_send_call); shmrpc.data passes it."""
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    if _default_pickler is not _pickler_ok:
        _check_pickler()
    named = _named(func) if type(func) in _BY_NAME_TYPES else None
    if named is None:
        if _is_script_function(func):
            func = _ScriptFunction(func.qualified_name)
        return _dumps((func, tuple(args or ()), dict(kwargs or {})))
    if not args and not kwargs:
        return named.head, [], []
    return _pack_args(named, args, kwargs)


def _pack_args(named, args, kwargs):
    """The payload of a call of named (a _Named) with args (a sequence)
    and kwargs (a dict or None), not both empty: _pack_call's, and the C
    path's for arguments it does not pack itself (python/_calls.c)."""
    # A proxy's call (name, rref, scalars...): its method's name written
    # out, its RRef the message's only one, no pickler (docs/PROTOCOL.md);
    # asked before the tensors, since its first argument is a name.
    if named.func is _proxy_func and not kwargs and _proxied(args := tuple(args)):
        rest = args[2:]
        return (named.head + _PROXY + args[0].encode() + b"\0" +
                (pickle.dumps(rest, pickle.HIGHEST_PROTOCOL) if rest else b""), [args[1]._r], [])
    if not kwargs and type(args) is tuple:
        handles = _torch_handles(args)
        if handles is not None:
            return named.tensors_head, [], handles
    args = tuple(args or ())
    if not kwargs and _scalars(args):  # as _dumps' scalars: C's pickler alone
        data, rrefs, tensors = _inline(pickle.dumps((args, {}), pickle.HIGHEST_PROTOCOL), [], [])
    else:
        data, rrefs, tensors = _dumps((args, dict(kwargs or {})))
    return named.head + data, rrefs, tensors


def _is_script_function(func):
    """Whether func is a TorchScript function (torch.jit.script of a
    function), known without importing torch."""
    t = type(func)
    return t.__name__ == "ScriptFunction" and t.__module__ == "torch.jit"


class _ScriptFunction:
    """A TorchScript function called by RPC, which pickle refuses: sent by
    its qualified name, as torch sends one (nowhere else, as in torch: an
    argument that is one fails to pickle), found on the callee by that
    name (_script_function)."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return _script_function, (self.name,)


def _script_function(name):
    """The TorchScript function named name (its qualified_name) in this
    process, where torch's RPC finds one: the compilation unit that
    torch.jit.script puts every scripted function in. As with torch, the
    callee must have scripted it too (imported the module that does).
    What it raises reaches the caller as a RuntimeError with the
    interpreter's message, as torch's script calls fail (torch.jit.Error
    is no RuntimeError)."""
    import torch
    func = torch.jit._state._python_cu.find_function(name)
    if func is None:
        raise RuntimeError(f'no TorchScript function named "{name}" in this process: '
                           "script it here too (import the module that calls "
                           "torch.jit.script on it) before it is called by RPC")
    jit_error = torch.jit.Error

    def run(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except jit_error as e:
            raise RuntimeError(str(e)) from None
    run.__qualname__ = run.__name__ = name
    return run


def _unpack_call(payload, rrefs, tensors):
    """(func, args, kwargs) from a call's payload."""
    # A call without arguments, the payload its head alone (ending in its
    # name's NUL, which no pickle or other payload of a call by name
    # but a proxy's ends in): one lookup of the short payload, without
    # the head's search (two index calls and a slice), 1.3 -> 0.8 us. A
    # call of tensors alone, its head and _TENSORS (the one payload of a
    # call by name that ends in it: a pickle ends in STOP, _OUT_OF_LINE in
    # text): one lookup of the head.
    last = payload[-1:]
    if last == b"\0":
        named = _named_heads.get(payload)
        if named is not None and named.holds():
            return named.func, (), {}
    elif last == _TENSORS:
        named = _named_heads.get(payload[:-1])
        if named is not None and named.holds():
            return named.func, _from_handles(tensors), {}
    if payload[:1] != _BY_NAME:
        return _loads((payload, rrefs, tensors), "call")
    end = payload.index(b"\0", payload.index(b"\0") + 1) + 1
    head = payload if end == len(payload) else payload[:end]
    named = _named_heads.get(head)
    if named is not None and named.holds():
        func = named.func
    else:
        module, name = (part.decode() for part in payload[1:end - 1].split(b"\0"))
        func = _resolve(module, name)
        if _by_name(func) == (module, name):
            _named_heads[head] = _Named(func, module, name)
    if end == len(payload):
        return func, (), {}
    if payload[end:] == _TENSORS:
        return func, _from_handles(tensors), {}
    if payload[end:end + 1] == _PROXY:
        name_end = payload.index(b"\0", end)
        rest = payload[name_end + 1:]
        return func, (payload[end + 1:name_end].decode(), _rref_of(rrefs[0])) + (
            pickle.loads(rest) if rest else ()), {}
    args, kwargs = _loads((payload[end:], rrefs, tensors), "call")
    return func, args, kwargs


# A proxy's call (rref.rpc_sync().method(args)) is _proxy_func(name, rref,
# *args), set by the RRef's module (set_proxy_func). When args are scalars
# (_scalars) and there are no keywords, the by-name reference is followed
# by this mark, the method's name and a NUL, then the pickle of args, or
# nothing; the RRef is the message's one RRef.
_PROXY = b"\x04"
_proxy_func = None


def set_proxy_func(func):
    global _proxy_func
    _proxy_func = func


def _proxied(args):
    """Whether a proxy's call arguments take the _PROXY form."""
    return (len(args) >= 2 and type(args[0]) is str and "\0" not in args[0]
            and type(args[1]) is _rref_type and _scalars(args[2:]))


def _func_name(func):
    """func's name in profiling keys, as torch's: a TorchScript function's
    is its qualified_name (it has no __qualname__)."""
    return (getattr(func, "__qualname__", None) or getattr(func, "qualified_name", None)
            or getattr(func, "__name__", None) or repr(func))


def _torch_internal_pickler():
    internal = sys.modules.get("torch.distributed.rpc.internal")
    return getattr(internal, "_internal_rpc_pickler", None)


# torch's default: its internal RPC pickler, once torch is loaded
# (install_as_torch sets it). shmrpc pickles calls its own way (shared
# tensors, RRefs by id): a call made while another pickler is in effect
# is refused (_check_pickler).
_default_pickler = _torch_internal_pickler()


@contextlib.contextmanager
def _use_rpc_pickler(rpc_pickler):
    """torch's: rpc_pickler is the default pickler inside the block."""
    global _default_pickler
    before, _default_pickler = _default_pickler, rpc_pickler
    _core._state_changed()
    try:
        yield
    finally:
        _default_pickler = before
        _core._state_changed()


# The pickler _check_pickler last let through (torch's, a fixed object, or
# None): a call checks it again only when _default_pickler changed.
_pickler_ok = None


def _check_pickler():
    """Raises unless calls may be pickled shmrpc's way (no pickler of the
    program's own in effect)."""
    global _pickler_ok
    if _default_pickler is not None and _default_pickler is not _torch_internal_pickler():
        raise _not_supported(f"an RPC pickler of the program's own "
                             f"({type(_default_pickler).__name__}, set by _use_rpc_pickler)")
    _pickler_ok = _default_pickler
    _core._state_changed()


# ---- _all_gather, _barrier, _wait_all_workers ----
