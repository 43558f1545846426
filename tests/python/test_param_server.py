# shmrun: -n 2 --pool-size 64M
# needs: has("torch")
"""The torch.distributed.rpc tutorial's parameter server (issue 10), a
2-worker job: rank 0 is the parameter server, the other ranks train its
model through RPC with distributed autograd and DistributedOptimizer. The
tutorial's code, written for torch.distributed.rpc, with only the imports
changed (marked), the model made smaller and MNIST replaced by synthetic
data (no downloads): each trainer's loss must fall over its 20 steps.
shmrun starts the workers, so rank and world size come from the job.

One trainer only: with two, one's optimizer step can land between the
other's forward and backward on the server, whose backward then fails
("modified by an inplace operation"), with torch.distributed.rpc as here
(torch's DistributedOptimizer does not order clients' steps).
Needs shmrpc.RRef(value) (get_param_rrefs). The tutorial's functions start
and shut down RPC under their own worker names: rpc_init = None
(conftest.py), and each rank's role is a test marked for that rank.
"""
import os
import sys
from threading import Lock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim

import shmrpc as rpc                                  # torch.distributed.rpc as rpc
import shmrpc.autograd as dist_autograd              # torch.distributed.autograd
from shmrpc.optim import DistributedOptimizer        # torch.distributed.optim

# The tutorial's Dropout2d on a flat layer: torch 1.13 warns.
pytestmark = pytest.mark.filterwarnings("ignore:dropout2d")
STEPS = 20
BATCH = 32


# --------- The tutorial's code (CPU only, a smaller image) ---------

class Net(nn.Module):
    def __init__(self, num_gpus=0):
        super(Net, self).__init__()
        self.num_gpus = num_gpus
        device = torch.device("cpu")
        self.conv1 = nn.Conv2d(1, 8, 3, 1).to(device)
        self.conv2 = nn.Conv2d(8, 16, 3, 1).to(device)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(144, 64).to(device)
        self.fc2 = nn.Linear(64, 10).to(device)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


class ParameterServer(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        model = Net(num_gpus=num_gpus)
        self.model = model
        self.input_device = torch.device("cpu")

    def forward(self, inp):
        inp = inp.to(self.input_device)
        out = self.model(inp)
        out = out.to("cpu")
        return out

    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        cpu_grads = {}
        for k, v in grads.items():
            k_cpu, v_cpu = k.to("cpu"), v.to("cpu")
            cpu_grads[k_cpu] = v_cpu
        return cpu_grads

    def get_param_rrefs(self):
        param_rrefs = [rpc.RRef(param) for param in self.model.parameters()]
        return param_rrefs

class TrainerNet(nn.Module):
    def __init__(self, num_gpus=0):
        super().__init__()
        self.num_gpus = num_gpus
        self.param_server_rref = rpc.remote(
            "parameter_server", get_parameter_server, args=(num_gpus,))

    def get_global_param_rrefs(self):
        remote_params = remote_method(
            ParameterServer.get_param_rrefs,
            self.param_server_rref)
        return remote_params

    def forward(self, x):
        model_output = remote_method(
            ParameterServer.forward, self.param_server_rref, x)
        return model_output


param_server = None
global_lock = Lock()


def get_parameter_server(num_gpus=0):
    global param_server
    with global_lock:
        if not param_server:
            torch.manual_seed(0)
            param_server = ParameterServer(num_gpus=num_gpus)
        return param_server


def run_parameter_server(rank, world_size):
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
    rpc.shutdown()


def run_training_loop(rank, num_gpus, train_loader):
    net = TrainerNet(num_gpus=num_gpus)
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.03)
    losses = []
    for i, (data, target) in enumerate(train_loader):
        with dist_autograd.context() as cid:
            model_output = net(data)
            target = target.to(model_output.device)
            loss = F.nll_loss(model_output, target)
            losses.append(loss.item())
            dist_autograd.backward(cid, [loss])
            # Ensure that dist autograd ran successfully and gradients were
            # returned.
            assert remote_method(
                ParameterServer.get_dist_gradients,
                net.param_server_rref,
                cid) != {}
            opt.step(cid)
    return losses


def run_worker(rank, world_size, num_gpus, train_loader):
    rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size)
    losses = run_training_loop(rank, num_gpus, train_loader)
    rpc.shutdown()
    return losses


# --------- Synthetic data in place of MNIST ---------

def synthetic_loader(seed):
    """STEPS batches of 1x10x10 images: noise, and a bright column at the
    label's place (a rule the model can learn)."""
    g = torch.Generator().manual_seed(seed)
    columns = torch.eye(10).reshape(10, 1, 1, 10).expand(10, 1, 10, 10) * 10.0
    for _ in range(STEPS):
        target = torch.randint(0, 10, (BATCH,), generator=g)
        data = torch.rand(BATCH, 1, 10, 10, generator=g) * 0.5 + columns[target]
        yield data, target


rpc_init = None  # the tutorial's functions start and shut down RPC


@pytest.mark.rank(0)
def test_parameter_server():
    run_parameter_server(0, int(os.environ["SHMRPC_WORLD_SIZE"]))


@pytest.mark.rank(1)
def test_trainer():
    losses = run_worker(1, int(os.environ["SHMRPC_WORLD_SIZE"]), 0, synthetic_loader(1))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"trainer_1: loss {first:.3f} over the first 5 steps, {last:.3f} over the last 5",
          file=sys.stderr)
    assert len(losses) == STEPS, f"{len(losses)} steps"
    assert last < 0.8 * first, f"trainer_1: the loss falls: {losses}"
