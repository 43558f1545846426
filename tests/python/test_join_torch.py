# shmrun: none
# needs: has("torch")
"""init_rpc in processes started by torch.multiprocessing.spawn (issue 19),
torch's usual way to start RPC workers: MASTER_ADDR/MASTER_PORT in the
environment, rank from spawn, tensors through the job's pool; a SIGKILLed
rank fails the call pending on it, naming it; torch's
TensorPipeRpcBackendOptions(init_method=...) accepted as options. After
each case no process is left (tests/python/test_join.py: the other routes)."""
import os
import signal

import pytest
import torch
import torch.multiprocessing as tmp

import shmrpc as rpc
from test_join import WAIT, free_port, key_of, nothing_left, stop_resource_tracker  # noqa: F401


def add(a, b):
    return a + b


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def worker(rank, world, case, init_method, out_dir):
    opts = None
    if init_method:
        from torch.distributed.rpc import TensorPipeRpcBackendOptions
        opts = TensorPipeRpcBackendOptions(init_method=init_method)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    said = [f"keeper {rpc._joined.keeper_pid}"]
    if case == "ring":
        t = rpc.rpc_sync(f"w{(rank + 1) % world}", add, args=(torch.ones(4) * rank, torch.ones(4)))
        assert torch.equal(t, torch.ones(4) * (rank + 1)), t
        said.append("ok")
    elif case == "death" and rank == 0:
        try:
            rpc.rpc_sync("w1", die)
            said.append("error: none")
        except Exception as e:  # noqa: BLE001
            said.append(f"error: {e}")
    rpc.shutdown()
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write("\n".join(said) + "\n")


def said(tmp_path, rank):
    with open(tmp_path / f"rank{rank}") as f:
        return f.read().splitlines()


@pytest.mark.parametrize("init_method", [None, "tcp", "file"])
def test_spawn_ring(init_method, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(port))
    im = {None: None, "tcp": f"tcp://127.0.0.1:{port}",
          "file": f"file://{tmp_path}/rendezvous"}[init_method]
    tmp.spawn(worker, args=(3, "ring", im, str(tmp_path)), nprocs=3, join=True)
    keepers = set()
    for r in range(3):
        lines = said(tmp_path, r)
        assert lines[1] == "ok", lines
        keepers.add(lines[0])
    assert len(keepers) == 1
    nothing_left({int(keepers.pop().split()[1])}, [key_of(init_method, port, tmp_path)])


def test_spawn_death(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    # join=False: spawn's own join stops every process at the first death.
    ctx = tmp.spawn(worker, args=(3, "death", None, str(tmp_path)), nprocs=3, join=False)
    for p in ctx.processes:
        p.join(WAIT)
        if p.exitcode is None:
            p.kill()
            p.join()
    assert [p.exitcode for p in ctx.processes] == [0, -signal.SIGKILL, 0]
    lines = said(tmp_path, 0)
    assert "worker 1 (w1)" in lines[1] and "died" in lines[1], lines
    assert said(tmp_path, 2)[0] == lines[0]
    nothing_left({int(lines[0].split()[1])}, [f"tcp:{port}"])
