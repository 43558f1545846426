"""shmrpc.data: torch.utils.data.DataLoader's API, with batches handed over
in the job's shared tensor pool instead of pickled through queues.

    from shmrpc.data import DataLoader
    for batch in DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2):
        ...

The workers are shmrpc workers. By default the loader starts them itself:
it forks them from this process (so, as with torch's default on Linux, the
dataset is inherited, not pickled) into a job of its own, whose launcher
this process is (_shmrpc.Job). Or, inside an ``shmrun`` job, give the ranks
that load with ``workers=[...]``: the dataset, collate_fn and
worker_init_fn then travel to them pickled, as with torch's "spawn".

A worker collates a batch straight into the pool (each byte written once)
and returns it; the trainer gets torch tensors viewing the same bytes, and
a batch's blocks go back to the pool when the trainer drops it. Sampling,
seeding, batching, the order of batches and the errors are torch's: this
module uses torch's samplers and mirrors its iterator. torch is needed.
"""
import itertools
import math
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback

from . import _core, _marshal, _shmrpc

__all__ = ["DataLoader", "get_worker_info", "WorkerInfo", "default_collate", "NativeTransform"]

_DEFAULT_POOL_BYTES = 256 << 20
ABORT_WAIT_MS = 5000  # how long a broken-off epoch waits for a rank's batch in flight
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


class _Batcher:
    """One worker's side of one loader: torch's fetchers. fetch(index) is a
    batch, or raises StopIteration when an iterable dataset is exhausted."""

    def __init__(self, dataset, iterable, auto_collation, collate_fn, drop_last):
        self.dataset, self.iterable = dataset, iterable
        self.auto_collation, self.drop_last = auto_collation, drop_last
        if collate_fn is None:  # torch's defaults
            collate_fn = default_collate if auto_collation else _convert
        self.collate_fn = collate_fn
        self.turn = threading.Condition()  # the trainer's requests run one at a time, in order
        self.next_seq = 0
        self.reset()

    def in_turn(self, seq, run):
        """run() once every request sent before request seq has run: the
        dataset, its iterator and the random generators see the order torch
        gives them, whatever thread the call came on. A plain wait: the
        requests come in order on one ring and the executor takes them in
        order, so every earlier one is already running on a thread. (Serving
        queued calls meanwhile, as a nested rpc_sync does, would deadlock:
        a later request run inside this wait would wait for this one.)"""
        with self.turn:
            while self.next_seq != seq:
                self.turn.wait()
            try:
                return run()
            finally:
                self.next_seq += 1
                self.turn.notify_all()

    def reset(self):
        self.it = iter(self.dataset) if self.iterable else None
        self.ended = False

    def fetch(self, index):
        if not self.iterable:
            if self.auto_collation:
                return self.collate_fn([self.dataset[i] for i in index])
            return self.collate_fn(self.dataset[index])
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            return self.collate_fn(next(self.it))
        data = []
        for _ in index:
            try:
                data.append(next(self.it))
            except StopIteration:
                self.ended = True
                break
        if not data or (self.drop_last and len(data) < len(index)):
            raise StopIteration
        return self.collate_fn(data)


_batchers = {}  # loader key -> _Batcher, in a worker
_init_errors = {}  # loader key -> the text of worker_init_fn's failure


def _set_worker(worker_id, num_workers, base_seed, dataset):
    """torch's worker start: one thread, seeds from base_seed, worker info."""
    global _worker_info
    torch = _torch()
    torch.set_num_threads(1)
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        import numpy as np
        from torch.utils.data._utils import worker as torch_worker
        np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    _worker_info = WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
    # torch.utils.data.get_worker_info() reads this module global of torch's.
    from torch.utils.data._utils import worker as torch_worker
    torch_worker._worker_info = _worker_info


def _error_text(worker_id):
    e = sys.exc_info()[1]
    return (type(e), f"Caught {type(e).__name__} in DataLoader worker process {worker_id}.\n"
            f"Original {''.join(traceback.format_exception(*sys.exc_info()))}")


