"""What the bench scripts share: two processes joined by
torch.distributed.rpc (TensorPipe), and medians. torch is imported only
when a pair is started, so bench/python_rpc.py runs without it."""
import os
import socket


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_pair(rank, port, rpc_timeout=120, device_map=None):
    """Joins the pair as worker w<rank> (w0 measures, w1 serves); device_map
    ({w0's device: w1's}, for CUDA tensors): w0's map for w1, whose replies
    come back by its inverse."""
    import torch.distributed.rpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=rpc_timeout)
    if device_map and rank == 0:
        opts.set_device_map("w1", device_map)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)


def spawn_pair(fn, *args):
    """fn(rank, port, *args) in two processes, on a free port."""
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(free_port(),) + args, nprocs=2, join=True)


def median_p99(samples):
    """(median, p99) of samples, sorted in place."""
    samples.sort()
    return samples[len(samples) // 2], samples[len(samples) * 99 // 100]
