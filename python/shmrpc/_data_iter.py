"""shmrpc.data's iterators: torch's _MultiProcessingDataLoaderIter over
shmrpc calls, the one of num_workers=0, and the progress line. Above
_data_job."""
import itertools
import sys
import time

from . import _marshal, _shmrpc
from ._data_collate import _tensors_of, _torch
from ._data_job import _LoaderJob
from ._data_worker import _Batcher

ABORT_WAIT_MS = 5000  # how long a broken-off epoch waits for a rank's batch in flight


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
            # After a whole epoch, the workers leave as the program goes on
            # (the next loader's start waits for them); after an abort, the
            # caller gets the error once they are gone.
            workers.close(wait=abort)

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
