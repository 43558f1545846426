"""A batch-updating parameter server in the pattern of PyTorch's RPC tutorial
("Implementing Batch RPC Processing Using Asynchronous Executions"): the
server object lives on rank 0 behind an RRef; each trainer fetches the model
through the RRef, sends its gradients with update_and_fetch_model (an
async_execution function that steps the server's optimizer once every
trainer's gradients are in), and asks the server for a forward of its batch
at each step: that forward must see the model the last update made. The
model is a small MLP and the data synthetic (no downloads).

    shmrun -n 3 -- python3 param_server.py shmrpc
    RANK=r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python3 param_server.py torch

Rank 0 prints each trainer's losses and, last, a line "RESULT {json}".
"""
import json
import os
import sys
import threading

import torch
import torch.nn as nn
from torch import optim

if (sys.argv[1:] or [os.environ.get("TUT_RPC", "torch")])[0] == "shmrpc":
    import shmrpc as rpc
    RANK, WORLD = int(os.environ["SHMRPC_RANK"]), int(os.environ["SHMRPC_WORLD_SIZE"])
else:
    import torch.distributed.rpc as rpc
    RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

NUM_TRAINERS = WORLD - 1
STEPS = 6
BATCH = 16
IN, HIDDEN, OUT = 8, 16, 4


class BatchUpdateParameterServer(object):
    def __init__(self, batch_update_size=NUM_TRAINERS):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    def forward(self, inputs):
        with torch.no_grad():
            return self.model(inputs)

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


class Trainer(object):
    def __init__(self, ps_rref):
        self.ps_rref, self.loss_fn = ps_rref, nn.MSELoss()
        self.generator = torch.Generator().manual_seed(RANK)

    def get_next_batch(self):
        for _ in range(STEPS):
            inputs = torch.randn(BATCH, IN, generator=self.generator)
            # A rule to learn: the label is the largest of the first OUT inputs.
            labels = torch.zeros(BATCH, OUT).scatter_(1, inputs[:, :OUT].argmax(1, keepdim=True), 1)
            yield inputs, labels

    def train(self):
        losses, server_losses = [], []
        m = self.ps_rref.rpc_sync().get_model()
        for inputs, labels in self.get_next_batch():
            # A forward on the server sees the model that the last update made.
            server_losses.append(self.loss_fn(self.ps_rref.rpc_sync().forward(inputs), labels).item())
            loss = self.loss_fn(m(inputs), labels)
            losses.append(loss.item())
            loss.backward()
            m = rpc.rpc_sync(
                self.ps_rref.owner(),
                BatchUpdateParameterServer.update_and_fetch_model,
                args=(self.ps_rref, [p.grad for p in m.cpu().parameters()]),
            )
        return losses, server_losses


def run_trainer(ps_rref):
    trainer = Trainer(ps_rref)
    return trainer.train()


def run_ps(trainers):
    ps = BatchUpdateParameterServer()
    ps_rref = rpc.RRef(ps)
    before = [p.detach().clone() for p in ps.model.parameters()]
    futs = [rpc.rpc_async(trainer, run_trainer, args=(ps_rref,)) for trainer in trainers]
    results = torch.futures.wait_all(futs)
    result = {"losses": {}, "server_losses": {}}
    for trainer, (losses, server_losses) in zip(trainers, results):
        for step, (loss, server_loss) in enumerate(zip(losses, server_losses)):
            print(f"{trainer} step {step} loss {loss:.6f} server's forward {server_loss:.6f}")
        result["losses"][trainer] = losses
        result["server_losses"][trainer] = server_losses
    model = ps_rref.local_value().model
    result["same_object"] = ps_rref.local_value() is ps
    result["param_change"] = max((p.detach() - b).abs().max().item()
                                 for p, b in zip(model.parameters(), before))
    print("RESULT", json.dumps(result), flush=True)


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if RANK == 0:
        rpc.init_rpc("ps", rank=RANK, world_size=WORLD)
        run_ps([f"trainer{r}" for r in range(1, WORLD)])
    else:
        rpc.init_rpc(f"trainer{RANK}", rank=RANK, world_size=WORLD)
    rpc.shutdown()


if __name__ == "__main__":
    main()
