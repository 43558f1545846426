"""The torch peers of bench/tensor_handoff: a CPU tensor of 1 KiB, 1 MiB,
64 MiB and 1 GiB sent to another process and back, with
torch.distributed.rpc (TensorPipe: the bytes are copied through a socket or
shared memory each way) and with a torch.multiprocessing queue (the tensor
is moved to shared memory and its fd passed). Prints BENCH torch_rpc_tensor
and BENCH torch_mp_tensor lines; bench/tensor_handoff prints its own as
ratios against them. -q: fewer repetitions.

Where torch has CUDA, the same for device tensors of 1 MiB, 64 MiB and
1 GiB (BENCH torch_rpc_cuda_tensor, torch_mp_cuda_tensor): rpc with a
device map (cuda:0 to cuda:0; TensorPipe's CUDA channels), and the queue
(CUDA IPC, spawned: CUDA does not survive fork). torch refuses to send a
CUDA tensor received from another process again, so the queue's child
answers each tensor with a small ack instead of the tensor: a handoff and
an ack, where the CPU queue echoes the tensor itself.
"""
import os
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from torchpeer import init_pair, median_p99, spawn_pair  # noqa: E402

SIZES = [1 << 10, 1 << 20, 64 << 20, 1 << 30]
CUDA_SIZES = [1 << 20, 64 << 20, 1 << 30]


def reps(size, quick):
    n = 200 if size <= (1 << 20) else (10 if size <= (64 << 20) else 3)
    return max(2, n // 10) if quick else n


def echo(t):
    return t


def rpc_echoes(name, sizes, device, quick):
    for size in sizes:
        t = torch.empty(size, dtype=torch.uint8, device=device)
        rpc.rpc_sync("w1", echo, args=(t,))
        samples = []
        for _ in range(reps(size, quick)):
            t0 = time.perf_counter_ns()
            rpc.rpc_sync("w1", echo, args=(t,))
            samples.append(time.perf_counter_ns() - t0)
        print(f"BENCH {name} size={size} median_ns={median_p99(samples)[0]}", flush=True)
        del t


def rpc_worker(rank, port, quick, cuda):
    init_pair(rank, port, rpc_timeout=600, device_map={0: 0} if cuda else None)
    if rank == 0:
        rpc_echoes("torch_rpc_tensor", SIZES, "cpu", quick)
        if cuda:
            rpc_echoes("torch_rpc_cuda_tensor", CUDA_SIZES, "cuda:0", quick)
    rpc.shutdown()


def mp_echo(inq, outq, ack):
    while True:
        t = inq.get()
        if t is None:
            return
        outq.put(True if ack else t)
        del t  # a CUDA tensor: the producer may let it go once acked


def mp_bench(name, sizes, device, method, quick):
    ctx = mp.get_context(method)
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=mp_echo, args=(inq, outq, device != "cpu"))
    p.start()
    for size in sizes:
        t = torch.empty(size, dtype=torch.uint8, device=device)
        if device == "cpu":
            t.share_memory_()
        inq.put(t)
        outq.get()
        samples = []
        for _ in range(reps(size, quick)):
            t0 = time.perf_counter_ns()
            inq.put(t)
            outq.get()
            samples.append(time.perf_counter_ns() - t0)
        print(f"BENCH {name} size={size} median_ns={median_p99(samples)[0]}", flush=True)
    inq.put(None)
    p.join()


if __name__ == "__main__":
    quick = "-q" in sys.argv
    cuda = torch.cuda.is_available()
    spawn_pair(rpc_worker, quick, cuda)
    mp_bench("torch_mp_tensor", SIZES, "cpu", "fork", quick)
    if cuda:
        mp_bench("torch_mp_cuda_tensor", CUDA_SIZES, "cuda:0", "spawn", quick)
