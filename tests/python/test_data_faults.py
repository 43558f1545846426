# shmrun: none
# needs: has("torch")
"""shmrpc.data.DataLoader when things go wrong: an exception in a worker
(raised in the trainer with the worker's id and traceback), a failing
worker_init_fn, a killed worker (named, with its pid and signal), a
timeout, Ctrl-C, an early break; persistent workers across epochs,
whose pool is back to zero once the batches are dropped; the progress
line. After each case (test) no worker process is left."""
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.utils.data as tud

import shmrpc
import shmrpc.data as sd
from shmrpc import _data_job


class Items(tud.Dataset):
    """n items; item `bad` does `how` ("raise", "kill" or "sleep")."""

    def __init__(self, n, bad=-1, how=None, nap=0.0):
        self.n, self.bad, self.how, self.nap = n, bad, how, nap

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.nap:
            time.sleep(self.nap)
        if i == self.bad:
            if self.how == "raise":
                raise ValueError(f"item {i} is bad")
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "sleep":
                time.sleep(3)
        return torch.tensor([i, os.getpid()])


def children():
    """The pids of this process's children (of every thread)."""
    pids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += f.read().split()
        except FileNotFoundError:
            pass  # a thread that ended since the listing (a loader's leave)
    return pids


def soon(cond, seconds=5.0):
    """cond() became true within seconds (things settle asynchronously)."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(autouse=True)
def no_children():
    yield
    assert soon(lambda: not children()), f"worker processes left: {children()}"


def test_exception_in_a_worker():
    with pytest.raises(ValueError, match=r"(?s)Caught ValueError in DataLoader worker process 1\.\n"
                       r"Original Traceback.*__getitem__.*item 7 is bad"):
        list(sd.DataLoader(Items(20, 7, "raise"), batch_size=2, num_workers=2))


def test_failing_worker_init_fn():
    def bad_init(wid):
        raise KeyError(f"init of {wid}")
    with pytest.raises(KeyError, match=r"(?s)Caught KeyError in DataLoader worker process 0.*"
                       r"init of 0"):
        list(sd.DataLoader(Items(8), batch_size=2, num_workers=2, worker_init_fn=bad_init))


def test_killed_worker():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader worker 0 \(pid \d+\) exited "
                       r"unexpectedly: killed by signal 9"):
        list(sd.DataLoader(Items(20, 8, "kill"), batch_size=2, num_workers=2))
    assert time.monotonic() - t0 < 30, "killed worker: took over 30 s"


def test_timeout():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.5 seconds"):
        list(sd.DataLoader(Items(8, 0, "sleep"), batch_size=2, num_workers=2, timeout=0.5))
    assert soon(lambda: not children()), f"timeout: worker processes left: {children()}"
    # The stuck worker (asleep for 3 s) is killed, not waited for: a generous bound.
    assert time.monotonic() - t0 < 2.5, \
        f"timeout: the epoch ended after {time.monotonic() - t0:.1f} s"


def test_early_break():
    for _ in sd.DataLoader(Items(100), batch_size=2, num_workers=2):
        break


def test_workers_leave_after_the_epoch():
    """Workers that do not persist leave as the program goes on after the
    epoch: new workers each epoch, even one started at once (it waits for
    the last epoch's to leave), and the process is in no job after."""
    loader = sd.DataLoader(Items(12), batch_size=3, num_workers=2)
    pids = [set(int(p) for b in loader for p in b[:, 1]) for _ in range(2)]
    assert len(pids[0]) == 2 and not pids[0] & pids[1], \
        f"workers that do not persist served two epochs: {pids}"
    for _ in loader:
        pass
    # A child forked while the trainer leaves in the background does not
    # wait for its parent's leave (as its exit and init_rpc would).
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)  # stuck: killed
        shmrpc._core._wait_left()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
        f"a child forked during the leave waited for it (status {status:#x})"
    shmrpc._core._wait_left()
    assert not shmrpc._core._initialized, "the last epoch's job was not left"


