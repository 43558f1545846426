# shmrun: -n 2 --pool-size 64M
# needs: has("torch")
"""TorchScript functions called by RPC (torch.jit.script of a function), as
torch's RPC calls them: sent by qualified name and found on the callee in
the compilation unit where every rank scripted it when it imported this
module; a failure in the interpreter arrives as a RuntimeError with its
message; torch's profiler names the call by the qualified name. A
scripted function given as an argument cannot be sent, as in torch."""
import pickle

import pytest
import torch

import shmrpc as rpc


@torch.jit.script
def script_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.add(x, y)


@torch.jit.script
def script_raise(message: str) -> torch.Tensor:
    raise ValueError(message)


def apply(f, x):
    return f(x, x)


def test_rpc_sync_rpc_async_remote():
    x, y = torch.arange(6.0), torch.ones(6)
    assert torch.equal(rpc.rpc_sync("worker1", script_add, args=(x, y)), x + y)
    assert torch.equal(rpc.rpc_async("worker1", script_add, args=(x,), kwargs={"y": y}).wait(),
                       x + y)
    rref = rpc.remote("worker1", script_add, args=(x, y))
    assert rref.owner().name == "worker1"
    assert torch.equal(rref.to_here(), x + y)


def test_failure_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="Expected from the script") as info:
        rpc.rpc_sync("worker1", script_raise, args=("Expected from the script",))
    # Not torch.jit.Error, which is no RuntimeError: as torch's script calls fail.
    assert type(info.value) is RuntimeError
    assert "TorchScript interpreter" in str(info.value)


def test_profiler_names_the_qualified_name():
    with torch.autograd.profiler_legacy.profile() as prof:
        rpc.rpc_sync("worker1", script_add, args=(torch.ones(2), torch.ones(2)))
    names = [e.name for e in prof.function_events]
    key = [n for n in names if n.startswith("rpc_sync#")]
    assert key and script_add.qualified_name in key[0], names
    assert "worker0 -> worker1" in key[0], key


def test_as_an_argument_refused():
    # torch's pickler refuses one too: only the called function goes by name.
    with pytest.raises(pickle.PickleError, match="ScriptFunction cannot be pickled"):
        rpc.rpc_sync("worker1", apply, args=(script_add, torch.ones(2)))


def test_unknown_name_on_the_callee():
    # What the callee does with a name it has no function of (a module
    # the caller scripted it in and the callee never imported).
    from shmrpc._marshal import _script_function

    with pytest.raises(RuntimeError, match='no TorchScript function named '
                       '"__torch__.nowhere.not_scripted" in this process'):
        _script_function("__torch__.nowhere.not_scripted")
    assert torch.equal(_script_function(script_add.qualified_name)(torch.ones(1), torch.ones(1)),
                       torch.full((1,), 2.0))
