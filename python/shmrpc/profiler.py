"""RPC profiling, in the spirit of torch.autograd.profiler.profile:

    with shmrpc.profiler.profile() as prof:
        rpc.rpc_sync("worker1", f, args=(1,))
    [e.name for e in prof.function_events]
    # ['rpc_sync#f(worker0 -> worker1)', 'rpc_sync#f(worker0 -> worker1)#remote_op: python']
    prof.export_chrome_trace("trace.json")

While it is on, this process's calls go out as RUN_WITH_PROFILING_REQ and
come back with the callee's events (docs/PROTOCOL.md). Times are the one
CLOCK_MONOTONIC of the machine, in microseconds in the events.

When torch's own legacy autograd profiler runs in the calling thread
(`torch.autograd.profiler_legacy.profile()`, the one torch 1.13 records
RPCs in), the calls made there are recorded in it as torch.distributed.rpc
records them: each under torch's key (`rpc_sync#f(worker0 -> worker1)`,
`rpc_async#...`, `rpc_remote#...`; node_id the caller's rank, is_async),
from its send until its reply, and beneath it the ops the function ran on
the callee, recorded there by torch's profiler as torch's callee records
them, named `KEY#remote_op: aten::add` (node_id the callee's rank,
is_remote; with the profile's record_shapes and profile_memory, their
input shapes and memory, as torch's agent carries them). They are in
`prof.function_events`, so in key_averages(),
table() and export_chrome_trace() too; so are the calls the function made
on the callee, with their own callees' ops beneath (as torch's nested
calls). A call is in the profile of the thread that made it, even if its
reply comes after the profile ended (its __exit__ waits for it, as
shmrpc's profile does). torch 1.13 has no Python API to add events to its
profiler: shmrpc wraps the function the profile's __exit__ makes its
events with (the comment at "torch's legacy autograd profiler" below says
how and why). A callee without torch loaded gives no ops, only the key is
recorded. Where torch's internals differ from 1.13's, shmrpc warns once
and records nothing in torch's profiler; shmrpc.profiler.profile still
works.

Events are timed on the CPU (CLOCK_MONOTONIC). `use_cuda=True` is
accepted, as torch's profile accepts it; where torch's RPC profiler would
fall back to CPU timing because CUDA events are unavailable, so does this
one, and it says so once per process.
"""
import functools
import inspect
import itertools
import json
import sys
import threading
import time
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


# ---- torch's legacy autograd profiler ----
#
# torch.distributed.rpc sends a call made while torch's legacy profiler
# runs in the calling thread (_get_should_profile) as RUN_WITH_PROFILING_REQ;
# its callee runs it under that profiler and ships everything recorded
# back, and the caller's C++ agent adds those events, renamed
# `KEY#remote_op: NAME`, to the profiler (addEventList), whose __exit__
# makes FunctionEvents of all with _parse_legacy_records. torch 1.13 gives
# Python no way to add events, so shmrpc wraps
# torch.autograd.profiler_legacy._parse_legacy_records (once, when the
# first call goes out under that profiler): the wrapper adds this thread's
# calls to what torch parsed, as FunctionEvents made as torch makes them,
# and sorts all as torch does. That function rather than profile.__exit__:
# every legacy profile makes its events with it (torch's server-side
# profiler and shmrpc's callee, below, too), and it gets the records, which
# give the profile's start. The call's key is made there too, not by a
# record_function: torch ends its record on the thread the reply completes
# on, with the caller's profiler state carried over, which Python cannot
# do, and a record ended on another thread is lost. A call's events are
# read when its reply has come (waited for, as shmrpc_profile_stop waits:
# a call made while profiling is in the profile even if its reply comes
# late).
#
# Times: legacy records are CLOCK_REALTIME (ProfilerEvent.start_us(), us
# since the epoch), FunctionEvents us since the profile's __start_profile;
# shmrpc's are CLOCK_MONOTONIC ns (one clock for every worker), converted
# with the two clocks' offset read at the time.

