# shmrun: -n 2 --pool-size 64M
# needs: has("torch") and __import__("torch").cuda.is_available()
# unmet: needs a GPU (torch.cuda.is_available() is false)
"""torch CUDA tensors through shmrpc, on the real driver (skipped where
torch has no CUDA: the needs line): handed over through CUDA IPC, never
pickled nor copied. A torch CUDA tensor written in place by the callee is
seen by the caller, and a receiver reads what the sender's kernels wrote
before the send. Never on the stand-in driver (test_cuda_fake.py's):
rpc_init drops an SHMRPC_LIBCUDA that names it, and once CUDA tensors
went both ways (an agent loads the driver on first use) neither rank has
it mapped.
"""
import os

import torch

import shmrpc as rpc
from test_cuda_fake import fake_cuda_path

PEER = "worker1"  # rank 0's peer


def rpc_init(rank):
    lib = os.environ.get("SHMRPC_LIBCUDA")
    if lib and (os.path.realpath(lib) == fake_cuda_path()
                or os.path.basename(os.path.dirname(lib)) == "fake_cuda"):
        del os.environ["SHMRPC_LIBCUDA"]  # the real driver: libcuda.so.1
    rpc.init_rpc(f"worker{rank}")


# ---- rank 1's functions ----

def add_one(x):
    ok = x.is_cuda
    x.add_(1)  # on the current stream: the reply orders the caller after it
    return ok, x


def total(x):
    return x.sum().item()


def stand_in_mapped():
    """The stand-in driver's mappings in this process (none, on the real driver)."""
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if "fake_cuda" in line]


# ---- the tests ----

def test_written_in_place_and_ordered():
    n = 1 << 20  # sums of up to 7 * 2^20 are exact in float32
    t = torch.zeros(n, device="cuda")
    ok, back = rpc.rpc_sync(PEER, add_one, args=(t,))
    assert ok and back.is_cuda and back.data_ptr() == t.data_ptr(), \
        "the callee got a CUDA tensor; ours came back"
    assert t.sum().item() == n, "the callee's in-place add is seen in our tensor"
    torch.cuda._sleep(200_000_000)  # the kernel below runs late
    t.fill_(7.0)
    assert rpc.rpc_sync(PEER, total, args=(t,)) == 7.0 * n, \
        "the receiver reads what our kernels wrote before the send"
    del t, back


def test_real_driver():
    mapped = [stand_in_mapped(), rpc.rpc_sync(PEER, stand_in_mapped)]
    assert mapped == [[], []], f"the stand-in driver is mapped on rank 0, rank 1: {mapped}"
