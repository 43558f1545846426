"""The torch.distributed.rpc peer of bench/rpc: the same calls, measured the
same way, between two processes on this machine (TensorPipe backend).

Prints one BENCH line per figure, named torch_rpc_*; bench/run.sh hands them
to bench/rpc, which prints its own figures as ratios against them.
Run by Debian's /usr/bin/python3 with python3-torch.
"""
import os
import sys
import time

import torch.distributed.rpc as rpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from torchpeer import init_pair, median_p99, spawn_pair  # noqa: E402


def nothing():
    return None


def echo(x):
    return x


def timed_sync(fn, args, n):
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        rpc.rpc_sync("w1", fn, args=args)
        samples.append(time.perf_counter_ns() - t0)
    return median_p99(samples)


def run(rank, port, quick):
    init_pair(rank, port)
    if rank == 0:
        n = 300 if quick else 3000
        for _ in range(100):
            rpc.rpc_sync("w1", nothing)
        med, p99 = timed_sync(nothing, (), n)
        print(f"BENCH torch_rpc_sync median_ns={med} p99_ns={p99}", flush=True)
        calls = 1000 if quick else 10000
        t0 = time.perf_counter_ns()
        futs = [rpc.rpc_async("w1", nothing) for _ in range(calls)]
        for f in futs:
            f.wait()
        dt = time.perf_counter_ns() - t0
        print(f"BENCH torch_rpc_async calls_per_s={calls * 1e9 / dt:.0f}", flush=True)
        for size in (1024, 1 << 20):
            med, p99 = timed_sync(echo, (bytes(size),), n // 3)
            print(f"BENCH torch_rpc_echo size={size} median_ns={med} p99_ns={p99}", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    spawn_pair(run, "-q" in sys.argv)
