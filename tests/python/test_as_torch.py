# shmrun: none
# needs: has("torch")
"""An unmodified torch.distributed.rpc program (programs/torch_unmodified.py:
TensorPipeRpcBackendOptions, remote modules, distributed autograd,
DistributedOptimizer, async_execution with a torch Future,
torch.futures.wait_all on rpc_async's futures) runs on shmrpc through
`python3 -m shmrpc.as_torch` (or `shmrun --as-torch`) and prints what it
prints on torch itself.
"""
import os
import socket
import subprocess
import sys

PROG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "torch_unmodified.py")
BUILD = os.environ.get("SHMRPC_BUILD", "build")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_torch():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, PROG], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], f"torch's run failed: {outs}"
    return outs[0]


def shmrun(*args, cwd=None):
    # Another folder (cwd) needs the package's path absolute.
    path = os.pathsep.join(os.path.abspath(p)
                           for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    return subprocess.run([os.path.abspath(os.path.join(BUILD, "bin", "shmrun")), "-n", "2",
                           "--quiet", *args], cwd=cwd, env=dict(os.environ, PYTHONPATH=path),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)


def on_shmrpc(*args, cwd=None):
    r = shmrun(*args, cwd=cwd)
    assert r.returncode == 0, f"shmrpc's run failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_unmodified_program_same_output():
    ours = on_shmrpc("--", sys.executable, "-m", "shmrpc.as_torch", PROG)
    assert "step 3 loss" in ours and "wait_all [1, 2, 3]" in ours, ours
    assert ours == on_torch(), "the same output as on torch.distributed.rpc"
    # The whole job opted in by shmrun, the program given as a file or a module.
    assert on_shmrpc("--as-torch", "--", sys.executable, "-u", PROG) == ours
    assert on_shmrpc("--as-torch", "--", sys.executable, "-X", "utf8", "-m",
                     "programs.torch_unmodified", cwd=os.path.dirname(PROG) + "/..") == ours


def test_as_torch_refuses_what_is_not_a_python_program():
    for cmd, says in ((["sh", "-c", "true"], "must start with a Python interpreter"),
                      ([sys.executable, "-c", "pass"], "a file or -m MODULE (not -c)"),
                      ([sys.executable, "-u"], "a file or -m MODULE (not nothing)")):
        r = shmrun("--as-torch", "--", *cmd)
        assert r.returncode == 2 and says in r.stderr, r.stderr


def test_install_replaces_torch_names():
    code = ("import shmrpc, torch, torch.distributed.rpc as before\n"
            "shmrpc.install_as_torch()\n"
            "import torch.distributed.rpc as rpc, torch.distributed.autograd as ag\n"
            "from torch.distributed.optim import DistributedOptimizer\n"
            "import shmrpc.optim\n"
            "assert rpc is shmrpc and ag is shmrpc.autograd, (rpc, ag)\n"
            "assert torch.distributed.rpc is shmrpc and before is not shmrpc\n"
            "assert DistributedOptimizer is shmrpc.optim.DistributedOptimizer\n"
            "assert rpc.TensorPipeRpcBackendOptions().rpc_timeout == 60.0\n"
            "f = shmrpc.Future(); f.set_result(3)\n"
            "assert torch.futures.wait_all([f]) == [3]\n"
            "t = torch.futures.Future(); t.set_result(4)\n"
            "assert torch.futures.wait_all([t]) == [4]\n")
    r = subprocess.run([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    assert r.returncode == 0, r.stderr


def test_wait_all_takes_shmrpc_futures():
    """Without install_as_torch: import shmrpc before or after torch."""
    for first, second in (("shmrpc", "torch"), ("torch", "shmrpc")):
        code = (f"import {first}, {second}\n"
                "f = shmrpc.Future(); f.set_result(3)\n"
                "assert torch.futures.wait_all([f]) == [3]\n"
                "assert torch.futures.collect_all([f]).wait()[0].wait() == 3\n"
                "t = torch.futures.Future(); t.set_result(4)\n"
                "assert torch.futures.wait_all([t]) == [4]\n")
        r = subprocess.run([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
        assert r.returncode == 0, f"{first} first: {r.stderr}"


def test_usage():
    r = subprocess.run([sys.executable, "-m", "shmrpc.as_torch"], stderr=subprocess.PIPE,
                       text=True)
    assert r.returncode == 2 and "usage" in r.stderr
