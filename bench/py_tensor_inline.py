"""Small plain torch tensors from Python, inline against the pool: an
rpc_sync echo of a torch.uint8 tensor made by torch (not in shmrpc's pool),
as most programs send them, in a two-worker shmrpc job run with
SHMRPC_INLINE_MAX=0 (every tensor copied into a pool block, pinned and
acknowledged: the path before inline tensors) and with it at 64 KiB (every
size below goes inside the frame). Prints

  BENCH py_tensor_echo tensor=plain path=pool size=S median_ns=
  BENCH py_tensor_echo tensor=plain path=inline size=S median_ns= vs_pool=

vs_pool below 1: inline is cheaper at that size; 1 MiB goes by the pool in
both jobs (above any threshold), for the size independence above it. The
jobs run in turns (pool, inline, pool, inline) and each size keeps the
lower median of its two jobs, the machine's noise being what it is. Both
jobs use 512 KiB rings, so that a 64 KiB tensor fits half a frame.
Needs torch; run by bench/run.sh. -q: fewer repetitions.
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from python_rpc import timed  # noqa: E402
from shmrpcjob import package_build, run_job  # noqa: E402

SIZES = [(16, "16B"), (1 << 10, "1KiB"), (4 << 10, "4KiB"), (16 << 10, "16KiB"),
         (64 << 10, "64KiB"), (1 << 20, "1MiB")]


def echo(x):
    return x


def worker(quick, out):
    import torch
    import shmrpc as rpc

    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"w{rank}")
    if rank == 0:
        fig = {}
        for n, label in SIZES:
            t = torch.zeros(n, dtype=torch.uint8)
            s = timed(lambda: rpc.rpc_sync("w1", echo, args=(t,)), 300 if quick else 3000)
            fig[label] = s[len(s) // 2]
        with open(out, "w") as f:
            json.dump(fig, f)
    rpc.shutdown()


def main():
    quick = "-q" in sys.argv
    if "--worker" in sys.argv:
        worker(quick, sys.argv[sys.argv.index("--worker") + 1])
        return 0
    try:
        import torch  # noqa: F401 (only whether it is there)
    except ImportError:
        print("py_tensor_inline: torch is not importable: skipped", file=sys.stderr)
        return 0
    build = package_build("py_tensor_inline")
    if build is None:
        return 0
    runs = {"pool": [], "inline": []}
    with tempfile.TemporaryDirectory(prefix="shmrpc-py-inline.") as tmp:
        for i in range(2):
            for path, limit in (("pool", 0), ("inline", 64 << 10)):
                runs[path].append(run_job(build, __file__, os.path.join(tmp, f"{path}{i}.json"),
                                          quick, ["--ring-size", "524288"],
                                          env={"SHMRPC_INLINE_MAX": str(limit)}))
    for _, label in SIZES:
        pool = min(r[label] for r in runs["pool"])
        inl = min(r[label] for r in runs["inline"])
        print(f"BENCH py_tensor_echo tensor=plain path=pool size={label} median_ns={pool}",
              flush=True)
        print(f"BENCH py_tensor_echo tensor=plain path=inline size={label} median_ns={inl} "
              f"vs_pool={inl / pool:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
