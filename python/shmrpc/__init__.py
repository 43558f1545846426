"""shmrpc: torch.distributed.rpc's API over shared memory, for one machine.

Change ``import torch.distributed.rpc as rpc`` to ``import shmrpc as rpc``
and start the program with ``shmrun -n N -- python3 prog.py``.

Functions travel by reference (module and qualified name) with pickle, as
torch's default RPC pickler does: define them on both sides. What torch
offers that shmrpc does not do yet raises NotImplementedError saying so.
"""
import io
import os
import pickle
import re
import sys
import threading
import traceback
import types
import weakref

from . import _shmrpc
from . import backend_registry, constants  # noqa: F401  (torch's submodules' names)
from . import profiler  # noqa: F401  (shmrpc.profiler.profile)
from . import server_profiler
from .options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions

__all__ = [
    "empty", "init_rpc", "shutdown", "get_worker_info", "WorkerInfo", "rpc_sync",
    "rpc_async", "remote", "RRef", "Future", "RemoteException", "wait_all", "collect_all",
    "functions", "autograd", "BackendType", "RpcBackendOptions", "TensorPipeRpcBackendOptions",
    "get_rpc_timeout", "enable_gil_profiling", "is_available", "install_as_torch",
]

UNSET_RPC_TIMEOUT = constants.UNSET_RPC_TIMEOUT  # torch's sentinel: the default timeout
_UNSET_RPC_TIMEOUT = UNSET_RPC_TIMEOUT
_DEFAULT_RPC_TIMEOUT_SEC = constants.DEFAULT_RPC_TIMEOUT_SEC
_DEFAULT_INIT_METHOD = constants.DEFAULT_INIT_METHOD
_DEFAULT_NUM_WORKER_THREADS = constants.DEFAULT_NUM_WORKER_THREADS
# The default timeout in seconds (0: none): the backend options', or one
# _set_rpc_timeout set; _timeout_override says the latter (the calls then
# name it, instead of the agent's default that init set).
_rpc_timeout = _DEFAULT_RPC_TIMEOUT_SEC
_timeout_override = False

_state = threading.local()
_initialized = False
_joined = None  # shmrpc._rendezvous.Joined: this process joined without shmrun
_shut_down = False  # shutdown ran once in this process
# A worker shmrun started: (rank, world size, job inode, inits so far). Its
# first init_rpc joins shmrun's job; each later one (after shutdown) meets
# the job's other workers at a rendezvous named after that job and count.
_shmrun_slot = None
# The job shmrun gave this process when it started (its segment's inode),
# if any: shmrpc.data's loader gives the trainer jobs of its own later.
_START_JOB_INO = os.environ.get("SHMRPC_JOB_INO")
_init_pid = None  # the process that joined (a child forked from it has not)


class WorkerInfo:
    """A worker's name and rank (torch's WorkerInfo: .name, .id)."""

    __slots__ = ("name", "id")

    def __init__(self, name, id):
        # torch's check of a WorkerInfo made by hand (the job's own names
        # are checked when workers join).
        if not (0 < len(name) < 128) or not all(c.isascii() and (c.isalnum() or c in "-_:")
                                                for c in name):
            raise RuntimeError("Worker name must match ^[A-Za-z0-9-_:]*$, and must be "
                               f"non-empty and shorter than 128 chars, but got {name}")
        self.name = name
        self.id = id

    @classmethod
    def _of(cls, name, id):
        """A job's worker, as the job names it (no check)."""
        info = cls.__new__(cls)
        info.name, info.id = name, id
        return info

    def __eq__(self, other):
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self):
        return hash((self.name, self.id))

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, name={self.name})"


class RemoteException:
    """An exception raised by a remote function, as it travels back."""

    def __init__(self, msg, exception_type):
        self.msg = msg
        self.exception_type = exception_type


class _RpcTimeout(TimeoutError, RuntimeError):
    """A call or an RRef that ran out of time: torch raises RuntimeError for
    it, the C half TimeoutError; this is both, so either except catches it."""


def _c_wait(wait, *args):
    """The C half's wait(*args), its timeout raised as _RpcTimeout."""
    try:
        return wait(*args)
    except TimeoutError as e:
        raise _RpcTimeout(*e.args) from None


def _not_supported(what):
    return NotImplementedError(f"{what} is not supported yet by shmrpc")


def _timeout_ms(timeout):
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        if not _timeout_override:
            return _shmrpc.TIMEOUT_DEFAULT
        timeout = _rpc_timeout
    if timeout == 0:
        return 0  # no timeout, as torch's 0
    if timeout < 0:
        raise ValueError(f"timeout {timeout}: give seconds above 0, 0 for none, or leave it unset")
    return max(1, int(timeout * 1000))


