# shmrun: -n 3 --pool-size 64M
# needs: has("torch")
"""shmrpc.optim.DistributedOptimizer and distributed autograd with a dead
worker (issue 10), in a 3-worker job. worker0 trains a model split across 2
and then 3 workers, whose other parts worker1 and worker2 hold and serve
(conftest.py); after every DistributedOptimizer step the gradients and the
parameters must equal those of the same model stepped in one process with
plain torch.

Then worker0 runs a second job, `shmrun --on-failure=continue -n 3 --
python3 test_optim.py` (this module as a plain script: its own roles and
shmrun options), in which worker2 is killed with SIGKILL during a context:
the backward must fail naming worker2, and no context may be left on the
survivors, neither worker0's nor the one worker2 had made.
"""
import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import shmrpc as rpc
from shmrpc.optim import DistributedOptimizer

W = {}  # this worker's parameters, by name


def weights(rows, cols, scale):
    """Fixed weights, the same in every process, that require grad."""
    w = torch.linspace(-1.0, 1.0, rows * cols, dtype=torch.float64).reshape(rows, cols) * scale
    return w.requires_grad_(True)


SHAPES = {"W1": (5, 6, 0.3), "W2": (6, 6, 0.5), "W3": (6, 2, 0.8)}


def make(name):
    """On a parameter's owner: the parameter, anew."""
    W[name] = torch.nn.Parameter(weights(*SHAPES[name]))


def get(name):
    return W[name]


def grad_of(cid, name):
    return rpc.autograd.get_gradients(cid).get(W[name])


def value_of(name):
    return W[name].detach().clone()


def num_optimizers():
    """Local optimizers alive here: live values of RRefs this worker owns."""
    local = sys.modules["shmrpc.optim"]._LocalOptimizer
    return sum(isinstance(v, local) for v in list(rpc._owned.values()))


def num_contexts():
    return rpc.autograd._num_contexts()


def layer1(x):
    return torch.relu(x @ W["W1"])


def layer3(x):
    return x @ W["W3"]


def inputs(step):
    return torch.linspace(-1.0, 1.0, 20, dtype=torch.float64).reshape(4, 5) * (step + 1)


def forward2(x):
    """worker1: layer1; here: W2; the loss."""
    h = rpc.rpc_sync("worker1", layer1, args=(x,))
    return (torch.tanh(h @ W["W2"]) ** 2).sum()


def forward3(x):
    """worker1: layer1; here: W2; worker2: layer3; the loss."""
    h = rpc.rpc_sync("worker1", layer1, args=(x,))
    z = rpc.rpc_async("worker2", layer3, args=(torch.tanh(h @ W["W2"]),)).wait()
    return (z ** 2).sum()


def reference(forward, names, optimizer_class, kwargs, steps):
    """The same model stepped in one process: [(grads, values)] per step."""
    p = {n: torch.nn.Parameter(weights(*SHAPES[n])) for n in names}
    opt = optimizer_class(list(p.values()), **kwargs)
    out = []
    for step in range(steps):
        opt.zero_grad()
        loss = forward(inputs(step), p)
        loss.backward()
        grads = {n: p[n].grad.clone() for n in names}
        opt.step()
        out.append((grads, {n: p[n].detach().clone() for n in names}))
    return out


def ref2(x, p):
    return (torch.tanh(torch.relu(x @ p["W1"]) @ p["W2"]) ** 2).sum()


def ref3(x, p):
    return ((torch.tanh(torch.relu(x @ p["W1"]) @ p["W2"]) @ p["W3"]) ** 2).sum()


OWNERS = {"W1": "worker1", "W2": "worker0", "W3": "worker2"}


def close(a, b):
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b)


@pytest.mark.parametrize("label, forward, ref, names, optimizer_class, kwargs", [
    ("2 workers, SGD", forward2, ref2, ["W1", "W2"], torch.optim.SGD,
     {"lr": 0.05, "momentum": 0.9}),
    ("3 workers, SGD", forward3, ref3, ["W1", "W2", "W3"], torch.optim.SGD,
     {"lr": 0.05, "momentum": 0.9}),
    ("3 workers, Adam", forward3, ref3, ["W1", "W2", "W3"], torch.optim.Adam, {"lr": 0.01}),
], ids=["2 workers, SGD", "3 workers, SGD", "3 workers, Adam"])
def test_split_model(label, forward, ref, names, optimizer_class, kwargs, steps=3):
    for n in names:
        rpc.rpc_sync(OWNERS[n], make, args=(n,))
    # worker0's own parameter goes through an RRef to itself, like the others.
    rrefs = [rpc.remote(OWNERS[n], get, args=(n,)) for n in names]
    opt = DistributedOptimizer(optimizer_class, rrefs, **kwargs)
    want = reference(ref, names, optimizer_class, kwargs, steps)
    for step in range(steps):
        with rpc.autograd.context() as cid:
            loss = forward(inputs(step))
            rpc.autograd.backward(cid, [loss])
            grads = {n: rpc.rpc_sync(OWNERS[n], grad_of, args=(cid, n)) for n in names}
            opt.step(cid)
        values = {n: rpc.rpc_sync(OWNERS[n], value_of, args=(n,)) for n in names}
        for n in names:
            assert close(grads[n], want[step][0][n]), \
                f"{label}: step {step}: {n}'s gradient {grads[n]} vs {want[step][0][n]}"
            assert close(values[n], want[step][1][n]), \
                f"{label}: step {step}: {n} after the step {values[n]} vs {want[step][1][n]}"
    assert W["W2"].grad is not None, f"{label}: the owner's optimizer stepped W2 itself"
    del opt, rrefs
    gc.collect()
    owners = sorted({OWNERS[n] for n in names})
    left = wait_for(lambda: [rpc.rpc_sync(o, num_optimizers) for o in owners],
                    [0] * len(owners))
    assert left == [0] * len(owners), f"{label}: owners dropped their optimizers: {left}"


