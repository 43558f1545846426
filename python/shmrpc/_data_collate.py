"""shmrpc.data's collate, which runs in a loader worker: torch's
default_collate with tensors stacked straight into a pool block, a
NativeTransform, and the worker's identity (get_worker_info), which tells
the collate it runs in a worker. The bottom of shmrpc.data's modules:
_data_collate, _data_worker, _data_job, _data_iter, data (each imports
only those before it)."""
import sys

from . import _marshal, _shmrpc

_POOL_DTYPES = {"int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64"}


def _torch():
    try:
        import torch
        import torch.utils.data  # noqa: F401
    except ImportError:
        raise ImportError("shmrpc.data needs torch (Debian: apt-get install python3-torch)") from None
    return torch


# ---- inside a worker ----

class WorkerInfo:
    """What get_worker_info() returns inside a loader worker (torch's fields)."""
    __initialized = False

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)
        self.__keys = tuple(kwargs.keys())
        self.__initialized = True

    def __setattr__(self, key, val):
        if self.__initialized:
            raise RuntimeError(f"Cannot assign attributes to {self.__class__.__name__} objects")
        return super().__setattr__(key, val)

    def __repr__(self):
        items = ", ".join(f"{k}={getattr(self, k)}" for k in self.__keys)
        return f"{self.__class__.__name__}({items})"


_worker_info = None


def get_worker_info():
    """In a loader worker: its WorkerInfo (id, num_workers, seed, dataset);
    None elsewhere. torch.utils.data.get_worker_info() says the same there,
    so datasets written for torch shard as they do under torch."""
    return _worker_info


# ---- collate, into the pool ----

_copied_batches = 0  # batches stacked outside the pool because it was full
# From this size a batch is streamed into its block (_shmrpc.stack_rows)
# rather than stacked by torch: the blocks in flight then outgrow the cache,
# the trainer reads the batch from memory anyway, and stores that bypass
# the cache skip reading each destination line first. Smaller batches gain
# more from staying in the cache (bench/dataloader.py: a 32 MiB batch
# collated faster streamed, an 8 MiB one slower).
_STREAM_MIN_BYTES = 16 << 20
# A streamed batch's block is mapped writable in this worker first, in one
# madvise(MADV_POPULATE_WRITE), rather than by a page fault per 4 KiB page
# as the stores reach it: a 512 MiB block whose pages another process
# committed (a loader's pool keeps freed blocks committed) 250-350 ms
# instead of 550-700 here, a fresh one 480-550 instead of 660-730. Once
# per block placement: populating pages this worker has mapped already is
# a walk over them (40-55 ms for 512 MiB), and a loader's pool never gives
# them back, so a placement populated stays mapped. A kernel without it
# (before 5.14) refuses it, and the stores fault the pages in as before.
_MADV_POPULATE_WRITE = 23
_POPULATED_MAX = 1024  # placements remembered; then forgotten at once (a repopulation is correct)
_populated = set()  # (address, bytes) this worker populated
_madvise = None


def _populate(address, nbytes):
    global _madvise
    if (address, nbytes) in _populated:
        return
    if _madvise is None:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _madvise = fn
    if len(_populated) >= _POPULATED_MAX:
        _populated.clear()
    _madvise(address, nbytes, _MADV_POPULATE_WRITE)
    _populated.add((address, nbytes))


def _pool_stack(torch, batch):
    """torch.stack(batch) written straight into a pool block, so that the
    batch travels without a copy; outside the pool when this process has
    none, the dtype is not a pool dtype, or the pool is full. (Samples of
    different shapes fail in torch.stack with torch's own message.)"""
    global _copied_batches
    elem = batch[0]
    dtype = elem.dtype
    name = str(dtype)[6:]  # "torch.float32"
    if _worker_info is None or elem.device.type != "cpu" or name not in _POOL_DTYPES:
        return torch.stack(batch, 0)
    shape = (len(batch),) + tuple(elem.shape)
    bits = elem.element_size() * 8
    try:
        block = _shmrpc.empty(shape, _marshal._DLPACK_CODES[name[0]], bits)
    except RuntimeError:
        _copied_batches += 1
        return torch.stack(batch, 0)
    row = elem.numel() * elem.element_size()
    if row * len(batch) >= _STREAM_MIN_BYTES and all(
            t.dtype == dtype and t.shape == elem.shape and t.device.type == "cpu"
            and t.is_contiguous() and not t.requires_grad for t in batch):
        _populate(block.data_ptr(), row * len(batch))
        _shmrpc.stack_rows(block, [t.data_ptr() for t in batch], row)
        return _as_torch(block)
    return torch.stack(batch, 0, out=_as_torch(block))


