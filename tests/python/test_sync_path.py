# shmrun: -n 2 --pool-size 64M
"""The two paths of rpc_sync, remote() and a user's to_here() (worker0
calls, worker1 serves): the common call, made in C (python/_calls.c:
rpc_sync, rpc_async_call, rpc_remote, rref_value), whatever its
arguments, and every other, made by the package's Python. Each case that must take the Python path is checked to
take it (the C path's count does not move) and to keep its meaning: an
autograd context learns the callee, torch's profiler records the call, a
timeout of the call's own or set for every call applies, a function no
longer found under its name is refused. The common call's results and
errors are those of the Python path: None, scalars, a tensor, a remote
exception's type and text, the default timeout (1 s in this job) raised
as RuntimeError and TimeoutError, a rank no worker has.
"""
import json
import math
import operator
import os
import pickle
import subprocess
import sys
import time
import warnings

import pytest
import torch

import shmrpc as rpc
from shmrpc import _core, _marshal, _shmrpc


def nothing():
    return None


def add(a, b=0):
    return a + b


def ident(x):
    return x


def pair(a, b):
    return a, b


class Holder:
    @staticmethod
    def twice(x):  # a function found by a dotted name (_Named.holds asked)
        return 2 * x


def boom(text):
    raise KeyError(text)


def slow(sec):
    time.sleep(sec)
    return sec


def make_list(n):
    return list(range(n))


def rebound():
    return "the first"


class _Watched(type):
    """A class whose attribute lookups run hook once (set): the lookup of
    its function by its dotted name, which _Named.holds makes inside the
    C path, then runs Python code of the program's."""
    hook = None

    def __getattribute__(cls, name):
        hook = type.__getattribute__(_Watched, "hook")
        if hook is not None and name == "thrice":
            _Watched.hook = None
            hook()
        return type.__getattribute__(cls, name)


class Watched(metaclass=_Watched):
    @staticmethod
    def thrice(x):
        return 3 * x


def nul():
    return "another function"


def nul_named():
    return "nul_named"


# Found under a name with a NUL: pickle sends it by that name, which the
# Python path then refuses to send (a C string's name for the profiler).
nul_named.__qualname__ = "nul\0named"
setattr(sys.modules[__name__], nul_named.__qualname__, nul_named)


# Functions called for the first time in test_entry_held_across_holds: as
# many as clear the C path's entries of functions (256).
for _i in range(300):
    exec(f"def fresh{_i}():\n    return {_i}")


def rpc_init(rank):
    class Opts:
        num_worker_threads = 4
        rpc_timeout = 1  # the default timeout, which the common call has
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's options shmrpc ignores (none here)
        rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts())


def common(call):
    """call()'s result, asserting it was made in C: one call counted."""
    before = _shmrpc.common_calls()
    result = call()
    assert _shmrpc.common_calls() == before + 1, "not made as the common call"
    return result


def general(call):
    """call()'s result, asserting it was made by the Python path."""
    before = _shmrpc.common_calls()
    result = call()
    assert _shmrpc.common_calls() == before, "made as the common call"
    return result


def test_common_calls():
    # The first call checks the pickler in effect (torch's, loaded here)
    # on the Python path; the later ones find it checked.
    general(lambda: rpc.rpc_sync("worker1", nothing))
    assert common(lambda: rpc.rpc_sync("worker1", nothing)) is None
    assert common(lambda: rpc.rpc_sync(1, add, args=(2, 3))) == 5
    assert common(lambda: rpc.rpc_sync("worker1", Holder.twice, args=(4,))) == 8
    assert common(lambda: rpc.rpc_sync("worker1", pair, ("x", b"y"), {})) == ("x", b"y")
    assert common(lambda: rpc.rpc_sync("worker1", add, args=(1.5, 2j),
                                       timeout=rpc.constants.UNSET_RPC_TIMEOUT)) == 1.5 + 2j
    t = torch.arange(6.0)
    # The pickler learns of torch at the first tensor sent (_pack_args).
    common(lambda: rpc.rpc_sync("worker1", ident, args=(t,)))
    got = common(lambda: rpc.rpc_sync("worker1", ident, args=(t,)))
    assert torch.equal(got, t), "a common tensor there and back"
    assert common(lambda: rpc.rpc_sync("worker1", add, args=(None,) * 0 + (True, 1))) == 2


def total(*ts):
    return sum(ts)


def same_object(a, b):
    return a is b


