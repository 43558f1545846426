"""Where a short epoch's time goes (issue 23), shmrpc.data's DataLoader and
torch's side by side: the short epoch of bench/dataloader.py (a fresh
loader, workers not persistent, 2 workers, 16 batches of 32 x 4 KiB),
ROUNDS epochs of each loader strictly in turn (shmrpc, torch, shmrpc, ...:
see bench/dataloader.py's short_epochs), and per loader the median of each
phase over its epochs, in ms:

  PHASES <loader> iter= fork= job= attach= w0_init= w0_get= first= b2_16=
         gap= gap_max= end= teardown= leave= gone= epoch=

iter: iter(loader) (the workers' start; fork: the trainer's os.fork calls
in it, parent side; job: shmrpc's _shmrpc.Job; attach: shmrpc's trainer
joining its job). w0_init, w0_get: from iter() to worker 0's
worker_init_fn and to its first __getitem__ (CLOCK_MONOTONIC is one clock
for every process). first: iter() to the first batch. b2_16: the first
batch to the last; gap, gap_max: the median and longest time between two
of those batches. end: the last batch to StopIteration. epoch: iter() to
StopIteration. teardown: del of the iterator and the loader, then a
gc.collect(). leave: shmrpc's background leave still running after that
(_core._wait_left; the next loader's start would wait for it). gone: the
end of the epoch to the last worker process gone (its pid reaped).
w0_init, w1_init: iter() to each worker's worker_init_fn; w0_made,
w1_made: to the end of their first collate; second: to the second batch.
From the third batch on (medians over the batches, then over epochs):
work, work_max: a worker's time to make a batch, from the later of its
previous collate's end and the request's send to its collate's end (the
request's delivery, the wake-up, the samples and the collate); lag,
lag_max: a batch's hand-over, from the later of its collate's end and the
receipt of the batch before to its receipt.

Then, from one more epoch of each (not timed), what each process holds
at the last batch, which may grow with the machine's cores:

  CENSUS <loader> trainer_threads= worker_threads= worker_cpu_ms= worker_minflt=
         worker_nvcsw= worker_nivcsw=

(per worker: the max over the workers of threads, the sum of the rest).
Also the machine (`ENV cpus= affinity= torch_threads= ...`), and os.fork
of this process, then in a forked child each: torch.set_num_threads(1),
which both loaders' workers call first, a whole worker start as shmrpc's
workers do it, torch.manual_seed, and an import of numpy.random (`FORK fork_ms= set_num_threads_ms=
set_worker_ms= manual_seed_ms= numpy_random_ms=`).
w1_joined: shmrpc's worker 1's join (its init_rpc's return). Run from the
repository root:

  SHMRPC_BUILD=build python3 bench/dataloader_phases.py [-q] [--rounds=N]

(-q: 7 rounds, as bench/run.sh passes it.)
"""
import mmap
import os
import platform
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.environ.get("SHMRPC_BUILD", "build"), "python"))

import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402

import shmrpc.data as sd  # noqa: E402
from shmrpc import _core, _shmrpc  # noqa: E402
from shmrpc._data_job import _alive  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dataloader  # noqa: E402 (bench/dataloader.py: its samples)

BATCH = 32
WORKERS = 2
BATCHES = 16
ROUNDS = 15

# Worker marks in memory shared across fork, per worker: the ns of its
# worker_init_fn, of its first __getitem__, of its join (shmrpc's workers:
# shmrpc.init_rpc's return), then of the end of each of its collates (0:
# not yet).
_FIRST_COLLATE = 3
_SLOTS = _FIRST_COLLATE + BATCHES
_MARKS = mmap.mmap(-1, WORKERS * _SLOTS * 8)
_collates = 0  # in a worker: its collates so far


def _mark(worker, slot, once=True):
    off = (worker * _SLOTS + slot) * 8
    if not once or struct.unpack_from("q", _MARKS, off)[0] == 0:
        struct.pack_into("q", _MARKS, off, time.perf_counter_ns())


def _marks(worker):
    return struct.unpack_from(f"{_SLOTS}q", _MARKS, worker * _SLOTS * 8)


def _init_fn(worker_id):
    _mark(worker_id, 0)


def _collate_with(default):
    def collate(samples):
        global _collates
        batch = default(samples)
        _mark(tud.get_worker_info().id, _FIRST_COLLATE + _collates, once=False)
        _collates += 1
        return batch
    return collate


class Samples(dataloader.Samples):
    """bench/dataloader.py's samples, each fetch marked."""

    def __getitem__(self, i):
        _mark(tud.get_worker_info().id, 1)
        return super().__getitem__(i)


