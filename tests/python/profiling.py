"""RPC profiling from Python (run by tests/python_rpc.c): the keys of
rpc_sync, rpc_async and remote, the callee's events beneath them, the
Chrome trace (valid JSON with the events and their flows), use_cuda=True
falling back to CPU timing with one warning, and the same keys in torch's
own profiler."""
import json
import os
import sys
import tempfile
import warnings

import shmrpc as rpc

from checks import check, failed


def add(a, b):
    return a + b


def torch_profiler():
    """Under torch's legacy autograd profiler the calls are recorded there
    too, under torch's keys (the compat suite compares sync and async with
    torch itself)."""
    try:
        import torch
    except ImportError:
        return
    with torch.autograd.profiler_legacy.profile() as prof:
        rpc.rpc_sync("worker1", add, args=(1, 2))
        rpc.rpc_async("worker1", add, args=(1, 2)).wait()
        rpc.remote("worker1", add, args=(1, 2)).to_here()
    names = {e.name for e in prof.function_events}
    for kind in ("rpc_sync", "rpc_async", "rpc_remote"):
        check(f"{kind}#add(worker0 -> worker1)" in names, f"torch's profiler has {kind}: {names}")


def cuda_fallback():
    """use_cuda=True: CPU timing, one warning for the process, events as usual."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with rpc.profiler.profile(use_cuda=True) as prof:
                rpc.rpc_sync("worker1", add, args=(1, 2))
            names = [e.name for e in prof.function_events]
            check("rpc_sync#add(worker0 -> worker1)#remote_op: python" in names,
                  f"use_cuda=True still records the remote event: {names}")
    texts = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    check(len(texts) == 1 and "timed on the CPU" in texts[0], f"one CPU-timing warning: {texts}")


def main():
    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        with rpc.profiler.profile() as prof:
            rpc.rpc_sync("worker1", add, args=(1, 2))
            rpc.rpc_async("worker1", add, args=(1, 2)).wait()
            rpc.remote("worker1", add, args=(1, 2)).to_here()
        names = [e.name for e in prof.function_events]
        for kind in ("rpc_sync", "rpc_async", "rpc_remote"):
            key = f"{kind}#add(worker0 -> worker1)"
            check(key in names, f"{key} in {names}")
            remote = [e for e in prof.function_events if e.name == f"{key}#remote_op: python"]
            check(len(remote) == 1 and remote[0].node_id == 1 and remote[0].parent.name == key,
                  f"the remote event of {key}")
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
        check(sum(e["ph"] == "X" for e in trace) == len(names), "complete events in the trace")
        check(sum(e["ph"] == "f" for e in trace) == 3, "flows in the trace")
        cuda_fallback()
        torch_profiler()
    rpc.shutdown()
    return failed()


if __name__ == "__main__":
    sys.exit(main())