def test_common_calls_of_tensors():
    # Six tensors, past the four whose handles the C path keeps on its
    # stack, one of them the pool's; the same tensor twice and a tensor
    # beside a number go pickled (_pack_args), as torch sends them (one
    # object twice).
    ts = (rpc.empty(3, "float32", like="torch"),) + tuple(
        torch.full((3,), float(i)) for i in range(1, 6))
    ts[0].fill_(7.0)
    rpc.rpc_sync("worker1", ident, args=(ts[1],))  # torch is known from here on
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", total, args=ts)), sum(ts))
    assert common(lambda: rpc.rpc_sync("worker1", same_object, args=(ts[1], ts[1]))) is True
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", add, args=(ts[1], 1))), ts[1] + 1)
    rref = common(lambda: rpc.remote("worker1", total, args=ts))
    assert torch.equal(general(rref.to_here), sum(ts))


INSPECT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    rpc.__file__)))), "bin", "shmrpc-inspect")


def pool_refs(rank):
    """The pool references rank holds (shmrpc-inspect's holder table)."""
    out = subprocess.run([INSPECT, "--json", str(os.getppid())], check=True,
                         capture_output=True, text=True)
    return {h["rank"]: h["refs"] for h in json.loads(out.stdout)["pool"]["holders"]}.get(rank, 0)


def settles(rank, want):
    """Whether rank's pool references come to want (a request's pin goes at
    the callee's TENSOR_ACK, a moment after the call returned)."""
    deadline = time.monotonic() + 10
    while pool_refs(rank) != want:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_common_calls_of_tensors_hold_nothing():
    # The C path's handles of the arguments are the call's own: freed once
    # sent (rpc_sync gives them to the request's pin, remote() has the pin
    # retain its own), and freed when one argument's handle cannot be made
    # (past the pool: the Python path then raises the same). The caller
    # then holds in the pool only its own tensor, after calls of four
    # tensors (on the stack) and of six (allocated).
    pt = rpc.empty(3, "float32", like="torch")
    pt.fill_(7.0)
    ts = (pt,) + tuple(torch.full((3,), float(i)) for i in range(1, 6))
    rpc.rpc_sync("worker1", ident, args=(ts[1],))  # torch is known from here on
    base = pool_refs(0)
    for args in (ts[:4], ts):
        assert torch.equal(common(lambda: rpc.rpc_sync("worker1", total, args=args)), sum(args))
        rref = common(lambda: rpc.remote("worker1", total, args=args))
        assert torch.equal(rref.to_here(), sum(args))
        del rref
    assert settles(0, base), f"the caller holds {pool_refs(0)} references, {base} before"
    big = torch.ones(17 * 1024 * 1024)  # 68 MiB, past the pool's 64
    for args in ((pt, ts[1], big), ts + (big,)):
        with pytest.raises(RuntimeError, match="pool exhausted"):
            rpc.rpc_sync("worker1", total, args=args)
        with pytest.raises(RuntimeError, match="pool exhausted"):
            rpc.remote("worker1", total, args=args)
        assert settles(0, base), f"the caller holds {pool_refs(0)} references, {base} before"


class Box:
    def __init__(self, n):
        self.n = n

    def get(self, plus=0):
        return self.n + plus


def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def test_common_calls_of_any_arguments():
    # Keywords, containers, tensors inside them, RRefs, a pickle past the
    # frame (out of line, in the pool), a proxy's call: made in C, their
    # arguments packed by _marshal._pack_args, as the Python path packs them.
    assert common(lambda: rpc.rpc_sync("worker1", add, args=(1,), kwargs={"b": 2})) == 3
    assert common(lambda: rpc.rpc_sync("worker1", add, kwargs={"a": [1], "b": [2]})) == [1, 2]
    assert common(lambda: rpc.rpc_sync("worker1", ident, args=({"k": (1, [2.0])},))) == \
        {"k": (1, [2.0])}
    t = torch.arange(4.0)
    got = common(lambda: rpc.rpc_sync("worker1", ident, args=([t, {"t": t}],)))
    assert torch.equal(got[0], t) and got[1]["t"] is got[0], "one tensor twice, one object"
    big = list(range(10000))  # a pickle past 16 KiB
    assert common(lambda: rpc.rpc_sync("worker1", ident, args=(big,))) == big
    box = general(lambda: rpc.remote("worker1", Box, args=(7,)))  # a class: by the pickle
    assert common(lambda: rpc.rpc_sync("worker1", call_method, args=(Box.get, box))) == 7
    assert box.rpc_sync().get() == 7  # its first asks the value's type, once
    assert common(lambda: box.rpc_sync().get()) == 7, "a proxy's call"
    assert common(lambda: box.rpc_sync().get(plus=1)) == 8, "a proxy's call with a keyword"
    fut = common(lambda: rpc.rpc_async("worker1", add, args=([1], [2])))
    assert fut.wait() == [1, 2] and isinstance(fut, torch.futures.Future)
    assert common(lambda: rpc.rpc_async("worker1", nothing)).wait() is None
    assert general(lambda: rpc.rpc_async("worker1", add, args=(1, 2), timeout=5)).wait() == 3
    with pytest.raises(KeyError, match="a"):
        common(lambda: rpc.rpc_async("worker1", boom, args=("a",))).wait()
    # Failures the Python path raises in its words, the same either way:
    # an argument pickle refuses (raised by the call), a rank no worker has
    # (through the Future, as torch's agent).
    def local():
        return 1
    with pytest.raises(AttributeError) as c:
        rpc.rpc_sync("worker1", ident, args=(local,))
    with pytest.raises(AttributeError) as g:
        general(lambda: rpc.rpc_sync("worker1", ident, args=(local,), timeout=5))
    assert str(c.value) == str(g.value) and "pickle" in str(c.value), repr(c.value)
    with pytest.raises(RuntimeError) as c:
        common(lambda: rpc.rpc_async(99, add, args=([1],))).wait()
    with pytest.raises(RuntimeError) as g:
        general(lambda: rpc.rpc_async(99, add, args=([1],), timeout=5)).wait()
    assert type(c.value) is type(g.value) and str(c.value) == str(g.value), \
        f"a rank no worker has: {c.value!r} and {g.value!r}"


