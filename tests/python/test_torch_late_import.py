# shmrun: -n 2 --pool-size 64M
# needs: has("torch")
"""A callee that never imports torch itself: torch is imported on an
executor thread of worker1 when the first tensor arrives, and later calls
on that thread must not crash (pybind11 keeps the thread state of the
thread that first imported it: _shmrpc.c's gil_take). Nothing here imports
torch at the top: worker1 imports this module too.
"""
import sys

import shmrpc as rpc


def add(a, b):
    return a + b


def torch_imported():
    return "torch" in sys.modules


def test_torch_imported_on_an_executor_thread():
    assert not rpc.rpc_sync("worker1", torch_imported), \
        "worker1 has not imported torch before the calls"
    import torch

    for _ in range(20):
        assert rpc.rpc_sync("worker1", add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0], \
            "rpc_sync with a tensor"
        assert rpc.rpc_async("worker1", add, args=(torch.ones(2), 1)).wait().tolist() \
            == [2.0, 2.0], "rpc_async with a tensor"
