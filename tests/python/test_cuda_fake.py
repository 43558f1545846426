# shmrun: -n 2 --pool-size 64M
# needs: __import__("os").access((__import__("os").environ.get("SHMRPC_BUILD") or "build") + "/tests/fake_cuda/libcuda.so.1", 4)
"""CUDA tensors through shmrpc from Python, on the stand-in driver
(tests/fake_cuda: host memory playing device memory): handed over through
CUDA IPC, never pickled nor copied. Skipped (the needs line) where the
stand-in driver is not built. test_cuda_torch.py is the real torch path.

A producer of this module allocates "device" memory through the driver
and speaks DLPack (as CuPy's arrays do); torch's CUDA, if any, is not that
driver's, so receivers get shmrpc's handles. Rank 0 sends such an array to
rank 1, which reads and writes it in place through data_ptr() and returns
it: rank 0 sees the writes and gets its own pointer back. Rank 1 makes
arrays and returns them, as results and as an RRef's value. A consumer's
stream waits for the sender (__dlpack__'s stream argument), or for the
stream that wrote memory of this process; host-only methods refuse device
memory. Lifetime: the producer's allocation stays while a receiver holds
it and is freed once every holder let go (the driver's count of
allocations), checked on both ranks after shutdown.

Every rank must load the stand-in driver (SHMRPC_LIBCUDA, an absolute
path, set before init_rpc loads it) and check what shutdown freed, so the
tests start and shut down RPC themselves (rpc_init = None, conftest.py):
test_start and test_all_freed_at_shutdown run on both ranks, the rest on
rank 0; rank 1 serves in between.
"""
import ctypes
import gc
import os
import time

import pytest

import shmrpc as rpc

N = 4096
IDLE_MAPS = 16  # TENSOR_IDLE_MAPS (worker/tensor.h): a receiver's cache of idle mappings
KDLCUDA = 2
PEER = "worker1"  # rank 0's peer

rpc_init = None  # the tests start and shut down RPC (test_start, test_all_freed_at_shutdown)

BUILD = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(rpc.__file__))))


def fake_cuda_path():
    """The stand-in driver beside the package's build, an absolute path."""
    return os.path.realpath(os.path.join(BUILD, "tests", "fake_cuda", "libcuda.so.1"))


# ---- the stand-in driver, and a DLPack producer over it ----

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", DELETER)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = b"dltensor"  # the capsule keeps a pointer to its name

cu = None  # the driver
_ctx = ctypes.c_void_p()
# The managed tensors handed out and not yet deleted, by address: each
# keeps its producer (and so the allocation) alive.
_live = {}


@DELETER
def _delete(m):
    _live.pop(ctypes.addressof(m.contents))


def load_driver(path):
    global cu
    cu = ctypes.CDLL(path)  # the same library the agent dlopens: one driver state
    cu.cuMemFree_v2.argtypes = [ctypes.c_ulonglong]
    cu.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    cu.fakeCuStreamWaits.argtypes = [ctypes.c_void_p]
    dev = ctypes.c_int()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(_ctx), dev) == 0


class Current:
    """The device's context current on this thread (the driver's calls need one)."""

    def __enter__(self):
        assert cu.cuCtxPushCurrent_v2(_ctx) == 0

    def __exit__(self, *exc):
        cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


class DeviceArray:
    """n bytes of device memory speaking DLPack, as a CuPy array does; the
    memory goes back to the driver when the array and every DLPack tensor
    made of it are gone."""

    def __init__(self, n, fill):
        p = ctypes.c_ulonglong()
        with Current():
            assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        self.ptr, self.n, self.streams = p.value, n, []
        ctypes.memset(self.ptr, fill, n)

    def __del__(self):
        with Current():  # as the driver, the fake frees in a current context only
            assert cu.cuMemFree_v2(self.ptr) == 0

    def __dlpack_device__(self):
        return (KDLCUDA, 0)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        shape = (ctypes.c_int64 * 1)(self.n)
        m = DLManagedTensor()
        m.dl_tensor = DLTensor(self.ptr, DLDevice(KDLCUDA, 0), 1, DLDataType(1, 8, 1), shape,
                               None, 0)
        m.deleter = _delete
        _live[ctypes.addressof(m)] = (m, shape, self)
        return _capsule_new(ctypes.addressof(m), _DLTENSOR, None)


def allocs():
    return cu.fakeCuAllocCount()


def settle(cond, seconds=10.0):
    """cond() once it holds, polled (a producer releases what receivers let
    go from its loop thread's check every 10 ms)."""
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        gc.collect()
        time.sleep(0.01)
    return cond()


def read(h, n=N):
    return ctypes.string_at(h.data_ptr(), n)


# ---- rank 1's functions ----

kept = {}


def touch(h, value):
    """Reads the bytes in place, writes value over them, returns the handle."""
    ok = (type(h) is rpc._shmrpc.Tensor and h.__dlpack_device__() == (KDLCUDA, 0)
          and read(h) == b"\x11" * N)
    ctypes.memset(h.data_ptr(), value, N)
    return ok, h


def hold(h):
    kept["held"] = h


def let_go():
    kept.clear()


def make(value):
    a = DeviceArray(N, value)
    kept["made"] = a
    return a


def made_bytes():
    return ctypes.string_at(kept["made"].ptr, N)


def made_ptr_is(h):
    return h.data_ptr() == kept["made"].ptr


def my_allocs():
    return allocs()


# ---- the tests ----

state = {}  # what one of rank 0's tests hands to the next


