# shmrun: -n 2
# needs: has("torch")
"""A default job (no --pool-size, issue 20): a plain 256 MiB torch tensor,
made by torch outside the pool, goes to the other worker and comes back
equal; then a 1 MiB one is sent and freed, and the 256 MiB one still goes
(the pool coalesces what is freed, and by default may grow to half of the
machine's memory)."""
import torch

import shmrpc as rpc

PEER = "worker1"


def ends(x):
    return float(x[0]), float(x[-1]), x.numel()


def echo(x):
    return x


def test_plain_256mib_torch_tensor():
    n = 64 * 1024 * 1024  # 256 MiB of float32
    t = torch.zeros(n, dtype=torch.float32)
    t[0], t[-1] = 1.0, 2.0
    assert rpc.rpc_sync(PEER, ends, args=(t,)) == (1.0, 2.0, n), "the callee reads it"
    small = torch.ones(256 * 1024)  # 1 MiB
    assert rpc.rpc_sync(PEER, ends, args=(small,)) == (1.0, 1.0, small.numel())
    del small
    back = rpc.rpc_sync(PEER, echo, args=(t,))
    assert back.shape == t.shape and float(back[0]) == 1.0 and float(back[-1]) == 2.0, \
        "the 256 MiB tensor comes back equal after a 1 MiB one came and went"
