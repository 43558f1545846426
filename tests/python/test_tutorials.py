# shmrun: none
# needs: has("torch")
"""The RPC tutorials' patterns (issue 18), each run on shmrpc and on
torch.distributed.rpc and compared: tests/python/tutorials/ holds four
programs written as PyTorch's RPC tutorials write them, the same code for
both (the command-line switch `shmrpc` or `torch` picks the module):

    param_server.py  a batch-updating parameter server behind an RRef (3 workers)
    rl.py            an RL agent with RRef(self), observers calling it (3)
    rnn.py           an RNN with a remote embedding table and decoder (2)
    pipeline.py      a two-stage pipeline with DistributedOptimizer (3)

Each is run once under shmrun and once as torch workers that this module
forks (it has imported torch; MASTER_ADDR=127.0.0.1, a free MASTER_PORT,
RANK and WORLD_SIZE). Rank 0 prints "RESULT {json}": per-step losses (for
rl.py rewards too) and what the program saw of the remote state.
test_torch[NAME] checks the reference: it ran, and the model trained;
test_shmrpc[NAME] checks the same of shmrpc, and that its results are
torch's (losses to 1e-5, rewards equal). By hand, from the top folder:

    PYTHONPATH=build/python build/bin/shmrun -n 2 -- python3 tests/python/tutorials/rnn.py shmrpc
    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python3 tests/python/tutorials/rnn.py torch    # for r in 0 1
"""
import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import pytest
import torch  # noqa: F401  (before the torch workers fork)
import torch.distributed.autograd  # noqa: F401
import torch.distributed.optim  # noqa: F401
import torch.distributed.rpc  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.path.abspath(os.environ.get("SHMRPC_BUILD") or "build")
SHMRUN = os.path.join(BUILD, "bin", "shmrun")
WORKERS = {"param_server": 3, "rl": 3, "rnn": 2, "pipeline": 3}
LIMIT_S = 90  # one job
TOL = 1e-5

_runs = {}  # (program, backend) -> Run


class Run:
    def __init__(self, backend, rcs, out):
        self.backend, self.rcs, self.out = backend, rcs, out
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        self.result = json.loads(lines[-1][len("RESULT "):]) if lines else None

    def ok(self):
        return not any(self.rcs) and self.result is not None

    def tail(self, n=120):
        return "\n".join(self.out.splitlines()[-n:])


def shm_names():
    return {n for n in os.listdir("/dev/shm") if "shmrpc" in n.lower()}


