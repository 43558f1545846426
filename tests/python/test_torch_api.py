# shmrun: -n 3 --pool-size 64M
"""torch.distributed.rpc.api's private names on shmrpc (shmrpc.api), used
the way torch's code and tests use them, under shmrun and without torch's
test suite: _all_gather and _barrier (every rank takes part), the
_wait_all block, the current agent, init_rpc's checks of its arguments,
_use_rpc_pickler, RRef proxies that look the method up on the caller.
(A gather whose worker died: test_join.py's death cases, through shutdown.)
"""
import threading
import time

import pytest

import shmrpc as rpc
from shmrpc import api

ALL = (0, 1, 2)


def add(a, b):
    return a + b


def boom():
    raise ValueError("boom")


def wait_for(event_name):
    events[event_name].wait(30)
    return event_name


events = {"release": threading.Event()}


class Box:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


@pytest.mark.rank(*ALL)
def test_all_gather():
    me = rpc.get_worker_info()
    got = api._all_gather(me.id * 10)
    assert got == {f"worker{r}": r * 10 for r in ALL}, got
    # Again, with the same workers: a second gather of its own.
    assert api._all_gather(me.name) == {f"worker{r}": f"worker{r}" for r in ALL}


@pytest.mark.rank(*ALL)
def test_all_gather_subset():
    me = rpc.get_worker_info()
    if me.id == 2:
        return  # not in this one
    got = api._all_gather(me.id, worker_names={"worker0", "worker1"})
    assert got == {"worker0": 0, "worker1": 1}, got


@pytest.mark.rank(*ALL)
def test_barrier():
    api._barrier([f"worker{r}" for r in ALL])
    api._barrier({"worker1", "worker2"} if rpc.get_worker_info().id else set(["worker0"]))


@pytest.mark.rank(*ALL)
def test_wait_all_workers():
    api._wait_all_workers()  # returns on every rank once all called it


def test_agent():
    agent = api._get_current_rpc_agent()
    assert api._is_current_rpc_agent_set()
    assert sorted((w.name, w.id) for w in agent.get_worker_infos()) == \
        [(f"worker{r}", r) for r in ALL]
    info = agent.get_debug_info()
    assert all(k.startswith("agent.") for k in info), info
    assert "agent.gil_average_wait_time_us" not in info, "not until enable_gil_profiling(True)"
    rpc.enable_gil_profiling(True)
    assert "agent.gil_average_wait_time_us" in agent.get_debug_info()
    rpc.enable_gil_profiling(False)
    assert rpc._get_current_rpc_agent is api._get_current_rpc_agent
    assert rpc.PyRRef is rpc.RRef


def test_wait_all_block():
    with api._wait_all():
        assert api._thread_local_var.future_list == []
        futs = [rpc.rpc_async("worker1", add, args=(i, 1)) for i in range(5)]
        assert rpc.rpc_sync("worker1", add, args=(1, 1)) == 2
        assert api._thread_local_var.future_list == futs, "rpc_async's futures, not rpc_sync's"
    assert all(f.done() for f in futs), "waited for at the end of the block"
    assert [f.wait() for f in futs] == [1, 2, 3, 4, 5]
    assert not hasattr(api._thread_local_var, "future_list")
    with pytest.raises(ValueError, match="boom"):
        with api._wait_all():
            rpc.rpc_async("worker2", boom)
    assert not hasattr(api._thread_local_var, "future_list")


def test_wait_all_raises_first_error_early():
    events["release"].clear()
    slow = rpc.rpc_async("worker0", wait_for, args=("release",))  # runs here, waits
    failed = rpc.rpc_async("worker1", boom)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom"):
        rpc.wait_all([slow, failed])
    assert not slow.done(), "wait_all raised before the slow call completed"
    events["release"].set()
    assert slow.wait() == "release"
    assert time.monotonic() - t0 < 30


def test_init_rpc_argument_types():
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.init_rpc("worker0", backend="TENSORPIPE")
    with pytest.raises(TypeError, match="must be an instance of RpcBackendOptions"):
        rpc.init_rpc("worker0", rpc_backend_options={"init_method": "env://"})

    class Foo(rpc.RpcBackendOptions):
        pass

    with pytest.raises(TypeError, match="Could not infer backend for options"):
        rpc.init_rpc("worker0", rpc_backend_options=Foo())
    # Right types: shmrpc's own check comes next.
    with pytest.raises(RuntimeError, match="already"):
        rpc.init_rpc("worker0", rpc_backend_options=rpc.TensorPipeRpcBackendOptions())


def test_other_pickler_refused():
    class Mine:
        pass

    mine = Mine()
    with api._use_rpc_pickler(mine):
        assert api._default_pickler is mine
        with pytest.raises(NotImplementedError, match="RPC pickler of the program's own"):
            rpc.rpc_sync("worker1", add, args=(1, 2))
    assert api._default_pickler is not mine
    assert rpc.rpc_sync("worker1", add, args=(1, 2)) == 3


def test_proxy_checks_method_on_caller():
    box = rpc.remote("worker1", Box, args=(7,))
    assert box.rpc_sync().get() == 7
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        box.rpc_sync().nope()
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        box.remote().nope()
    fut = box.rpc_async().nope()
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        fut.wait()
    assert box.rpc_async().get().wait() == 7


def test_rref_serialize_refused():
    box = rpc.remote("worker1", Box, args=(1,))
    with pytest.raises(NotImplementedError, match="torch's RPC pickler"):
        box._serialize()


def test_peer_gone():
    assert [rpc._shmrpc.peer_gone(r) for r in ALL] == [None] * 3, "all in the job"
