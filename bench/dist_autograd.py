"""Distributed autograd (issue 10): the forward+backward step of a 2-worker
model-parallel MLP, on shmrpc and on torch.distributed.rpc +
torch.distributed.autograd (TensorPipe) in the same run. Prints

  BENCH dist_autograd_1MiB step_us= torch_us= vs_torch=
  BENCH dist_autograd_64MiB step_us= torch_us= vs_torch=

with the median step of each (vs_torch: shmrpc/torch, lower is better).
A step, inside a distributed autograd context: w0 computes relu(x @ A),
sends it to w1, which returns relu(h @ B); the loss is its sum; backward
sends the gradient of w1's result to w1 and brings h's back. Each of the
four transfers is an activation of the size named, batch x 16 float32 (a
narrow layer: little compute a byte moved). One torch thread a process:
the machine may have 2 cores.

Run by bench/run.sh with Debian's /usr/bin/python3 (it runs every
bench/*.py); the shmrpc build is $SHMRPC_BUILD (default build). Skips
(exit 0, no lines) without torch or without the package. -q: fewer steps.
"""
import json
import os
import sys
import tempfile

try:
    import torch
except ImportError:
    torch = None

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "lib"))
sys.path.insert(0, here)
from shmrpcjob import package_build  # noqa: E402
from torchpeer import init_pair, spawn_pair  # noqa: E402
from python_rpc import run_shmrpc, timed  # noqa: E402

WIDTH = 16
SIZES = [(1 << 20, "1MiB"), (64 << 20, "64MiB")]
POOL = "1G"  # the four activations of a 64 MiB step, and room to spare

B = {}  # w1's weights, by batch size


def weight(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5).requires_grad_(True)


def stage2(h):
    """On w1: the second layer."""
    return torch.relu(h @ B["w"])


def measure(rpc, dist_autograd, quick):
    """Rank 0's median step times in ns, by size label."""
    a = weight(0)
    fig = {}
    for nbytes, label in SIZES:
        x = torch.randn(nbytes // 4 // WIDTH, WIDTH)

        def step():
            with dist_autograd.context() as cid:
                h = torch.relu(x @ a)
                y = rpc.rpc_sync("w1", stage2, args=(h,))
                dist_autograd.backward(cid, [y.sum()])
        small = nbytes < (8 << 20)
        s = timed(step, (100 if small else 20) if quick else (500 if small else 60),
                  (1000 if quick else 4000) * 1000000)
        fig[label] = s[len(s) // 2]
    return fig


def worker_setup():
    torch.set_num_threads(1)
    B["w"] = weight(1)


def torch_worker(rank, port, quick, out):
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    worker_setup()
    init_pair(rank, port, rpc_timeout=600)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(measure(rpc, dist_autograd, quick), f)
    rpc.shutdown()


def shmrpc_worker(quick, out):
    """Under shmrun: rank 0 measures, rank 1 serves."""
    import shmrpc as rpc
    import shmrpc.autograd as dist_autograd

    worker_setup()
    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"w{rank}")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(measure(rpc, dist_autograd, quick), f)
    rpc.shutdown()


def main():
    quick = "-q" in sys.argv
    if "--worker" in sys.argv:
        shmrpc_worker(quick, sys.argv[sys.argv.index("--worker") + 1])
        return 0
    build = package_build("dist_autograd")
    if build is None:
        return 0
    if torch is None:
        print("dist_autograd: torch is not importable: skipped", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="shmrpc-dist-autograd.") as tmp:
        theirs = os.path.join(tmp, "torch.json")
        spawn_pair(torch_worker, quick, theirs)
        with open(theirs) as f:
            theirs = json.load(f)
        ours = run_shmrpc(build, quick, os.path.join(tmp, "shmrpc.json"), __file__, POOL)
    for _, label in SIZES:
        print(f"BENCH dist_autograd_{label} step_us={ours[label] / 1000:.0f} "
              f"torch_us={theirs[label] / 1000:.0f} vs_torch={ours[label] / theirs[label]:.3g}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
