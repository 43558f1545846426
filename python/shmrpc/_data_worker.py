"""shmrpc.data inside a loader worker: its batcher (torch's fetchers),
the requests the trainer sends it (_w_setup, _w_fetch, _w_forget,
_w_leave), and a forked worker's life (_child_main). Above _data_collate."""
import os
import random
import signal
import sys
import threading
import traceback

from . import _data_collate, _shmrpc
from ._data_collate import WorkerInfo, _convert, _torch, default_collate

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
# Clear while a forked worker sets itself up after joining (_child_main).
_set_up = threading.Event()
_set_up.set()
_init_errors = {}  # loader key -> the text of worker_init_fn's failure


def _set_worker(worker_id, num_workers, base_seed, dataset):
    """torch's worker start: one thread, seeds from base_seed, worker info."""

    torch = _torch()
    torch.set_num_threads(1)
    seed = base_seed + worker_id
    random.seed(seed)
    if torch.backends.cuda.is_built():
        torch.manual_seed(seed)
    else:
        # torch.manual_seed's CUDA part, with no CUDA to seed, is a queued
        # seeding that formats the stack (traceback.format_stack): 1.5 ms
        # of a worker's start, on the first batch's path.
        torch.default_generator.manual_seed(seed)
    if "numpy" in sys.modules:
        from torch.utils.data._utils import worker as torch_worker
        _seed_numpy(torch_worker._generate_state(base_seed, worker_id))
    info = WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
    _data_collate._worker_info = info  # get_worker_info's, and the collate's sign
    # torch.utils.data.get_worker_info() reads this module global of torch's.
    from torch.utils.data._utils import worker as torch_worker
    torch_worker._worker_info = info


_numpy_seeding = None  # the _SeedAtImport of numpy.random, while it waits


def _seed_numpy(state):
    """np.random.seed(state), as torch's workers do. numpy 2 imports
    numpy.random at its first use (np.random's first lookup), and its import
    in a fresh worker is most of the worker's start: 22 ms of 24 on the
    16-core machine, on the first batch's path (the trainer's attach waits
    for the join that follows the setup) and the second's (the last
    worker's setup). So until it is imported it is seeded as its import
    ends, before anyone can draw from it: the numbers drawn are torch's,
    and a worker that never draws pays nothing."""
    global _numpy_seeding
    if _numpy_seeding is not None:
        _numpy_seeding.cancel()  # a former loader's, on a rank of a job
        _numpy_seeding = None
    module = sys.modules.get("numpy.random")
    if module is not None:
        module.seed(state)
    else:
        _numpy_seeding = _SeedAtImport("numpy.random", state)


class _SeedAtImport:
    """A sys.meta_path finder for one module not imported yet: the module is
    found and run as it would be without it, then module.seed(state) runs;
    the finder leaves once the module is imported (not at a mere
    importlib.util.find_spec, which imports nothing)."""

    def __init__(self, name, state):
        self.name, self.state = name, state
        sys.meta_path.insert(0, self)

    def cancel(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass  # it left at the import

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _SeedAfterExec(spec.loader, self)
        return spec


class _SeedAfterExec:
    """A module's own loader, then module.seed(state) and the finder's
    leave. The module keeps its own loader (its __loader__ and
    __spec__.loader)."""

    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        module.seed(self.finder.state)
        self.finder.cancel()

    def __getattr__(self, name):
        return getattr(self.loader, name)


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
        _set_up.wait()
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
        return ("error",) + _error_text(_data_collate._worker_info.id)
    except Exception:
        return ("error",) + _error_text(_data_collate._worker_info.id)


def _w_forget(key):
    _batchers.pop(key, None)
    _init_errors.pop(key, None)


_leave = threading.Event()  # set in a forked worker when its trainer closes the job


def _w_leave():
    _leave.set()


def _job_env(rank, world, name, fds):
    """What the agent's init reads to join the loader's job as rank, as
    shmrun gives it (fds: the job's segment, pool and RRef table)."""
    return {"SHMRPC_RANK": str(rank), "SHMRPC_WORLD_SIZE": str(world), "SHMRPC_NAME": name,
            "SHMRPC_JOB_FD": str(fds[0]), "SHMRPC_POOL_FD": str(fds[1]),
            "SHMRPC_RREF_FD": str(fds[2]), "SHMRPC_JOB_INO": str(os.fstat(fds[0]).st_ino)}


def _child_main(key, spec, worker_id, num_workers, base_seed, names, fds, parent):
    """A forked worker: joins the job, serves fetches until the trainer
    leaves, and exits without running the trainer's cleanup."""
    code = 1
    try:
        _shmrpc.die_with_parent(parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
        rank = worker_id + 1
        os.environ.update(_job_env(rank, num_workers + 1, names[rank], fds))
        # The setup (seeds, worker_init_fn) takes milliseconds, and the
        # join waits for every rank. A worker forked before the last sets
        # itself up first, while the trainer forks the next ones; the last
        # joins first (the trainer waits for it) and sets up while the
        # trainer's start goes on: a fetch that comes meanwhile waits for
        # the setup (_w_fetch).
        import shmrpc
        if worker_id < num_workers - 1:
            _w_setup(key, spec, worker_id, num_workers, base_seed)
            shmrpc.init_rpc(names[rank], rpc_backend_options=_OneThread())
        else:
            _set_up.clear()
            shmrpc.init_rpc(names[rank], rpc_backend_options=_OneThread())
            try:
                _w_setup(key, spec, worker_id, num_workers, base_seed)
            finally:
                _set_up.set()
        # Waits for the trainer's leave without a wake-up (a graceful
        # shutdown barrier would poll the other ranks every 200 us
        # meanwhile, on cores the loader shares). The trainer has had every
        # reply when it asks to leave: nothing is left to wait for.
        _leave.wait()
        shmrpc.shutdown(graceful=False)
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
    requests run in arrival order without waiting for their turn. The
    trainer, whom nobody calls, starts (and at the epoch's end joins) one
    thread, not the default 16."""
    num_worker_threads = 1
