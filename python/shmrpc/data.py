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

from ._data_collate import NativeTransform, WorkerInfo, _torch, default_collate, get_worker_info
from ._data_iter import _Iter, _SingleIter

__all__ = ["DataLoader", "get_worker_info", "WorkerInfo", "default_collate", "NativeTransform"]

_DEFAULT_POOL_BYTES = 256 << 20


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
