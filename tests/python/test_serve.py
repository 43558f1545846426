# shmrun: -n 2 --pool-size 64M
# needs: has("torch")
"""The callee's ways of serving a call (python/_handler.c): a PYTHON_CALL
or PYTHON_REMOTE_CALL of a function sent by name, without RRefs, its
arguments none, pickled without tensors, or common tensors alone, in C
(python/_serve_fast.c) once the function's name is known there; the other
PYTHON_CALLs and PYTHON_REMOTE_CALLs its caller does not profile by
_serve._serve_plain; the rest by _run_function (inside a distributed
autograd context, profiled, an RRef fetch). Each test sends the same kind
of call several ways, or one way whose answer depends on a shortcut (a
result of None sent as the bare empty pickle, async_execution's mark asked
only of a callable that may have it, a check the C way must make as
_serve_plain does), and checks what comes back. Rank 0 calls rank 1.
"""
import functools
import io
import sys
import threading
import time
import types

import pytest
import torch

import shmrpc as rpc
from shmrpc import _contexts, _serve
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
    name if neither is there (the C way)."""
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


def way():
    return served_by("C")


def way_of(value):
    return served_by("C"), value


def test_ways():
    """Plain calls, remote calls and a call in a distributed autograd
    context: each served the way the C half picks. A function's first call
    by name is served by _serve_plain, which caches its name
    (_marshal._named_heads); the next ones in C."""
    assert rpc.rpc_sync(PEER, way) == "_serve_plain"
    assert rpc.rpc_sync(PEER, way) == "C"
    assert rpc.rpc_sync(PEER, way_of, args=(1,)) == ("_serve_plain", 1)
    assert rpc.rpc_sync(PEER, way_of, args=(2,)) == ("C", 2)
    assert rpc.rpc_sync(PEER, way_of, kwargs={"value": 3}) == ("C", 3)
    assert rpc.remote(PEER, way).to_here() == "C", "a remote call, in C too"
    with context():
        assert rpc.rpc_sync(PEER, way) == "_run_function"
    # Tensors among the arguments: the first pickled (the caller learns of
    # torch at it), then common tensors alone, which the C way takes once
    # the callee knows torch (at that first one).
    assert rpc.rpc_sync(PEER, way_of, args=(torch.ones(2),))[0] == "_serve_plain"
    way_, t = rpc.rpc_sync(PEER, way_of, args=(torch.ones(2),))
    assert way_ == "C" and torch.equal(t, torch.ones(2))
    way_, t = rpc.remote(PEER, way_of, args=(torch.ones(3),)).to_here()
    assert way_ == "C" and torch.equal(t, torch.ones(3)), "a remote call's live value"
    assert rpc.rpc_sync(PEER, way_of, args=((torch.ones(2), 1),))[0] == "_serve_plain", \
        "a tensor beside a number: pickled, which the C way leaves"


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
    if bad:  # without the fast path, which would serve the call without it
        _shmrpc.set_handler(_serve._run_function, emptied_reply)
    else:
        _shmrpc.set_handler(_serve._run_function, _serve._serve_plain, _serve._fast())


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


# ---- the C way (python/_serve_fast.c): each check _serve_plain makes ----

def twice(fn, *args):
    """fn's results on the callee, called twice: the first call by
    _serve_plain where the callee does not know fn's name yet (it caches
    it), the second in C."""
    return [rpc.rpc_sync(PEER, fn, args=args) for _ in range(2)]


def rebound():
    return "first", served_by("C")


def replaced(how):
    """On the callee: rebound's name made to find another function ("name":
    the module's attribute rebound; "module": another module put under the
    module's name in sys.modules, which has this function too, so that the
    test can undo it), or both undone (None)."""
    if how == "name":
        _HOME.rebound = lambda: ("second", served_by("C"))
    elif how == "module":
        other = types.ModuleType(__name__)
        other.rebound = lambda: ("another module's", served_by("C"))
        other.replaced = replaced
        sys.modules[__name__] = other
    else:
        _HOME.rebound = _REBOUND
        sys.modules[__name__] = _HOME


_HOME = sys.modules[__name__]
_REBOUND = rebound


class Box:
    """A function found by a dotted name (Box.inside), which holds() walks."""
    @staticmethod
    def inside():
        return "first", served_by("C")


def replaced_inside(on):
    """On the callee: Box.inside rebound to another function (on), or back."""
    Box.inside = staticmethod((lambda: ("second", served_by("C"))) if on else _INSIDE)


_INSIDE = Box.inside


@pytest.mark.parametrize("how, now", [("name", "second"), ("module", "another module's")])
def test_rebound_name(how, now):
    """A function's name that finds another function once the first was
    served in C (its name rebound, or its module replaced in sys.modules):
    the other one runs, found by _serve_plain, as pickle would find it."""
    assert twice(rebound)[1] == ("first", "C")
    rpc.rpc_sync(PEER, replaced, args=(how,))
    try:
        assert rpc.rpc_sync(PEER, rebound) == (now, "_serve_plain")
    finally:
        rpc.rpc_sync(PEER, replaced, args=(None,))
    assert rpc.rpc_sync(PEER, rebound) == ("first", "C")  # its name holds again


def test_rebound_dotted_name():
    """The same for a function found by a dotted name (holds() called from
    C)."""
    assert twice(Box.inside)[1] == ("first", "C")
    rpc.rpc_sync(PEER, replaced_inside, args=(True,))
    try:
        assert rpc.rpc_sync(PEER, Box.inside) == ("second", "_serve_plain")
    finally:
        rpc.rpc_sync(PEER, replaced_inside, args=(False,))
    assert rpc.rpc_sync(PEER, Box.inside) == ("first", "C")


class NotNamed:
    """A _Named without some of its slots ("func" and "module" only)."""
    __slots__ = ("func", "module")


def set_fast_named(named_type):
    """On the callee: set_handler's fast path given named_type for
    _Named: the error it raises, or None."""
    from shmrpc import _shmrpc
    objs = list(_serve._fast())
    objs[1] = named_type
    try:
        _shmrpc.set_handler(_serve._run_function, _serve._serve_plain, tuple(objs))
    except Exception as e:
        return type(e).__name__
    return None


def test_refused_named_type():
    """set_handler refusing a fast path (a _Named type without the slots
    it reads) leaves the one in effect as it was: calls by name are still
    served in C."""
    assert twice(rebound)[1] == ("first", "C")
    assert rpc.rpc_sync(PEER, set_fast_named, args=(NotNamed,)) == "AttributeError"
    assert rpc.rpc_sync(PEER, rebound) == ("first", "C")


@rpc.functions.async_execution
def async_way(value):
    """async_execution's: a Future, whose value the caller gets."""
    fut = torch.futures.Future()
    fut.set_result((served_by("C"), value))
    return fut


