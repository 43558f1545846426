"""Futures and async execution from Python (run by tests/python_rpc.c):
then() chains, add_done_callback, set_result/set_exception, collect_all and
wait_all, @functions.async_execution returning a Future (and its error when
it returns something else), nested rpc_sync inside functions with one
executor thread.
"""
import os
import sys
import threading

import shmrpc as rpc

from checks import check, failed


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


def main():
    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts())
    me, peer = f"worker{rank}", f"worker{1 - rank}"

    fut = rpc.rpc_async(peer, add, args=(1, 2))
    chained = fut.then(lambda f: f.wait() * 10)
    check(chained.wait() == 30 and fut.value() == 3, "then() chains on a call")
    seen = threading.Event()
    fut.add_done_callback(lambda f: seen.set())
    check(seen.wait(5), "add_done_callback on a completed future runs")

    mine = rpc.Future()
    check(not mine.done(), "a new Future is not done")
    mine.set_result(7)
    check(mine.done() and mine.wait() == 7, "set_result")
    bad = rpc.Future()
    bad.set_exception(KeyError("k"))
    try:
        bad.wait()
        check(False, "set_exception did not raise")
    except KeyError:
        pass
    broken = rpc.rpc_async(peer, add, args=(1, "x")).then(lambda f: f.wait())
    try:
        broken.wait()
        check(False, "an error did not travel through then()")
    except TypeError as e:
        check("unsupported operand" in str(e), f"TypeError text: {e}")

    futs = [rpc.rpc_async(peer, add, args=(i, 1)) for i in range(50)]
    check(rpc.wait_all(futs) == list(range(1, 51)), "wait_all")
    done = rpc.collect_all([rpc.rpc_async(peer, add, args=(i, i)) for i in range(5)]).wait()
    check([f.value() for f in done] == [0, 2, 4, 6, 8], "collect_all")

    check(rpc.rpc_sync(peer, async_add_chain, args=(me, 1, 3)) == 4, "async_execution chain")
    try:
        rpc.rpc_sync(peer, async_wrong)
        check(False, "async_execution returning an int did not fail")
    except TypeError as e:
        check("must return a torch.futures.Future" in str(e) and "but got builtins.int" in str(e),
              f"async_execution text: {e}")

    # Deeper than the pool (one thread per worker): must complete.
    check(rpc.rpc_sync(peer, ping_pong, args=(8, me)) == "bottom", "a nested chain of 8")

    rpc.shutdown()
    return failed()


if __name__ == "__main__":
    sys.exit(main())