def init_rpc(name, backend=None, rank=None, world_size=None, rpc_backend_options=None):
    """Joins the job. Under shmrun, rank and world size come from it.
    Elsewhere (torch.multiprocessing.spawn, mp.Process, torchrun's
    convention) the processes meet at rpc_backend_options.init_method
    (env://, the default: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE;
    tcp://HOST:PORT; file://PATH), on this machine (shmrpc._rendezvous)."""
    global _initialized, _joined, _rpc_timeout, _timeout_override, _init_pid, _shmrun_slot
    api._check_init_args(backend, rpc_backend_options)
    _rpc_timeout, _timeout_override = _DEFAULT_RPC_TIMEOUT_SEC, False
    joined = None
    if _initialized and _init_pid != os.getpid():
        # The C init refuses it too, in its words for C programs.
        raise RuntimeError("init_rpc: this process was forked from a worker whose RPC agent "
                           "was running, and cannot start one: start it with "
                           "multiprocessing's spawn or forkserver method (as "
                           "torch.multiprocessing.spawn does), or fork before init_rpc")
    if _shmrun_slot is not None and not _initialized and not _started_by_shmrun():
        from . import _rendezvous
        joined = _join_again(name, rank, world_size, rpc_backend_options)
    elif "SHMRPC_RANK" in os.environ and not _started_by_shmrun():
        from . import _rendezvous
        _rendezvous.clear_env()  # a worker's, inherited: not this process's
    if "SHMRPC_RANK" not in os.environ:
        from . import _rendezvous
        if _initialized:
            raise RuntimeError("RPC is already initialized")
        joined = _rendezvous.join(name, rank, world_size, rpc_backend_options)
    try:
        env_rank = int(os.environ.get("SHMRPC_RANK", "-1"))
        env_world = int(os.environ.get("SHMRPC_WORLD_SIZE", "-1"))
        if env_rank < 0:
            raise RuntimeError("init_rpc: this process is not a shmrpc worker: start it with "
                               "shmrun -n N -- python3 prog.py")
        if rank is not None and rank != env_rank:
            raise ValueError(f"init_rpc: rank {rank} given, but shmrun started this worker as rank {env_rank}")
        if world_size is not None and world_size != env_world:
            raise ValueError(f"init_rpc: world_size {world_size} given, but the job has {env_world} workers")
        threads, timeout_ms, maps = 0, 0, []
        if rpc_backend_options is not None:
            threads = int(getattr(rpc_backend_options, "num_worker_threads", 0) or 0)
            t = getattr(rpc_backend_options, "rpc_timeout", None)
            if t is not None:
                timeout_ms = -1 if t == 0 else int(t * 1000)
                _rpc_timeout = float(t)
            maps = _device_map_entries(getattr(rpc_backend_options, "device_maps", None) or {})
            _warn_ignored(rpc_backend_options, joined=joined is not None)
        _shmrpc.set_handler(_run_function)
        _shmrpc.set_live_release(_release_owned)
        # Initialized before the agent serves: a peer's call can come before
        # init returns here, and the function it runs may call out.
        was, _initialized, _init_pid = _initialized, True, os.getpid()
        try:
            _shmrpc.init(name, threads, timeout_ms, maps)
        except BaseException:
            _initialized = was
            raise
    except BaseException:
        if joined is not None:
            joined.leave()
            joined.close_unused()
        raise
    finally:
        if joined is not None:
            _rendezvous.clear_env()
    _joined = joined
    if joined is None and _START_JOB_INO and os.environ.get("SHMRPC_JOB_INO") == _START_JOB_INO:
        _shmrun_slot = (env_rank, env_world, _START_JOB_INO, 1)
    elif joined is not None and _shmrun_slot is not None:
        _shmrun_slot = _shmrun_slot[:3] + (_shmrun_slot[3] + 1,)
    api._init_rpc_states()


def _join_again(name, rank, world_size, opts):
    """init_rpc after shutdown in a worker shmrun started (its agent closed
    what shmrun gave): the job's workers meet again at a rendezvous named
    after shmrun's job and how many times they joined, in a new job of
    their own (shmrpc._rendezvous), with shmrun's rank and world size."""
    from . import _rendezvous
    slot_rank, slot_world, job, inits = _shmrun_slot
    if rank is not None and rank != slot_rank:
        raise ValueError(f"init_rpc: rank {rank} given, but shmrun started this worker as rank "
                         f"{slot_rank}")
    if world_size is not None and world_size != slot_world:
        raise ValueError(f"init_rpc: world_size {world_size} given, but the job has "
                         f"{slot_world} workers")
    _rendezvous.clear_env()
    return _rendezvous.join(name, slot_rank, slot_world, opts,
                            key=f"shmrun:{job}:{inits}")


def _started_by_shmrun():
    """Whether shmrun's variables in the environment are this process's:
    a process a worker starts (multiprocessing, a shell) inherits them, but
    is not that worker. Started with its fds closed (mp's spawn), it holds
    another file at SHMRPC_JOB_FD, or none; forked from a worker that had
    joined, init_rpc refuses it; forked before, the C init refuses the
    second of the two to join (its slot is taken)."""
    try:
        st = os.fstat(int(os.environ["SHMRPC_JOB_FD"]))
    except (KeyError, ValueError, OSError):
        return False
    return str(st.st_ino) == os.environ.get("SHMRPC_JOB_INO")


def is_available():
    return True


def get_rpc_timeout():
    """The default timeout of calls, in seconds (0: none), as torch's."""
    return _rpc_timeout


def _set_rpc_timeout(rpc_timeout):
    """Sets the default timeout of calls made from now on, in seconds (0:
    none), as torch's private helper (its tests use it)."""
    global _rpc_timeout, _timeout_override
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout {rpc_timeout}: give seconds, 0 for none")
    _rpc_timeout, _timeout_override = float(rpc_timeout), True


def _device_index(d):
    """The index of a CUDA device of a device map, given as torch takes
    one: an int, a string "cuda:N" or a torch.device."""
    if isinstance(d, int) and not isinstance(d, bool):
        return d
    if isinstance(d, str):
        kind, _, index = d.partition(":")
        index = int(index) if index.isdigit() else None
    else:
        kind, index = getattr(d, "type", None), getattr(d, "index", None)
        if kind is None:
            raise TypeError(f"a device map takes ints, 'cuda:N' strings and torch.device "
                            f"objects, not {type(d).__name__}")
    if kind != "cuda":
        raise ValueError(f"`set_devices` expect a list of CUDA devices, but got device type {kind}.")
    if index is None:
        raise ValueError(f"a device map needs device indices: {d!r} names none (give cuda:N)")
    return index


def _device_map_entries(device_maps):
    """torch's device_maps (a dict: worker name -> {device: device}, as
    TensorPipeRpcBackendOptions and its set_device_map keep them) as
    (name, from, to) triples for the library, which checks them with every
    worker's at init (worker/devmap.h)."""
    return [(str(to), _device_index(k), _device_index(v))
            for to, m in device_maps.items() for k, v in m.items()]