def marks_itself(value):
    """A plain function that gives itself async_execution's mark while it
    runs (_serve_plain asks after the call)."""
    marks_itself.__dict__.clear()
    marks_itself._shmrpc_async_execution = True
    fut = torch.futures.Future()
    fut.set_result((served_by("C"), value))
    return fut


def test_async_execution_in_c():
    """A function with async_execution's mark in its __dict__, before the
    call or from it: its Future is waited for, in C as by _serve_plain."""
    assert twice(async_way, 5) == [("_serve_plain", 5), ("C", 5)]
    assert twice(marks_itself, 6) == [("_serve_plain", 6), ("C", 6)]


def leak_context(on):
    """On the callee: this executor thread in a distributed autograd
    context (on), as one inside a call that waits and serves others
    meanwhile is, or out of it again; its thread's id."""
    _contexts._tls.ctx = _contexts._get_or_create(12345) if on else None
    return threading.get_ident()


def leak_off():
    _contexts._tls.ctx = None
    return (threading.get_ident(),)


def context_seen():
    return _contexts._current() is None, served_by("C"), threading.get_ident()


def on_thread(tid, fn, *args):
    """fn(*args) on the callee until the executor thread tid runs it (the
    pool's threads take calls in no fixed order): its result less the id."""
    for _ in range(2000):
        *result, ran_on = rpc.rpc_sync(PEER, fn, args=args)
        if ran_on == tid:
            return tuple(result)
    pytest.fail(f"no call ran on executor thread {tid} in 2000 tries")


def test_thread_in_context():
    """A call served by a thread that is in a distributed autograd context
    goes through _serve_call (called from C: no _serve_plain frame), which
    runs it outside that context, as _serve_plain does. The C half learns
    the thread's context from _contexts._tls.ctx's setter."""
    assert [r[:2] for r in twice(context_seen)] == [(True, "_serve_plain"), (True, "C")]
    tid = rpc.rpc_sync(PEER, leak_context, args=(True,))
    try:
        assert on_thread(tid, context_seen) == (True, "C")
    finally:
        on_thread(tid, leak_off)
    assert on_thread(tid, context_seen) == (True, "C")


_PROFILES = []


def server_profile(on):
    """On the callee: a server profile entered (on), or exited: how many
    calls it recorded."""
    if on:
        _PROFILES.append(rpc._server_process_global_profile())
        _PROFILES[-1].__enter__()
        return None
    prof = _PROFILES.pop()
    prof.__exit__(None, None, None)
    return len(prof.process_global_function_events)


def test_server_profiler():
    """Calls served in C while a server profile records are recorded, each
    (_serve_call, called from C)."""
    assert twice(way)[1] == "C"
    rpc.rpc_sync(PEER, server_profile, args=(True,))
    try:
        ways = [rpc.rpc_sync(PEER, way) for _ in range(3)]
    finally:
        recorded = rpc.rpc_sync(PEER, server_profile, args=(False,))
    assert ways == ["C"] * 3 and recorded == 3


def raises(text):
    raise ValueError(f"{text} {served_by('C')}")


def parses(text):
    """Raises what a C function raised (its error set without an
    exception object, which the traceback is given to when made)."""
    return int(f"{text} {served_by('C')}")


