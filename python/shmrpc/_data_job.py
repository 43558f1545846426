"""shmrpc.data's trainer side of a loader's workers: the job it forks them
into (or the ranks of its own job it loads with), its requests to them, and
its end. Above _data_worker."""
import _thread
import itertools
import os
import pickle
import sys
import time

from . import _core, _marshal, _shmrpc
from ._data_collate import _torch
from ._data_worker import (_OneThread, _child_main, _job_env, _w_fetch, _w_forget, _w_leave,
                           _w_setup)

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
        _core._wait_left()  # the last epoch's job, if it is still being left
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
        self.job = _shmrpc.Job(names, loader.pool_size, *_job_sizes(loader.pool_size))
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

    def close(self, wait=True):
        """Ends the workers' part in this loader. wait False (the end of an
        epoch of workers that do not persist): a job this process forked
        is left by a thread of its own (_core._leaving), so that the epoch
        ends with its last batch, as the program goes on."""
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
        if wait:
            _leave_job(job, self.ranks)
            return
        # A bare thread: threading.Thread's start waits for the new thread
        # to run (1-2 ms of the epoch's end on the loaded 2-core VM).
        leaving = _thread.allocate_lock()
        leaving.acquire()
        _thread.start_new_thread(_leave_in_background, (job, self.ranks, leaving))
        _core._leaving = leaving


def _leave_in_background(job, ranks, leaving):
    try:
        _leave_job(job, ranks)
    except BaseException as e:
        _core._leave_error = e  # raised by whoever waits for the lock next
    finally:
        leaving.release()


def _leave_job(job, ranks):
    """This process and the workers ranks leave the loader's job. It has
    nothing to gather at its end (no RRefs; every call was waited for):
    once each worker has answered its leave, every process leaves on its
    own, and a graceful shutdown's gathers and barrier (8 ms, a short
    epoch's seventh) buy nothing."""
    import shmrpc
    leaves = []
    for r in ranks:
        try:
            leaves.append(shmrpc.rpc_async(r, _w_leave))
        except RuntimeError:
            pass  # it died: the job's watcher has its cause
    for fut in leaves:
        try:
            fut.wait()
        except Exception:
            pass  # it died meanwhile: as above
    try:
        shmrpc.shutdown(graceful=False)
    finally:
        # The workers' exits (a few ms each: a forked trainer's address
        # space to tear down) are not waited for here: a thread of the
        # job reaps them and frees the job, kept in _closing until it
        # is done (the interpreter's exit waits for it).
        job.close(5000, False)
        _closing[:] = [j for j in _closing if not j.closed()] + [job]


# A loader's job makes no RRefs, and its pool holds batches: shmrun's
# defaults (65536 RRefs, 2^18 block records, 2^18 holder records per rank)
# are 25 MiB committed at creation, 8 ms of a short epoch's start. Here a
# record per 8 KiB of pool (a 64 B block per record in the worst case would
# be a waste of records nobody makes: batches are bigger), and holder tables
# twice that, so no rank's table fills before the records run out: a
# worker whose block does not fit then stacks its batch outside the pool
# (_pool_stack), never an error. 256 MiB: 1.5 MiB committed, not 25.
# The pool holds nothing but the batches in flight (prefetch_factor per
# worker, and those the program holds), so it keeps every freed block's
# pages committed (its retain budget: the whole pool) for the next batches:
# with shmrun's budget (an eighth of the pool, 256 MiB at most) a batch
# larger than that was committed (fallocate, zeroed pages, a page fault
# each) and punched out again (a TLB shootdown in every process) per batch.
# What stays committed is the most that was in flight, until the job ends
# (each epoch's end for workers that do not persist).
_JOB_RREFS = 64
_POOL_BYTES_PER_RECORD = 8 << 10
_MIN_POOL_RECORDS = 4096


def _job_sizes(pool_bytes):
    """(max_rrefs, pool_records, holder_records, pool_retain) of a loader's job."""
    records = max(_MIN_POOL_RECORDS, pool_bytes // _POOL_BYTES_PER_RECORD)
    records = min(records, 1 << 22)  # the pool's default cap
    return _JOB_RREFS, records, 1 << (2 * records - 1).bit_length(), pool_bytes


_closing = []  # jobs whose close(wait=False) may still run


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


def _attach(name, world, fds):
    """This process joins the loader's job as rank 0 (with duplicates of
    its memfds: the agent closes what it attaches)."""
    import shmrpc
    dups = [os.dup(fd) for fd in fds]
    env = _job_env(0, world, name, dups)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        shmrpc.init_rpc(name, rpc_backend_options=_OneThread())
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