class PicklesInside:
    """Pickling it makes another message on the same thread."""
    def __reduce__(self):
        inner = _marshal._dumps([torch.ones(2)])
        return list, ([len(inner[2])],)


class Unpicklable:
    def __reduce__(self):
        raise ValueError("not this one")


_plain_reads = [0]  # on worker1: the calls whose arguments the plain handler read


def count_plain_reads():
    from shmrpc import _serve
    read = _serve._unpack_call

    def counted(*a):
        _plain_reads[0] += 1
        return read(*a)
    _serve._unpack_call = counted


def plain_reads():
    return _plain_reads[0]


def fill(t, value):
    t.fill_(value)


def test_scalars_beside_tensors():
    # Scalars and common tensors together (at most four tensors, each
    # once): the pickle of (args, {}) written in C with each tensor a
    # BINPERSID of its index (_calls.c, mixed_payload), read by the
    # callee's C path (_serve_fast.c, mixed_loaded) without the plain
    # handler, and by the plain handler's _Unpickler (persistent_load).
    rpc.rpc_sync("worker1", count_plain_reads)
    t, u = torch.arange(6.0), torch.ones(2, 3, dtype=torch.int64)
    rpc.rpc_sync("worker1", plain_reads)
    # A function's first call by its name is the plain handler's (it
    # enters the name, _named_heads): these read the form in Python.
    first = rpc.rpc_sync("worker1", plain_reads)
    assert common(lambda: rpc.rpc_sync("worker1", pair_all, args=(u, 3)))[1] == 3
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", torch.add, args=(t, 2))), t + 2)
    common(lambda: rpc.rpc_sync("worker1", fill, args=(t.clone(), 1.0)))
    before = rpc.rpc_sync("worker1", plain_reads)
    assert before == first + 3, "the first calls, by the plain handler"
    for args in [(t, 1), (1, t, "x", None), (t, u, 2.5), (b"b", u, t.clone(), u.clone(), t, 0)]:
        got = common(lambda: rpc.rpc_sync("worker1", pair_all, args=args))
        assert len(got) == len(args) and all(
            torch.equal(g, a) and g.dtype == a.dtype if isinstance(a, torch.Tensor) else g == a
            for g, a in zip(got, args)), f"{args!r:.60}"
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", torch.add, args=(t, 1))), t + 1)
    shared = rpc.empty(4, "float32", like="torch")
    common(lambda: rpc.rpc_sync("worker1", fill, args=(shared, 2.5)))
    assert torch.equal(shared, torch.full((4,), 2.5)), "the callee wrote the pool's bytes"
    assert rpc.rpc_sync("worker1", plain_reads) == before, "read by the plain handler"
    # What the form does not take goes to the pickler, as before: the same
    # tensor twice (one object there), five tensors, one that requires
    # grad, a list.
    assert common(lambda: rpc.rpc_sync("worker1", same_object, args=(t, t))) is True
    five = (t, 1) + tuple(torch.full((2,), float(i)) for i in range(4))
    assert all(torch.equal(g, a) if isinstance(a, torch.Tensor) else g == a for g, a in
               zip(common(lambda: rpc.rpc_sync("worker1", pair_all, args=five)), five))
    grad = torch.ones(2, requires_grad=True)
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", pair_all, args=(grad, 1)))[0],
                       grad.detach())
    assert common(lambda: rpc.rpc_sync("worker1", pair_all, args=(t, [1])))[1] == [1]
    assert rpc.rpc_sync("worker1", plain_reads) == before + 4
    # The plain handler's reader, and what it refuses.
    h = _shmrpc.torch_handle(t)
    got = _marshal._loads((b"\x80\x05K\x00QK\x07\x86.", [], [h]))
    assert torch.equal(got[0], t) and got[1] == 7
    with pytest.raises(pickle.UnpicklingError, match="no tensor 1"):
        _marshal._loads((b"\x80\x05K\x01Q.", [], [_shmrpc.torch_handle(t)]))
    assert _shmrpc.scalar_unpickle(b"\x80\x05K\x00Q.") == (False, None), \
        "no tensors to read it with"