def wait_for(probe, want, seconds=10.0):
    """probe() once it gives want, or its last value after seconds (what
    is waited for is asynchronous; the bound only keeps a bug from hanging)."""
    end = time.monotonic() + seconds
    got = probe()
    while got != want and time.monotonic() < end:
        time.sleep(0.01)
        got = probe()
    return got


def test_errors():
    rpc.rpc_sync("worker1", make, args=("W1",))
    rrefs = [rpc.remote("worker1", get, args=("W1",))]
    with pytest.raises(ValueError, match="Invalid learning rate"):  # the owner's error
        DistributedOptimizer(torch.optim.SGD, rrefs, lr=-1.0)
    opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.1)
    with rpc.autograd.context() as cid:
        pass
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        opt.step(cid)


def test_no_context_left():
    live = [rpc.rpc_sync(f"worker{r}", num_contexts) for r in range(3)]
    assert live == [0, 0, 0], f"no context left on any worker: {live}"


def test_dead_worker():
    """Runs this module as a script, the dead-worker job (below)."""
    shmrun = os.readlink(f"/proc/{os.getppid()}/exe")  # a worker's parent is shmrun
    argv = [shmrun, "-n", "3", "--on-failure=continue", "--pool-size", "64M", "--timeout", "60",
            "--", sys.executable, os.path.abspath(__file__)]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = r.stdout
    assert r.returncode == 1, \
        f"dead worker: the job exits 1 (a worker was killed): {r.returncode}\n{out}"
    for rank in (0, 1):
        assert f"dead-worker rank {rank}: ok" in out, f"dead worker: rank {rank} passed\n{out}"


# The dead-worker job.

def echo(x):
    return x


def nothing():
    return None


def nested(x):
    """On worker1: through worker2."""
    return rpc.rpc_sync("worker2", layer3, args=(torch.tanh(x) * 2.0,))


def orphan():
    """On worker2: a context reaching worker0 and worker1, left open: its
    maker dies holding it."""
    cm = rpc.autograd.context()
    cid = cm.__enter__()
    x = weights(2, 6, 1.0)
    for w in ("worker0", "worker1"):
        rpc.rpc_sync(w, echo, args=(x,))
    W["orphan"] = (cm, x)
    return cid


def dead_worker(rank):
    """A rank of the dead-worker job; a failed assert fails it (exit 1)."""
    W["W3"] = weights(*SHAPES["W3"])
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        orphan_cid = rpc.rpc_sync("worker2", orphan)
        assert [rpc.rpc_sync(f"worker{r}", num_contexts) for r in (0, 1)] == [1, 1], \
            "worker2's context reached worker0 and worker1"
        pid2 = rpc.rpc_sync("worker2", os.getpid)
        x = weights(3, 6, 0.4)
        with rpc.autograd.context() as cid:
            direct = rpc.rpc_sync("worker2", layer3, args=(x,))
            through = rpc.rpc_sync("worker1", nested, args=(x,))
            loss = (direct * through).sum()
            os.kill(pid2, signal.SIGKILL)
            wait_for(lambda: probe_dead("worker2"), True)
            with pytest.raises(RuntimeError, match=r"worker 2 \(worker2\) died"):
                rpc.autograd.backward(cid, [loss])  # needs the dead worker
        live = [num_contexts(), rpc.rpc_sync("worker1", num_contexts)]
        assert live == [0, 0], f"no context left on worker0 and worker1: {live}"
        # worker2's context was released
        with pytest.raises(RuntimeError, match="Could not find autograd context"):
            rpc.autograd.get_gradients(orphan_cid)
    if rank != 2:
        rpc.shutdown()
        print(f"dead-worker rank {rank}: ok", flush=True)
        return 0
    signal.pause()  # worker2 waits for its SIGKILL
    return 1


def probe_dead(name):
    try:
        rpc.rpc_sync(name, nothing, timeout=1)
        return False
    except RuntimeError as e:
        return "died" in str(e)


if __name__ == "__main__":
    sys.exit(dead_worker(int(os.environ["SHMRPC_RANK"])))