def _as_torch(block):
    """A torch tensor of pool block handle block, which it keeps (the
    handle's reference taken over, the handle left empty): torch's DLPack
    import in C, without torch.from_dlpack's Python (7 us a batch,
    measured alone)."""
    return _marshal._from_handles([block])[0]


def _convert(data):
    return _torch().utils.data.default_convert(data)


def default_collate(batch):
    """torch's default_collate (same structure, types and errors), with
    tensors stacked into the pool inside a loader worker."""
    torch = _torch()
    elem = batch[0]
    if isinstance(elem, torch.Tensor):  # first: the common case, per batch
        return _pool_stack(torch, batch)
    import collections.abc
    import re
    elem_type = type(elem)
    if elem_type.__module__ == "numpy" and elem_type.__name__ not in ("str_", "string_"):
        if elem_type.__name__ in ("ndarray", "memmap"):
            if re.search("[SaUO]", elem.dtype.str) is not None:
                raise TypeError(_COLLATE_ERR.format(elem.dtype))
            return default_collate([torch.as_tensor(b) for b in batch])
        if elem.shape == ():  # numpy scalars
            return torch.as_tensor(batch)
    elif isinstance(elem, float):
        return torch.tensor(batch, dtype=torch.float64)
    elif isinstance(elem, int):
        return torch.tensor(batch)
    elif isinstance(elem, (str, bytes)):
        return batch
    elif isinstance(elem, collections.abc.Mapping):
        try:
            return elem_type({key: default_collate([d[key] for d in batch]) for key in elem})
        except TypeError:
            return {key: default_collate([d[key] for d in batch]) for key in elem}
    elif isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return elem_type(*(default_collate(samples) for samples in zip(*batch)))
    elif isinstance(elem, collections.abc.Sequence):
        it = iter(batch)
        elem_size = len(next(it))
        if not all(len(e) == elem_size for e in it):
            raise RuntimeError("each element in list of batch should be of equal size")
        transposed = list(zip(*batch))
        if isinstance(elem, tuple):
            return [default_collate(samples) for samples in transposed]
        try:
            return elem_type([default_collate(samples) for samples in transposed])
        except TypeError:
            return [default_collate(samples) for samples in transposed]
    raise TypeError(_COLLATE_ERR.format(elem_type))


_COLLATE_ERR = ("default_collate: batch must contain tensors, numpy arrays, numbers, "
                "dicts or lists; found {}")


class NativeTransform:
    """A collate_fn that runs a C function on the collated batch in place,
    in the worker: each tensor of the batch (a pool block, when collated
    there) is passed as a DLPack DLTensor* to `int symbol(DLTensor *t)`
    from the shared library `library`, with the GIL released; a non-zero
    return fails the batch. So a pipeline can be native from the pool block
    to the trainer:

        collate_fn=NativeTransform("./libaugment.so", "normalize")

    collate_fn: what collates before the transform (default_collate).
    Picklable (the library is loaded in each worker, once)."""

    def __init__(self, library, symbol, collate_fn=None):
        self.library, self.symbol, self.collate_fn = library, symbol, collate_fn
        self._fn = None

    def __getstate__(self):
        return (self.library, self.symbol, self.collate_fn)

    def __setstate__(self, state):
        self.library, self.symbol, self.collate_fn = state
        self._fn = None

    def __call__(self, batch):
        import ctypes
        if self._fn is None:
            fn = getattr(ctypes.CDLL(self.library), self.symbol)
            fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
            self._fn = fn
        out = (self.collate_fn or default_collate)(batch)
        for t in _tensors_of(out):
            self._run(ctypes, t)
        return out

    def _run(self, ctypes, t):
        from torch.utils.dlpack import to_dlpack
        capsule = to_dlpack(t)  # a view: its DLTensor points at t's bytes
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.argtypes, get.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
        rc = self._fn(get(capsule, b"dltensor"))  # DLManagedTensor starts with its DLTensor
        if rc:
            raise RuntimeError(f"native transform {self.symbol} from {self.library} returned {rc} "
                               f"for a tensor of shape {tuple(t.shape)} and dtype {t.dtype}")


def _tensors_of(obj):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_of(v)