def pair_all(*args):
    return args


def test_values_of_scalars_and_tensors():
    # A value that is a tuple of scalars and common tensors (a batch and
    # its label, ("ok", batch)) is written by _dumps in the same form as
    # such arguments, and read in C: by the common call's reply
    # (_calls.c, reply_value), by _loads (unpickle_tensors) for the rest.
    t, u = torch.arange(4.0), torch.ones(2, dtype=torch.int32)
    data, rrefs, tensors = _marshal._dumps(("ok", t, 3, u))
    assert data[:1] == b"\x80" and b"Q" in data and not rrefs and len(tensors) == 2
    read, value = _shmrpc.unpickle_tensors(data, tensors)
    assert read and value[0] == "ok" and value[2] == 3 and torch.equal(value[1], t) and \
        torch.equal(value[3], u) and value[3].dtype == torch.int32
    again = _marshal._loads(_marshal._dumps(("ok", t, 3, u)))
    assert torch.equal(again[1], t) and again[0] == "ok"
    # The pickler's values are not read so: the same tensor twice (one
    # object there), a list.
    for v in ((t, t), (t, [1])):
        data, rrefs, tensors = _marshal._dumps(v)
        assert _shmrpc.unpickle_tensors(data, tensors) == (False, None), f"{v!r:.40}"
        got = _marshal._loads((data, rrefs, tensors))
        assert torch.equal(got[0], t) and (got[0] is got[1] if v[1] is t else got[1] == [1])
    # Over calls: the reply read in C, a Future's by _result, an RRef's value.
    got = common(lambda: rpc.rpc_sync("worker1", pair_all, args=("ok", t, 3)))
    assert got[0] == "ok" and torch.equal(got[1], t) and got[2] == 3
    got = rpc.rpc_async("worker1", pair_all, args=(t, 2.5)).wait()
    assert torch.equal(got[0], t) and got[1] == 2.5
    got = rpc.remote("worker1", pair_all, args=(u, None)).to_here()
    assert torch.equal(got[0], u) and got[1] is None


def test_dumps_inside_dumps_and_after_errors():
    # _dumps (python/_dumps.c): a message made while the thread's pickler
    # makes another has a pickler of its own; a failed pickle leaves the
    # thread's pickler empty for the next (its memo, its tensors).
    data, rrefs, tensors = _marshal._dumps([PicklesInside(), torch.full((3,), 5.0)])
    assert not rrefs and len(tensors) == 1, f"the outer message's tensors: {tensors}"
    got = _marshal._loads((data, rrefs, tensors))
    assert got[0] == [1] and torch.equal(got[1], torch.full((3,), 5.0)), got
    with pytest.raises(ValueError, match="not this one"):
        _marshal._dumps([torch.ones(3), Unpicklable()])
    data, rrefs, tensors = _marshal._dumps([1, "x"])
    assert not tensors and _marshal._loads((data, rrefs, tensors)) == [1, "x"], \
        "the pickle after a failed one holds none of it"
    assert _marshal._dumps(None) == (b"", [], []) and _marshal._dumps((1, 2.0))[2] == []


SCALARS = [None, True, False, 0, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31,
           -2**31 - 1, 2**63 - 1, -2**63, 0.0, -0.0, 1.5, float("inf"), 1e300, "", "é€😀",
           "x" * 255, "x" * 300, b"", b"\0" * 9, b"y" * 300, (), (1,), (1, "a"), (1, 2, 3),
           (1, "a", None, 2.5, b"b"), ((1, 2), {}), ((), {})]