def failing_leave(job, ranks, real=_data_job._leave_job):
    """The leave after an epoch, then an error as if it had failed."""
    real(job, ranks)
    raise OSError("the leave failed on purpose")


def test_a_failing_background_leave_is_raised(monkeypatch):
    """An error in the leave after an epoch, which a bare thread of its own
    does, is raised (with its cause) where the leave is next waited for:
    the next loader's start; once, then loaders go on."""
    loader = sd.DataLoader(Items(8), batch_size=2, num_workers=2)
    monkeypatch.setattr(_data_job, "_leave_job", failing_leave)
    assert len(list(loader)) == 4, "the epoch before the failing leave"
    # Kept until the leave was waited for: its thread looks _leave_job up
    # when it runs, which may be after the epoch's end.
    with pytest.raises(RuntimeError, match=r"leaving the last epoch's loader job \(workers not "
                       r"persistent\), done in the background after its last batch, failed: "
                       r"OSError: the leave failed on purpose") as e:
        iter(loader)
    monkeypatch.undo()
    assert isinstance(e.value.__cause__, OSError), f"the cause is lost: {e.value.__cause__!r}"
    assert len(list(loader)) == 4, "the epoch after the failing leave"
    shmrpc._core._wait_left()
    assert not shmrpc._core._initialized, "the last epoch's job was not left"


def test_a_failing_background_leave_at_exit():
    """An epoch's failing leave that nothing waited for is said, with its
    traceback, at the interpreter's exit."""
    code = ("import torch, test_data_faults as t, shmrpc.data as sd\n"
            "t._data_job._leave_job = t.failing_leave\n"
            "print(len(list(sd.DataLoader(t.Items(8), batch_size=2, num_workers=2))))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == "4\n", (run.returncode, run.stdout, run.stderr)
    assert re.search(r"(?s)shmrpc: at the interpreter's exit:.*in failing_leave.*OSError: the "
                     r"leave failed on purpose.*RuntimeError: shmrpc.data: leaving the last "
                     r"epoch's loader job", run.stderr), f"at exit, stderr: {run.stderr}"


def test_persistent_workers():
    loader = sd.DataLoader(Items(12), batch_size=3, num_workers=2, persistent_workers=True)
    pids = [set(int(p) for b in loader for p in b[:, 1]) for _ in range(3)]
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2], \
        f"persistent workers changed between epochs: {pids}"
    used = lambda: loader._workers.job.pool_stats()[1]  # noqa: E731
    # A worker holds a reply's blocks until the trainer's TENSOR_ACK: settled in a moment.
    assert soon(lambda: used() == 0), \
        f"persistent workers: {used()} bytes of the pool in use with no batch held"
    kept = next(iter(loader))
    assert used() > 0, "a batch held uses no pool bytes"
    del kept
    assert soon(lambda: used() == 0), "a dropped batch's bytes stay in use"
    loader.close()


def test_progress_line():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        n = len(list(sd.DataLoader(Items(40, nap=0.02), batch_size=4, num_workers=2,
                                   progress=True)))
    line = err.getvalue().rstrip("\n").split("\r")[-1]
    assert n == 10 and re.fullmatch(r"10 batches  [\d,]+ samples/s  [\d,.]+ MB/s", line), \
        f"progress line: {line!r}"


def test_ctrl_c():
    # Python raises KeyboardInterrupt on SIGINT only when it found SIGINT's
    # default disposition at start-up: a background job of a
    # non-interactive shell (`make check &` in a script) inherits SIGINT
    # ignored, and the signal then did nothing ("DID NOT RAISE"). What a
    # Ctrl-C at a terminal reaches is Python's handler: installed here.
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt():
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)
    try:
        threading.Thread(target=interrupt).start()
        with pytest.raises(KeyboardInterrupt):
            list(sd.DataLoader(Items(200, nap=0.05), batch_size=2, num_workers=2))
    finally:
        signal.signal(signal.SIGINT, saved)
