# shmrun: -n 2 --pool-size 64M
# needs: has("torch") and __import__("os").access((__import__("os").environ.get("SHMRPC_BUILD") or "build") + "/tests/fake_cuda/libcuda.so.1", 4)
"""init_rpc's rpc_backend_options.device_maps: torch's
TensorPipeRpcBackendOptions, with device_maps and set_device_map, and a
plain object's dict of ints, "cuda:N" strings and torch.device objects,
are accepted; a device map of another device type is refused before the
job is joined. There is no GPU for torch here: the job runs on the
stand-in driver (tests/fake_cuda, two devices; skipped where it is not
built), where the landing itself is tests/tensor_cuda_devmap's to check.
Then rank 0 runs one job of this module as a script per bad map
(`shmrun -n 2 -- python3 test_device_maps.py bad CASE`, its __main__
section), in which init_rpc must fail on both workers with the same
ValueError, torch's text.

The tests start RPC themselves, several times (rpc_init = None,
conftest.py): those marked for both ranks run on both.
"""
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.rpc import TensorPipeRpcBackendOptions

import shmrpc as rpc
from test_cuda_fake import BUILD, fake_cuda_path

rpc_init = None  # the tests start and shut down RPC

BAD = {
    "duplicate": ({0: {"worker1": {0: 1, 1: 1}}},
                  "Node worker0 has duplicated target devices in its device map for worker1"),
    "target": ({1: {"worker0": {"cuda:0": "cuda:7"}}},
               "Node worker1 has target devices with invalid indices in its device map for worker0"),
    "unknown": ({0: {"nosuch": {0: 0}}},
                "Node worker0 has invalid target node names in its device maps"),
    "nocuda": ({1: {"worker0": {0: 1}}},
               "Node worker1 has device maps, but CUDA is not available on this machine"),
}

# A device map from dev is refused before the job is joined, with torch's words.
REFUSED = [("cpu", "CUDA devices, but got device type cpu"),
           ("cuda", "needs device indices"), (1.5, "not float")]


def rank():
    return int(os.environ["SHMRPC_RANK"])


def use_fake_cuda(devices):
    os.environ["SHMRPC_LIBCUDA"] = fake_cuda_path()
    os.environ["FAKE_CUDA_DEVICES"] = str(devices)


class Opts:
    def __init__(self, device_maps):
        self.device_maps = device_maps


@pytest.mark.rank(0, 1)
@pytest.mark.parametrize("dev, want", REFUSED, ids=[repr(d) for d, _ in REFUSED])
def test_refused_before_join(dev, want):
    with pytest.raises((ValueError, TypeError)) as e:  # a device map from dev is accepted
        rpc.init_rpc(f"worker{rank()}", rpc_backend_options=Opts({"worker1": {dev: 0}}))
    assert want in str(e.value), f"a device map from {dev!r}: {e.value}"


@pytest.mark.rank(0, 1)
def test_maps_accepted():
    use_fake_cuda(2)
    if rank() == 0:
        opts = TensorPipeRpcBackendOptions(device_maps={"worker1": {0: 1}})
        opts.set_device_map("worker1", {torch.device("cuda:1"): "cuda:0"})
    else:
        opts = Opts({"worker0": {"cuda:1": torch.device("cuda", 0), 0: 1}})
    rpc.init_rpc(f"worker{rank()}", rpc_backend_options=opts)
    try:
        assert rpc.rpc_sync(f"worker{1 - rank()}", max, args=(rank(), 7)) == 7, "a call with maps"
    finally:
        rpc.shutdown()


@pytest.mark.parametrize("case", BAD)
def test_bad_map(case):
    """A job of this module's __main__ section: init_rpc fails on both workers."""
    shmrun = os.path.join(BUILD, "bin", "shmrun")
    out = subprocess.run([shmrun, "-n", "2", "--", sys.executable, os.path.abspath(__file__),
                          "bad", case], capture_output=True, text=True)
    assert out.returncode == 0, f"the {case} job exited {out.returncode}: {out.stderr}"


def bad(case, rank):
    """A worker of a bad map's job; a failed assert fails it (exit 1)."""
    maps, text = BAD[case]
    if case == "nocuda":
        os.environ["SHMRPC_LIBCUDA"] = "/nonexistent/libcuda.so.1"
    else:
        use_fake_cuda(2)
    with pytest.raises(ValueError) as e:  # init_rpc succeeded on this worker
        rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts(maps.get(rank, {})))
    assert text in str(e.value), f"{case}: worker{rank}'s init_rpc says {e.value}"


if __name__ == "__main__":
    if sys.argv[1:2] != ["bad"] or len(sys.argv) != 3 or sys.argv[2] not in BAD:
        sys.exit(f"usage: {sys.argv[0]} bad {{{','.join(BAD)}}} (a worker of an shmrun job)")
    bad(sys.argv[2], rank())
