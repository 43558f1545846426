"""A model split in two stages on two workers, in the pattern of PyTorch's
"Distributed Pipeline Parallelism Using RPC" tutorial (ResNet50 in two
shards): the master (rank 0) makes each shard with remote() on worker1 and
worker2; each micro-batch goes in as RRef(x), through the first shard with
p1_rref.remote().forward(x_rref) and into the second with
p2_rref.rpc_async().forward(y_rref); the shards' parameters come back as
RRefs for DistributedOptimizer, and distributed autograd trains both.
Small MLP shards with a lock each, as the tutorial's, and synthetic data.

    shmrun -n 3 -- python3 pipeline.py shmrpc
    RANK=r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python3 pipeline.py torch

Rank 0 prints each step's loss and, last, "RESULT {json}".
"""
import json
import os
import sys
import threading

import torch
import torch.nn as nn
import torch.optim as optim

if (sys.argv[1:] or [os.environ.get("TUT_RPC", "torch")])[0] == "shmrpc":
    import shmrpc as rpc
    import shmrpc.autograd as dist_autograd
    from shmrpc.optim import DistributedOptimizer
    RANK, WORLD = int(os.environ["SHMRPC_RANK"]), int(os.environ["SHMRPC_WORLD_SIZE"])
else:
    import torch.distributed.rpc as rpc
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
RRef = rpc.RRef

NUM_BATCHES, BATCH, SPLIT = 5, 12, 4
IN, HIDDEN, NUM_CLASSES = 10, 16, 4


class ShardBase(nn.Module):
    def __init__(self, seed):
        super(ShardBase, self).__init__()
        self._lock = threading.Lock()
        torch.manual_seed(seed)

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = self.seq(x)
        return out.cpu()

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]

    def parameter_values(self):
        return [p.detach().clone() for p in self.parameters()]


class Shard1(ShardBase):
    def __init__(self):
        super(Shard1, self).__init__(seed=1)
        self.seq = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())


class Shard2(ShardBase):
    def __init__(self):
        super(Shard2, self).__init__(seed=2)
        self.seq = nn.Sequential(nn.Linear(HIDDEN, NUM_CLASSES))


class DistNet(nn.Module):
    def __init__(self, split_size, workers):
        super(DistNet, self).__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], Shard1)
        self.p2_rref = rpc.remote(workers[1], Shard2)

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params

    def parameter_values(self):
        return self.p1_rref.rpc_sync().parameter_values() + self.p2_rref.rpc_sync().parameter_values()


def run_master(split_size):
    model = DistNet(split_size, ["worker1", "worker2"])
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.2)
    before = model.parameter_values()
    generator = torch.Generator().manual_seed(0)
    result = {"losses": []}
    for i in range(NUM_BATCHES):
        inputs = torch.randn(BATCH, IN, generator=generator)
        # A rule to learn: the class is the largest of the first classes' inputs.
        labels = torch.zeros(BATCH, NUM_CLASSES).scatter_(
            1, inputs[:, :NUM_CLASSES].argmax(1, keepdim=True), 1)
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        print(f"step {i} loss {loss.item():.6f}")
        result["losses"].append(loss.item())
    result["param_change"] = [(a - b).abs().max().item()
                              for a, b in zip(model.parameter_values(), before)]
    print("RESULT", json.dumps(result), flush=True)


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if RANK == 0:
        rpc.init_rpc("master", rank=RANK, world_size=WORLD)
        run_master(SPLIT)
    else:
        rpc.init_rpc(f"worker{RANK}", rank=RANK, world_size=WORLD)
    rpc.shutdown()


if __name__ == "__main__":
    main()
