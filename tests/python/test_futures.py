# shmrun: -n 2 --pool-size 64M
"""Futures and async execution from Python: then() chains,
add_done_callback, set_result/set_exception, collect_all and wait_all,
@functions.async_execution returning a Future (and its error when it
returns something else), nested rpc_sync inside functions with one
executor thread. worker0 calls, worker1 serves (conftest.py).
"""
import threading

import pytest

import shmrpc as rpc


def add(a, b):
    return a + b


@rpc.functions.async_execution
def async_add_chain(to, x, times):
    # Returns at once; the reply goes when the chain of calls completes.
    fut = rpc.rpc_async(to, add, args=(x, 1))
    for _ in range(times - 1):
        fut = fut.then(lambda f: f.wait() + 1)
    return fut


@rpc.functions.async_execution
def async_wrong():
    return 42


def ping_pong(depth, other):
    if depth == 0:
        return "bottom"
    me = rpc.get_worker_info().name
    return rpc.rpc_sync(other, ping_pong, args=(depth - 1, me))


class Opts:
    num_worker_threads = 1
    rpc_timeout = 30


def rpc_init(rank):
    rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts())


def test_then_and_done_callback():
    fut = rpc.rpc_async("worker1", add, args=(1, 2))
    chained = fut.then(lambda f: f.wait() * 10)
    assert chained.wait() == 30 and fut.value() == 3, "then() chains on a call"
    seen = threading.Event()
    fut.add_done_callback(lambda f: seen.set())
    assert seen.wait(5), "add_done_callback on a completed future runs"


def test_set_result_and_exception():
    mine = rpc.Future()
    assert not mine.done(), "a new Future is not done"
    mine.set_result(7)
    assert mine.done() and mine.wait() == 7, "set_result"
    bad = rpc.Future()
    bad.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        bad.wait()


def test_error_through_then():
    broken = rpc.rpc_async("worker1", add, args=(1, "x")).then(lambda f: f.wait())
    with pytest.raises(RuntimeError, match="(?s)Got the following error when running the callback: "
                       "TypeError: .*unsupported operand"):  # torch's
        broken.wait()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        rpc.rpc_async("worker1", add, args=(1, 2)).then(None)


def test_wait_all_and_collect_all():
    futs = [rpc.rpc_async("worker1", add, args=(i, 1)) for i in range(50)]
    assert rpc.wait_all(futs) == list(range(1, 51)), "wait_all"
    done = rpc.collect_all([rpc.rpc_async("worker1", add, args=(i, i)) for i in range(5)]).wait()
    assert [f.value() for f in done] == [0, 2, 4, 6, 8], "collect_all"


def test_async_execution():
    assert rpc.rpc_sync("worker1", async_add_chain, args=("worker0", 1, 3)) == 4, \
        "async_execution chain"
    with pytest.raises(RuntimeError) as e:  # torch's type and text
        rpc.rpc_sync("worker1", async_wrong)
    assert "must return a torch.futures.Future object" in str(e.value) \
        and "but got builtins.int" in str(e.value), f"async_execution text: {e.value}"


def test_nested_deeper_than_the_pool():
    # Deeper than the pool (one thread per worker): must complete.
    assert rpc.rpc_sync("worker1", ping_pong, args=(8, "worker0")) == "bottom", \
        "a nested chain of 8"