@pytest.mark.rank(0, 1)
def test_start():
    path = fake_cuda_path()
    os.environ["SHMRPC_LIBCUDA"] = path  # before init_rpc loads the driver
    load_driver(path)
    rpc._marshal._torch_cuda = False  # fake "device" memory is host memory: never torch's CUDA
    rpc.init_rpc(f"worker{os.environ['SHMRPC_RANK']}")


def test_sent_array_read_and_written_in_place():
    state["base"] = allocs()
    a = DeviceArray(N, 0x11)
    ok, back = rpc.rpc_sync(PEER, touch, args=(a, 0x22))
    assert ok, "the callee got a device handle and read the sender's bytes in place"
    assert ctypes.string_at(a.ptr, N) == b"\x22" * N, "the callee's writes are in our memory"
    assert type(back) is rpc._shmrpc.Tensor and back.data_ptr() == a.ptr, \
        "the tensor returned is our own pointer"
    assert a.streams == [1], f"the producer was asked to order on the legacy stream: {a.streams}"
    state["a"], state["back"] = a, back


def test_allocation_held_then_freed():
    """A holder keeps the allocation; it goes once every holder let go
    (rank 1's idle cache included: other tensors push it out)."""
    base, a, back = state.pop("base"), state.pop("a"), state.pop("back")
    rpc.rpc_sync(PEER, hold, args=(back,))
    del a, back
    gc.collect()
    time.sleep(0.05)
    assert allocs() == base + 1, "the allocation stays while the callee holds it"
    rpc.rpc_sync(PEER, let_go)
    for i in range(IDLE_MAPS):
        rpc.rpc_sync(PEER, touch, args=(DeviceArray(N, 0x11), i))
    assert settle(lambda: allocs() <= base + IDLE_MAPS), \
        f"the first allocation freed once nobody holds it: {allocs() - base} left"


def test_results_and_rref():
    """Results: the callee's memory, read and written here, seen there."""
    got = rpc.rpc_sync(PEER, make, args=(0x33,))
    assert type(got) is rpc._shmrpc.Tensor and got.__dlpack_device__() == (KDLCUDA, 0) \
        and read(got) == b"\x33" * N, "a device array returned by the callee"
    ctypes.memset(got.data_ptr(), 0x34, N)
    assert rpc.rpc_sync(PEER, made_bytes) == b"\x34" * N, "our writes are in the callee's memory"
    assert rpc.rpc_sync(PEER, made_ptr_is, args=(got,)), \
        "passed back, the callee gets its own pointer"
    rr = rpc.remote(PEER, make, args=(0x44,))
    h = rr.to_here()
    assert type(h) is rpc._shmrpc.Tensor and read(h) == b"\x44" * N, "a device array in an RRef"
    state["got"], state["rr"], state["h"] = got, rr, h


def test_consumer_stream_waits():
    """The consumer's stream waits for the sender (DLPack's stream argument)."""
    h = state["h"]
    waits = cu.fakeCuStreamWaits
    s = ctypes.c_void_p()
    with Current():
        assert cu.cuStreamCreate(ctypes.byref(s), 0) == 0
    # The import made the legacy default stream wait for the sender: a
    # consumer there needs no more; one on another stream waits for it.
    for stream, on, more in ((s.value, s.value, 1), (None, 0, 0), (1, 0, 0), (2, 2, 1)):
        before = waits(on)
        rpc._shmrpc.from_dlpack(h.__dlpack__(stream=stream))
        assert waits(on) == before + more, \
            f"__dlpack__(stream={stream}): {waits(on) - before} waits on stream {on}, want {more}"
    mine = rpc._shmrpc.from_dlpack(DeviceArray(N, 0x55))
    before = [waits(x) for x in (0, s.value)]
    mine.__dlpack__(stream=None)
    mine.__dlpack__(stream=s.value)
    assert [waits(x) for x in (0, s.value)] == [before[0], before[1] + 1], \
        "our own memory: a consumer on the stream that wrote it waits for nothing, one on " \
        "another stream waits for that one"
    del mine
    before = [waits(x) for x in (0, 2, s.value)]
    h.__dlpack__(stream=-1)
    assert [waits(x) for x in (0, 2, s.value)] == before, "__dlpack__(stream=-1) orders nothing"
    with pytest.raises(ValueError) as e:
        h.__dlpack__(stream=0)  # refused
    assert "legacy default" in str(e.value), f"stream 0 refused with a reason: {e.value}"


def test_host_only_methods_refused():
    h = state["h"]
    for what in ("tobytes", "__array_interface__"):
        with pytest.raises(TypeError) as e:  # refused on device memory
            getattr(h, what)() if what == "tobytes" else h.__array_interface__
        assert "CUDA device 0" in str(e.value) and "from_dlpack" in str(e.value), \
            f"{what} says why and what to do: {e.value}"
    del e, h
    assert rpc.rpc_sync(PEER, my_allocs) == 2, "the callee keeps the arrays we hold"
    state.clear()
    gc.collect()
    rpc.rpc_sync(PEER, let_go)


@pytest.mark.rank(0, 1)
def test_all_freed_at_shutdown():
    state.clear()  # what a failed test of rank 0 left
    gc.collect()
    rpc.shutdown()
    # The receivers' caches let go at shutdown: nothing of ours is held.
    assert allocs() == 0 and not _live, \
        f"every allocation freed once every holder let go: {allocs()} left, " \
        f"{len(_live)} DLPack tensors not deleted"
