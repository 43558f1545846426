# shmrun: -n 2 --pool-size 64M
"""RPC profiling from Python (worker0 calls, worker1 serves): the keys of
rpc_sync, rpc_async and remote, the callee's events beneath them, the
Chrome trace (valid JSON with the events and their flows), use_cuda=True
falling back to CPU timing with one warning; and in torch's own legacy
profiler the same keys with the ops the callee ran beneath them (nested
calls' too), in its tables and trace, a profile holding only its own calls,
and one warning, nothing recorded there, when torch's internals differ."""
import json
import os
import tempfile
import warnings

import pytest

import shmrpc as rpc


def add(a, b):
    return a + b


def add_back(a):
    """On worker1: a call back to worker0 (nested under the caller's key)."""
    return rpc.rpc_sync("worker0", add, args=(a, 1))


def torch_calls(torch):
    """One call of each kind, under torch's legacy profiler; its events."""
    with torch.autograd.profiler_legacy.profile() as prof:
        rpc.rpc_sync("worker1", add, args=(torch.ones(2), 1))
        rpc.rpc_async("worker1", add, args=(torch.ones(2), 1)).wait()
        rpc.remote("worker1", add, args=(torch.ones(2), 1)).to_here()
        rpc.rpc_sync("worker1", add_back, args=(torch.ones(2),))
    return prof


def test_shmrpc_profiler():
    with rpc.profiler.profile() as prof:
        rpc.rpc_sync("worker1", add, args=(1, 2))
        rpc.rpc_async("worker1", add, args=(1, 2)).wait()
        rpc.remote("worker1", add, args=(1, 2)).to_here()
    names = [e.name for e in prof.function_events]
    for kind in ("rpc_sync", "rpc_async", "rpc_remote"):
        key = f"{kind}#add(worker0 -> worker1)"
        assert key in names, f"{key} in {names}"
        remote = [e for e in prof.function_events if e.name == f"{key}#remote_op: python"]
        assert len(remote) == 1 and remote[0].node_id == 1 and remote[0].parent.name == key, \
            f"the remote event of {key}"
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)["traceEvents"]
    os.unlink(path)
    os.rmdir(os.path.dirname(path))
    assert sum(e["ph"] == "X" for e in trace) == len(names), "complete events in the trace"
    # add's result is an int: the user reads the owner's pickle of it without a
    # message (a value that cannot change); a live one would add the fetch's call.
    assert sum(e["ph"] == "f" for e in trace) == 3, f"flows in the trace: {names}"


def test_cuda_fallback():
    """use_cuda=True: CPU timing, one warning for the process, events as usual."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with rpc.profiler.profile(use_cuda=True) as prof:
                rpc.rpc_sync("worker1", add, args=(1, 2))
            names = [e.name for e in prof.function_events]
            assert "rpc_sync#add(worker0 -> worker1)#remote_op: python" in names, \
                f"use_cuda=True still records the remote event: {names}"
    texts = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1 and "timed on the CPU" in texts[0], f"one CPU-timing warning: {texts}"


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def test_torch_internals_differ(torch):
    """torch's internals not as 1.13's (here: FunctionEvent takes other
    arguments): one warning, calls go on, nothing of them in torch's
    profiler, shmrpc's profiler as usual. Runs before anything installed
    the wrapper around torch's _parse_legacy_records (pytest runs the tests
    in this file's order)."""
    util = torch.autograd.profiler_util
    real = util.FunctionEvent

    class Other:
        def __init__(self, name):
            pass
    util.FunctionEvent = Other
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                with torch.autograd.profiler_legacy.profile() as prof:
                    assert rpc.rpc_sync("worker1", add, args=(1, 2)) == 3, "the call works"
    finally:
        util.FunctionEvent = real
    texts = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1 and "cannot record RPCs in torch's profiler" in texts[0], \
        f"one warning: {texts}"
    names = [e.name for e in prof.function_events if e.name.startswith("rpc_")]
    assert not names, f"nothing in torch's profiler: {names}"
    with rpc.profiler.profile() as shm:
        rpc.rpc_sync("worker1", add, args=(1, 2))
    assert len(shm.function_events) == 2, "shmrpc's profiler still works"
    rpc.profiler._torch_state = None  # the real torch again, for test_torch_profiler