def stderr_kept(on):
    """On the callee: its stderr kept from now on (on), or what it kept."""
    if on:
        _STDERR.append(sys.stderr)
        sys.stderr = io.StringIO()
        return None
    kept, sys.stderr = sys.stderr, _STDERR.pop()
    return kept.getvalue()


_STDERR = []


@pytest.mark.parametrize("fn, line", [(raises, "raise ValueError"), (parses, "return int")])
def test_raises_in_c(fn, line):
    """What a function served in C raises reaches the caller with its
    type, text and traceback, and the callee prints it: the same text
    either way (the handlers' frames left out)."""
    texts = []
    for way_ in ("_serve_plain", "C"):
        rpc.rpc_sync(PEER, stderr_kept, args=(True,))
        try:
            with pytest.raises(ValueError, match=f"not this {way_}") as info:
                rpc.rpc_sync(PEER, fn, args=("not this",))
        finally:
            printed = rpc.rpc_sync(PEER, stderr_kept, args=(False,))
        text = str(info.value)
        where = f"in {fn.__name__}"
        assert "Traceback" in text and where in text and line in text, text
        assert "On WorkerInfo(id=1" in printed and where in printed, printed
        texts.append(text.replace(f"not this {way_}", "not this ..."))
    assert texts[0] == texts[1] and "in _serve_plain" not in texts[0], texts


def nothing_in(way_):
    _WAYS.append(served_by("C"))


def scalar_in(way_):
    _WAYS.append(served_by("C"))
    return 2.5


def tensor_in(way_):
    _WAYS.append(served_by("C"))
    return torch.arange(4.0)


class Refuses:
    def __reduce__(self):
        raise ValueError(f"this object refuses to be pickled {served_by('C')}")


def refusing_in(way_):
    _WAYS.append(served_by("C"))
    return Refuses()


def ways_taken():
    taken = _WAYS[:]
    del _WAYS[:]
    return taken


_WAYS = []


def test_results_in_c():
    """None (the empty pickle), a number, a tensor and a result that fails
    to pickle, served both ways."""
    assert twice(nothing_in, 0) == [None, None]
    assert twice(scalar_in, 0) == [2.5, 2.5]
    got = twice(tensor_in, 0)
    assert all(torch.equal(t, torch.arange(4.0)) for t in got)
    for _ in range(2):  # a result that fails to pickle: _failed's reply
        with pytest.raises(ValueError, match="refuses to be pickled"):
            rpc.rpc_sync(PEER, refusing_in, args=(0,))
    assert rpc.rpc_sync(PEER, ways_taken) == ["_serve_plain", "C"] * 4


def owned_count():
    return len(rpc._owned)


def test_live_value_released_both_ways():
    """A remote call's live value kept by its owner (the reply marked live)
    is dropped there once its RRef is gone, whichever way served it."""
    before = rpc.rpc_sync(PEER, owned_count)
    for expected_way in ("_serve_plain", "C"):
        rref = rpc.remote(PEER, pair_with_way)
        assert rref.to_here() == [1, 2, expected_way]
        assert rpc.rpc_sync(PEER, owned_count) == before + 1
        del rref
        end = time.monotonic() + 10
        while rpc.rpc_sync(PEER, owned_count) != before:
            assert time.monotonic() < end, f"the live value served by {expected_way} stays"
            time.sleep(0.01)


def pair_with_way():
    return [1, 2, served_by("C")]



_UNPICKLED = []


def unpickled(what):
    """Run by pickle on the callee for an argument (Unpickles' reduce):
    counted, then the failure what names."""
    _UNPICKLED.append(what)
    if what == "fails":
        raise ValueError("this argument fails to unpickle")
    raise AttributeError("this argument names nothing")


class Unpickles:
    """An argument whose unpickling on the callee runs unpickled(what)."""
    def __init__(self, what):
        self.what = what

    def __reduce__(self):
        return unpickled, (self.what,)


def takes(arg):
    return served_by("C")


def takes_too(arg):
    return served_by("C")


def unpickled_count():
    count = len(_UNPICKLED)
    del _UNPICKLED[:]
    return count


@pytest.mark.parametrize("what, error, fn", [("fails", ValueError, takes),
                                             ("names nothing", RuntimeError, takes_too)])
def test_arguments_unpickled_once(what, error, fn):
    """Arguments that fail to unpickle: the code their pickle names runs
    once per call, served in C as by _serve_plain (which the C way once
    left them to, to run it again), and the caller gets the same error;
    for a name not found, torch's hint with the same text either way."""
    texts = []
    for _ in range(2):  # by _serve_plain, which caches fn's name, then in C
        with pytest.raises(error, match=what) as info:
            rpc.rpc_sync(PEER, fn, args=(Unpickles(what),))
        texts.append(str(info.value))
    with pytest.raises(error, match=what):
        rpc.remote(PEER, fn, args=(Unpickles(what),)).to_here()
    assert rpc.rpc_sync(PEER, unpickled_count) == 3
    assert rpc.rpc_sync(PEER, fn, args=(0,)) == "C"
    if error is RuntimeError:
        assert "Default RPC pickler" in texts[0] and texts[0] == texts[1], texts
