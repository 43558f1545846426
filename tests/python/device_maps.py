"""init_rpc's rpc_backend_options.device_maps (run by tests/python_rpc.c):
torch's TensorPipeRpcBackendOptions, with device_maps and set_device_map,
and a plain object's dict of ints, "cuda:N" strings and torch.device
objects, are accepted; a device map of another device type is refused
before the job is joined. There is no GPU for torch here: the job runs on
the stand-in driver (tests/fake_cuda, two devices), where the landing
itself is tests/tensor_cuda_devmap's to check. Then rank 0 runs one job of
this script per bad map ("bad CASE"), in which init_rpc must fail on both
workers with the same ValueError, torch's text.
"""
import os
import subprocess
import sys

import shmrpc as rpc

from checks import check, failed

BUILD = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(rpc.__file__))))

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


def use_fake_cuda(devices):
    os.environ["SHMRPC_LIBCUDA"] = os.path.join(BUILD, "tests", "fake_cuda", "libcuda.so.1")
    os.environ["FAKE_CUDA_DEVICES"] = str(devices)


class Opts:
    def __init__(self, device_maps):
        self.device_maps = device_maps


def bad(case, rank):
    maps, text = BAD[case]
    if case == "nocuda":
        os.environ["SHMRPC_LIBCUDA"] = "/nonexistent/libcuda.so.1"
    else:
        use_fake_cuda(2)
    try:
        rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts(maps.get(rank, {})))
        check(False, f"{case}: init_rpc succeeded on worker{rank}")
    except ValueError as e:
        check(text in str(e), f"{case}: worker{rank}'s init_rpc says {e}")
    return failed()


def main():
    rank = int(os.environ["SHMRPC_RANK"])
    if sys.argv[1:2] == ["bad"]:
        return bad(sys.argv[2], rank)

    # Refused before the job is joined, with torch's words.
    for dev, want in (("cpu", "CUDA devices, but got device type cpu"),
                      ("cuda", "needs device indices"), (1.5, "not float")):
        try:
            rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts({"worker1": {dev: 0}}))
            check(False, f"a device map from {dev!r} is accepted")
        except (ValueError, TypeError) as e:
            check(want in str(e), f"a device map from {dev!r}: {e}")

    import torch
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

    use_fake_cuda(2)
    if rank == 0:
        opts = TensorPipeRpcBackendOptions(device_maps={"worker1": {0: 1}})
        opts.set_device_map("worker1", {torch.device("cuda:1"): "cuda:0"})
    else:
        opts = Opts({"worker0": {"cuda:1": torch.device("cuda", 0), 0: 1}})
    rpc.init_rpc(f"worker{rank}", rpc_backend_options=opts)
    check(rpc.rpc_sync(f"worker{1 - rank}", max, args=(rank, 7)) == 7, "a call with maps")
    rpc.shutdown()

    if rank == 0:
        shmrun = os.path.join(BUILD, "bin", "shmrun")
        for case in BAD:
            out = subprocess.run([shmrun, "-n", "2", "--", sys.executable, __file__, "bad", case],
                                 capture_output=True, text=True)
            check(out.returncode == 0, f"the {case} job exited {out.returncode}: {out.stderr}")
    return failed()


if __name__ == "__main__":
    sys.exit(main())
