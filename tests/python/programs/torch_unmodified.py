"""A torch.distributed.rpc program, written for torch and not changed for
shmrpc: tests/python/test_as_torch.py runs it under
`shmrun -n 2 -- python3 -m shmrpc.as_torch` and on torch itself, and
compares what it prints. Ranks and the world size come from RANK and
WORLD_SIZE, as torchrun (and shmrun) set them.
"""
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x_rref):
        self.calls += 1
        return torch.tanh(self.lin(x_rref.to_here()))

    def params(self):
        return [rpc.RRef(p) for p in self.parameters()]

    def count(self):
        return self.calls


@rpc.functions.async_execution
def add_later(x):
    fut = torch.futures.Future()
    fut.set_result(x + 1)
    return fut


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=30)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        print("timeout", rpc.get_rpc_timeout())
        stage = rpc.remote("worker1", Stage)
        opt = DistributedOptimizer(torch.optim.SGD, stage.rpc_sync().params(), lr=0.1)
        torch.manual_seed(0)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        for step in range(4):
            with dist_autograd.context() as cid:
                out = stage.rpc_sync().forward(rpc.RRef(x))
                loss = ((out - y) ** 2).mean()
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
            print(f"step {step} loss {loss.item():.6f}")
        futs = [rpc.rpc_async("worker1", add_later, args=(i,)) for i in range(3)]
        print("wait_all", torch.futures.wait_all(futs))
        print("calls", stage.rpc_sync().count())
    rpc.shutdown()


if __name__ == "__main__":
    main()