_torch_lock = threading.Lock()
_torch_state = None  # None: not looked at; True: the wrapper is in; False: unusable (warned)
_torch_calls = {}    # thread id -> [C Future or RRef of calls made for torch's profiler]
_event_ids = itertools.count(1 << 62)  # FunctionEvent ids, apart from torch's record handles
# The FunctionEvent arguments used (torch 1.13's).
_FUNCTION_EVENT_ARGS = {"id", "name", "trace_name", "thread", "start_us", "end_us", "fwd_thread",
                        "input_shapes", "stack", "node_id", "is_async", "is_remote",
                        "device_type", "is_legacy", "cpu_memory_usage"}
_torch_options = threading.local()  # .bits: the options of the legacy profile entered here


def watch_torch_profiles(legacy):
    """A legacy profile entered in a thread leaves its options here
    (record_shapes, profile_memory as PROFILE_SHAPES, PROFILE_MEMORY bits):
    a call made under it asks the callee to record its ops so, as torch's
    agent does. torch 1.13 cannot read a running profile's options back
    from Python (its agent reads them in C++), so profile._start_trace is
    wrapped; `import shmrpc` does it when torch.autograd.profiler_legacy
    is loaded (as_torch.torch_hooks)."""
    start = legacy.profile._start_trace
    if getattr(start, "_shmrpc", False):
        return

    @functools.wraps(start)
    def start_trace(self):
        _torch_options.bits = ((_shmrpc.PROFILE_SHAPES if self.record_shapes else 0) |
                               (_shmrpc.PROFILE_MEMORY if self.profile_memory else 0))
        return start(self)
    start_trace._shmrpc = True
    legacy.profile._start_trace = start_trace


def _torch_unusable(why):
    """torch's internals are not as expected: warn once; nothing more goes
    to torch's profiler."""
    global _torch_state
    with _torch_lock:
        warned, _torch_state = _torch_state is False, False
    if not warned:
        warnings.warn(f"shmrpc.profiler: cannot record RPCs in torch's profiler ({why!r}); "
                      "shmrpc.profiler.profile records them", RuntimeWarning, stacklevel=3)


def _install(torch):
    """The wrapper around torch's _parse_legacy_records, once; whether it is in."""
    global _torch_state
    with _torch_lock:
        if _torch_state is not None:
            return _torch_state
        try:
            legacy = torch.autograd.profiler_legacy
            parse = legacy._parse_legacy_records
            missing = _FUNCTION_EVENT_ARGS - set(
                inspect.signature(torch.autograd.profiler_util.FunctionEvent).parameters)
            if missing:
                raise TypeError(f"FunctionEvent takes no {sorted(missing)}")
            if not hasattr(torch._C._autograd.ProfilerEvent, "start_us"):
                raise AttributeError("torch's ProfilerEvent has no start_us()")
        except (AttributeError, TypeError, ValueError) as e:
            why = e
        else:
            legacy._parse_legacy_records = functools.wraps(parse)(
                functools.partial(_parse_with_rpcs, parse))
            _torch_state = True
            return True
    _torch_unusable(why)
    return False


def torch_profiling():
    """What a call made now asks for torch's profiler: 0 when its legacy
    profiler does not run in this thread (torch's _get_should_profile;
    torch is not imported when it is not loaded) or the wrapper cannot be
    in, else PROFILE_TORCH and the profile's options (watch_torch_profiles)."""
    torch = sys.modules.get("torch")
    if torch is None or _torch_state is False:
        return 0
    try:
        if (not torch.autograd._profiler_enabled() or torch._C._autograd._profiler_type()
                != torch._C._profiler.ActiveProfilerType.LEGACY):
            return 0
    except AttributeError as e:
        _torch_unusable(e)
        return 0
    if not (_torch_state or _install(torch)):
        return 0
    return _shmrpc.PROFILE_TORCH | getattr(_torch_options, "bits", 0)


def torch_called(call):
    """call (the C Future or RRef of a call sent with torch_profile=True)
    joins this thread's profile (_parse_with_rpcs)."""
    _torch_calls.setdefault(threading.get_ident(), []).append(call)


def _realtime_minus_monotonic_us():
    m0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    r = time.clock_gettime_ns(time.CLOCK_REALTIME)
    m1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    return (r - (m0 + m1) / 2) / 1e3


def _start_record(thread_records):
    """The records' __start_profile (as _parse_legacy_records finds it)."""
    return next(r for r in itertools.chain(*thread_records) if r.name() == "__start_profile")


