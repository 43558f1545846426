"""shmrpc._get_debug_info() (run by tests/python_rpc.c): torch's agent keys,
their values strings of numbers as torch's; the GIL counters of the worker
that serves Python calls grow by at least the calls it ran (each one took
the GIL on an executor thread), and a completion callback takes it too.
"""
import os
import sys
import threading

import shmrpc as rpc

from checks import check, failed

TORCH_KEYS = {"agent.thread_pool_size", "agent.num_idle_threads", "agent.client_active_calls",
              "agent.server_active_calls", "agent.server_active_async_calls",
              "agent.gil_average_wait_time_us", "num_owner_rrefs", "num_pending_futures",
              "num_forks", "num_pending_users"}
AUTOGRAD_KEYS = {"num_autograd_contexts", "num_current_backward_passes"}  # ints, as torch's
SHMRPC_KEYS = {"agent.server_pending_calls", "agent.calls_served", "agent.gil_acquisitions",
               "agent.gil_wait_time_ns"}
CALLS = 20


def add(a, b):
    return a + b


def numbers(info):
    return {k: int(v) for k, v in info.items()}


def main():
    rank = int(os.environ["SHMRPC_RANK"])
    try:
        rpc._get_debug_info()
        check(False, "_get_debug_info before init_rpc raises")
    except RuntimeError as e:
        check("init_rpc" in str(e), f"_get_debug_info before init_rpc says why: {e}")
    rpc.init_rpc(f"worker{rank}")
    peer = f"worker{1 - rank}"

    info = rpc._get_debug_info()
    check(set(info) == TORCH_KEYS | SHMRPC_KEYS | AUTOGRAD_KEYS, f"the keys: {sorted(info)}")
    check(all(isinstance(v, int if k in AUTOGRAD_KEYS else str) for k, v in info.items()),
          f"values are strings, autograd's ints, as torch's: {info}")
    mine = numbers(info)
    check(all(v >= 0 for v in mine.values()), f"values are counts: {info}")
    check(mine["agent.thread_pool_size"] >= 1, "the executor pool has threads")

    # The peer's counters, read on the peer by a call of their own.
    before = numbers(rpc.rpc_sync(peer, rpc._get_debug_info))
    for i in range(CALLS):
        check(rpc.rpc_sync(peer, add, args=(i, 1)) == i + 1, "add on the peer")
    after = numbers(rpc.rpc_sync(peer, rpc._get_debug_info))
    grew = after["agent.gil_acquisitions"] - before["agent.gil_acquisitions"]
    # CALLS adds and the second _get_debug_info ran there since `before`.
    check(grew >= CALLS + 1, f"the peer took the GIL {grew} times for {CALLS + 1} calls")
    check(after["agent.gil_wait_time_ns"] > before["agent.gil_wait_time_ns"],
          "the peer's GIL wait time grew")
    check(after["agent.gil_average_wait_time_us"] >= 0, "the average is a number >= 0")
    check(after["agent.calls_served"] >= before["agent.calls_served"],
          "calls_served does not go back")

    # A done callback runs on one of our executor threads, under the GIL.
    takes = numbers(rpc._get_debug_info())["agent.gil_acquisitions"]
    ran = threading.Event()
    rpc.rpc_async(peer, add, args=(1, 1)).add_done_callback(lambda f: ran.set())
    check(ran.wait(30), "the done callback ran")
    check(numbers(rpc._get_debug_info())["agent.gil_acquisitions"] > takes,
          "the callback's GIL acquisition is counted")

    # An RRef the peer owns and we hold: counted there as an owner RRef
    # and a fork (ours); a context of ours is counted here.
    r = rpc.remote(peer, add, args=(1, 2))
    check(r.to_here() == 3, "remote add")
    held = numbers(rpc.rpc_sync(peer, rpc._get_debug_info))
    check(held["num_owner_rrefs"] >= 1 and held["num_forks"] >= 1,
          f"the peer counts the RRef it owns and our fork: {held}")
    check(held["num_pending_futures"] == 0 and held["num_pending_users"] == 0,
          f"nothing pending on the peer: {held}")
    with rpc.autograd.context():
        check(rpc._get_debug_info()["num_autograd_contexts"] == 1, "our context is counted")
    check(rpc._get_debug_info()["num_current_backward_passes"] == 0, "no backward running")
    del r
    print(f"rank {rank}: peer's debug info: {after}", file=sys.stderr)
    rpc.shutdown()
    return failed()


if __name__ == "__main__":
    sys.exit(main())
