"""The torch.distributed.rpc peer of bench/rref: the same RRef operations,
measured the same way, between two processes on this machine (TensorPipe
backend):
  BENCH torch_rref_remote_to_here value=empty median_ns= p99_ns=
  BENCH torch_rref_remote_to_here value=1MiB_tensor median_ns= p99_ns=
  BENCH torch_rref_proxy_rpc_sync median_ns= p99_ns=
remote(...).to_here() of a function returning None, and of one returning a
1 MiB float32 tensor made once on the owner (bench/rref returns a tensor
made once in its pool: neither measures making it); the proxy is
rref.rpc_sync().get() on an RRef to a small object on the other process.
bench/run.sh hands these lines to bench/rref, which prints its own figures
as ratios against them. Run by Debian's /usr/bin/python3 with python3-torch.
-q: fewer round trips.
"""
import os
import sys
import time

import torch
import torch.distributed.rpc as rpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from torchpeer import init_pair, median_p99, spawn_pair  # noqa: E402

# Made on the owner when it imports this file; only the owner's is sent.
ONES = torch.ones(262144, dtype=torch.float32)


def empty():
    return None


def tensor():
    return ONES


class Box:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


def timed(op, n):
    for _ in range(max(10, n // 10)):
        op()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        op()
        samples.append(time.perf_counter_ns() - t0)
    return median_p99(samples)


def run(rank, port, quick):
    init_pair(rank, port)
    if rank == 0:
        n = 100 if quick else 1000
        med, p99 = timed(lambda: rpc.remote("w1", empty).to_here(), n)
        print(f"BENCH torch_rref_remote_to_here value=empty median_ns={med} p99_ns={p99}",
              flush=True)
        med, p99 = timed(lambda: rpc.remote("w1", tensor).to_here(), n // 4)
        print(f"BENCH torch_rref_remote_to_here value=1MiB_tensor median_ns={med} p99_ns={p99}",
              flush=True)
        box = rpc.remote("w1", Box, args=(7,))
        med, p99 = timed(lambda: box.rpc_sync().get(), n)
        print(f"BENCH torch_rref_proxy_rpc_sync median_ns={med} p99_ns={p99}", flush=True)
        del box
    rpc.shutdown()


if __name__ == "__main__":
    spawn_pair(run, "-q" in sys.argv)
