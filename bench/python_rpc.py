"""The torch RPC bench from Python, on shmrpc and on torch.distributed.rpc in
the same run: one measurement function, run once between two processes with
torch.distributed.rpc (TensorPipe backend, spawned here) and once as a
two-worker shmrpc job (shmrun runs this file again with --worker). Prints

  BENCH py_call_floor median_ns=
  BENCH py_rpc_sync median_ns= p99_ns= runs= min_run_ns= max_run_ns= vs_torch_rpc= vs_floor=
  BENCH py_rpc_async calls_per_s= vs_torch_rpc=
  BENCH py_remote_to_here median_ns= vs_torch_rpc= vs_py_rpc_sync=
  BENCH py_tensor_echo size=1KiB|1MiB|64MiB|1GiB median_ns= vs_py_rpc_sync= vs_torch_rpc=
  BENCH py_tensor_echo tensor=plain size=1MiB|64MiB median_ns= copy_ns= memcpy_ns=
        memcpy_in_call_ns= vs_memcpy= vs_memcpy_in_call=
  BENCH py_tensor_echo ratio_1GiB_vs_1KiB=
  BENCH py_rpc_sync mode=spin median_ns= p99_ns= vs_torch_rpc=
  BENCH py_remote_to_here mode=spin median_ns= vs_torch_rpc= vs_py_rpc_sync=
  BENCH py_rref_proxy_rpc_sync median_ns= vs_torch_rpc= vs_py_rpc_sync=
  BENCH py_rpc_async_wait median_ns= vs_torch_rpc= vs_py_rpc_sync=
  BENCH py_rpc_sync args=list3|kwarg|torch_add median_ns= vs_torch_rpc= vs_py_rpc_sync=
  BENCH py_remote_to_here value=1KiB_bytes|1KiB_bytearray|1MiB_tensor median_ns= vs_torch_rpc=

with shmrpc's figures. py_call_floor is what a call costs in Python with
no transport at all: the empty function's payload packed and unpacked as
a call's is, the function called, its result pickled and unpickled, in
one process (issue 23: py rpc_sync should cost at most the C call plus
twice that); vs_floor is py_rpc_sync over it. py_rpc_sync's median_ns is
the median of SYNC_JOBS jobs' medians (the first job's, and jobs of the
calls alone after it), min_run_ns and max_run_ns their extremes, p99_ns
the first job's; the other lines' vs_py_rpc_sync compare with the first
job's median, measured in turns with them. vs_torch_rpc is shmrpc/torch for times and
torch/shmrpc for the throughput, so lower is better on every line. The
tensors echoed by shmrpc are made in its pool (shmrpc.empty): sending one
hands over the same bytes, so the echo should take as long for 1 GiB as for
1 KiB (ratio_1GiB_vs_1KiB near 1), and at most twice an empty call
(vs_py_rpc_sync, issue 23; the empty calls measured beside each size, in
turns: echo_rounds). tensor=plain: a torch tensor of torch's memory,
copied into the pool when sent; copy_ns is its echo less a pool tensor's
of the same size, in turns; memcpy_ns a memcpy of its bytes in a loop of
its own, and vs_memcpy copy_ns over it (issue 23: one copy, at most 1.5x
a memcpy); memcpy_in_call_ns what the same memcpy, into the pool tensor
just before its echo, adds to that echo (the copy in the cache state a
call leaves, and the rest of the call slowed by what it pushed out of the
cache), and vs_memcpy_in_call copy_ns over that. The loop's memcpy is
warmer than a call's can be: between two copies it touches nothing else.
The calls programs make beside the empty one: rpc_async(...).wait(), and
an echo of [1, 2, 3] and of one keyword (kwargs={"x": 1}), pickled both
ways, and torch's own example, rpc_sync(to, torch.add, args=(a 1 KiB
torch tensor, 1)) (args=torch_add, where torch is loaded), timed in turns
with py_rpc_sync as the proxy is.
The RRef lines: a proxy's rpc_sync on a live object
(rref.rpc_sync().get()), and remote()+to_here() of a value made once on
the owner: 1 KiB of bytes (a value that cannot change, read
without asking the owner), 1 KiB bytearray (a live value, fetched with
PYTHON_RREF_FETCH_CALL) and a 1 MiB float32 torch tensor (live, fetched,
copied into the pool once per fetch). py_rpc_sync, py_remote_to_here
and the proxy are timed in turns, blocks of each (alternated), so that
their ratios compare the same moments. The mode=spin lines are a second shmrpc
job in spin mode (shmrun --wait=spin), calls alone. Without torch, shmrpc's figures alone
(numpy arrays for the echo); torch's 1 GiB echo is skipped when the machine
has too little memory for its copies.

Run by bench/run.sh with Debian's /usr/bin/python3; the shmrpc build is
$SHMRPC_BUILD (default build), its package in $SHMRPC_BUILD/python.
-q: fewer repetitions.
"""
import ctypes
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from shmrpcjob import package_build, run_job  # noqa: E402
from torchpeer import init_pair, spawn_pair  # noqa: E402