def _warn_ignored(opts, joined=False):
    """One warning naming the backend options set to something shmrpc does
    not use: under shmrun the workers meet through shmrun's shared memory,
    not a rendezvous (a process that joins without shmrun uses
    init_method), and the rings are the only transport. torch's `devices`
    (the devices the agent may use) is not needed either: every device of
    the machine is reachable through CUDA IPC."""
    ignored = [name for name in ("init_method", "devices", "_transports", "_channels")
               if getattr(opts, name, None) not in (None, "env://", [], ())
               and not (joined and name == "init_method")]
    if ignored:
        import warnings
        warnings.warn("shmrpc ignores rpc_backend_options " + ", ".join(ignored) + ": the "
                      "workers of a shmrun job meet and talk through shared memory",
                      stacklevel=3)


def shutdown(graceful=True, timeout=0):
    """Graceful: waits until every worker is done (api._wait_all_workers,
    then the agent's barrier), then all leave together."""
    global _initialized, _joined, _shut_down
    try:
        try:
            leaks = api._shutdown_first(graceful, timeout)
        except BaseException:
            _shmrpc.shutdown(False, 0)  # torch's: the local shutdown, then the error
            raise
        _shmrpc.shutdown(bool(graceful), int(timeout * 1000) if timeout else 0)
        if leaks:
            # torch's RRefContext::checkRRefLeaks, raised after the local
            # shutdown as torch's _finalize_shutdown does.
            raise RuntimeError(leaks)
    finally:
        # The agent is gone either way: a process that joined leaves its
        # keeper's job (the keeper releases what it still held there).
        joined, _joined = _joined, None
        if joined is not None:
            joined.leave()
        _initialized = False
        _shut_down = True
        api._job_left()


def _worker(who):
    """(name, rank) of a worker name or rank (None: this worker); an unknown
    name in torch's words too."""
    if not _initialized:
        raise _not_initialized()
    try:
        return _shmrpc.worker_info(who)
    except RuntimeError as e:
        if isinstance(who, str):
            raise RuntimeError(f"could not find destination {who}: {e}") from None
        raise


def get_worker_info(worker_name=None):
    return WorkerInfo._of(*_worker(worker_name))


def _not_initialized():
    return RuntimeError("RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.")


def _rank_of(to):
    if isinstance(to, WorkerInfo):
        return to.id
    if isinstance(to, int) and not isinstance(to, bool):
        return to
    if isinstance(to, str):
        return _worker(to)[1]
    if isinstance(to, float):
        raise ValueError(f"to {to}: a rank is a whole number")
    raise TypeError(f"to must be a worker name, a rank or a WorkerInfo, not {type(to).__name__}")


_POOL_TORCH_DTYPES = {f"torch.{t}" for t in ("int8", "int16", "int32", "int64", "uint8",
                                               "float16", "float32", "float64")}


_KDLCUDA = 2  # DLPack's device type of CUDA memory

# How the objects of a type are sent, asked once per type (_type_kind).
_NOT_ARRAY, _NUMPY, _TORCH, _DLPACK = range(4)
_TYPE_KINDS = {}
# Per torch dtype: whether a CPU tensor of it goes through the pool.
_TORCH_DTYPE_OK = {}


def _type_kind(t):
    """numpy and torch are recognised by their type's module and name
    (importing neither); another type by whether it speaks DLPack (CuPy's
    arrays...)."""
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        return _NUMPY
    if t.__module__.startswith("torch") and getattr(t, "__name__", "") in ("Tensor", "Parameter"):
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
        return "np" if obj.dtype.kind in "iuf" and obj.size else None
    if how == _TORCH:
        if obj.is_cpu:
            ok = _TORCH_DTYPE_OK.get(obj.dtype)
            if ok is None:
                ok = _TORCH_DTYPE_OK[obj.dtype] = str(obj.dtype) in _POOL_TORCH_DTYPES
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
        return _shmrpc.from_dlpack(np.ascontiguousarray(obj))
    if kind == "torch":
        return _shmrpc.from_dlpack(obj.detach().contiguous())
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
            obj = obj.detach().contiguous()
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


def _whole(obj, received):
    """True when torch tensor obj is all of received's bytes, as received's dtype."""
    return (received is not None and obj.dtype == received.dtype
            and obj.numel() == received.numel() and obj.is_contiguous())


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
    import torch
    return torch.from_dlpack(t)  # holds t's reference through the capsule


# Objects of these exact types are never RRefs or tensors.
_PLAIN_TYPES = frozenset((int, float, bool, str, bytes, type(None), tuple, list, dict))


