# shmrun: -n 2 --pool-size 1G
"""Arrays and tensors through shmrpc from Python: handed over through the
pool, not pickled. A 256 MiB array made in the pool and written by the
callee is seen written by the caller (nothing was copied); other arrays
arrive equal; torch tensors too when torch is there. Both workers run
every test at once, each calling the other (conftest.py: a module-wide
rank mark), as the script did: two 256 MiB arrays in the pool.
"""
import gc
import os

import numpy as np
import pytest

import shmrpc as rpc


pytestmark = pytest.mark.rank(0, 1)
RANK = int(os.environ.get("SHMRPC_RANK", "0"))
PEER = f"worker{1 - RANK}"


def scribble(a, value):
    a[0] = value
    a[-1] = value
    return None


def echo(x):
    return x


def total(x):
    return float(x.sum())


def test_pool_array_is_shared():
    n = 64 * 1024 * 1024  # 256 MiB of float32
    big = rpc.empty(n, "float32")
    big[:2] = 1.0  # a few spots: filling 256 MiB only measures page faults
    big[-1] = 1.0
    rpc.rpc_sync(PEER, scribble, args=(big, 7.0 + RANK))
    assert big[0] == 7.0 + RANK and big[-1] == 7.0 + RANK and big[1] == 1.0, \
        "the callee's writes to a pool array are seen by the caller"
    back = rpc.rpc_sync(PEER, echo, args=(big,))
    assert back.shape == big.shape and back[0] == big[0], "an array returned as it came"
    back[5] = 3.0
    assert big[5] == 3.0, "the returned array is the same memory"


def test_plain_array():
    plain = np.arange(12, dtype=np.int64).reshape(3, 4)
    got = rpc.rpc_sync(PEER, echo, args=(plain,))
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.shape == (3, 4) \
        and (got == plain).all(), f"an ordinary array arrives equal: {got!r}"
    assert rpc.rpc_sync(PEER, total, args=(plain,)) == 66.0, "the callee reads it"
    rr = rpc.remote(PEER, echo, args=(plain,))
    assert (rr.to_here() == plain).all(), "an array in an RRef"


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.arange(10, dtype=torch.float32)
    got = rpc.rpc_sync(PEER, echo, args=(t,))
    assert isinstance(got, torch.Tensor) and torch.equal(got, t), f"a torch tensor: {got!r}"
    pool_t = rpc.empty((4, 4), "float32", like="torch")
    pool_t.zero_()
    rpc.rpc_sync(PEER, scribble, args=(pool_t.view(-1), 5.0))
    assert pool_t[0, 0].item() == 5.0, "a pool torch tensor written by the callee"


def test_forked_child_drop():
    # A child forked from a worker (as torch's DataLoader forks) that drops
    # its copy of a pool array must not drop the worker's reference: the
    # block stays ours, and a new one is not laid over it.
    kept = rpc.empty(4096, "int32")
    kept[:] = 7
    pid = os.fork()
    if pid == 0:
        del kept
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    fresh = [rpc.empty(4096, "int32") for _ in range(4)]
    for f in fresh:
        f[:] = 9
    assert bool((kept == 7).all()), "a forked child's drop freed the parent's pool block"