def test_scalar_pickles():
    # The scalars' pickles written and read in C (python/_scalar_pickle.c),
    # not by pickle's Pickler and Unpickler objects: pickle reads what C
    # writes, C reads what pickle writes, both to the same value; what C
    # does not write or read is left to pickle.
    for v in SCALARS:
        mine = _shmrpc.scalar_pickle(v)
        assert mine is not None and pickle.loads(mine) == v and \
            type(pickle.loads(mine)) is type(v), f"pickle reads C's {v!r:.40}"
        for data in (mine, pickle.dumps(v, pickle.HIGHEST_PROTOCOL)):
            read, got = _shmrpc.scalar_unpickle(data)
            assert read and got == v and type(got) is type(v), f"C reads {data!r:.60}"
    assert str(_shmrpc.scalar_unpickle(_shmrpc.scalar_pickle(-0.0))[1]) == "-0.0"
    nan = _shmrpc.scalar_unpickle(_shmrpc.scalar_pickle(float("nan")))[1]
    assert nan != nan, "NaN"
    for v in (2**63, -2**63 - 1, 1j, "\ud800", [1], {"a": 1}, (1, [2]), (((1,),),), "z" * 600):
        assert _shmrpc.scalar_pickle(v) is None, f"left to pickle: {v!r:.40}"
    shared = "abc" * 2
    for data in (pickle.dumps([1]), pickle.dumps((shared, shared)), b"\x80\x05K", b"",
                 pickle.dumps((1, 2))[:-1], b"\x80\x05\x8c\x02\xff\xfe."):
        assert _shmrpc.scalar_unpickle(data) == (False, None), f"left to pickle: {data!r}"
    assert common(lambda: rpc.rpc_sync("worker1", ident, args=(SCALARS,))) == SCALARS
    for v in SCALARS:
        assert common(lambda: rpc.rpc_sync("worker1", ident, args=(v,))) == v


def test_scalar_unpickle_refuses_what_pickle_refuses():
    # A payload comes from another process: what scalar_unpickle reads
    # pickle.loads must read to the same value, and what pickle.loads
    # refuses it must leave to pickle.loads, to raise its own error (a
    # protocol past 5, a FRAME longer than the rest, a memo write with
    # nothing above the mark). Found by fuzzing these opcodes.
    frame = b"\x80\x05\x95" + (11).to_bytes(8, "little") + b"K\x01."
    for data in (b"\x80\x06K\x01.", b"\x80\xffK\x01.", b"\x80\x05\x94K\x01.",
                 b"\x80\x05q\x00K\x01.", b"\x80\x05K\x01(\x94t\x94.", frame,
                 b"\x80\x05\x95" + (2**63).to_bytes(8, "little") + b"K\x01.",
                 b"\x80\x05(r\x00\x00\x00\x00K\x01t."):
        with pytest.raises(Exception):  # noqa: B017 (pickle's own, whichever it is)
            pickle.loads(data)
        assert _shmrpc.scalar_unpickle(data) == (False, None), \
            f"read where pickle.loads raises: {data!r}"
    # A memo write at a large index: pickle.loads grows its memo to it
    # (MemoryError, or as much memory as the machine gives), so whether it
    # reads the pickle is its own to say.
    assert _shmrpc.scalar_unpickle(b"\x80\x05)r\x00\x00\x01\x00.") == (False, None)
    assert _shmrpc.scalar_unpickle(b"\x80\x05)r\xff\xff\x00\x00.") == (True, ())
    # The same opcodes where pickle.loads takes them are still read here.
    for data in (b"\x80\x05\x95" + (3).to_bytes(8, "little") + b"K\x01.",
                 b"\x80\x05K\x01\x94.", b"\x80\x05K\x01q\x00.", b"\x80\x05K\x01r\x00\x00\x00\x00.",
                 b"\x80\x02(K\x02\x94t."):
        assert _shmrpc.scalar_unpickle(data) == (True, pickle.loads(data)), \
            f"C reads {data!r} as pickle.loads does"


def test_mixed_frames_left_to_the_plain_handler():
    # A payload comes from another process. The plain handler reads a
    # pickle with tensors from a file (_Unpickler on a BytesIO), where a
    # FRAME is read whole before its opcodes: an opcode that crosses its
    # end is read otherwise than pickle.loads reads the same bytes, and
    # here it is refused. The callee's C reader (mixed_loaded), which reads
    # as pickle.loads does, must leave such a pickle to the plain handler,
    # not answer the call with a value (mixed_payload writes no FRAME).
    # Found by fuzzing scalar_unpickle_tensors against _Unpickler.
    t = torch.arange(4.0)
    assert common(lambda: rpc.rpc_sync("worker1", pair_all, args=(t, 1)))[1] == 1  # entered
    rest = b"K\x01\x86}\x86."
    data = (b"\x80\x05\x95" + (10).to_bytes(8, "little") + b"K\x00Q\x95" +
            len(rest).to_bytes(8, "little") + rest)
    with pytest.raises(pickle.UnpicklingError):
        _marshal._loads((data, [], [_shmrpc.torch_handle(t)]))
    pack_args = _marshal._pack_args
    _marshal._pack_args = lambda named, args, kwargs: (named.head + data, [],
                                                       [_shmrpc.torch_handle(t)])
    try:
        with pytest.raises(Exception, match="truncated"):  # noqa: B017 (the plain handler's)
            general(lambda: rpc.rpc_sync("worker1", pair_all, args=(t, 1), timeout=5))
    finally:
        _marshal._pack_args = pack_args