def run_shmrpc(program, n):
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    argv = [SHMRUN, "-n", str(n), "--pool-size", "64M", "--timeout", str(LIMIT_S), "--",
            sys.executable, os.path.join(HERE, "tutorials", program + ".py"), "shmrpc"]
    before = shm_names()
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                       timeout=LIMIT_S + 30)
    assert "left in the RRef table" not in r.stdout, f"{program}: RRefs left\n{r.stdout}"
    assert not shm_names() - before, f"{program}: left in /dev/shm: {shm_names() - before}"
    return Run("shmrpc", [r.returncode], r.stdout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_rank(path, rank, env, log_path, barrier):
    """A torch worker, forked from this process (torch already imported:
    a second of CPU less for each): the program as __main__, its output
    to log_path; exits with its status once every rank has run (a rank
    gone at once can reset the connections of one still in torch's
    rpc.shutdown(): "Connection reset by peer", 1 job in 60)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    os.environ.update(env, RANK=str(rank))
    sys.argv = [path, "torch"]
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    try:
        barrier.wait(LIMIT_S)
    except threading.BrokenBarrierError:
        pass  # a rank failed or hung: its own status tells
    os._exit(code)


def run_torch(program, n):
    """n torch workers, reaped (killed past LIMIT_S); their output, rank by rank."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
    path = os.path.join(HERE, "tutorials", program + ".py")
    fork = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"rank{rank}.log") for rank in range(n)]
        barrier = fork.Barrier(n)
        procs = [fork.Process(target=torch_rank, args=(path, rank, env, logs[rank], barrier))
                 for rank in range(n)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + LIMIT_S
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.exitcode is None:  # past the limit: every rank goes
                for q in procs:
                    q.kill()
                p.join()
        rcs, out = [p.exitcode for p in procs], ""
        for rank, log in enumerate(logs):
            with open(log) as f:
                out += f"---- torch rank {rank} (exit {rcs[rank]})\n" + f.read()
    return Run("torch", rcs, out)


def run(program, backend):
    if (program, backend) not in _runs:
        job = run_shmrpc if backend == "shmrpc" else run_torch
        _runs[program, backend] = job(program, WORKERS[program])
    r = _runs[program, backend]
    assert r.ok(), f"{program} on {backend}: exits {r.rcs}, result {r.result}\n{r.tail()}"
    return r


def close(a, b, what, names=("shmrpc", "torch")):
    assert len(a) == len(b) and all(abs(x - y) <= TOL for x, y in zip(a, b)), \
        f"{what}:\n  {names[0]} {a}\n  {names[1]} {b}"


# What each program must show on either backend (r.result), then what must
# be as torch's (the same checks first on torch's run, the reference).

def check_param_server(r):
    res = r.result
    assert res["same_object"], f"{r.backend}: ps_rref.local_value() is the server object"
    assert sorted(res["losses"]) == ["trainer1", "trainer2"], res
    for trainer, losses in res["losses"].items():
        assert len(losses) == 6, f"{r.backend} {trainer}: {len(losses)} steps"
        close(res["server_losses"][trainer], losses,
              f"{r.backend} {trainer}: the server's forward sees the last update",
              ("by the server's forward", "by the trainer's fetched model"))
        assert losses[-1] < 0.8 * losses[0], f"{r.backend} {trainer}: trains: {losses}"
    assert res["param_change"] > 1e-3, f"{r.backend}: the server's model changed: {res}"


def check_rl(r):
    res = r.result
    assert res["same_object"], f"{r.backend}: agent_rref.local_value() is the agent"
    assert len(res["observed"]) == 5, f"{r.backend}: 5 episodes: {res}"
    assert res["recorded"] == res["observed"], \
        f"{r.backend}: the rewards the agent recorded are the observers': {res}"
    assert sum(map(sum, res["observed"])) > 0, f"{r.backend}: some rewards: {res}"
    assert res["param_change"] > 1e-3, f"{r.backend}: the policy changed: {res}"


def check_rnn(r):
    res = r.result
    assert len(res["losses"]) == 8, f"{r.backend}: 8 steps: {res}"
    assert all(res["grads_keyed"]), \
        f"{r.backend}: get_gradients(ctx) on the ps holds local_value().parameters(): {res}"
    assert res["remote_param_change"] > 1e-3, f"{r.backend}: the remote layers changed: {res}"
    assert res["losses"][-1] < res["losses"][0] - 0.05, f"{r.backend}: trains: {res['losses']}"


def check_pipeline(r):
    res = r.result
    assert len(res["losses"]) == 5, f"{r.backend}: 5 steps: {res}"
    assert len(res["param_change"]) == 6 and min(res["param_change"]) > 1e-3, \
        f"{r.backend}: every parameter of both shards changed: {res['param_change']}"
    assert res["losses"][-1] < res["losses"][0], f"{r.backend}: trains: {res['losses']}"


CHECKS = {"param_server": check_param_server, "rl": check_rl, "rnn": check_rnn,
          "pipeline": check_pipeline}


def compare(program, mine, ref):
    a, b = mine.result, ref.result
    if program == "param_server":
        for trainer in b["losses"]:
            close(a["losses"][trainer], b["losses"][trainer], f"{program} {trainer}'s losses")
            close(a["server_losses"][trainer], b["server_losses"][trainer],
                  f"{program} {trainer}'s losses by the server's forward")
    elif program == "rl":
        assert a["observed"] == b["observed"], \
            f"rl: the observers' rewards: shmrpc {a['observed']}\n  torch {b['observed']}"
        assert a["recorded"] == b["recorded"], \
            f"rl: the agent's recorded rewards: shmrpc {a['recorded']}\n  torch {b['recorded']}"
        close(a["losses"], b["losses"], "rl's policy losses")
        close(a["running_reward"], b["running_reward"], "rl's running rewards")
    else:
        close(a["losses"], b["losses"], f"{program}'s losses")
    for key in ("param_change", "remote_param_change"):  # how far the parameters moved
        if key in b:
            close(*[x[key] if isinstance(x[key], list) else [x[key]] for x in (a, b)],
                  f"{program}'s {key}")


@pytest.mark.parametrize("program", list(WORKERS))
def test_torch(program):
    """The reference: the program runs on torch.distributed.rpc and trains."""
    CHECKS[program](run(program, "torch"))


@pytest.mark.parametrize("program", list(WORKERS))
def test_shmrpc(program):
    """The same program on shmrpc: it trains, and as torch's does."""
    mine = run(program, "shmrpc")
    CHECKS[program](mine)
    compare(program, mine, run(program, "torch"))