def _w_setup(key, spec, worker_id, num_workers, base_seed):
    """Makes this process worker worker_id of loader key (spec: what
    _Loader._spec returns). A worker_init_fn failure is kept and sent with
    the first batch, as torch does."""
    dataset, iterable, auto_collation, collate_fn, drop_last, init_fn = spec
    _set_worker(worker_id, num_workers, base_seed, dataset)
    try:
        if init_fn is not None:
            init_fn(worker_id)
        _batchers[key] = _Batcher(dataset, iterable, auto_collation, collate_fn, drop_last)
    except Exception:
        _init_errors[key] = _error_text(worker_id)
        _batchers[key] = _Batcher((), False, False, None, False)


def _w_fetch(key, seq, index):
    """Request seq of loader key to this worker: a batch, ("ok", batch);
    ("stop",) when an iterable dataset is exhausted; ("error", type, text).
    index None: a new epoch of persistent workers (an iterable dataset
    starts over), answered ("ok", None)."""
    b = _batchers.get(key)
    if b is None:
        return ("error", RuntimeError, "shmrpc.data: this worker has no such loader")
    return b.in_turn(seq, lambda: _fetch(key, b, index))


def _fetch(key, b, index):
    if index is None:
        b.reset()
        return ("ok", None)
    err = _init_errors.pop(key, None)
    if err is not None:
        return ("error",) + err
    try:
        return ("ok", b.fetch(index))
    except StopIteration:
        if b.iterable:
            return ("stop",)
        return ("error",) + _error_text(_worker_info.id)
    except Exception:
        return ("error",) + _error_text(_worker_info.id)


def _w_forget(key):
    _batchers.pop(key, None)
    _init_errors.pop(key, None)


_leave = threading.Event()  # set in a forked worker when its trainer closes the job


def _w_leave():
    _leave.set()


# ---- collate, into the pool ----

_copied_batches = 0  # batches stacked outside the pool because it was full
# From this size a batch is streamed into its block (_shmrpc.stack_rows)
# rather than stacked by torch: the blocks in flight then outgrow the cache,
# the trainer reads the batch from memory anyway, and stores that bypass
# the cache skip reading each destination line first. Smaller batches gain
# more from staying in the cache (bench/dataloader.py: a 32 MiB batch
# collated faster streamed, an 8 MiB one slower).
_STREAM_MIN_BYTES = 16 << 20
_DLPACK_CODES = {"i": 0, "u": 1, "f": 2}


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
        block = _shmrpc.empty(shape, _DLPACK_CODES[name[0]], bits)
    except RuntimeError:
        _copied_batches += 1
        return torch.stack(batch, 0)
    out = torch.from_dlpack(block)  # a view of the block, which it keeps
    row = elem.numel() * elem.element_size()
    if row * len(batch) >= _STREAM_MIN_BYTES and all(
            t.dtype == dtype and t.shape == elem.shape and t.device.type == "cpu"
            and t.is_contiguous() and not t.requires_grad for t in batch):
        _shmrpc.stack_rows(block, [t.data_ptr() for t in batch], row)
        return out
    return torch.stack(batch, 0, out=out)


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


# ---- the trainer's side ----

