# shmrun: -n 2 --pool-size 64M
"""torch.distributed.rpc's and .autograd's other names that programs and
torch's own tests use, on shmrpc: the backend options and types, the
default timeout and its private setter, the current agent, RRef._get_type
and _get_future, a call with kwargs and no args, dist_autograd's
private helpers, and Futures that are torch.futures.Futures.
"""
import time

import pytest

import shmrpc as rpc


def add(a, b=0):
    return a + b


def slow(sec):
    time.sleep(sec)
    return sec


class Box:
    def __init__(self, n):
        self.n = n


def boom():
    raise ValueError("no box")


def rpc_init(rank):
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=20,
                                           init_method="env://")
    rpc.init_rpc(f"worker{rank}", backend=rpc.BackendType.TENSORPIPE, rpc_backend_options=opts)


def test_options_and_constants():
    o = rpc.TensorPipeRpcBackendOptions()
    assert (o.num_worker_threads, o.rpc_timeout, o.init_method, o.device_maps, o.devices) == \
        (16, 60.0, "env://", {}, [])
    o.set_device_map("worker1", {0: 1})
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        o.set_device_map("worker1", {0: 2})
    assert isinstance(o, rpc.RpcBackendOptions)
    assert rpc.constants.DEFAULT_RPC_TIMEOUT_SEC == 60.0 and rpc.constants.UNSET_RPC_TIMEOUT == -1
    assert rpc.backend_registry.backend_registered("TENSORPIPE")
    assert rpc.is_available()


def test_timeouts():
    assert rpc.get_rpc_timeout() == 20.0, "the backend options' rpc_timeout"
    rpc._set_rpc_timeout(0.2)
    try:
        assert rpc.get_rpc_timeout() == 0.2
        with pytest.raises(RuntimeError):
            rpc.rpc_sync("worker1", slow, args=(2,))  # the new default applies
        assert rpc.rpc_sync("worker1", slow, args=(0.5,), timeout=5) == 0.5
    finally:
        rpc._set_rpc_timeout(20)


def test_kwargs_without_args():
    assert rpc.rpc_sync("worker1", add, kwargs={"a": 1, "b": 2}) == 3
    assert rpc.rpc_async("worker1", add, kwargs={"a": 2}).wait() == 2
    assert rpc.remote("worker1", add, kwargs={"a": 3, "b": 4}).to_here() == 7


def test_current_agent():
    agent = rpc._get_current_rpc_agent()
    assert agent.get_worker_info().name == "worker0"
    assert [w.name for w in agent.get_worker_infos()] == ["worker0", "worker1"]
    assert "agent.thread_pool_size" in agent.get_debug_info()
    assert rpc._is_current_rpc_agent_set()
    rpc.enable_gil_profiling(True)


def test_rref_type_and_future():
    box = rpc.remote("worker1", Box, args=(1,))
    assert box._get_type() is Box
    assert box._get_type(blocking=False).wait() is Box
    assert box._get_future().wait() is None
    assert rpc.RRef(Box(2))._get_type() is Box
    bad = rpc.remote("worker1", boom)
    with pytest.raises(ValueError, match="no box"):
        bad._get_future().wait()


def test_dist_autograd_helpers():
    pytest.importorskip("torch")
    ag = rpc.autograd
    with pytest.raises(RuntimeError, match="doesn't have a valid autograd context"):
        ag._current_context()
    with ag.context() as cid:
        ctx = ag._current_context()
        assert ctx._context_id() == cid and ag._is_valid_context(cid)
        assert ag._retrieve_context(cid) is ctx
        assert cid <= ag._get_max_id()
    assert not ag._is_valid_context(cid)
    assert "num_autograd_contexts" in ag._get_debug_info()


def echo(x):
    return x


def test_non_contiguous_tensors_keep_their_strides():
    """As torch's: a view travels with its whole storage and its strides
    and offset (a .contiguous() or .clone() sends only its elements)."""
    torch = pytest.importorskip("torch")
    t = torch.arange(24.0).reshape(4, 6)
    for view in (t.narrow(1, 2, 3), t.t(), t[1:, ::2]):
        assert not view.is_contiguous()
        got = rpc.rpc_sync("worker1", echo, args=(view,))
        assert torch.equal(got, view)
        assert (got.stride(), got.storage_offset()) == (view.stride(), view.storage_offset())
        assert got.storage().size() == t.numel()
    got = rpc.rpc_sync("worker1", echo, args=(t.narrow(1, 2, 3).contiguous(),))
    assert got.is_contiguous() and got.storage().size() == 12
    w = torch.ones(3, 4, requires_grad=True)
    with rpc.autograd.context() as cid:
        got = rpc.rpc_sync("worker1", echo, args=(w.t(),))
        assert got.stride() == (1, 4) and got.requires_grad
        rpc.autograd.backward(cid, [got.sum()])
        assert torch.equal(rpc.autograd.get_gradients(cid)[w], torch.ones(3, 4))