SIZES = [(1 << 10, "1KiB"), (1 << 20, "1MiB"), (64 << 20, "64MiB"), (1 << 30, "1GiB")]
# torch's 1 GiB echo holds the caller's tensor, the callee's copy and the
# reply's copy at once, beside TensorPipe's buffers: ask for room to spare.
TORCH_1GIB_NEEDS = 8 << 30
POOL = "3G"  # shmrpc's pool: the 1 GiB tensor, its echo is the same block


def nothing():
    return None


KIB_BYTES = bytes(1024)
KIB_BYTEARRAY = bytearray(1024)
try:  # the 1 MiB tensor, made once when the owner imports this file
    import torch as _torch
    MIB_TENSOR = _torch.ones(262144, dtype=_torch.float32)
except ImportError:
    MIB_TENSOR = None


def kib_bytes():
    return KIB_BYTES


def kib_bytearray():
    return KIB_BYTEARRAY


def mib_tensor():
    return MIB_TENSOR


class Box:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


def echo(x):
    return x


def call_floor():
    """One call's Python work without the transport (py_call_floor)."""
    from shmrpc import _marshal

    def once():
        func, args, kwargs = _marshal._unpack_call(*_marshal._pack_call(nothing, (), None))
        return _marshal._loads(_marshal._dumps(func(*args, **kwargs)))
    return once


