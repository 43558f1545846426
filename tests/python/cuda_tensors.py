"""CUDA tensors through shmrpc from Python (run by tests/python_rpc.c, twice):
handed over through CUDA IPC, never pickled nor copied.

With SHMRPC_LIBCUDA naming the stand-in driver (tests/fake_cuda: host
memory playing device memory), a producer of this script allocates
"device" memory through the driver and speaks DLPack (as CuPy's arrays
do); torch's CUDA, if any, is not that driver's, so receivers get shmrpc's
handles. Rank 0 sends such an array to rank 1, which reads and writes it
in place through data_ptr() and returns it: rank 0 sees the writes and
gets its own pointer back. Rank 1 makes arrays and returns them, as
results and as an RRef's value. A consumer's stream waits for the sender
(__dlpack__'s stream argument), or for the stream that wrote memory of
this process; host-only methods refuse device memory.
Lifetime: the producer's allocation stays while a receiver holds it and
is freed once every holder let go (the driver's count of allocations).

Without it, the real torch path, where torch has CUDA (else skipped): a
torch CUDA tensor written in place by the callee is seen by the caller,
and a receiver reads what the sender's kernels wrote before the send.
"""
import ctypes
import gc
import os
import sys
import time

import shmrpc as rpc

from checks import check, failed

N = 4096
IDLE_MAPS = 16  # TENSOR_IDLE_MAPS (worker/tensor.h): a receiver's cache of idle mappings
KDLCUDA = 2

rank = int(os.environ["SHMRPC_RANK"])
peer = f"worker{1 - rank}"


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

cu = None  # the driver, in fake mode
_ctx = ctypes.c_void_p()
# The managed tensors handed out and not yet deleted, by address: each
# keeps its producer (and so the allocation) alive.
_live = {}


@DELETER
def _delete(m):
    _live.pop(ctypes.addressof(m.contents))


def load_driver(path):
    global cu
    cu = ctypes.CDLL(path)  # the same library the agent dlopened: one driver state
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
        cu.cuMemFree_v2(self.ptr)

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


# ---- rank 1's functions (fake mode) ----

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


def fake_main():
    load_driver(os.environ["SHMRPC_LIBCUDA"])
    rpc._torch_cuda = False  # fake "device" memory is host memory: never torch's CUDA
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        fake_caller()
    rpc.shutdown()
    # The receivers' caches let go at shutdown: nothing of ours is held.
    check(allocs() == 0 and not _live,
          f"every allocation freed once every holder let go: {allocs()} left, "
          f"{len(_live)} DLPack tensors not deleted")
    return failed()


