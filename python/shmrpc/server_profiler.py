"""torch's server-side process-global profiler over shmrpc:
`rpc._server_process_global_profile` (torch.distributed.rpc's).

    prof = rpc.remote("worker1", rpc._server_process_global_profile)
    prof.rpc_sync().__enter__()
    ...  # calls served by worker1 meanwhile are profiled there
    prof.rpc_sync().__exit__(None, None, None)
    prof.rpc_sync().key_averages()

While a profile is entered in a process, each Python call that process
serves (rpc_sync, rpc_async, remote, with or without a distributed
autograd context) runs under torch's legacy autograd profiler on its
executor thread, and the events it recorded go to every profile entered
before the call began and still entered when it ended: on __exit__,
`process_global_function_events` holds one list of FunctionEvents per call
served, and `function_events` all of them (an EventList), as torch's. A
call served under a profiler of its own (its caller's, for torch's RPC
profiling; one the function started) is not recorded here, nor are RRef
fetches and distributed autograd's backward requests.

Importing this module needs no torch; the profile class (a subclass of
torch's legacy profile) is made when first asked for.
"""
import itertools
import sys
import threading

_lock = threading.Lock()
# The profiles entered and not exited yet, oldest first: changed in place,
# never rebound (the fast path holds this list: _serve._fast).
_active = []
_made = {}    # "_server_process_global_profile" -> the class, once made


class recorded:
    """Around a call served on an executor thread: under torch's legacy
    profiler when a profile is entered (nothing else to do otherwise)."""

    __slots__ = ("profiles", "torch")

    def __init__(self):
        self.profiles = None

    def __enter__(self):
        if not _active:
            return self
        torch = sys.modules.get("torch")
        if torch is None or torch.autograd._profiler_enabled():
            return self
        with _lock:
            self.profiles = list(_active)
        if not self.profiles:
            return self
        self.torch = torch
        torch.autograd._enable_profiler_legacy(self.profiles[0].config())
        return self

    def __exit__(self, *exc):
        if not self.profiles:
            return False
        legacy = self.torch.autograd.profiler_legacy
        records = self.torch.autograd._disable_profiler_legacy()
        # Parsed here, on the thread that recorded: the calls the function
        # made under the profiler join its events (shmrpc.profiler).
        events = legacy._parse_legacy_records(records)
        with _lock:
            for p in self.profiles:
                if p in _active:
                    p._calls.append(list(events))
        return False


def _make_class():
    from torch.autograd.profiler_legacy import profile
    from torch.autograd.profiler_util import EventList

    class _server_process_global_profile(profile):
        """torch's: its legacy profile's arguments and methods; entered,
        it profiles the calls this process serves (above)."""

        def __enter__(self):
            if not self.enabled:
                return None
            if self.entered:
                raise RuntimeError("autograd profiler traces are not reentrant")
            self.entered = True
            self._calls = []
            with _lock:
                _active.append(self)
            return self

        def __exit__(self, exc_type, exc_val, exc_tb):
            if not self.enabled:
                return None
            with _lock:
                if self in _active:
                    _active.remove(self)
                calls, self._calls = self._calls, []
            for events in calls:
                events.sort(key=lambda e: [e.time_range.start, -e.time_range.end])
            self.function_events = EventList(list(itertools.chain(*calls)),
                                             use_cuda=self.use_cuda,
                                             profile_memory=self.profile_memory)
            self.function_events._build_tree()
            self.process_global_function_events = calls
            return False

    # Found by pickle (a remote() makes one) as this module's attribute.
    _server_process_global_profile.__module__ = __name__
    _server_process_global_profile.__qualname__ = _server_process_global_profile.__name__
    return _server_process_global_profile


def __getattr__(name):
    if name != "_server_process_global_profile":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lock:
        if name not in _made:
            _made[name] = _make_class()
        return _made[name]