def timed(op, n, budget_ns=0):
    """Timings of op() in ns, sorted: n of them after n/10 (at most 100)
    untimed ones. With a budget, fewer once the time spent passes it (one
    untimed and one timed at least): torch's large echoes take seconds a
    call, shmrpc's do not, and both get as many as fit."""
    end = time.perf_counter_ns() + budget_ns if budget_ns else None
    for i in range(min(100, max(1, n // 10))):
        if i and end and time.perf_counter_ns() > end:
            break
        op()
    samples = []
    while len(samples) < n and not (samples and end and time.perf_counter_ns() > end):
        t0 = time.perf_counter_ns()
        op()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return samples


def alternated(ops, n, block=50):
    """Timings of each op in ops, sorted: n each, in blocks of block runs
    that take turns (after n/10 untimed turns), so that ops compared by
    their ratio see the same moments: on a shared machine the load, and
    even how the two processes' threads are placed on its cores, change
    from one second to the next (bench/rref times its C figures so)."""
    samples = [[] for _ in ops]
    for _ in range(max(1, n // 10)):
        for op in ops:
            op()
    while len(samples[0]) < n:
        for op, s in zip(ops, samples):
            for _ in range(min(block, n - len(s))):
                t0 = time.perf_counter_ns()
                op()
                s.append(time.perf_counter_ns() - t0)
    for s in samples:
        s.sort()
    return samples


def median(values):
    return sorted(values)[len(values) // 2]


def echo_rounds(rpc, alloc, sizes, quick):
    """({size: the echo's median ns}, {size: its ratio to an empty call})
    of tensors made by alloc, echoed whole. The sizes are measured in
    turns, each beside a batch of empty calls, over several rounds; a
    figure is the median of the rounds' medians, a ratio the median of
    the rounds' ratios. Measured one size after the other instead, the
    first size took the load of its moment (this VM's neighbours) and the
    tail of the RRef figures before it (their values' frees still running
    on the owner): 1 KiB came out up to 3x slower than 1 GiB."""
    tensors = []
    for size, label in sizes:
        t = alloc(size)
        t[:] = 1  # real pages, not the zero page
        tensors.append((label, t))
    rounds = 3 if quick else 5
    calls = (60 if quick else 300) // rounds
    budget = (500 if quick else 1500) * 1000000 // rounds
    meds = {label: [] for label, _ in tensors}
    ratios = {label: [] for label, _ in tensors}
    for _ in range(rounds):
        for label, t in tensors:
            s = timed(lambda: rpc.rpc_sync("w1", echo, args=(t,)), calls, budget)
            e = timed(lambda: rpc.rpc_sync("w1", nothing), max(calls, 60))
            meds[label].append(s[len(s) // 2])
            ratios[label].append(s[len(s) // 2] / e[len(e) // 2])
    return ({label: median(v) for label, v in meds.items()},
            {label: median(v) for label, v in ratios.items()})


# The plain torch tensors' sizes: copied into the pool once each way
# they go (a pool block is handed over), so their echo costs one copy
# more than the pool tensor's (the callee sends back what it received).
PLAIN_SIZES = [(1 << 20, "1MiB"), (64 << 20, "64MiB")]


def plain_rounds(rpc, alloc, plain, quick):
    """{size: [plain echo ns, pool echo ns, pool echo after a memcpy ns,
    memcpy ns]}, in turns over rounds, medians of medians: the echo of a
    plain torch tensor (plain(nbytes)); of a pool tensor of that size; of
    the pool tensor with a memcpy of the plain tensor's bytes into it just
    before (what a caller who made the copy itself would pay); and that
    memcpy alone, again and again between two tensors made before (libc's,
    as the pool's copy is: torch's copy_ took twice as long at 1 MiB, its
    dispatch and threads). The first less the second is what the plain
    tensor's one copy costs in a call (issue 23: at most 1.5x a memcpy);
    the third less the second is a memcpy of the same bytes in the same
    place, its source and destination as cold as the call leaves them and
    the rest of the call slowed as much by what the copy pushed out of
    the cache (docs/ARCHITECTURE.md, sixth pass). The memcpy alone is
    warmer than any call's can be: it touches nothing else."""
    rounds = 3 if quick else 5
    calls = (60 if quick else 200) // rounds
    out = {}
    for size, label in PLAIN_SIZES:
        src, pooled, dst = plain(size), alloc(size), plain(size)
        src[:] = 1
        pooled[:] = 1
        dst[:] = 0
        s_at, p_at, d_at = src.data_ptr(), pooled.data_ptr(), dst.data_ptr()
        runs = [[], [], [], []]
        for _ in range(rounds):
            for i, op in enumerate((lambda: rpc.rpc_sync("w1", echo, args=(src,)),
                                    lambda: rpc.rpc_sync("w1", echo, args=(pooled,)),
                                    lambda: (ctypes.memmove(p_at, s_at, size),
                                             rpc.rpc_sync("w1", echo, args=(pooled,))),
                                    lambda: ctypes.memmove(d_at, s_at, size))):
                s = timed(op, calls)
                runs[i].append(s[len(s) // 2])
        out[label] = [median(r) for r in runs]
    return out


def measure(rpc, alloc, sizes, quick, calls_only=False, floor=None, plain=None):
    """The figures of rank 0 calling rank 1 ("w1"), as a dict for JSON.
    alloc(nbytes) makes the tensor to echo. calls_only: empty rpc_sync and
    remote + to_here alone. floor: py_call_floor's op, if measured.
    plain(nbytes): a plain torch tensor, for plain_rounds, if measured."""
    fig = {}
    if floor is not None:
        s = timed(floor, 2000 if quick else 20000)
        fig["floor"] = s[len(s) // 2]
    # rpc_sync, remote()+to_here() and a proxy's rpc_sync in turns: the
    # last two are given as ratios to the first.
    ops = [lambda: rpc.rpc_sync("w1", nothing), lambda: rpc.remote("w1", nothing).to_here()]
    if not calls_only:
        box = rpc.remote("w1", Box, args=(7,))
        ops += [lambda: box.rpc_sync().get(), lambda: rpc.rpc_async("w1", nothing).wait(),
                lambda: rpc.rpc_sync("w1", echo, args=([1, 2, 3],)),
                lambda: rpc.rpc_sync("w1", echo, kwargs={"x": 1})]
        if "torch" in sys.modules:
            one_k = sys.modules["torch"].ones(256)
            ops.append(lambda: rpc.rpc_sync("w1", sys.modules["torch"].add, args=(one_k, 1)))
    runs = alternated(ops, 300 if quick else 2000)
    s = runs[0]
    fig["sync"] = [s[len(s) // 2], s[len(s) * 99 // 100]]
    fig["remote"] = runs[1][len(runs[1]) // 2]
    if calls_only:
        return fig
    fig["proxy"], fig["async_wait"], fig["list3"], fig["kwarg"] = (
        r[len(r) // 2] for r in runs[2:6])
    if len(runs) > 6:
        fig["torch_add"] = runs[6][len(runs[6]) // 2]
    del box, ops

    # Pipelined: every call in flight before the first wait.
    calls = 1000 if quick else 5000
    for f in [rpc.rpc_async("w1", nothing) for _ in range(100)]:
        f.wait()
    t0 = time.perf_counter_ns()
    futs = [rpc.rpc_async("w1", nothing) for _ in range(calls)]
    for f in futs:
        f.wait()
    fig["async"] = calls * 1e9 / (time.perf_counter_ns() - t0)
    del futs

    fig["rref_values"] = {}
    for label, fn in (("1KiB_bytes", kib_bytes), ("1KiB_bytearray", kib_bytearray),
                      ("1MiB_tensor", mib_tensor)):
        if fn is mib_tensor and MIB_TENSOR is None:
            continue
        s = timed(lambda: rpc.remote("w1", fn).to_here(), 100 if quick else 500)
        fig["rref_values"][label] = s[len(s) // 2]

    fig["echo"], fig["echo_vs_sync"] = echo_rounds(rpc, alloc, sizes, quick)
    if plain is not None:
        fig["plain"] = plain_rounds(rpc, alloc, plain, quick)
    return fig


def write_figures(path, fig):
    with open(path, "w") as f:
        json.dump(fig, f)


def torch_worker(rank, port, quick, sizes, out):
    import torch
    import torch.distributed.rpc as rpc

    init_pair(rank, port, rpc_timeout=600)
    if rank == 0:
        write_figures(out, measure(rpc, lambda n: torch.empty(n, dtype=torch.uint8), sizes, quick))
    rpc.shutdown()


def shmrpc_worker(quick, out, calls_only):
    """Under shmrun: rank 0 measures, rank 1 serves."""
    import shmrpc as rpc

    try:
        import torch
    except ImportError:
        torch = None
    like = "numpy" if torch is None else "torch"

    def plain(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)
    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"w{rank}")
    if rank == 0:
        write_figures(out, measure(rpc, lambda n: rpc.empty(n, "uint8", like=like), SIZES, quick,
                                   calls_only, call_floor(), plain if torch else None))
    rpc.shutdown()


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_torch(quick, out):
    """torch's figures, or None without torch."""
    try:
        import torch  # noqa: F401 (only whether it is there)
    except ImportError:
        print("python_rpc: torch is not importable: shmrpc's figures alone", file=sys.stderr)
        return None
    sizes = SIZES
    if mem_available() < TORCH_1GIB_NEEDS:
        print("python_rpc: too little memory for torch's 1 GiB echo: shmrpc's alone",
              file=sys.stderr)
        sizes = SIZES[:-1]
    spawn_pair(torch_worker, quick, sizes, out)
    with open(out) as f:
        return json.load(f)


def run_shmrpc(build, quick, out, script=__file__, pool=POOL, spin=False, calls_only=False):
    """Runs script --worker out as a two-worker shmrpc job (pool: its
    --pool-size; spin: in spin mode, the calls alone; calls_only: the calls
    alone); what its rank 0 wrote to out, as JSON."""
    return run_job(build, script, out, quick,
                   ["--pool-size", pool] + (["--wait=spin"] if spin else []),
                   ["--calls-only"] if spin or calls_only else [])


# Jobs of the calls alone (default wait mode) measured after the full one:
# py_rpc_sync's median_ns is the median of all the jobs' medians, as the C
# rpc_sync's (bench/rpc.c): a job's wait mode can settle differently from
# the next one's (issue 23), which one job's median does not show.
SYNC_JOBS = 3


def line(name, fields, num, den):
    """A BENCH line, with vs_torch_rpc=num/den when torch measured it (0
    stands for not measured)."""
    text = f"BENCH {name} " + " ".join(f"{k}={v}" for k, v in fields)
    if num and den:
        text += f" vs_torch_rpc={num / den:.3g}"
    print(text, flush=True)


def main():
    quick = "-q" in sys.argv
    if "--worker" in sys.argv:
        shmrpc_worker(quick, sys.argv[sys.argv.index("--worker") + 1], "--calls-only" in sys.argv)
        return 0
    build = package_build("python_rpc")
    if build is None:
        return 0
    try:
        import numpy  # noqa: F401 (shmrpc makes its pool arrays with it)
    except ImportError:
        print("python_rpc: numpy is not importable (make bench-deps installs it): skipped",
              file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="shmrpc-py-bench.") as tmp:
        theirs = run_torch(quick, os.path.join(tmp, "torch.json"))
        ours = run_shmrpc(build, quick, os.path.join(tmp, "shmrpc.json"))
        sync_runs = [ours["sync"][0]] + [
            run_shmrpc(build, quick, os.path.join(tmp, f"sync{i}.json"), calls_only=True)["sync"][0]
            for i in range(1, SYNC_JOBS)]
        spin = run_shmrpc(build, quick, os.path.join(tmp, "spin.json"), spin=True)
    t = theirs or {"sync": [0, 0], "async": 0, "remote": 0, "echo": {}, "proxy": 0,
                   "async_wait": 0, "list3": 0, "kwarg": 0, "torch_add": 0, "rref_values": {}}

    print(f"BENCH py_call_floor median_ns={ours['floor']}", flush=True)
    # The ratios below compare figures of the first job, taken in turns.
    med, p99 = median(sync_runs), ours["sync"][1]
    line("py_rpc_sync", [("median_ns", med), ("p99_ns", p99), ("runs", len(sync_runs)),
                         ("min_run_ns", min(sync_runs)), ("max_run_ns", max(sync_runs)),
                         ("vs_floor", f"{med / ours['floor']:.3g}")], med, t["sync"][0])
    # A throughput: torch's over ours, so that lower is better here too.
    line("py_rpc_async", [("calls_per_s", f"{ours['async']:.0f}")], t["async"], ours["async"])
    line("py_remote_to_here", [("median_ns", ours["remote"]),
                               ("vs_py_rpc_sync", f"{ours['remote'] / ours['sync'][0]:.3g}")],
         ours["remote"], t["remote"])
    line("py_rref_proxy_rpc_sync", [("median_ns", ours["proxy"]),
                                    ("vs_py_rpc_sync", f"{ours['proxy'] / ours['sync'][0]:.3g}")],
         ours["proxy"], t["proxy"])
    line("py_rpc_async_wait", [("median_ns", ours["async_wait"]),
                               ("vs_py_rpc_sync", f"{ours['async_wait'] / ours['sync'][0]:.3g}")],
         ours["async_wait"], t["async_wait"])
    for label in ("list3", "kwarg", "torch_add"):
        if label not in ours:
            continue
        line(f"py_rpc_sync args={label}", [("median_ns", ours[label]),
                                           ("vs_py_rpc_sync", f"{ours[label] / ours['sync'][0]:.3g}")],
             ours[label], t[label])
    for label, med in ours["rref_values"].items():
        line("py_remote_to_here", [("value", label), ("median_ns", med)], med,
             t["rref_values"].get(label))
    for _, label in SIZES:
        med = ours["echo"][label]
        line("py_tensor_echo", [("size", label), ("median_ns", med),
                                ("vs_py_rpc_sync", f"{ours['echo_vs_sync'][label]:.3g}")],
             med, t["echo"].get(label))
    for label, (plain, pooled, copied, memcpy) in ours.get("plain", {}).items():
        copy, in_call = plain - pooled, copied - pooled
        # A burst of load during the pool echoes can make the difference
        # nothing or less: no ratio then, rather than a meaningless one.
        vs_in_call = f"{copy / in_call:.3g}" if in_call > 0 else "nan"
        print(f"BENCH py_tensor_echo tensor=plain size={label} median_ns={plain} "
              f"copy_ns={copy} memcpy_ns={memcpy} memcpy_in_call_ns={in_call} "
              f"vs_memcpy={copy / memcpy:.3g} vs_memcpy_in_call={vs_in_call}", flush=True)
    med, p99 = spin["sync"]
    line("py_rpc_sync mode=spin", [("median_ns", med), ("p99_ns", p99)], med, t["sync"][0])
    line("py_remote_to_here mode=spin", [("median_ns", spin["remote"]),
                                         ("vs_py_rpc_sync",
                                          f"{spin['remote'] / spin['sync'][0]:.3g}")],
         spin["remote"], t["remote"])
    ratio = ours["echo"]["1GiB"] / ours["echo"]["1KiB"]
    print(f"BENCH py_tensor_echo ratio_1GiB_vs_1KiB={ratio:.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