def _alive(pid):
    """pid runs (not a zombie, not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The state follows the command's closing parenthesis.
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class _LoaderJob:
    """The workers of one loader: a job this process launched by fork, or
    ranks of the job this process is in (workers=[...])."""

    _next_key = itertools.count()

    def __init__(self, loader, base_seed):
        import shmrpc
        self.key = (os.getpid(), next(self._next_key))
        self.job = None
        self.pinned = None  # the pool's address, once registered with CUDA
        self.seq = [0] * loader.num_workers
        self.fetch_head = _marshal._pack_call(_w_fetch, (), None)[0]  # _w_fetch by name
        n = loader.num_workers
        spec = loader._spec()
        if loader.workers is not None:
            self.ranks = [_core._rank_of(w) for w in loader.workers]
            futs = [shmrpc.rpc_async(r, _w_setup, (self.key, spec, i, n, base_seed))
                    for i, r in enumerate(self.ranks)]
            shmrpc.wait_all(futs)
            self.pids = [None] * n
            return
        if _core._initialized:
            raise NotImplementedError(
                "shmrpc.data: this process is a worker of an shmrpc job already; forking loader "
                "workers from it is not supported yet: give the loader ranks of the job to load "
                "with, DataLoader(..., workers=[...])")
        names = ["dataloader-trainer"] + [f"dataloader{i}" for i in range(n)]
        self.job = _shmrpc.Job(names, loader.pool_size)
        self.ranks = list(range(1, n + 1))
        self.pids = []
        fds = self.job.fds()
        parent = os.getpid()
        try:
            for i in range(n):
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child_main(self.key, spec, i, n, base_seed, names, fds, parent)
                self.pids.append(pid)
                self.job.started(i + 1, pid)
            self.job.watch()
            _attach(names[0], n + 1, fds)
            self.pinned = loader._pin and _pin_pool()
        except BaseException:
            self.job.kill()
            if _core._initialized:  # attached before the failure: leave the job
                shmrpc.shutdown(graceful=False)
            self.job.close(0)
            self.job = None
            raise

    def fetch(self, worker_id, index):
        """Sends request number seq[worker_id] (index None: a reset); the call."""
        dst = self.ranks[worker_id]
        seq = self.seq[worker_id]
        self.seq[worker_id] += 1
        if type(index) is list and all(type(i) is int for i in index):
            # A sampler's indices, nothing for the pool: pickled as the
            # package's pickler would, without its per-object hook.
            data, rrefs, tensors = (self.fetch_head + pickle.dumps(
                ((self.key, seq, index), {}), pickle.HIGHEST_PROTOCOL), [], [])
        else:
            data, rrefs, tensors = _marshal._pack_call(_w_fetch, (self.key, seq, index), None, dst)
        try:
            return _shmrpc.call(dst, data, rrefs, tensors, 0, "rpc_async", "shmrpc.data._w_fetch")
        except RuntimeError as e:
            raise RuntimeError(self.death_text(worker_id) or str(e)) from None

    def reset(self):
        for call in [self.fetch(w, None) for w in range(len(self.ranks))]:
            call.wait(-1)

    def death_text(self, worker_id):
        """The torch-like message for a worker that ended, or None. A call
        fails as soon as the worker's process is gone, which can be before
        the job's watcher thread has reaped it and recorded how it ended
        (on a loaded machine): while the process is dead but not yet
        recorded, wait for the record (2 s at most)."""
        if self.job is None:
            return None
        deadline = time.monotonic() + 2.0
        while True:
            for rank, pid, info, text in self.job.ended():
                if rank == self.ranks[worker_id] and info:
                    return (f"DataLoader worker {worker_id} (pid {pid}) exited unexpectedly: "
                            f"{text}")
            if _alive(self.pids[worker_id]) or time.monotonic() > deadline:
                return None
            time.sleep(0.002)

    def close(self):
        import shmrpc
        if self.job is None:
            if _core._initialized:
                for r in self.ranks:
                    try:
                        shmrpc.rpc_sync(r, _w_forget, (self.key,))
                    except Exception:
                        pass  # a rank that died forgets by itself
            return
        job, self.job = self.job, None
        if self.pinned:
            # Copies queued from the pool with non_blocking=True may still
            # be reading it: unregistered (and unmapped after) only once
            # every device is done with them.
            torch = _torch()
            for d in range(torch.cuda.device_count()):
                torch.cuda.synchronize(d)
            torch.cuda.cudart().cudaHostUnregister(self.pinned)
        for r in self.ranks:
            try:
                shmrpc.rpc_async(r, _w_leave)  # answered before this shutdown returns
            except RuntimeError:
                pass  # it died: the job's watcher has its cause
        try:
            shmrpc.shutdown(graceful=True, timeout=30)
        except Exception:
            job.kill()
            if _core._initialized:
                shmrpc.shutdown(graceful=False)
        finally:
            job.close(5000)


def _pin_pool():
    """pin_memory with CUDA: the pool itself becomes pinned host memory
    (cudaHostRegister), so batches are pinned where the workers wrote them
    and go to the GPU by DMA, with no pinned copy. Its address, or None
    (then batches are pinned by copy, as torch does)."""
    import warnings
    where = _shmrpc.pool_mapping()
    if where is None:
        return None
    try:
        err = int(_torch().cuda.cudart().cudaHostRegister(where[0], where[1], 0))
    except Exception as e:  # no CUDA runtime to call: as a failed registration
        err = repr(e)
    if err != 0:
        warnings.warn(f"shmrpc.data: cannot pin the pool ({where[1]} bytes) with "
                      f"cudaHostRegister (error {err}); batches are pinned by copy")
        return None
    return where[0]


def _job_env(rank, world, name, fds):
    """What the agent's init reads to join the loader's job as rank, as
    shmrun gives it (fds: the job's segment, pool and RRef table)."""
    return {"SHMRPC_RANK": str(rank), "SHMRPC_WORLD_SIZE": str(world), "SHMRPC_NAME": name,
            "SHMRPC_JOB_FD": str(fds[0]), "SHMRPC_POOL_FD": str(fds[1]),
            "SHMRPC_RREF_FD": str(fds[2]), "SHMRPC_JOB_INO": str(os.fstat(fds[0]).st_ino)}


def _attach(name, world, fds):
    """This process joins the loader's job as rank 0 (with duplicates of
    its memfds: the agent closes what it attaches)."""
    import shmrpc
    dups = [os.dup(fd) for fd in fds]
    env = _job_env(0, world, name, dups)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        shmrpc.init_rpc(name)
    except BaseException:
        for fd in dups:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child_main(key, spec, worker_id, num_workers, base_seed, names, fds, parent):
    """A forked worker: joins the job, serves fetches until the trainer
    leaves, and exits without running the trainer's cleanup."""
    code = 1
    try:
        _shmrpc.die_with_parent(parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
        rank = worker_id + 1
        os.environ.update(_job_env(rank, num_workers + 1, names[rank], fds))
        _w_setup(key, spec, worker_id, num_workers, base_seed)
        import shmrpc
        shmrpc.init_rpc(names[rank], rpc_backend_options=_OneThread())
        # Waits for the trainer's leave without a wake-up: a graceful
        # shutdown barrier polls the other ranks every 200 us meanwhile,
        # thousands of wake-ups a second on cores the loader shares.
        _leave.wait()
        shmrpc.shutdown(graceful=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class _OneThread:
    """A forked worker serves its loader on one executor thread: its
    requests run in arrival order without waiting for their turn."""
    num_worker_threads = 1


class _BaseIter:
    """What both iterators share: their length, and a batch's delivery."""

    def __iter__(self):
        return self

    def __len__(self):
        return len(self.loader)

    def _deliver(self, batch):
        if self.loader._pin:  # a no-op for tensors in a pinned pool
            batch = _torch().utils.data._utils.pin_memory.pin_memory(batch)
        self.progress.update(batch)
        return batch


class _Iter(_BaseIter):
    """torch's _MultiProcessingDataLoaderIter, over shmrpc calls: up to
    prefetch_factor batches per worker in flight, handed out round robin,
    returned in order."""

    def __init__(self, loader):
        torch = _torch()
        self.loader = loader
        self.sampler_iter = iter(loader._index_sampler)
        self.num_yielded = 0
        self.progress = _Progress(loader.progress)
        if loader.persistent_workers and loader._workers is not None:
            # As torch's _reset: the same workers, no new base seed.
            self.workers = loader._workers
            if loader._iterable:
                self.workers.reset()
        else:
            base_seed = torch.empty((), dtype=torch.int64).random_(
                generator=loader.generator).item()
            self.workers = _LoaderJob(loader, base_seed)
            if loader.persistent_workers:
                loader._workers = self.workers
        # In a job of its own, this process waits for every call it makes:
        # it takes the workers' replies itself when it waits, and a reply
        # that comes before that wakes nobody (worker/link.h).
        self.took_replies = self.workers.job is not None
        if self.took_replies:
            _shmrpc.take_replies(True)
        n = loader.num_workers
        self.active = [True] * n
        self.cycle = itertools.cycle(range(n))
        self.tasks = {}  # send index -> (worker id, call)
        self.abandoned = []
        self.send_idx = self.rcvd_idx = 0
        self.ended = False
        for _ in range(loader.prefetch_factor * n):
            self._put()

    def _put(self):
        try:
            index = next(self.sampler_iter)
        except StopIteration:
            return
        for _ in range(len(self.active)):
            w = next(self.cycle)
            if self.active[w]:
                break
        else:
            return
        self.tasks[self.send_idx] = (w, self.workers.fetch(w, index))
        self.send_idx += 1

    def _wait(self, w, call):
        timeout = self.loader.timeout
        try:
            msg = call.wait(int(timeout * 1000) if timeout > 0 else -1)
        except TimeoutError:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from None
        except RuntimeError as e:
            raise RuntimeError(self.workers.death_text(w) or str(e)) from None
        return _marshal._result(msg)

    def __next__(self):
        try:
            reply = self._next_reply()
        except StopIteration:
            raise
        except BaseException:
            self._end(abort=True)  # a death, a timeout, Ctrl-C: the epoch is over
            raise
        if reply[0] == "error":
            raise _reraise(reply[1], reply[2])
        self.num_yielded += 1
        return self._deliver(reply[1])

    def _next_reply(self):
        """The next task's reply in order, skipping workers whose iterable
        dataset is exhausted (torch's _next_data)."""
        while True:
            while self.rcvd_idx < self.send_idx and not self.active[self.tasks[self.rcvd_idx][0]]:
                # Its worker is exhausted: the reply will be "stop"; collected at _end.
                self.abandoned.append(self.tasks.pop(self.rcvd_idx)[1])
                self.rcvd_idx += 1
            if self.rcvd_idx >= self.send_idx:
                self._end()
                raise StopIteration
            w, call = self.tasks.pop(self.rcvd_idx)
            reply = self._wait(w, call)
            self.rcvd_idx += 1
            if reply[0] == "stop":
                self.active[w] = False
            self._put()
            if reply[0] != "stop":
                return reply

    def _end(self, abort=False):
        """The epoch is over: the workers stop unless they persist; batches
        in flight are dropped. abort (a death, a timeout, Ctrl-C): workers
        this loader forked are killed at once, persistent or not (a stuck
        worker is not waited for); ranks of a job get ABORT_WAIT_MS."""
        if self.ended:
            return
        self.ended = True
        self.progress.close()
        if self.took_replies:
            _shmrpc.take_replies(False)
        workers = self.workers
        if abort and workers.job is not None:
            workers.job.kill()
            if workers is self.loader._workers:
                self.loader._workers = None  # the next epoch starts new ones
        for call in self.abandoned + [call for _, call in self.tasks.values()]:
            try:
                call.wait(ABORT_WAIT_MS if abort else -1)
            except Exception:
                pass
        self.tasks.clear()
        self.abandoned.clear()
        if workers is not self.loader._workers:
            workers.close()

    def __del__(self):
        try:
            self._end()
        except Exception:
            pass


def _reraise(exc_type, text):
    """torch's ExceptionWrapper.reraise: the worker's type, with its traceback in the text."""
    if exc_type is KeyError:
        text = KeyErrorMessage(text)
    try:
        return exc_type(text)
    except Exception:
        return RuntimeError(text)


class KeyErrorMessage(str):
    """As torch: a KeyError's message printed as is (not repr'd)."""

    def __repr__(self):
        return self


class _SingleIter(_BaseIter):
    """num_workers=0: batches made in this process, as torch does."""

    def __init__(self, loader):
        torch = _torch()
        self.loader = loader
        self.sampler_iter = iter(loader._index_sampler)
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)  # torch's base seed draw
        self.batcher = _Batcher(*loader._spec()[:5])
        self.progress = _Progress(loader.progress)

    def __next__(self):
        try:
            index = next(self.sampler_iter)
            batch = self.batcher.fetch(index)
        except StopIteration:
            self.progress.close()
            raise
        return self._deliver(batch)


class _Progress:
    """progress=True: one line on stderr, rewritten in place, with batches,
    samples/s and bytes/s (of the tensors in the batches)."""

    def __init__(self, on):
        self.on = on
        self.t0 = self.shown = time.monotonic()
        self.batches = self.samples = self.bytes = 0

    def update(self, batch):
        if not self.on:
            return
        self.batches += 1
        sizes = []
        self.bytes += _tensor_bytes(batch, sizes)
        self.samples += sizes[0] if sizes else 1
        now = time.monotonic()
        if now - self.shown >= 0.25:
            self.shown = now
            self._show(now)

    def _show(self, now):
        dt = max(now - self.t0, 1e-9)
        sys.stderr.write(f"\r{self.batches} batches  {self.samples / dt:,.0f} samples/s  "
                         f"{self.bytes / dt / 1e6:,.1f} MB/s")
        sys.stderr.flush()

    def close(self):
        if self.on and self.batches:
            self._show(time.monotonic())
            sys.stderr.write("\n")
            self.on = False


def _tensor_bytes(obj, sizes):
    n = 0
    for t in _tensors_of(obj):
        sizes.append(t.shape[0] if t.dim() else 1)
        n += t.numel() * t.element_size()
    return n


class DataLoader:
    """torch.utils.data.DataLoader, with workers that hand batches over in
    shared memory. Arguments mean what torch's do; shmrpc adds:

    workers: inside an shmrun job, the ranks (names, ranks or WorkerInfo)
        that load for this loader (num_workers is then their number);
    pool_size: bytes of the pool of the job the loader starts (256 MiB by
        default; committed up front). A batch that does not fit is stacked
        outside it and copied once in transit (counted, never an error);
    progress: a progress line on stderr.
    """

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=2, persistent_workers=False, pin_memory_device="",
                 workers=None, pool_size=_DEFAULT_POOL_BYTES, progress=False):
        torch = _torch()
        tud = torch.utils.data
        if workers is not None:
            workers = list(workers)
            num_workers = len(workers)
        if num_workers < 0:
            raise ValueError("num_workers option should be non-negative; "
                             "use num_workers=0 to disable multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if num_workers == 0 and prefetch_factor != 2:
            raise ValueError("prefetch_factor option could only be specified in multiprocessing."
                             "let num_workers > 0 to enable multiprocessing.")
        if prefetch_factor <= 0:
            raise ValueError("prefetch_factor must be positive")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        if multiprocessing_context is not None:
            raise NotImplementedError("shmrpc.data: multiprocessing_context is not supported yet "
                                      "(workers are forked, or given with workers=[...])")
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.workers = workers
        self.pool_size = pool_size
        self.progress = progress
        self._pin = pin_memory and torch.cuda.is_available()
        self._iterable = isinstance(dataset, tud.IterableDataset)
        if self._iterable:
            if shuffle not in {False, None}:
                raise ValueError("DataLoader with IterableDataset: expected unspecified shuffle "
                                 f"option, but got shuffle={shuffle}")
            if sampler is not None:
                raise ValueError("DataLoader with IterableDataset: expected unspecified sampler "
                                 f"option, but got sampler={sampler}")
            if batch_sampler is not None:
                raise ValueError("DataLoader with IterableDataset: expected unspecified "
                                 f"batch_sampler option, but got batch_sampler={batch_sampler}")
        else:
            shuffle = bool(shuffle)
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                                 "shuffle, sampler, and drop_last")
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")
        if sampler is None:
            if self._iterable:
                sampler = itertools.repeat(None)
            elif shuffle:
                sampler = tud.RandomSampler(dataset, generator=generator)
            else:
                sampler = tud.SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = (_InfiniteBatches(batch_size) if self._iterable
                             else tud.BatchSampler(sampler, batch_size, drop_last))
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        self.collate_fn = collate_fn
        self._workers = None  # persistent workers, once started

    @property
    def _auto_collation(self):
        return self.batch_sampler is not None

    @property
    def _index_sampler(self):
        if self._auto_collation:
            return self.batch_sampler
        if self._iterable:
            return itertools.repeat(None)
        return self.sampler

    def _spec(self):
        return (self.dataset, self._iterable, self._auto_collation, self.collate_fn,
                self.drop_last, self.worker_init_fn)

    def __iter__(self):
        if self.num_workers == 0:
            return _SingleIter(self)
        return _Iter(self)

    def __len__(self):
        if self._iterable:
            length = len(self.dataset)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(
                    length / self.batch_size)
            return length
        return len(self._index_sampler)

    def close(self):
        """Stops persistent workers (also done when the loader is collected)."""
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _InfiniteBatches:
    """An iterable dataset's batch sampler: batch_size placeholders, forever."""

    def __init__(self, batch_size):
        self.batch_size = batch_size

    def __iter__(self):
        while True:
            yield [None] * self.batch_size