def test_scalar_pickle_stops_at_its_budget():
    # scalar_pickle writes 512 bytes at most: a larger str or a long tuple
    # is pickle's (a str of more characters than that refused before its
    # UTF-8 is made, a tuple at the first element past the budget: what it
    # saves is time, which no test here decides), and their message is
    # pickle's, read back the same.
    big = ("\u00e9" * 100_000, tuple(range(200_000)), ("s",) * 200_000, "x" * 513)
    for v in big:
        assert _shmrpc.scalar_pickle(v) is None, f"a {type(v).__name__} of {len(v)}"
        assert _marshal._loads(_marshal._dumps(v)) == v


def test_general_calls():
    me = rpc.get_worker_info()
    peer = rpc.get_worker_info("worker1")
    assert general(lambda: rpc.rpc_sync(peer, add, args=(1, 2))) == 3, "a WorkerInfo"
    assert general(lambda: rpc.rpc_sync("worker1", add, args=[1, 2])) == 3, "a list of args"
    assert general(lambda: rpc.rpc_sync("worker1", add, args=(1, 2), timeout=5)) == 3
    d = {"k": 1}
    assert general(lambda: rpc.rpc_sync("worker1", d.get, args=("k",))) == 1, \
        "a builtin bound to an object"
    assert common(lambda: rpc.rpc_sync(me.name, add, args=(1, 2))) == 3, "to oneself"
    with pytest.raises(RuntimeError, match="could not find destination nobody"):
        general(lambda: rpc.rpc_sync("nobody", nothing))


def test_builtins_go_by_name():
    # A module's builtin, and torch's operators (torch.add: qualified name
    # _VariableFunctionsClass.add, found as torch.add), go by name as
    # functions do, on every kind of call; the first call of each on the
    # Python path's check of the pickler is in test_common_calls.
    assert common(lambda: rpc.rpc_sync("worker1", len, args=("abc",))) == 3
    assert common(lambda: rpc.rpc_sync("worker1", math.sqrt, args=(16.0,))) == 4.0
    assert common(lambda: rpc.rpc_sync("worker1", operator.add, args=(2, 3))) == 5
    t = torch.arange(4.0)
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", torch.add, args=(t, 1))), t + 1)
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", torch.add, args=(t, t),
                                                   kwargs={"alpha": 2})), 3 * t)
    assert torch.equal(common(lambda: rpc.rpc_sync("worker1", torch.mul, args=(t, t))), t * t)
    assert torch.equal(common(lambda: rpc.rpc_async("worker1", torch.sub, args=(t, 1))).wait(),
                       t - 1)
    rref = common(lambda: rpc.remote("worker1", torch.ones, args=(2, 3)))
    assert torch.equal(rref.to_here(), torch.ones(2, 3))
    # Errors keep their type and text, and the callee's traceback.
    with pytest.raises(ValueError, match="math domain error"):
        common(lambda: rpc.rpc_sync("worker1", math.sqrt, args=(-1.0,)))
    with pytest.raises(RuntimeError, match="must match the size"):
        common(lambda: rpc.rpc_sync("worker1", torch.add, args=(t, torch.ones(3))))
    # The name the calls go by, and the one the profiler is told.
    named = _marshal._named(torch.add)
    assert (named.module, named.name, named.qualname) == \
        ("torch", "add", "_VariableFunctionsClass.add")
    assert _marshal._named(d_get := {}.get) is None and general(
        lambda: rpc.rpc_sync("worker1", d_get, args=("x", 5))) == 5, "bound to an object"