def fake_caller():
    base = allocs()
    a = DeviceArray(N, 0x11)
    ok, back = rpc.rpc_sync(peer, touch, args=(a, 0x22))
    check(ok, "the callee got a device handle and read the sender's bytes in place")
    check(ctypes.string_at(a.ptr, N) == b"\x22" * N, "the callee's writes are in our memory")
    check(type(back) is rpc._shmrpc.Tensor and back.data_ptr() == a.ptr,
          "the tensor returned is our own pointer")
    check(a.streams == [1], f"the producer was asked to order on the legacy stream: {a.streams}")

    # A holder keeps the allocation; it goes once every holder let go
    # (rank 1's idle cache included: other tensors push it out).
    rpc.rpc_sync(peer, hold, args=(back,))
    del a, back
    gc.collect()
    time.sleep(0.05)
    check(allocs() == base + 1, "the allocation stays while the callee holds it")
    rpc.rpc_sync(peer, let_go)
    for i in range(IDLE_MAPS):
        rpc.rpc_sync(peer, touch, args=(DeviceArray(N, 0x11), i))
    check(settle(lambda: allocs() <= base + IDLE_MAPS),
          f"the first allocation freed once nobody holds it: {allocs() - base} left")

    # Results: the callee's memory, read and written here, seen there.
    got = rpc.rpc_sync(peer, make, args=(0x33,))
    check(type(got) is rpc._shmrpc.Tensor and got.__dlpack_device__() == (KDLCUDA, 0)
          and read(got) == b"\x33" * N, "a device array returned by the callee")
    ctypes.memset(got.data_ptr(), 0x34, N)
    check(rpc.rpc_sync(peer, made_bytes) == b"\x34" * N, "our writes are in the callee's memory")
    check(rpc.rpc_sync(peer, made_ptr_is, args=(got,)),
          "passed back, the callee gets its own pointer")
    rr = rpc.remote(peer, make, args=(0x44,))
    h = rr.to_here()
    check(type(h) is rpc._shmrpc.Tensor and read(h) == b"\x44" * N, "a device array in an RRef")

    # The consumer's stream waits for the sender (DLPack's stream argument).
    waits = cu.fakeCuStreamWaits
    s = ctypes.c_void_p()
    with Current():
        assert cu.cuStreamCreate(ctypes.byref(s), 0) == 0
    for stream, on in ((s.value, s.value), (None, 0), (1, 0), (2, 2)):
        before = waits(on)
        rpc._shmrpc.from_dlpack(h.__dlpack__(stream=stream))
        check(waits(on) == before + 1, f"__dlpack__(stream={stream}) waits on stream {on}")
    mine = rpc._shmrpc.from_dlpack(DeviceArray(N, 0x55))
    before = [waits(x) for x in (0, s.value)]
    mine.__dlpack__(stream=None)
    mine.__dlpack__(stream=s.value)
    check([waits(x) for x in (0, s.value)] == [before[0], before[1] + 1],
          "our own memory: a consumer on the stream that wrote it waits for nothing, one on "
          "another stream waits for that one")
    del mine
    before = [waits(x) for x in (0, 2, s.value)]
    h.__dlpack__(stream=-1)
    check([waits(x) for x in (0, 2, s.value)] == before, "__dlpack__(stream=-1) orders nothing")
    try:
        h.__dlpack__(stream=0)
        check(False, "__dlpack__(stream=0) refused")
    except ValueError as e:
        check("legacy default" in str(e), f"stream 0 refused with a reason: {e}")
    for what in ("tobytes", "__array_interface__"):
        try:
            getattr(h, what)() if what == "tobytes" else h.__array_interface__
            check(False, f"{what} refused on device memory")
        except TypeError as e:
            check("CUDA device 0" in str(e) and "from_dlpack" in str(e),
                  f"{what} says why and what to do: {e}")
    check(rpc.rpc_sync(peer, my_allocs) == 2, "the callee keeps the arrays we hold")
    del got, rr, h
    gc.collect()
    rpc.rpc_sync(peer, let_go)


# ---- the real torch path ----

def add_one(x):
    ok = x.is_cuda
    x.add_(1)  # on the current stream: the reply orders the caller after it
    return ok, x


def total(x):
    return x.sum().item()


def torch_main():
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        print(f"rank {rank}: skip: torch has no CUDA here", file=sys.stderr)
        return 0
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        n = 1 << 20  # sums of up to 7 * 2^20 are exact in float32
        t = torch.zeros(n, device="cuda")
        ok, back = rpc.rpc_sync(peer, add_one, args=(t,))
        check(ok and back.is_cuda and back.data_ptr() == t.data_ptr(),
              "the callee got a CUDA tensor; ours came back")
        check(t.sum().item() == n, "the callee's in-place add is seen in our tensor")
        torch.cuda._sleep(200_000_000)  # the kernel below runs late
        t.fill_(7.0)
        check(rpc.rpc_sync(peer, total, args=(t,)) == 7.0 * n,
              "the receiver reads what our kernels wrote before the send")
        del t, back
    rpc.shutdown()
    return failed()


if __name__ == "__main__":
    sys.exit(fake_main() if os.environ.get("SHMRPC_LIBCUDA") else torch_main())
