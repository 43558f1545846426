# shmrun: -n 2 --pool-size 64M
# needs: has("torch")
"""The callee's two ways of serving a call (python/_handler.c): most calls
by _serve._serve_plain (a PYTHON_CALL or PYTHON_REMOTE_CALL its caller does
not profile), the others by _run_function (inside a distributed autograd
context, profiled, an RRef fetch). Each test sends the same kind of call
both ways, or one way whose answer depends on the shortcut the plain way
takes (a result of None sent as the bare empty pickle, async_execution's
mark asked only of a callable that may have it), and checks what comes
back. Rank 0 calls rank 1.
"""
import functools
import types

import pytest

import shmrpc as rpc
from shmrpc import _serve
from shmrpc.autograd import context

PEER = "worker1"


def nothing():
    return None


def seven():
    return 7


def pair():
    return [1, 2]  # a list: kept live by its owner, fetched by to_here


def wrapped(fn):
    """A decorator whose function has attributes (functools.wraps sets
    __wrapped__ and copies fn's): the plain way then asks whether it is
    async_execution's."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@wrapped
def wrapped_add(a, b):
    return a + b


@rpc.functions.async_execution
def async_add(a, b):
    return rpc.rpc_async(PEER, wrapped_add, args=(a, b))


def served_by(name):
    """On the callee: which handler serves the call this function runs in
    (the innermost of _serve_plain and _run_function on this stack), or
    name if neither is there."""
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in (_serve._serve_plain.__code__, _serve._run_function.__code__):
            return frame.f_code.co_name
        frame = frame.f_back
    return name


def missing_on_the_callee():
    """A function the callee cannot find by its name (made on the caller
    alone, under a name no module defines there)."""
    fn = types.FunctionType(nothing.__code__, globals(), "only_on_the_caller")
    fn.__qualname__ = "only_on_the_caller"
    globals()["only_on_the_caller"] = fn
    return fn


pytestmark = pytest.mark.rank(0)


def test_ways():
    """Plain calls, remote calls and a call in a distributed autograd
    context: each served the way the C half picks."""
    assert rpc.rpc_sync(PEER, served_by, args=("?",)) == "_serve_plain"
    assert rpc.remote(PEER, served_by, args=("?",)).to_here() == "_serve_plain"
    with context():
        assert rpc.rpc_sync(PEER, served_by, args=("?",)) == "_run_function"


def test_results():
    """None (the bare empty pickle), a number, a live value, both ways."""
    for _ in range(2):
        assert rpc.rpc_sync(PEER, nothing) is None
        assert rpc.rpc_sync(PEER, seven) == 7
        assert rpc.remote(PEER, nothing).to_here() is None
        assert rpc.remote(PEER, seven).to_here() == 7
        assert rpc.remote(PEER, pair).to_here() == [1, 2]
        with context():
            assert rpc.rpc_sync(PEER, nothing) is None
            assert rpc.rpc_sync(PEER, seven) == 7
            assert rpc.remote(PEER, pair).to_here() == [1, 2]


def test_attributes_and_async():
    """A function with attributes that is not async_execution's, and one
    that is: the plain way asks, and waits for the second's Future."""
    assert rpc.rpc_sync(PEER, wrapped_add, args=(2, 3)) == 5
    assert rpc.rpc_sync(PEER, async_add, args=(2, 3)) == 5
    assert rpc.remote(PEER, async_add, args=(4, 5)).to_here() == 9
    with context():
        assert rpc.rpc_sync(PEER, async_add, args=(2, 3)) == 5


def test_missing_function():
    """A function the callee cannot find: torch's hint, both ways."""
    fn = missing_on_the_callee()
    with pytest.raises(RuntimeError, match="Ensure that UDFs are defined on both caller and "
                       "callee modules"):
        rpc.rpc_sync(PEER, fn)
    with pytest.raises(RuntimeError, match="Ensure that UDFs are defined"):
        rpc.remote(PEER, fn).to_here()
    with context():
        with pytest.raises(RuntimeError, match="Ensure that UDFs are defined"):
            rpc.rpc_sync(PEER, fn)



def emptied_reply(*args):
    """A plain handler whose reply lists a Tensor emptied by take_dlpack
    (the package's pickler refuses one sooner: only a handler's bug gets
    here)."""
    from shmrpc import _shmrpc
    t = _shmrpc.from_bytes(bytes(64))
    _shmrpc.take_dlpack(t)
    return (b"", [], [t])


def set_plain(bad):
    from shmrpc import _shmrpc
    _shmrpc.set_handler(_serve._run_function, emptied_reply if bad else _serve._serve_plain)


def test_emptied_tensor_reply():
    """A reply listing an emptied Tensor fails the call with the handler's
    error in its text (its handles are in the call's arena: the refusal
    frees none of them), and the callee serves the next one."""
    rpc.rpc_sync(PEER, set_plain, args=(True,))
    try:
        with pytest.raises(RuntimeError, match="handler failed: ValueError.*take_dlpack"):
            rpc.rpc_sync(PEER, seven)
    finally:
        with context():  # served by _run_function
            rpc.rpc_sync(PEER, set_plain, args=(False,))
    assert rpc.rpc_sync(PEER, seven) == 7