def test_same_errors_both_ways():
    # The same failures through both paths, in the same words.
    with pytest.raises(KeyError) as c:
        common(lambda: rpc.rpc_sync("worker1", boom, args=("c",)))
    with pytest.raises(KeyError) as g:
        general(lambda: rpc.rpc_sync("worker1", boom, args=("c",), timeout=5))
    assert str(c.value) == str(g.value) and "On WorkerInfo(id=1, name=worker1)" in str(c.value)
    with pytest.raises(RuntimeError) as c:
        common(lambda: rpc.rpc_sync(99, nothing))
    with pytest.raises(RuntimeError) as g:
        general(lambda: rpc.rpc_sync(99, nothing, timeout=5))
    assert type(c.value) is type(g.value) and str(c.value) == str(g.value), \
        f"a rank no worker has: {c.value!r} and {g.value!r}"


def test_default_timeout():
    # The job's default timeout (rpc_init: 1 s) ends a common call, raised
    # as both TimeoutError and RuntimeError (torch's), its context dropped.
    with pytest.raises(RuntimeError) as e:
        common(lambda: rpc.rpc_sync("worker1", slow, args=(2.0,)))
    assert isinstance(e.value, TimeoutError) and e.value.__suppress_context__, repr(e.value)


def test_autograd_context_takes_python_path():
    import shmrpc.autograd as dist_autograd
    with dist_autograd.context() as cid:
        general(lambda: rpc.rpc_sync("worker1", nothing))
        known = dist_autograd._current_context()._known_worker_ids()
    assert 1 in known, f"the context {cid} learnt its callee: {known}"


def test_torch_profiler_takes_python_path():
    with torch.autograd.profiler_legacy.profile() as prof:
        general(lambda: rpc.rpc_sync("worker1", add, args=(1, 2)))
    names = [e.name for e in prof.function_events]
    assert any(n.startswith("rpc_sync#add(worker0 -> worker1)") for n in names), names


def test_shmrpc_profiler_sees_common_call():
    with rpc.profiler.profile() as prof:
        common(lambda: rpc.rpc_sync("worker1", add, args=(1, 2)))
    names = [e.name for e in prof.function_events]
    assert "rpc_sync#add(worker0 -> worker1)" in names, names


def test_timeout_set_for_all_takes_python_path():
    saved = _core._rpc_timeout, _core._timeout_override
    try:
        rpc._set_rpc_timeout(0.1)
        with pytest.raises(RuntimeError, match="timeout"):
            general(lambda: rpc.rpc_sync("worker1", slow, args=(0.5,)))
    finally:
        _core._rpc_timeout, _core._timeout_override = saved
        _core._state_changed()
    common(lambda: rpc.rpc_sync("worker1", nothing))


def test_other_pickler_takes_python_path():
    class Mine:
        pass
    with _marshal._use_rpc_pickler(Mine()):
        with pytest.raises(NotImplementedError, match="RPC pickler of the program's own"):
            general(lambda: rpc.rpc_sync("worker1", nothing))
    # The pickler restored, the calls are common again (_core._state_changed).
    common(lambda: rpc.rpc_sync("worker1", nothing))


def test_function_rebound_under_its_name():
    module = sys.modules[__name__]
    first = rebound
    assert common(lambda: rpc.rpc_sync("worker1", first)) == "the first"

    def second():
        return "the second"
    second.__qualname__ = "rebound"
    module.rebound = second
    try:
        # The name finds another function now: the first cannot go by it
        # (pickle refuses it, as torch's), the second can.
        with pytest.raises(pickle.PicklingError):
            general(lambda: rpc.rpc_sync("worker1", first))
    finally:
        module.rebound = first
    assert common(lambda: rpc.rpc_sync("worker1", first)) == "the first"


def renamed():
    return "renamed"


@pytest.mark.parametrize("attr, value", [("__qualname__", "no_such_function"),
                                         ("__module__", "no_such_module")])
def test_renamed_function_takes_python_path(attr, value):
    """A function whose __qualname__ or __module__ changed (read through
    FunctionType's descriptors in C): pickle looks it up by the new name,
    and finds nothing."""
    assert common(lambda: rpc.rpc_sync("worker1", renamed)) == "renamed"
    before = getattr(renamed, attr)
    setattr(renamed, attr, value)
    try:
        with pytest.raises(pickle.PicklingError):
            general(lambda: rpc.rpc_sync("worker1", renamed))
    finally:
        setattr(renamed, attr, before)
    assert common(lambda: rpc.rpc_sync("worker1", renamed)) == "renamed"


