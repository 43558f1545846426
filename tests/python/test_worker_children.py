# shmrun: -n 2 --pool-size 64M
"""Processes a shmrun worker starts inherit its variables (SHMRPC_RANK, the
job's fds) but are not that worker: started with multiprocessing's spawn
or forkserver method they meet each other at an init_method as any
processes do, in a job of their own, while the worker's job goes on; one
forked from a worker whose agent runs is refused with a sentence (its
threads did not survive the fork).
"""
import multiprocessing as mp
import os

import pytest

import shmrpc as rpc


def child(rank, path, out):
    rpc.init_rpc(f"child{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}"))
    try:
        out.put((rank, rpc.get_worker_info().name, rpc.rpc_sync(f"child{1 - rank}", max,
                                                                   args=(rank, 7))))
    finally:
        rpc.shutdown()


def forked_child(path, out):
    try:
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}")
        rpc.init_rpc("forked", rank=0, world_size=1, rpc_backend_options=opts)
    except RuntimeError as e:
        out.put(str(e))
    else:
        out.put("joined")
        rpc.shutdown()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_children_meet_in_their_own_job(method, tmp_path):
    ctx = mp.get_context(method)
    out = ctx.Queue()
    procs = [ctx.Process(target=child, args=(r, tmp_path / "rdv", out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert got == [(0, "child0", 7), (1, "child1", 7)]
    # The worker's own job is untouched.
    assert rpc.get_worker_info().name == "worker0"
    assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2


def test_forked_from_a_running_worker_is_refused(tmp_path):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=forked_child, args=(tmp_path / "rdv", out))
    p.start()
    said = out.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    assert "forked from a worker whose RPC agent was running" in said, said
    assert "spawn or forkserver" in said


def test_programs_a_worker_runs_hold_none_of_the_job():
    # The job's fds are close-on-exec once the agent has attached them.
    import subprocess
    out = subprocess.run(["sh", "-c", "ls -l /proc/self/fd"], capture_output=True, text=True,
                         check=True).stdout
    assert "memfd:" not in out, out