def _joins(init_rpc):
    """shmrpc.init_rpc, marking a loader worker's join (slot 2) as it returns."""
    def joined(*a, **k):
        init_rpc(*a, **k)
        info = tud.get_worker_info()
        name = a[0] if a else k.get("name", "")
        if name.startswith("dataloader") and name[10:].isdigit():
            _mark(int(name[10:]), 2)
        elif info is not None:
            _mark(info.id, 2)
    return joined


def _child_costs(runs=5):
    """Medians over runs forked children of this process (ms): os.fork in
    the parent; in the child, torch.set_num_threads(1), as both loaders'
    workers call it first (its cost may grow with the cores: torch builds
    its thread pool anew in a child); then, in another child each, all of
    a worker's start as shmrpc's workers do it (_data_worker._set_worker:
    threads, seeds, worker info), torch.manual_seed alone, and an import
    of numpy.random (numpy 2 imports it at its first use only)."""
    from shmrpc import _data_worker
    out = mmap.mmap(-1, 8)
    steps = {"set_num_threads": lambda: torch.set_num_threads(1),
             "set_worker": lambda: _data_worker._set_worker(1, WORKERS, 12345, None),
             "manual_seed": lambda: torch.manual_seed(12346),
             "numpy_random": lambda: __import__("numpy.random")}
    ms = {"fork": []}
    for name, step in steps.items():
        ms[name] = []
        for _ in range(runs):
            t = time.perf_counter_ns()
            pid = os.fork()
            if pid == 0:
                t1 = time.perf_counter_ns()
                step()
                struct.pack_into("q", out, 0, time.perf_counter_ns() - t1)
                os._exit(0)
            ms["fork"].append(time.perf_counter_ns() - t)
            os.waitpid(pid, 0)
            ms[name].append(struct.unpack_from("q", out, 0)[0])
    return {k: sorted(v)[len(v) // 2] * 1e-6 for k, v in ms.items()}


def _loader(module, ds):
    return module.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, worker_init_fn=_init_fn,
                             collate_fn=_collate_with(module.default_collate))


class _Timed:
    """Adds the time spent in obj.name's calls (this process's side) to
    self.ns while installed."""

    def __init__(self, obj, name):
        self.obj, self.name, self.orig, self.ns = obj, name, getattr(obj, name), 0

    def __enter__(self):
        def timed(*a, **k):
            t = time.perf_counter_ns()
            try:
                return self.orig(*a, **k)
            finally:
                if os.getpid() == me:  # a forked child's return is not the trainer's
                    self.ns += time.perf_counter_ns() - t
        me = os.getpid()
        setattr(self.obj, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.orig)


def _pids(module, it):
    if module is sd:
        return list(it.workers.pids)
    return [w.pid for w in it._workers]




def epoch(module, ds):
    """One fresh loader's epoch: its phases in ms (a dict)."""
    from shmrpc import _data_job
    _MARKS[:] = bytes(len(_MARKS))
    loader = _loader(module, ds)
    with _Timed(os, "fork") as fork, _Timed(_shmrpc, "Job") as job, \
            _Timed(_data_job, "_attach") as attach:
        t0 = time.perf_counter_ns()
        it = iter(loader)
        t_iter = time.perf_counter_ns()
    pids = _pids(module, it)
    c0 = time.process_time_ns()
    got = []
    for _ in it:
        got.append(time.perf_counter_ns())
    t_end = time.perf_counter_ns()
    marks = [_marks(w) for w in range(WORKERS)]
    # Batch k is worker k % WORKERS's (k // WORKERS)th (round robin, in order).
    made = [marks[k % WORKERS][_FIRST_COLLATE + k // WORKERS] for k in range(len(got))]
    c_end = time.process_time_ns()
    del it, loader
    t_down = time.perf_counter_ns()
    _core._wait_left()
    t_left = time.perf_counter_ns()
    while any(_alive(p) for p in pids):
        time.sleep(0.0002)
    t_gone = time.perf_counter_ns()
    gaps = sorted(b - a for a, b in zip(got[1:], got[2:]))
    # From batch 2 on: the worker's time to make a batch (from the later of
    # its previous collate's end and the request's send, to its own
    # collate's end: the request's delivery, the worker's wake-up, its
    # __getitem__s and collate), and its lag (from the later of its
    # collate's end and the trainer's receipt of the batch before, to its
    # receipt: the hand-over when the trainer is ready for it). The
    # iterator sends batch k + prefetch * workers on receiving batch k.
    ahead = 2 * WORKERS
    sent = [t_iter if k < ahead else got[k - ahead] for k in range(len(got))]
    work = sorted(made[k] - max(made[k - WORKERS], sent[k]) for k in range(2, len(got)))
    lag = sorted(got[k] - max(made[k], got[k - 1]) for k in range(1, len(got)))
    ms = 1e-6
    return {"iter": (t_iter - t0) * ms, "fork": fork.ns * ms, "job": job.ns * ms,
            "attach": attach.ns * ms, "w0_init": (marks[0][0] - t0) * ms,
            "w1_joined": (marks[1][2] - t0) * ms if marks[1][2] else float("nan"),
            "w1_init": (marks[1][0] - t0) * ms, "w0_get": (marks[0][1] - t0) * ms,
            "w0_made": (made[0] - t0) * ms, "first": (got[0] - t0) * ms,
            "w1_made": (made[1] - t0) * ms, "second": (got[1] - t0) * ms,
            "b2_16": (got[-1] - got[0]) * ms, "gap": gaps[len(gaps) // 2] * ms,
            "gap_max": gaps[-1] * ms, "work": work[len(work) // 2] * ms,
            "work_max": work[-1] * ms, "lag": lag[len(lag) // 2] * ms, "lag_max": lag[-1] * ms,
            "end": (t_end - got[-1]) * ms, "epoch": (t_end - t0) * ms,
            "trainer_cpu": (c_end - c0) * ms, "teardown": (t_down - t_end) * ms, "leave": (t_left - t_down) * ms,
            "gone": (t_gone - t_end) * ms}


def _proc(pid):
    """(threads, cpu ms, minor faults, voluntary and involuntary switches) of pid."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    threads, minflt = int(fields[17]), int(fields[7])
    cpu = 0  # the threads' run times in ns (stat's ticks are too coarse)
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                cpu += int(f.read().split()[0])
        except OSError:
            pass  # the thread ended
    cpu *= 1e-6
    sw = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                sw[k] = int(v)
    return (threads, cpu, minflt, sw.get("voluntary_ctxt_switches", 0),
            sw.get("nonvoluntary_ctxt_switches", 0))


def census(module, ds):
    loader = _loader(module, ds)
    it = iter(loader)
    for i, _ in enumerate(it):
        if i == BATCHES - 1:
            trainer = _proc(os.getpid())[0]
            per = [_proc(p) for p in _pids(module, it)]
    del it, loader
    _core._wait_left()
    return (f"trainer_threads={trainer} worker_threads={max(p[0] for p in per)} "
            f"worker_cpu_ms={sum(p[1] for p in per):.1f} worker_minflt={sum(p[2] for p in per)} "
            f"worker_nvcsw={sum(p[3] for p in per)} worker_nivcsw={sum(p[4] for p in per)}")


def _numpy_version():
    numpy = sys.modules.get("numpy")
    return numpy.__version__ if numpy is not None else "none"


def main():
    rounds = ROUNDS
    for a in sys.argv[1:]:
        if a.startswith("--rounds="):
            rounds = int(a.split("=", 1)[1])
        elif a == "-q":  # bench/run.sh's quick run
            rounds = 7
        else:
            sys.exit(f"usage: {sys.argv[0]} [-q] [--rounds=N]")
    print(f"ENV cpus={os.cpu_count()} affinity={len(os.sched_getaffinity(0))} "
          f"torch_threads={torch.get_num_threads()} torch={torch.__version__} "
          f"python={platform.python_version()} load={os.getloadavg()[0]:.1f} "
          f"wait={os.environ.get('SHMRPC_WAIT', 'auto')} numpy={_numpy_version()} "
          f"numpy_random_imported={'numpy.random' in sys.modules}", flush=True)
    costs = _child_costs()
    print("FORK " + " ".join(f"{k}_ms={v:.2f}" for k, v in costs.items()), flush=True)
    import shmrpc
    shmrpc.init_rpc = _joins(shmrpc.init_rpc)
    ds = Samples(4 << 10, BATCHES * BATCH)
    modules = {"shmrpc": sd, "torch": tud}
    for name, m in modules.items():  # a warm-up epoch each, not counted
        epoch(m, ds)
    times = {name: [] for name in modules}
    for _ in range(rounds):
        for name, m in modules.items():
            times[name].append(epoch(m, ds))
    for name in modules:
        keys = times[name][0].keys()
        med = {k: sorted(t[k] for t in times[name])[rounds // 2] for k in keys}
        print(f"PHASES {name} " + " ".join(f"{k}={v:.2f}" for k, v in med.items()), flush=True)
    for name, m in modules.items():
        print(f"CENSUS {name} {census(m, ds)}", flush=True)


if __name__ == "__main__":
    main()