def test_remote_common_and_general():
    import shmrpc.autograd as dist_autograd
    rref = common(lambda: rpc.remote("worker1", add, args=(1, 2)))
    assert type(rref) is rpc.RRef and rref.owner().name == "worker1"
    assert common(rref.to_here) == 3, "a value that came pickled, read in C"
    assert general(lambda: rref.to_here(timeout=5)) == 3
    live = common(lambda: rpc.remote("worker1", make_list, args=(3,)))
    assert general(live.to_here) == [0, 1, 2], "a live value, fetched"
    t = common(lambda: rpc.remote("worker1", ident, args=(torch.ones(2),)))
    assert torch.equal(general(t.to_here), torch.ones(2)), "a tensor value"
    failed = common(lambda: rpc.remote("worker1", boom, args=("r",)))
    with pytest.raises(KeyError, match="r"):
        failed.to_here()
    with pytest.raises(KeyError, match="r"):
        failed.to_here(timeout=5)
    assert common(lambda: rpc.remote("worker1", add, args=(1,), kwargs={"b": 1})).to_here() == 2
    with dist_autograd.context():
        general(lambda: rpc.remote("worker1", nothing))
    mine = rpc.RRef([1])
    assert general(mine.to_here) == [1], "an owner's RRef"


def test_entry_held_across_holds():
    # A dotted name's holds runs Python code (here a class's
    # __getattribute__; in a program also a switch to another thread)
    # while the C path uses the function's entry: calls made then that
    # clear the entries (or replace this one) must not free it under the
    # call, which then read freed memory (the tuples made after reuse it).
    thrice = Watched.thrice
    assert common(lambda: rpc.rpc_sync("worker1", thrice, args=(1,))) == 3  # entered
    made = []

    def first_calls():
        for i in range(300):
            assert common(lambda: rpc.rpc_sync("worker1", globals()[f"fresh{i}"])) == i
        made.extend((i,) * 8 for i in range(5000))  # the size of an entry
    _Watched.hook = first_calls
    before = _shmrpc.common_calls()
    assert rpc.rpc_sync("worker1", thrice, args=(2,)) == 6
    assert _Watched.hook is None, "holds looked the function up"
    assert _shmrpc.common_calls() == before + 301, "made as the common call, its entry held"


def _chain(call):
    """What call raises, raised inside an except: its type, text and what
    it chains to (its context's type, whether suppressed, its cause)."""
    try:
        raise KeyError("handled by the caller")
    except KeyError:
        try:
            call()
        except RuntimeError as e:
            return (type(e), str(e), type(e.__context__), e.__suppress_context__, e.__cause__)
    raise AssertionError("nothing raised")


def test_errors_chain_as_python_path():
    # _send_call and _c_wait raise their errors `from None` inside their
    # except: the C half's error is the context, suppressed, and the
    # exception the caller is handling is not shown with it.
    sent = _chain(lambda: common(lambda: rpc.rpc_sync(99, nothing)))
    assert sent == _chain(lambda: general(lambda: rpc.rpc_sync(99, nothing, timeout=5))), sent
    assert sent[2:] == (RuntimeError, True, None), sent
    late = _chain(lambda: common(lambda: rpc.rpc_sync("worker1", slow, args=(1.5,))))
    assert late[0] is _core._RpcTimeout and late[2:] == (TimeoutError, True, None), late
    assert _chain(lambda: general(lambda: rpc.rpc_sync("worker1", slow, args=(1.5,),
                                                       timeout=1)))[2:] == late[2:]
    rref = common(lambda: rpc.remote("worker1", slow, args=(1.5,)))
    assert _chain(lambda: common(rref.to_here))[2:] == late[2:], "to_here's timeout"


def test_name_with_nul_refused_both_ways():
    # Its payload's head, read up to the first NUL, names another function
    # (nul) on the callee: no path sends it.
    for timeout in (rpc.constants.UNSET_RPC_TIMEOUT, 5):
        with pytest.raises(ValueError, match="embedded null character"):
            general(lambda: rpc.rpc_sync("worker1", nul_named, args=(1,), timeout=timeout))
        with pytest.raises(ValueError, match="embedded null character"):
            general(lambda: rpc.remote("worker1", nul_named, timeout=timeout))


def test_interrupt_while_asked_not_lost():
    # A KeyboardInterrupt raised in the Python code that the C path runs to
    # ask whether a call is common (here a dotted name's holds; in a
    # program Ctrl-C's handler at any point of it) is raised, not cleared
    # for the Python path, which asks again and would not meet it.
    thrice = Watched.thrice
    assert common(lambda: rpc.rpc_sync("worker1", thrice, args=(1,))) == 3  # entered

    def interrupt():
        raise KeyboardInterrupt
    for call in (lambda: rpc.rpc_sync("worker1", thrice, args=(2,)),
                 lambda: rpc.remote("worker1", thrice, args=(2,))):
        _Watched.hook = interrupt
        with pytest.raises(KeyboardInterrupt):
            call()
        assert _Watched.hook is None, "holds looked the function up"