class _Pickler(pickle.Pickler):
    """torch's default RPC pickler: functions by reference. RRefs and
    tensors go beside the pickle (which names them by index): the agent
    forks an RRef (the receiver gets a reference of its own) and hands a
    tensor over through the pool (the receiver sees the same bytes), or a
    small one not in the pool inside the message (a copy of its own). A
    tensor that requires grad travels detached, with its autograd metadata
    (shmrpc.autograd)."""

    def __init__(self, buf):
        super().__init__(buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.rrefs = []
        self.tensors = []
        self.grad_tensors = None  # an autograd._Outgoing, at the first tensor that requires grad

    def persistent_id(self, obj):
        if type(obj) in _PLAIN_TYPES:  # the common case, e.g. a list of indices, at once
            return None
        if isinstance(obj, RRef):
            self.rrefs.append(obj._r)
            return ("rref", len(self.rrefs) - 1)
        kind = _tensor_kind(obj)
        if kind:
            # Any DLPack producer may be sent: it may have no .shape.
            shape = getattr(obj, "shape", None)
            shape = None if shape is None else tuple(shape)
            data = obj
            if kind == "torch" and not obj.is_contiguous():
                # As torch's: a view's whole storage and its strides (a
                # .contiguous() or .clone() sends only its elements).
                shape = {"size": shape, "stride": obj.stride(), "offset": obj.storage_offset()}
                data = obj.detach().new_empty(0).set_(obj.storage())
            self.tensors.append(_to_pool(kind, data))
            if kind != "np" and getattr(obj, "requires_grad", False):
                if self.grad_tensors is None:
                    self.grad_tensors = autograd._Outgoing()
                return (kind, len(self.tensors) - 1, shape, self.grad_tensors.add(obj))
            return (kind, len(self.tensors) - 1, shape)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, buf, rrefs, tensors, grad_mode):
        super().__init__(buf)
        self.rrefs = rrefs
        self.tensors = tensors
        self.grad_mode = grad_mode  # how a tensor sent requiring grad arrives (autograd._Incoming)
        self.grad_tensors = None  # an autograd._Incoming, at the first tensor that required grad

    def persistent_load(self, pid):
        if pid[0] == "rref":
            return RRef(_c=self.rrefs[pid[1]])
        handle = self.tensors[pid[1]]
        t = _from_pool(pid[0], handle)
        if type(t) is _shmrpc.Tensor:  # a handle keeps its shape
            if len(pid) > 3:
                raise _not_supported("receiving a CUDA tensor that requires grad where torch "
                                     "has no CUDA")
            return t
        if isinstance(pid[2], dict):  # a view, sent with its storage (_Pickler)
            t = t.as_strided(pid[2]["size"], pid[2]["stride"], pid[2]["offset"])
        elif pid[2] is not None:
            t = t.reshape(pid[2])
        if len(pid) > 3:
            if self.grad_tensors is None:
                self.grad_tensors = autograd._Incoming(self.grad_mode)
            t = self.grad_tensors.add(t, pid[3])
        if pid[0] == "cuda":
            _remember_received(t, handle)  # the tensor as the program gets it
        return t


# A pickle larger than this travels in the pool (copied in once and out
# once) rather than in the frame, whose payload is bounded by the ring.
_INLINE_MAX = 16 * 1024
_OUT_OF_LINE = b"\x00shmrpc: the pickle is the last tensor"


def _dumps(obj):
    """(pickle, [C RRef...], [C Tensor...]) for the agent; None is b""."""
    if obj is None:  # most results: no pickle to make, nor to read
        return b"", [], []
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    if p.grad_tensors is not None:
        p.grad_tensors.sent()
    data = buf.getvalue()
    if len(data) > _INLINE_MAX:
        p.tensors.append(_shmrpc.from_bytes(data))
        data = _OUT_OF_LINE
    return data, p.rrefs, p.tensors


def _loads(msg, grad_mode="result"):
    data, rrefs, tensors = msg
    if not data:
        return None
    if not rrefs and not tensors:  # nothing beside the pickle: C's unpickler alone
        return pickle.loads(data)
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


_UDF_HINT = ("Default RPC pickler does not serialize function code. Ensure that UDFs are "
             "defined on both caller and callee modules.")