def test_futures_are_torch_futures():
    # Once torch.futures is loaded, rpc_async's Futures (and the ones
    # shmrpc makes) are torch.futures.Futures whose torch side completes
    # by itself: torch's C++ code waits on it without asking shmrpc.
    import torch

    fut = rpc.rpc_async("worker1", add, args=(1, 2))
    assert isinstance(fut, torch.futures.Future) and isinstance(fut, rpc.Future)
    assert torch._C.Future.wait(fut) == 3 and fut.wait() == 3
    bad = rpc.rpc_async("worker1", boom)
    with pytest.raises(ValueError, match="no box"):
        torch._C.Future.wait(bad)
    assert isinstance(fut.then(lambda f: f.wait()), torch.futures.Future)
    with torch.autograd.profiler.profile() as prof:
        with torch.autograd.profiler.record_function("outer") as rf:
            ended = rf._call_end_callbacks_on_future(rpc.rpc_async("worker1", slow, args=(0.2,)))
        assert torch._C.Future.wait(ended) == 0.2
    outer = [e for e in prof.function_events if e.name == "outer"]
    assert outer and outer[0].time_range.elapsed_us() >= 0.2e6


def test_waiter_settles_its_call():
    # The thread waiting in wait() settles the call's Future itself (the
    # call's completion hook runs there: future_hook), where an executor
    # thread that ran it took the GIL from the waiter, and an
    # rpc_async().wait() made 15 futex calls against rpc_sync's 1. With
    # nobody waiting in shmrpc (torch's C++ wait), an executor runs it.
    import threading

    import torch
    from shmrpc import _futures

    ran = []
    settle = _futures.Future._from_call

    def recorded(self):
        ran.append(threading.get_ident())
        settle(self)

    _futures.Future._from_call = recorded
    try:
        assert rpc.rpc_async("worker1", slow, args=(0.2,)).wait() == 0.2
        # Twice: the hook, and wait()'s own look (an executor's may come later).
        deadline = time.monotonic() + 5
        while len(ran) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(ran) == {threading.get_ident()}, f"settled by the waiter: {ran}"
        ran.clear()
        assert torch._C.Future.wait(rpc.rpc_async("worker1", slow, args=(0.2,))) == 0.2
        assert ran and threading.get_ident() not in ran, "settled by an executor"
    finally:
        _futures.Future._from_call = settle


def test_waiter_raises_an_interrupt_its_hook_met():
    # Ctrl-C while the waiter runs the call's done-callbacks itself (the
    # hook, future_hook): the KeyboardInterrupt comes out of wait(), as out
    # of wait()'s own settling, not printed and lost by the C hook (which
    # left wait() returning as if nothing had been pressed). Sent from the
    # callback on whichever thread runs it: an executor's reaches the main
    # thread's wait() or the sleep after it all the same.
    import os
    import signal
    import threading

    assert threading.current_thread() is threading.main_thread(), "Ctrl-C lands there"
    ran_on = []

    def interrupted(fut):
        ran_on.append(threading.current_thread().name)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the main thread's handler raises here

    # Python's own SIGINT handler, which a process started in the
    # background of a shell without job control (a CI run's) does not get:
    # SIGINT is ignored there from the start.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        fut = rpc.rpc_async("worker1", slow, args=(0.2,))
        fut.add_done_callback(interrupted)
        with pytest.raises(KeyboardInterrupt):
            fut.wait()
            time.sleep(2)  # an interrupt still pending is raised here at the latest
    finally:
        signal.signal(signal.SIGINT, before)
    assert ran_on, "the callback ran"
    assert fut.done() and fut.wait() == 0.2, "the call settled all the same"


def test_remote_timeout_fails_the_rref():
    # As torch's: remote()'s own timeout fails the RRef, for good, even
    # once the owner has stored the value.
    r = rpc.remote("worker1", slow, args=(0.5,), timeout=0.05)
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        r._get_future().wait()
    time.sleep(0.6)
    with pytest.raises(RuntimeError, match=r"RRef creation via rpc.remote\(\) timed out"):
        r.to_here()
