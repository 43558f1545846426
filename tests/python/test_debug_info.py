# shmrun: -n 2 --pool-size 64M
"""shmrpc._get_debug_info(): torch's agent keys, their values strings of
numbers as torch's; the GIL counters of the worker that serves Python calls
grow by at least the calls it ran (each one took the GIL on an executor
thread), and a completion callback takes it too; the GIL wait average is
reported once enable_gil_profiling(True) ran on the worker, as torch's.
Before init_rpc it raises, on both workers; the rest runs on worker0
(conftest.py).
"""
import sys
import threading

import pytest

import shmrpc as rpc

GIL_AVERAGE = "agent.gil_average_wait_time_us"
TORCH_KEYS = {"agent.thread_pool_size", "agent.num_idle_threads", "agent.client_active_calls",
              "agent.server_active_calls", "agent.server_active_async_calls",
              GIL_AVERAGE, "num_owner_rrefs", "num_pending_futures",
              "num_forks", "num_pending_users"}
AUTOGRAD_KEYS = {"num_autograd_contexts", "num_current_backward_passes"}  # ints, as torch's
SHMRPC_KEYS = {"agent.server_pending_calls", "agent.calls_served", "agent.gil_acquisitions",
               "agent.gil_wait_time_ns"}
CALLS = 20


def add(a, b):
    return a + b


def numbers(info):
    return {k: int(v) for k, v in info.items()}


before_init = []  # what _get_debug_info did before init_rpc, on this rank


def rpc_init(rank):
    try:
        before_init.append(rpc._get_debug_info())
    except RuntimeError as e:
        before_init.append(e)
    rpc.init_rpc(f"worker{rank}")


@pytest.mark.rank(0, 1)
def test_before_init_rpc():
    got = before_init[0]
    assert isinstance(got, RuntimeError), f"_get_debug_info before init_rpc raises: {got}"
    assert "init_rpc" in str(got), f"_get_debug_info before init_rpc says why: {got}"


def enable_gil_profiling():
    rpc.enable_gil_profiling(True)


def test_keys_and_values():
    info = rpc._get_debug_info()
    assert set(info) == TORCH_KEYS - {GIL_AVERAGE} | SHMRPC_KEYS | AUTOGRAD_KEYS, \
        f"the keys, without the GIL average until GIL profiling is enabled: {sorted(info)}"
    enable_gil_profiling()
    info = rpc._get_debug_info()
    assert set(info) == TORCH_KEYS | SHMRPC_KEYS | AUTOGRAD_KEYS, f"the keys: {sorted(info)}"
    assert all(isinstance(v, int if k in AUTOGRAD_KEYS else str) for k, v in info.items()), \
        f"values are strings, autograd's ints, as torch's: {info}"
    mine = numbers(info)
    assert all(v >= 0 for v in mine.values()), f"values are counts: {info}"
    assert mine["agent.thread_pool_size"] >= 1, "the executor pool has threads"


def test_peer_counters():
    # The peer's counters, read on the peer by a call of their own.
    rpc.rpc_sync("worker1", enable_gil_profiling)
    before = numbers(rpc.rpc_sync("worker1", rpc._get_debug_info))
    for i in range(CALLS):
        assert rpc.rpc_sync("worker1", add, args=(i, 1)) == i + 1, "add on the peer"
    after = numbers(rpc.rpc_sync("worker1", rpc._get_debug_info))
    grew = after["agent.gil_acquisitions"] - before["agent.gil_acquisitions"]
    # CALLS adds and the second _get_debug_info ran there since `before`.
    assert grew >= CALLS + 1, f"the peer took the GIL {grew} times for {CALLS + 1} calls"
    assert after["agent.gil_wait_time_ns"] > before["agent.gil_wait_time_ns"], \
        "the peer's GIL wait time grew"
    assert after["agent.gil_average_wait_time_us"] >= 0, "the average is a number >= 0"
    assert after["agent.calls_served"] >= before["agent.calls_served"], \
        "calls_served does not go back"
    print(f"peer's debug info: {after}", file=sys.stderr)


def test_done_callback_takes_the_gil():
    # A done callback runs on one of our executor threads, under the GIL.
    takes = numbers(rpc._get_debug_info())["agent.gil_acquisitions"]
    ran = threading.Event()
    rpc.rpc_async("worker1", add, args=(1, 1)).add_done_callback(lambda f: ran.set())
    assert ran.wait(30), "the done callback ran"
    assert numbers(rpc._get_debug_info())["agent.gil_acquisitions"] > takes, \
        "the callback's GIL acquisition is counted"


def test_rref_and_autograd_counts():
    # An RRef worker1 owns and we hold: counted there as an owner RRef and
    # a fork (ours); a context of ours is counted here.
    r = rpc.remote("worker1", add, args=(1, 2))
    assert r.to_here() == 3, "remote add"
    held = numbers(rpc.rpc_sync("worker1", rpc._get_debug_info))
    assert held["num_owner_rrefs"] >= 1 and held["num_forks"] >= 1, \
        f"the peer counts the RRef it owns and our fork: {held}"
    assert held["num_pending_futures"] == 0 and held["num_pending_users"] == 0, \
        f"nothing pending on the peer: {held}"
    with rpc.autograd.context():
        assert rpc._get_debug_info()["num_autograd_contexts"] == 1, "our context is counted"
    assert rpc._get_debug_info()["num_current_backward_passes"] == 0, "no backward running"
