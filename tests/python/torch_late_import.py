"""A callee that never imports torch itself (run by tests/python_rpc.c):
torch is imported on an executor thread when the first tensor arrives, and
later calls on that thread must not crash (pybind11 keeps the thread state
of the thread that first imported it: _shmrpc.c's gil_take)."""
import os
import sys

import shmrpc as rpc

from checks import check, failed


def add(a, b):
    return a + b


def main():
    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        try:
            import torch
        except ImportError:
            torch = None
        for _ in range(20 if torch is not None else 0):
            check(rpc.rpc_sync("worker1", add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0],
                  "rpc_sync with a tensor")
            check(rpc.rpc_async("worker1", add, args=(torch.ones(2), 1)).wait().tolist()
                  == [2.0, 2.0], "rpc_async with a tensor")
    else:
        check("torch" not in sys.modules, "worker1 has not imported torch before the calls")
    rpc.shutdown()
    return failed()


if __name__ == "__main__":
    sys.exit(main())