def test_torch_profiler(torch):
    """Under torch's legacy autograd profiler each call is recorded under
    torch's key (node_id the caller's, async, as torch's) and the ops the
    callee ran beneath it, `KEY#remote_op: aten::add` (node_id the
    callee's, remote), within the call (1 us of slack: the two clocks'
    offset is read on each side, and torch's times are floats of
    microseconds since the epoch). The compat suite compares the names
    with torch itself."""
    prof = torch_calls(torch)
    events = prof.function_events
    for kind in ("rpc_sync", "rpc_async", "rpc_remote"):
        key = f"{kind}#add(worker0 -> worker1)"
        keys = [e for e in events if e.name == key]
        assert len(keys) == 1 and keys[0].node_id == 0 and keys[0].is_async, \
            f"torch's profiler has {key} once: {[e.name for e in events]}"
        remote = [e for e in events if e.name.startswith(key + "#remote_op: ")]
        assert f"{key}#remote_op: aten::add" in {e.name for e in remote}, \
            f"the callee's aten::add under {key}: {[e.name for e in remote]}"
        assert all(e.node_id == 1 and e.is_remote for e in remote), \
            f"{key}'s remote events ran on worker1"
        if keys:
            k = keys[0].time_range
            outside = [(e.name, e.time_range.start, e.time_range.end) for e in remote
                       if e.time_range.start < k.start - 1 or e.time_range.end > k.end + 1]
            assert not outside, f"{key}'s remote events lie in [{k.start}, {k.end}]: {outside}"
    nested = "rpc_sync#add_back(worker0 -> worker1)#remote_op: rpc_sync#add(worker1 -> worker0)"
    ops = [e for e in events if e.name.startswith(nested + "#remote_op: ")]
    assert any(e.name.endswith("aten::add") and e.node_id == 0 for e in ops), \
        f"the nested call's ops, on worker0: {[(e.name, e.node_id) for e in ops]}"
    # Everywhere torch's events go.
    avg = {(e.key, e.node_id) for e in prof.key_averages()}
    assert ("rpc_async#add(worker0 -> worker1)#remote_op: aten::add", 1) in avg, \
        f"key_averages() has the remote op: {avg}"
    assert ("rpc_sync#add(worker0 -> worker1)#remote_op: aten::add" in prof.table(
        max_name_column_width=200)), "table() shows the remote op"
    path = os.path.join(tempfile.mkdtemp(), "torch.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        traced = {e.get("name") for e in json.load(f)}  # torch's: a list of events
    os.unlink(path)
    os.rmdir(os.path.dirname(path))
    assert "rpc_remote#add(worker0 -> worker1)#remote_op: aten::add" in traced, \
        "the Chrome trace has the remote op"
    # A profile holds its own calls only (not those of the one before, nor
    # a call made between the two).
    rpc.rpc_sync("worker1", add, args=(torch.ones(2), 1))
    with torch.autograd.profiler_legacy.profile() as again:
        rpc.rpc_async("worker1", add, args=(torch.ones(2), 1)).wait()
    keys = sorted(e.name for e in again.function_events if e.name.startswith("rpc_")
                  and "#remote_op: " not in e.name)
    assert keys == ["rpc_async#add(worker0 -> worker1)"], f"the second profile's calls: {keys}"


def test_torch_profiler_options(torch):
    """The profile's record_shapes and profile_memory reach the callee, as
    torch's agent carries them: its ops come back with their input shapes
    and memory; without them, none."""
    t1, t2 = torch.ones(100), torch.ones(3, 5)

    def remote_ops(**options):
        with torch.autograd.profiler_legacy.profile(**options) as prof:
            rpc.rpc_sync("worker1", torch.add, args=(t1, t1))
            rpc.rpc_sync("worker1", torch.zeros, args=(1000,))
        return [e for e in prof.function_events if e.is_remote]

    adds = [e for e in remote_ops(record_shapes=True) if e.name.endswith("aten::add")]
    assert adds and adds[0].input_shapes == [[100], [100], []], adds[0].input_shapes
    with torch.autograd.profiler_legacy.profile(record_shapes=True) as local:
        torch.add(t2, t2)
    assert [e.input_shapes for e in local.function_events if e.name == "aten::add"] == \
        [[[3, 5], [3, 5], []]]
    assert {e.cpu_memory_usage for e in remote_ops(profile_memory=True)} != {0}
    plain = remote_ops()
    assert plain and all(e.input_shapes == [] and e.cpu_memory_usage == 0 for e in plain)