def _parse_with_rpcs(parse, thread_records):
    """torch's _parse_legacy_records(thread_records) and, after the events
    it made, this thread's calls made for torch's profiler since the
    profile began (their keys, their callees' events)."""
    functions = parse(thread_records)
    calls = _torch_calls.pop(threading.get_ident(), None)
    if calls:
        try:
            functions += _rpc_events(thread_records, calls)
        except Exception as e:  # torch's internals differ: its own events stay
            _torch_unusable(e)
        else:
            functions.sort(key=lambda evt: [evt.time_range.start, -evt.time_range.end])
    return functions


def _rpc_events(thread_records, calls):
    import torch
    from torch.autograd.profiler_util import FunctionEvent

    start = _start_record(thread_records)
    zero_us = start.start_us() - _realtime_minus_monotonic_us()  # on CLOCK_MONOTONIC
    thread = start.thread_id()
    rank = _shmrpc.rank()
    out = []

    def event(name, on_thread, start_ns, end_ns, node_id, remote, shapes=None, mem=0):
        out.append(FunctionEvent(
            id=next(_event_ids), name=name, trace_name=name, thread=on_thread,
            start_us=start_ns / 1e3 - zero_us, end_us=end_ns / 1e3 - zero_us, fwd_thread=on_thread,
            input_shapes=json.loads(shapes) if shapes else [], stack=[], node_id=node_id,
            is_async=not remote, is_remote=remote, device_type=torch.autograd.DeviceType.CPU,
            is_legacy=True, cpu_memory_usage=mem))

    for call in calls:
        done = call.profiled()
        if done is None:
            continue
        key, sent_ns, done_ns, events = done
        if sent_ns / 1e3 < zero_us:
            continue  # made in an earlier profile that did not parse its records
        event(key, thread, sent_ns, done_ns, rank, False)
        for name, start_ns, end_ns, node_id, callee_thread, shapes, mem in events:
            event(f"{key}#remote_op: {name}", callee_thread, start_ns, end_ns, node_id, True,
                  shapes, mem)
    return out


class torch_ops:
    """On the callee, around a function called for torch's profiler (ops: the
    list the C half gave, or None; what: the caller's PROFILE_ bits): the
    function runs under torch's legacy profiler on this thread, with the
    caller's profile's options, as torch's callee runs it, and everything
    it recorded (the ops, and the calls it made, with their callees' events)
    goes into ops as (name, start_ns, end_ns, thread, rank, input shapes as
    JSON or None, bytes of memory) on CLOCK_MONOTONIC, rank -1 for this
    worker (torch's node_id for its own events: the C half puts its rank
    there).
    Nothing where torch is not loaded here or this thread profiles already."""

    def __init__(self, ops, what=0):
        self.ops = ops
        self.what = what
        self.on = False

    def __enter__(self):
        torch = sys.modules.get("torch")
        if self.ops is None or torch is None or _torch_state is False:
            return self
        try:
            if not torch.autograd._profiler_enabled():
                torch.autograd._enable_profiler_legacy(torch.autograd.profiler_legacy.profile(
                    record_shapes=bool(self.what & _shmrpc.PROFILE_SHAPES),
                    profile_memory=bool(self.what & _shmrpc.PROFILE_MEMORY)).config())
                self.on = True
        except (AttributeError, TypeError, RuntimeError) as e:
            _torch_unusable(e)
        return self

    def __exit__(self, *exc):
        if not self.on:
            return False
        import torch
        records = torch.autograd._disable_profiler_legacy()
        try:
            zero_ns = (_start_record(records).start_us() - _realtime_minus_monotonic_us()) * 1e3
            # Looked up now: the wrapper, if this thread's calls installed it.
            events = torch.autograd.profiler_legacy._parse_legacy_records(records)
            self.ops.extend((e.name, round(zero_ns + e.time_range.start * 1e3),
                             round(zero_ns + e.time_range.end * 1e3), e.thread,
                             e.node_id if e.is_remote else -1,
                             json.dumps(e.input_shapes) if e.input_shapes else None,
                             e.cpu_memory_usage) for e in events)
        except Exception as e:  # torch's internals differ: the call goes on without
            _torch_unusable(e)
        return False