def _run_function(caller, msg_type, context_id, message_id, retain_graph, payload, rrefs, tensors,
                  ops, rref_id, profile):
    """Serves a request of this package on an executor thread (the C half
    gives its type and autograd metadata, worker/python.h). A pickled
    (func, args, kwargs) runs inside the autograd context its
    FORWARD_AUTOGRAD_REQ names (wrapping a call or a remote call: the C half
    stores a remote call's result in its RRef), its result pickled inside
    it too, and for a call profiled for torch's profiler (ops, a list, not
    None; profile, what its caller's profiler asks) under that profiler
    (profiler.torch_ops); a remote call's result
    (rref_id, not 0) is kept here, live, and its RRef stores _LIVE; a
    PYTHON_RREF_FETCH_CALL pickles such a value; distributed autograd's
    other requests go to shmrpc.autograd.
    Returns the pickled result or RemoteException, and for a
    FORWARD_AUTOGRAD_REQ the reply's autograd message id."""
    try:
        if msg_type == _shmrpc.PYTHON_RREF_FETCH_CALL:
            return _serve_fetch(RRef(_c=rrefs[0]), caller, context_id)
        if msg_type not in (_shmrpc.PYTHON_CALL, _shmrpc.PYTHON_REMOTE_CALL,
                            _shmrpc.FORWARD_AUTOGRAD_REQ):
            return _dumps(autograd._serve(msg_type, caller, context_id, retain_graph,
                                          (payload, rrefs, tensors)))
        try:
            func, args, kwargs = _unpack_call(payload, rrefs, tensors)
        except (AttributeError, ModuleNotFoundError, ImportError) as e:
            raise RuntimeError(f"{e}. {_UDF_HINT}") from None
        if msg_type != _shmrpc.FORWARD_AUTOGRAD_REQ:
            context_id = None
        reply = _serve_call(func, args, kwargs, caller, context_id, ops, rref_id, profile)
        if msg_type == _shmrpc.FORWARD_AUTOGRAD_REQ:
            return reply + (autograd._message_id(), reply[0] == _LIVE)
        return reply + (0, True) if reply[0] == _LIVE else reply
    except BaseException as e:  # every error travels back
        # From the agent: a call can come before init_rpc has returned here.
        me = WorkerInfo._of(*_shmrpc.worker_info(None))
        text = (f"On {me!r}:\n{e!r}\n"
                + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        print(text, file=sys.stderr, flush=True)  # the callee logs it too, as torch's
        try:
            return _dumps(RemoteException(text, type(e)))
        except Exception:  # noqa: BLE001  a type pickle cannot name (a function's own class)
            return _dumps(RemoteException(text, RuntimeError))  # its words still go


# async_execution functions whose Future this worker is waiting for
# (torch's agent.server_active_async_calls), under _async_lock.
_async_serving = 0
_async_lock = threading.Lock()


def _serve_call(func, args, kwargs, caller, context_id, ops, rref_id=0, profile=0):
    """The pickled result of a call served here: run inside the caller's
    autograd context, under torch's profiler when ops is a list. A remote
    call's (rref_id) is kept live instead, under its RRef's id."""
    if context_id is None and ops is None and autograd._current() is None and \
            not server_profiler._active:
        # Most calls: no context to enter or leave, no profiler; the
        # context managers would cost more than the rest of the handler.
        return _reply(_call(func, args, kwargs), rref_id)
    with autograd._running_in(context_id, caller):
        with profiler.torch_ops(ops, profile), server_profiler.recorded():
            result = _call(func, args, kwargs)
        return _reply(result, rref_id)


def _reply(result, rref_id):
    """What the C half sends or stores for a result: its pickle, also for a
    remote call's value that no code can change (everyone reads it from the
    RRef table, and it cannot go stale); any other remote call's value is
    kept here, live, and the RRef stores the live mark."""
    if not rref_id or _immutable(result):
        return _dumps(result)
    _owned[rref_id] = result
    return _LIVE, [], []


_IMMUTABLE_TYPES = frozenset((type(None), bool, int, float, complex, str, bytes))


def _immutable(value):
    """Whether no code can change value: None, numbers, strings, bytes, and
    tuples and frozensets of them (exact types: a subclass may add state)."""
    t = type(value)
    if t in _IMMUTABLE_TYPES:
        return True
    return (t is tuple or t is frozenset) and all(_immutable(v) for v in value)


def _serve_fetch(rref, caller, context_id):
    """PYTHON_RREF_FETCH_CALL: the pickle of our RRef's live value as it is
    now, inside the caller's autograd context (-1: none), so that tensors
    that require grad in it are recorded as sends, as torch's fetch does."""
    if not rref.is_owner():
        raise RuntimeError(f"a fetch came in for {rref}, which this worker does not own")
    value = rref.local_value()
    if context_id < 0:
        return _dumps(value)
    with autograd._running_in(context_id, caller):
        return _dumps(value)


def _is_async_execution(func):
    """Decorated with shmrpc's or torch's functions.async_execution."""
    return (getattr(func, "_shmrpc_async_execution", False)
            or hasattr(func, "_wrapped_async_rpc_function"))


def _call(func, args, kwargs):
    """func's result; an async_execution function's Future waited for. A
    proxy's call runs the live value's method itself (torch's proxies honour
    an async_execution method too)."""
    global _async_serving
    if func is _call_method:
        func, args = getattr(args[1].local_value(), args[0]), args[2:]
    result = func(*args, **(kwargs or {}))
    if not _is_async_execution(func):
        return result
    torch_future = sys.modules.get("torch.futures")
    if not isinstance(result, Future) and not (torch_future is not None
                                               and isinstance(result, torch_future.Future)):
        raise RuntimeError(
            "Functions decorated with @rpc.async_function must return a "
            "torch.futures.Future object, but got "
            f"{type(result).__module__}.{type(result).__qualname__}")
    with _async_lock:
        _async_serving += 1
    try:
        return result.wait()
    finally:
        with _async_lock:
            _async_serving -= 1


def _result(msg, grad_mode="result"):
    """Unpickles a result; a RemoteException is raised as its own type."""
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


class Future:
    """torch.futures.Future's interface: the result of rpc_async, or one
    made by user code (set_result / set_exception), e.g. for
    @functions.async_execution."""

    def __new__(cls, *args, **kwargs):
        # Once torch.futures is loaded, a Future is also a
        # torch.futures.Future (_TorchFuture): torch's C++ code that takes
        # one (the profiler's end callbacks, torch.jit) then takes ours.
        if cls is Future and _TorchFuture is not None:
            cls = _TorchFuture
        return super().__new__(cls)

    def __init__(self, _c=None):
        self._cond = threading.Condition()
        self._have = False
        self._value = None
        self._error = None
        self._callbacks = []
        self._c = _c  # the call in flight, if any
        self._settling = False
        self._hooked = False  # the call completes us by itself (a callback is waiting)

    def _from_call(self):
        """The call completed: its result becomes ours (once, from the
        completion callback or from wait(), whichever comes first)."""
        with self._cond:
            if self._have or self._settling:
                return
            self._settling = True
        try:
            value = _result(_c_wait(self._c.wait))
        except BaseException as e:
            self.set_exception(e)
        else:
            self.set_result(value)

    def _finish(self, value, error):
        with self._cond:
            if self._have:
                raise RuntimeError("Future can only be marked completed once")
            self._value, self._error, self._have = value, error, True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        self._settle_torch(value, error)
        for cb in callbacks:
            self._run(cb)

    def _settle_torch(self, value, error):
        """Completes the torch.futures.Future this one also is (_TorchFuture)."""

    def _run(self, cb):
        try:
            cb(self)
        except Exception:
            traceback.print_exc()  # as torch: a failing callback does not fail the Future

    def set_result(self, result):
        self._finish(result, None)

    def set_exception(self, result):
        self._finish(None, result)

    def wait(self):
        if self._c is not None and not self._have:
            try:
                # The C wait releases the GIL, and on an executor thread it
                # runs what the call needs and is counted out of the pool
                # meanwhile (worker/executor.h): a nested call cannot starve
                # the pool waiting for its own completion callback.
                self._c.wait()
            except Exception:
                pass  # _from_call raises it below
            self._from_call()
        with self._cond:
            if not self._have:
                # On an executor thread, what completes us may be queued
                # behind us: the pool runs it on another thread while this
                # one is counted out (worker/executor.h).
                _shmrpc.blocking(True)
                try:
                    while not self._have:
                        self._cond.wait()
                finally:
                    _shmrpc.blocking(False)
        if self._error is not None:
            raise self._error
        return self._value

    def value(self):
        if not self._have:
            raise RuntimeError("Future.value() before the Future completed")
        return self.wait()

    def done(self):
        return self._have or (self._c is not None and self._c.done())

    def add_done_callback(self, callback):
        with self._cond:
            if not self._have:
                self._callbacks.append(callback)
                # Only now does the call need to complete us by itself:
                # a plain wait() costs no executor job and no GIL hand-off.
                hook, self._hooked = self._c is not None and not self._hooked, True
                if not hook:
                    return
            else:
                hook = False
        if hook:
            self._c.add_done_callback(self._from_call)
        else:
            self._run(callback)

    def then(self, callback):
        """A new Future holding callback(self)'s result, or its error as
        torch's RuntimeError ("Got the following error when running the
        callback: ...")."""
        if not callable(callback):
            raise TypeError("then(): incompatible function arguments. The callback must be "
                            f"callable, not {type(callback).__name__}")
        nxt = Future()

        def chain(fut):
            try:
                nxt.set_result(callback(fut))
            except BaseException as e:
                nxt.set_exception(RuntimeError("Got the following error when running the "
                                               f"callback: {type(e).__name__}: {e}"))
        self.add_done_callback(chain)
        return nxt


_TorchFuture = None  # Future's torch.futures.Future form, once torch.futures is loaded


def _adopt_torch_futures(torch_futures):
    """From now on a new Future is also a torch.futures.Future: a subclass of
    both, completing its torch side as torch's set_result/set_exception do
    (about 2 µs a Future here: made only once torch.futures is loaded, so a
    program that never loads torch pays nothing)."""
    global _TorchFuture
    if _TorchFuture is not None:
        return
    torch_c_future = torch_futures.Future.__mro__[1]  # torch._C.Future

    def raise_error(error):
        raise error

    class TorchFuture(Future, torch_futures.Future):
        __doc__ = Future.__doc__

        def __init__(self, _c=None):
            Future.__init__(self, _c)
            torch_c_future.__init__(self, [])
            if _c is not None:
                # torch's C++ code waits on the torch side without asking
                # us: the call must complete it by itself.
                self._hooked = True
                _c.add_done_callback(self._from_call)

        def _settle_torch(self, value, error):
            if error is not None:
                torch_c_future._set_unwrap_func(self, raise_error)
                value = error
            torch_c_future.set_result(self, value)

    TorchFuture.__name__ = TorchFuture.__qualname__ = "Future"
    TorchFuture.__module__ = __name__
    _TorchFuture = TorchFuture


def wait_all(futures):
    """The values of all futures, once all completed; the first error to
    occur is raised as soon as it does, as torch's."""
    futures = list(futures)
    if all(f.done() for f in futures):
        return [f.wait() for f in futures]
    first = Future()  # completes with the first error, or once all are done
    left = [len(futures)]
    lock = threading.Lock()

    def one(f):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if first.done():
            return
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001 (the future's error, for the waiter)
            with lock:
                if not first.done():
                    first.set_exception(e)
            return
        if last:
            with lock:
                if not first.done():
                    first.set_result(None)
    for f in futures:
        f.add_done_callback(one)
    first.wait()
    return [f.wait() for f in futures]


def collect_all(futures):
    """A Future completed with the list of futures once all are done."""
    futures = list(futures)
    out = Future()
    left = [len(futures)]
    lock = threading.Lock()
    if not futures:
        out.set_result([])

    def one(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result(futures)
    for f in futures:
        f.add_done_callback(one)
    return out


class functions:
    """shmrpc.functions.async_execution, as torch.distributed.rpc.functions."""

    @staticmethod
    def async_execution(fn):
        """The decorated function returns a Future; the reply goes when it
        completes. (shmrpc waits for it on the executor thread that ran the
        function: a chain of such functions needs as many threads.)"""
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        wrapper._shmrpc_async_execution = True
        return wrapper


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


def _by_name(func):
    """func's reference (module, qualified name) if pickle would send it
    by that name and the name finds func itself, else None."""
    if type(func) is not types.FunctionType:
        return None
    module, name = func.__module__, func.__qualname__
    try:
        if _resolve(module, name) is func:
            return module, name
    except Exception:
        pass
    return None


def _pack_call(func, args, kwargs, dst=None):
    """The call's payload (above). dst is not used: the autograd context
    travels in the message (_send_call); shmrpc.data passes it."""
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    api._check_pickler()
    ref = _by_name(func)
    if ref is None:
        return _dumps((func, tuple(args or ()), dict(kwargs or {})))
    head = b"".join((_BY_NAME, ref[0].encode(), b"\0", ref[1].encode(), b"\0"))
    if not args and not kwargs:
        return head, [], []
    data, rrefs, tensors = _dumps((tuple(args or ()), dict(kwargs or {})))
    return head + data, rrefs, tensors


def _unpack_call(payload, rrefs, tensors):
    """(func, args, kwargs) from a call's payload."""
    if payload[:1] != _BY_NAME:
        return _loads((payload, rrefs, tensors), "call")
    module, name, rest = payload[1:].split(b"\0", 2)
    func = _resolve(module.decode(), name.decode())
    if not rest:
        return func, (), {}
    args, kwargs = _loads((rest, rrefs, tensors), "call")
    return func, args, kwargs


def _func_name(func):
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _send_call(dst, func, args, kwargs, timeout, kind):
    """The C call in flight: a PYTHON_CALL, or inside a distributed autograd
    context a FORWARD_AUTOGRAD_REQ wrapping it (as torch, for every Python
    call made in a context); profiled for torch's profiler when it runs in
    this thread (shmrpc.profiler)."""
    if not _initialized:
        raise _not_initialized()
    cid = autograd._calling(dst)
    data, rrefs, tensors = _pack_call(func, args, kwargs)
    torch_profile = profiler.torch_profiling()
    try:
        if cid is None:
            call = _shmrpc.call(dst, data, rrefs, tensors, _timeout_ms(timeout), kind,
                                _func_name(func), torch_profile=torch_profile)
        else:
            call = _shmrpc.call(dst, data, rrefs, tensors, _timeout_ms(timeout), kind,
                                _func_name(func), _shmrpc.FORWARD_AUTOGRAD_REQ, cid,
                                autograd._message_id(), torch_profile=torch_profile)
    except RuntimeError as e:
        raise _NotSent(str(e)) from None
    if torch_profile:
        profiler.torch_called(call)
    return call


class _NotSent(RuntimeError):
    """A call the C half could not send (its worker has left the job or
    died, the message cannot be made): rpc_async gives it through its
    Future, as torch's agent does; the arguments' own errors are raised."""


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    try:
        fut = Future(_c=_send_call(_rank_of(to), func, args, kwargs, timeout, "rpc_async"))
    except _NotSent as e:
        fut = Future()
        fut.set_exception(e)
        return fut
    autograd._called(fut)
    api._note_future(fut)
    return fut


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    call = _send_call(_rank_of(to), func, args, kwargs, timeout, "rpc_sync")
    return _result(_c_wait(call.wait))


class RRef:
    """A reference to a value on its owner (from remote(), or RRef(value)
    made on the owner itself). As torch's: the value is the owner's live
    object, kept under the RRef's id until the RRef is deleted everywhere
    (docs/RREF.md, "Python values"); local_value() and proxies act on it,
    and to_here() on a user pickles it as it is then."""

    def __class_getitem__(cls, item):
        """RRef[T] in annotations, as torch's RRef is generic. Where torch
        is loaded, torch's own RRef[T], which TorchScript understands in a
        scripted function's signature (shmrpc runs no TorchScript: such a
        function cannot take a shmrpc RRef, but its module imports)."""
        torch_api = api._torch_api()
        torch_rref = getattr(torch_api, "RRef", None)
        return torch_rref[item] if torch_rref is not None else cls

    def __init__(self, value=None, type_hint=None, _c=None):
        if _c is None:
            # A local owner RRef, ready at once, holding value as a remote
            # call's result is held (_reply): the object itself, kept here
            # under the RRef's id, or a value no code can change, pickled.
            if not _initialized:
                raise _not_initialized()
            pickled, _, out_of_line = _dumps(value) if _immutable(value) else (None, 0, 0)
            if pickled is not None and not out_of_line:
                _c = _shmrpc.rref_local(pickled, False)
            else:
                # No one else knows the id before this returns.
                _c = _shmrpc.rref_local(_LIVE, True)
                _owned[_c.id()] = value
        self._r = _c

    def to_here(self, timeout=UNSET_RPC_TIMEOUT):
        """The value: on the owner the object itself (as torch's), on a
        user a copy made by the owner now (PYTHON_RREF_FETCH_CALL), once
        the remote call has stored it."""
        if not _initialized:
            raise RuntimeError(f"{self} was deleted when RPC shut down. Cannot call to_here() "
                               "on it after deletion.")
        if self._r.is_owner():
            return self._owned(timeout)
        msg = _c_wait(self._r.to_here, _timeout_ms(timeout))
        if msg[0] == _LIVE:
            msg = _c_wait(self._fetch(timeout).wait)
        return _result(msg)

    def local_value(self):
        """The value, on the owner: the same object every time."""
        if not self._r.is_owner():
            # The RRef as torch's C++ prints it in this error.
            ref = re.sub(r"UserRRef\(RRefId = (.*), ForkId = (.*)\)$",
                         r"UserRRef(rref_id=\1, fork_id=\2)", str(self))
            raise RuntimeError(f"For {ref}, can't call localValue() on user "
                               f"{get_worker_info()!r}. Call it on owner {self.owner()!r}")
        return self._owned(UNSET_RPC_TIMEOUT)

    def _owned(self, timeout):
        """On the owner: the live value, once stored (the remote call's
        error raised, as to_here's)."""
        value = _owned.get(self._r.id(), _owned)
        if value is not _owned:
            return value
        msg = _c_wait(self._r.to_here, _timeout_ms(timeout))  # waits; the error raised
        if msg[0] == _LIVE:
            return _owned[self._r.id()]
        return _result(msg)  # a value that cannot change (a copy), or a C function's

    def _fetch(self, timeout):
        """The owner's pickle of the value now: PYTHON_RREF_FETCH_CALL,
        inside the caller's autograd context if any (as torch's to_here,
        which records the tensors that require grad it receives)."""
        owner = self._r.owner()
        cid = autograd._calling(owner)
        return _shmrpc.call(owner, b"", [self._r], [], _timeout_ms(timeout), "rpc_sync",
                            "to_here", _shmrpc.PYTHON_RREF_FETCH_CALL,
                            -1 if cid is None else cid)

    def _get_type(self, timeout=UNSET_RPC_TIMEOUT, blocking=True):
        """The type of the value, asked of the owner once (one
        _rref_typeof_on_owner call, its Future kept), or with blocking=False
        that Future itself, as torch's."""
        fut = getattr(self, "_type_future", None)
        if fut is None:
            if self._r.is_owner():
                fut = Future()
                fut.set_result(type(self.local_value()))
            else:
                fut = rpc_async(self._r.owner(), _rref_typeof_on_owner, args=(self,),
                                timeout=timeout)
            self._type_future = fut
        return fut.wait() if blocking else fut

    def _get_future(self):
        """A Future completed (with None) once the owner has stored the
        value, or with the remote call's error, as torch's."""
        fut = Future()
        if self._r.is_owner() and self._r.confirmed_by_owner():
            fut.set_result(None)
            return fut

        def wait():  # this RRef itself: on its creator it knows remote()'s request
            try:
                _rref_created(self)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)
        threading.Thread(target=wait, name="shmrpc-rref-future", daemon=True).start()
        return fut

    def _get_profiling_future(self):
        """torch's: completes once the remote() that made this RRef, and so
        its profiled events, have completed."""
        return self._get_future()

    def backward(self, dist_autograd_ctx_id=-1, retain_graph=False):
        """Backward from the value (a scalar tensor) on the owner: in the
        given distributed autograd context, or with -1 (on the owner only)
        torch.autograd's local backward, as torch's."""
        return autograd._rref_backward(self, dist_autograd_ctx_id, retain_graph)

    def owner(self):
        return WorkerInfo._of(self._r.owner_name(), self._r.owner())

    def owner_name(self):
        return self._r.owner_name()

    def is_owner(self):
        return self._r.is_owner()

    def confirmed_by_owner(self):
        return self._r.confirmed_by_owner()

    def rpc_sync(self, timeout=UNSET_RPC_TIMEOUT):
        """rref.rpc_sync().method(*args): the method runs on the owner."""
        return _Proxy(self, rpc_sync, timeout)

    def rpc_async(self, timeout=UNSET_RPC_TIMEOUT):
        return _Proxy(self, rpc_async, timeout)

    def remote(self, timeout=UNSET_RPC_TIMEOUT):
        return _Proxy(self, remote, timeout)

    def _serialize(self):
        """The hook of torch's own RPC pickler (torch.distributed.rpc.internal),
        which finds shmrpc's RRef as torch.distributed.rpc.PyRRef: shmrpc's
        RRefs travel in its calls' arguments only."""
        if not _initialized:
            raise RuntimeError(f"{self} was deleted when RPC shut down. Cannot call fork an "
                               "UserRRef after deletion.")
        raise _not_supported("pickling an RRef with torch's RPC pickler (pass it in a call's "
                             "arguments or result instead)")

    def __reduce__(self):
        # Only the RPC pickler (persistent_id) may carry an RRef, as in torch.
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled "
                           "when using RPC (as an argument or a result of rpc_sync, rpc_async "
                           "or remote)")

    def __str__(self):
        return str(self._r)

    __repr__ = __str__


# What an RRef stores for a value its owner keeps live (worker/python.h):
# a user's to_here() that reads it asks the owner for the value.
_LIVE = b"\x02"
# RRef id -> the live value of an RRef this worker owns, until the RRef
# goes everywhere (the C half's live-release hook calls _release_owned).
_owned = {}


def _release_owned(rref_id):
    """The RRef rref_id went (deleted everywhere, or this worker stops): its
    value is dropped here, on its owner (its __del__ runs here, now)."""
    _owned.pop(rref_id, None)


def _rref_typeof_on_owner(rref):
    return type(rref.local_value())


def _rref_created(rref):
    """On an RRef's holder: returns once its value is stored (raises its error)."""
    msg = _c_wait(rref._r.to_here, _timeout_ms(UNSET_RPC_TIMEOUT))
    if msg[0] != _LIVE:
        _result(msg)


def _call_method(name, rref, *args, **kwargs):
    """On the owner: rref's value's method name (the proxies' function; _call
    runs it as the method itself, honouring async_execution)."""
    return getattr(rref.local_value(), name)(*args, **kwargs)


def _check_method(value_type, name):
    """As torch's proxies: the method is looked up on the value's type
    first, so a missing one raises AttributeError on the caller (a
    ScriptModule's methods are not its type's)."""
    torch = sys.modules.get("torch")
    if torch is None or not issubclass(value_type, (torch.jit.ScriptModule,
                                                    torch._C.ScriptModule)):
        getattr(value_type, name)


class _Proxy:
    def __init__(self, rref, how, timeout):
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name):
        def send(args, kwargs):
            return self._how(self._rref.owner(), _call_method, args=(name, self._rref) + args,
                             kwargs=kwargs, timeout=self._timeout)

        def call(*args, **kwargs):
            if self._how is not rpc_async:
                _check_method(self._rref._get_type(self._timeout), name)
                return send(args, kwargs)
            # rpc_async does not wait for the type: the check and the call
            # follow it, their error or result in the Future returned.
            result = Future()

            def typed(type_fut):
                try:
                    _check_method(type_fut.wait(), name)
                    fut = send(args, kwargs)
                except BaseException as e:  # noqa: BLE001 (the caller's, in result)
                    result.set_exception(e)
                    return
                fut.add_done_callback(lambda f: _settle(result, f))
            self._rref._get_type(self._timeout, blocking=False).add_done_callback(typed)
            return result
        return call


