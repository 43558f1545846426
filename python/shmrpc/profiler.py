"""RPC profiling, in the spirit of torch.autograd.profiler.profile:

    with shmrpc.profiler.profile() as prof:
        rpc.rpc_sync("worker1", f, args=(1,))
    [e.name for e in prof.function_events]
    # ['rpc_sync#f(worker0 -> worker1)', 'rpc_sync#f(worker0 -> worker1)#remote_op: python']
    prof.export_chrome_trace("trace.json")

While it is on, this process's calls go out as RUN_WITH_PROFILING_REQ and
come back with the callee's events (docs/PROTOCOL.md). Times are the one
CLOCK_MONOTONIC of the machine, in microseconds in the events.

When torch's own (legacy) autograd profiler is the one running, each call
is also recorded there, under torch's key (`rpc_sync#f(worker0 ->
worker1)`, `rpc_async#...`, `rpc_remote#...`), from its send until its
future completes, as torch.distributed.rpc records it. The callee's events
are not added to torch's profiler (torch 1.13 has no Python API for
that): shmrpc.profiler.profile has them.

Events are timed on the CPU (CLOCK_MONOTONIC). `use_cuda=True` is
accepted, as torch's profile accepts it; where torch's RPC profiler would
fall back to CPU timing because CUDA events are unavailable, so does this
one, and it says so once per process.
"""
import contextlib
import json
import sys
import warnings

from . import _shmrpc


class FunctionEvent:
    __slots__ = ("id", "name", "node_id", "parent", "start_us", "end_us")

    def __init__(self, id, name, node_id, parent, start_ns, end_ns):
        self.id = id
        self.name = name
        self.node_id = node_id  # the worker it ran on, as torch's remote events
        self.parent = parent    # the FunctionEvent of the call it ran for, or None
        self.start_us = start_ns / 1000.0
        self.end_us = end_ns / 1000.0

    @property
    def is_remote(self):
        return self.parent is not None

    @property
    def cpu_time_total(self):
        return self.end_us - self.start_us

    def __repr__(self):
        return (f"<FunctionEvent id={self.id} name={self.name} node_id={self.node_id} "
                f"cpu_time_total={self.cpu_time_total:.1f}us>")


class profile:
    """A context manager: records the RPCs this process makes inside it."""

    _warned_cuda = False

    def __init__(self, enabled=True, use_cuda=False):
        self.enabled = enabled
        self.use_cuda = use_cuda
        self.function_events = []
        if enabled and use_cuda and not profile._warned_cuda:
            profile._warned_cuda = True
            warnings.warn("shmrpc.profiler: CUDA event timing is not available for RPC "
                          "events; they are timed on the CPU", RuntimeWarning, stacklevel=2)

    def __enter__(self):
        if self.enabled:
            _shmrpc.profile_start()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        raw = _shmrpc.profile_stop()
        events = [FunctionEvent(i, name, rank, None, start, end)
                  for i, (name, rank, _, start, end) in enumerate(raw)]
        for ev, (_, _, parent, _, _) in zip(events, raw):
            if 0 <= parent < len(events):
                ev.parent = events[parent]
        self.function_events = events
        return False

    def export_chrome_trace(self, path):
        """A Chrome trace-event JSON file: a process per worker, a flow
        arrow from each call to what its callee ran."""
        trace = []
        for e in self.function_events:
            trace.append({"name": e.name, "cat": "rpc", "ph": "X", "pid": e.node_id,
                          "tid": 1 if e.is_remote else 0, "ts": e.start_us,
                          "dur": e.cpu_time_total})
            if e.is_remote:
                trace.append({"name": "rpc", "cat": "rpc", "ph": "s", "id": e.id,
                              "pid": e.parent.node_id, "tid": 0, "ts": e.parent.start_us})
                trace.append({"name": "rpc", "cat": "rpc", "ph": "f", "bp": "e", "id": e.id,
                              "pid": e.node_id, "tid": 1, "ts": e.start_us})
        with open(path, "w") as f:
            json.dump({"displayTimeUnit": "ns", "traceEvents": trace}, f)


def _torch_profiling():
    """torch's legacy autograd profiler is on in this thread (torch's
    _get_should_profile), without importing torch when it is not loaded."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.autograd._profiler_enabled():
        return False
    return torch._C._autograd._profiler_type() == torch._C._profiler.ActiveProfilerType.LEGACY


@contextlib.contextmanager
def torch_record(exec_type, func, dst):
    """Around a call to rank dst ("sync", "async" or "remote"): when torch's
    profiler is on, a record_function named with torch's key (ended on
    leaving, or by end_on(rf, future)). Yields it, or None."""
    if not _torch_profiling():
        yield None
        return
    import torch
    name = getattr(func, "__qualname__", None) or repr(func)
    key = (f"rpc_{exec_type}#{name}({_shmrpc.worker_info(None)[0]} -> "
           f"{_shmrpc.worker_info(dst)[0]})")
    with torch.autograd.profiler.record_function(key) as rf:
        yield rf


def end_on(rf, fut):
    """The record ends when fut completes (on whatever thread completes it),
    as torch's _call_end_callbacks_on_future does."""
    if rf is None:
        return
    import torch
    rf.run_callbacks_on_exit = False
    fut.add_done_callback(lambda _: torch.ops.profiler._record_function_exit(rf.handle))

