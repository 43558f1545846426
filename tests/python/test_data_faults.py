"""shmrpc.data.DataLoader when things go wrong: an exception in a worker
(raised in the trainer with the worker's id and traceback), a failing
worker_init_fn, a killed worker (named, with its pid and signal), a
timeout, Ctrl-C, an early break; persistent workers across epochs,
whose pool is back to zero once the batches are dropped; the progress
line. After each case
no worker process is left."""
import os
import re
import signal
import sys
import threading
import time

import torch
import torch.utils.data as tud

import shmrpc.data as sd
from checks import check, failed


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
        with open(f"/proc/self/task/{tid}/children") as f:
            pids += f.read().split()
    return pids


def soon(cond, seconds=5.0):
    """cond() became true within seconds (things settle asynchronously)."""
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def no_children(what):
    check(soon(lambda: not children()), f"{what}: worker processes left: {children()}")


def raises(what, exc_type, pattern, run):
    try:
        run()
    except exc_type as e:
        check(re.search(pattern, str(e), re.S), f"{what}: message {str(e)!r} lacks {pattern!r}")
        return
    except BaseException as e:
        check(False, f"{what}: raised {type(e).__name__}: {e}, not {exc_type.__name__}")
        return
    check(False, f"{what}: nothing raised")


def main():
    raises("exception in a worker", ValueError,
           r"Caught ValueError in DataLoader worker process 1\.\nOriginal Traceback.*"
           r"__getitem__.*item 7 is bad",
           lambda: list(sd.DataLoader(Items(20, 7, "raise"), batch_size=2, num_workers=2)))
    no_children("exception in a worker")

    def bad_init(wid):
        raise KeyError(f"init of {wid}")
    raises("failing worker_init_fn", KeyError,
           r"Caught KeyError in DataLoader worker process 0.*init of 0",
           lambda: list(sd.DataLoader(Items(8), batch_size=2, num_workers=2,
                                      worker_init_fn=bad_init)))
    no_children("failing worker_init_fn")

    t0 = time.monotonic()
    raises("killed worker", RuntimeError,
           r"DataLoader worker 0 \(pid \d+\) exited unexpectedly: killed by signal 9",
           lambda: list(sd.DataLoader(Items(20, 8, "kill"), batch_size=2, num_workers=2)))
    check(time.monotonic() - t0 < 30, "killed worker: took over 30 s")
    no_children("killed worker")

    t0 = time.monotonic()
    raises("timeout", RuntimeError, r"DataLoader timed out after 0.5 seconds",
           lambda: list(sd.DataLoader(Items(8, 0, "sleep"), batch_size=2, num_workers=2,
                                      timeout=0.5)))
    no_children("timeout")
    # The stuck worker (asleep for 3 s) is killed, not waited for: a generous bound.
    check(time.monotonic() - t0 < 2.5, f"timeout: the epoch ended after {time.monotonic() - t0:.1f} s")

    for _ in sd.DataLoader(Items(100), batch_size=2, num_workers=2):
        break
    no_children("early break")

    loader = sd.DataLoader(Items(12), batch_size=3, num_workers=2, persistent_workers=True)
    pids = [set(int(p) for b in loader for p in b[:, 1]) for _ in range(3)]
    check(len(pids[0]) == 2 and pids[0] == pids[1] == pids[2],
          f"persistent workers changed between epochs: {pids}")
    used = lambda: loader._workers.job.pool_stats()[1]  # noqa: E731
    # A worker holds a reply's blocks until the trainer's TENSOR_ACK: settled in a moment.
    check(soon(lambda: used() == 0), f"persistent workers: {used()} bytes of the pool in use "
          "with no batch held")
    kept = next(iter(loader))
    check(used() > 0, "a batch held uses no pool bytes")
    del kept
    check(soon(lambda: used() == 0), "a dropped batch's bytes stay in use")
    loader.close()
    no_children("persistent workers, closed")

    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        n = len(list(sd.DataLoader(Items(40, nap=0.02), batch_size=4, num_workers=2,
                                   progress=True)))
    line = err.getvalue().rstrip("\n").split("\r")[-1]
    check(n == 10 and re.fullmatch(r"10 batches  [\d,]+ samples/s  [\d,.]+ MB/s", line),
          f"progress line: {line!r}")

    def interrupt():
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt).start()
    raises("Ctrl-C", KeyboardInterrupt, "",
           lambda: list(sd.DataLoader(Items(200, nap=0.05), batch_size=2, num_workers=2)))
    no_children("Ctrl-C")
    return failed()


if __name__ == "__main__":
    sys.exit(main())