def _settle(fut, done):
    """fut completes as done did."""
    try:
        value = done.wait()
    except BaseException as e:  # noqa: BLE001 (done's error, passed on)
        fut.set_exception(e)
    else:
        fut.set_result(value)


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """A PYTHON_REMOTE_CALL, or inside a distributed autograd context a
    FORWARD_AUTOGRAD_REQ wrapping it (as _send_call's)."""
    if not _initialized:
        raise _not_initialized()
    dst = _rank_of(to)
    cid = autograd._calling(dst)
    data, rrefs, tensors = _pack_call(func, args, kwargs)
    torch_profile = profiler.torch_profiling()
    if cid is None:
        r = _shmrpc.remote(dst, data, rrefs, tensors, _timeout_ms(timeout), _func_name(func),
                           torch_profile=torch_profile)
    else:
        r = _shmrpc.remote(dst, data, rrefs, tensors, _timeout_ms(timeout), _func_name(func),
                           _shmrpc.FORWARD_AUTOGRAD_REQ, cid, autograd._message_id(),
                           torch_profile=torch_profile)
    if torch_profile:
        profiler.torch_called(r)
    return RRef(_c=r)


from . import autograd  # noqa: E402  (it uses the functions above)
from . import api  # noqa: E402  (torch's private API: it uses the functions above)
from .api import (  # noqa: E402,F401  (torch's names, as torch.distributed.rpc has them)
    PyRRef, _get_current_rpc_agent, _get_debug_info, _init_rpc_backend,
    _is_current_rpc_agent_set, _rref_context_get_debug_info, enable_gil_profiling)


def _hook_torch():
    from . import as_torch
    as_torch.torch_hooks()


_hook_torch()


def __getattr__(name):
    """torch's _server_process_global_profile, which needs torch: made when
    first asked for (shmrpc.server_profiler)."""
    if name == "_server_process_global_profile":
        return server_profiler._server_process_global_profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install_as_torch():
    """torch.distributed.rpc, .autograd and DistributedOptimizer resolve to
    shmrpc from now on (shmrpc.as_torch says exactly what is replaced)."""
    from . import as_torch
    as_torch.install()
