"""The compatibility suite's cases (run by tests/python/compat.py), written
once against `rpc`: torch.distributed.rpc or shmrpc, chosen by
$COMPAT_IMPL ("torch" or "shmrpc") before this module is imported, so that
both workers import the same module and functions travel by reference.

Each case runs on worker0 and returns one deterministic line: values as
show() writes them, errors as their type and a stable part of their text
(never a traceback or an address). A case marked known= is a documented
difference (README, Python section): compare reports it and skips it.
"""
import functools
import operator
import os
import re
import threading
import time

import numpy as np

try:
    import torch
except ImportError:  # the shmrpc half runs without torch, less its tensor cases
    torch = None

IMPL = os.environ.get("COMPAT_IMPL")
if IMPL == "torch":
    import torch.distributed.rpc as rpc
    import torch.futures as futures
elif IMPL == "shmrpc":
    import shmrpc as rpc
    futures = rpc  # Future, wait_all and collect_all live in shmrpc itself
else:  # compare mode reads only CASES and KNOWN
    rpc = futures = None

ME, PEER = "worker0", "worker1"
CASES = []  # (name, function) in the order they run
KNOWN = {}  # name -> why the two differ (documented in README)


def case(fn=None, known=None, needs_torch=False):
    def register(f):
        if torch or not needs_torch:
            CASES.append((f.__name__, f))
        if known:
            KNOWN[f.__name__] = known
        return f
    return register(fn) if fn else register


def async_execution(fn):
    return rpc.functions.async_execution(fn) if rpc else fn


def show(x):
    """A value as one line: tensors and arrays by dtype, shape and values."""
    if torch and isinstance(x, torch.Tensor):
        grad = ",grad" if x.requires_grad else ""
        return f"tensor[{x.dtype}{grad}]{list(x.shape)}={x.tolist()}"
    if isinstance(x, np.ndarray):
        return f"ndarray[{x.dtype}]{list(x.shape)}={x.tolist()}"
    if isinstance(x, list):
        return "[" + ", ".join(show(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(show(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{show(k)}: {show(v)}" for k, v in x.items()) + "}"
    if isinstance(x, rpc.RRef if rpc else ()):
        return "RRef"
    return repr(x)


WORKER_LINE = re.compile(r"On (WorkerInfo\(id=\d+, name=\w+\)):\n(.*)")


def raised(fn, remote=True):
    """What fn raised: for a remote error its type, the worker it names and
    the remote error's repr (torch's first lines; torch's rpc_sync prefixes
    them with the type's name); else its type only (the texts of local and
    framework errors are each implementation's own)."""
    try:
        value = fn()
    except Exception as e:  # the case is about which
        if not remote:
            return type(e).__name__
        text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
        m = WORKER_LINE.search(text)
        where = f"on {m[1]}: {m[2]}" if m else f"without a worker line: {text[:60]!r}"
        return f"{type(e).__name__} {where}"
    return f"no error, got {show(value)}"


def timed_out(fn):
    """A timeout: whether `except RuntimeError` catches it, as in torch (its
    type and text are each implementation's own)."""
    try:
        value = fn()
    except Exception as e:
        return f"raised, a RuntimeError: {isinstance(e, RuntimeError)}"
    return f"no timeout, got {show(value)}"


# ---- user functions (run on the callee) ------------------------------------

def add(a, b=0):
    return a + b


def echo(x):
    return x


def nothing():
    return None


def whoami():
    return rpc.get_worker_info().name


def kwonly(a, *, b, c=3):
    return (a, b, c)


def varargs(*args, **kwargs):
    return (args, sorted(kwargs.items()))


def slow(sec):
    time.sleep(sec)
    return sec


def ping_pong(depth, other):
    """depth calls back and forth; the names of the workers on the way."""
    me = rpc.get_worker_info().name
    if depth == 0:
        return [me]
    return [me] + rpc.rpc_sync(other, ping_pong, args=(depth - 1, me))


class CompatError(Exception):
    pass


class TwoArgError(Exception):
    def __init__(self, a, b):  # cannot be rebuilt from one message
        super().__init__(a, b)


def raise_value(msg):
    raise ValueError(msg)


def raise_key(k):
    return {}[k]


def raise_custom(msg):
    raise CompatError(msg)


def raise_two_arg():
    raise TwoArgError(1, 2)


def divide(a, b):
    return a / b


def raise_nested(other):
    """An error raised one hop further: it travels back twice."""
    return rpc.rpc_sync(other, raise_value, args=("deep",))


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __repr__(self):
        return f"Point({self.x}, {self.y})"

    @staticmethod
    def origin():
        return Point(0, 0)

    @classmethod
    def diagonal(cls, v):
        return cls(v, v)


class Counter:
    def __init__(self, start):
        self.n = start

    def increment(self, by=1):
        self.n += by
        return self.n

    def get(self):
        return self.n


def deref(r):
    return r.to_here()


def rref_info(r):
    """How an RRef looks where it arrives."""
    return (r.is_owner(), r.owner_name(), r.to_here())


def make_rref(owner, x):
    return rpc.remote(owner, add, args=(x, 1))


def rref_sum(rrefs):
    return sum(r.to_here() for r in rrefs)


@async_execution
def async_add_chain(to, x, times):
    """Returns at once; the reply goes when the chain of calls completes."""
    fut = rpc.rpc_async(to, add, args=(x, 1))
    for _ in range(times - 1):
        fut = fut.then(lambda f: f.wait() + 1)
    return fut


@async_execution
def async_hop(to, x):
    """An async function whose Future waits for another async function."""
    me = rpc.get_worker_info().name
    return rpc.rpc_async(to, async_add_chain, args=(me, x, 2)).then(lambda f: f.wait() * 10)


@async_execution
def async_later(x):
    """A Future completed by another thread."""
    fut = futures.Future()
    threading.Timer(0.05, lambda: fut.set_result(x * 2)).start()
    return fut


@async_execution
def async_set_exception():
    fut = futures.Future()
    fut.set_exception(ValueError("set on the future"))
    return fut


@async_execution
def async_raise():
    raise ValueError("before the future")


@async_execution
def async_not_future():
    return 42


def tensor_add(a, b):
    return a + b


def tensor_stats(t):
    return (str(t.dtype), list(t.shape), float(t.double().sum()))


def make_tensor(n):
    return torch.arange(n, dtype=torch.float32) * 2


def scale_in_place(t, by):
    t.mul_(by)
    return t


def array_stats(a):
    return (str(a.dtype), list(a.shape), a.sum().item())


def write_first(a, b):
    a.add_(1)
    return (a is b, b)


def first_two_same(seq):
    return seq[0] is seq[1]


def twice(x):
    return (x, x)


def both_same(a, b):
    return a is b


# ---- the cases (run on worker0) ---------------------------------------------

@case
def info_self():
    me = rpc.get_worker_info()
    return f"{me!r} id={me.id} name={me.name}"


@case
def info_peer():
    return repr(rpc.get_worker_info(PEER))


@case
def info_unknown():
    return raised(lambda: rpc.get_worker_info("nobody"), remote=False)


@case
def sync_user():
    return show(rpc.rpc_sync(PEER, add, args=(2, 3)))


@case
def sync_kwargs():
    return show(rpc.rpc_sync(PEER, add, args=(2,), kwargs={"b": 40}))


@case
def sync_kwonly():
    return show(rpc.rpc_sync(PEER, kwonly, args=(1,), kwargs={"b": 2}))


@case
def sync_varargs():
    return show(rpc.rpc_sync(PEER, varargs, args=(1, "two"), kwargs={"z": 3, "a": None}))


@case
def sync_destinations():
    peer = rpc.get_worker_info(PEER)
    return show([rpc.rpc_sync(to, whoami) for to in (PEER, peer, 1)])


@case
def sync_self():
    return show(rpc.rpc_sync(ME, whoami))


@case
def sync_builtin():
    return show((rpc.rpc_sync(PEER, len, args=([1, 2, 3],)),
                 rpc.rpc_sync(PEER, sorted, args=([3, 1, 2],), kwargs={"reverse": True}),
                 rpc.rpc_sync(PEER, operator.mul, args=(6, 7))))


@case(needs_torch=True)
def sync_torch_builtin():
    # torch runs torch.add as a TorchScript builtin, not a pickled function.
    return show(rpc.rpc_sync(PEER, torch.add, args=(torch.ones(3), 2)))


@case
def sync_class_and_methods():
    return show((rpc.rpc_sync(PEER, Point, args=(1, 2)),
                 rpc.rpc_sync(PEER, Point.origin),
                 rpc.rpc_sync(PEER, Point.diagonal, args=(5,)),
                 rpc.rpc_sync(PEER, Counter(7).increment, args=(3,))))


@case
def sync_partial():
    return show(rpc.rpc_sync(PEER, functools.partial(add, 10), args=(5,)))


@case
def sync_values():
    value = {"a": [1, 2.5, None, True], "b": (b"\x00\xff", "text"), 3: frozenset({1}),
             "big": 2 ** 100, "nested": [[[()]]]}
    return show(rpc.rpc_sync(PEER, echo, args=(value,)))


@case
def sync_none():
    return show(rpc.rpc_sync(PEER, nothing))


@case
def sync_16k():
    data = bytes(range(256)) * 64
    back = rpc.rpc_sync(PEER, echo, args=(data,))
    return f"len={len(back)} equal={back == data}"


@case
def sync_4m():
    data = bytes(range(256)) * 16384
    back = rpc.rpc_sync(PEER, echo, args=(data,))
    return f"len={len(back)} equal={back == data}"


@case
def sync_nested():
    return show(rpc.rpc_sync(PEER, ping_pong, args=(5, ME)))


@case
def async_wait():
    fut = rpc.rpc_async(PEER, add, args=(1, 2))
    return show((fut.wait(), fut.done(), fut.value()))


@case
def async_many():
    futs = [rpc.rpc_async(PEER, add, args=(i, i)) for i in range(50)]
    return show(futures.wait_all(futs) == [2 * i for i in range(50)])


@case
def async_then():
    fut = rpc.rpc_async(PEER, add, args=(1, 2))
    chained = fut.then(lambda f: f.wait() * 10).then(lambda f: f.wait() + 1)
    return show(chained.wait())


@case
def async_done_callback():
    fut = rpc.rpc_async(PEER, add, args=(4, 4))
    seen = []
    done = threading.Event()
    fut.add_done_callback(lambda f: (seen.append(f.value()), done.set()))
    return show((done.wait(10), seen))


@case
def async_error():
    return raised(lambda: rpc.rpc_async(PEER, raise_value, args=("async no",)).wait())


@case
def async_error_through_then():
    return raised(lambda: rpc.rpc_async(PEER, add, args=(1, "x")).then(lambda f: f.wait()).wait())


@case
def async_collect_all():
    done = futures.collect_all([rpc.rpc_async(PEER, add, args=(i, 1)) for i in range(5)]).wait()
    return show([f.value() for f in done])


@case
def future_local():
    fut = futures.Future()
    before = fut.done()
    fut.set_result(5)
    bad = futures.Future()
    bad.set_exception(KeyError("k"))
    return f"{before} {fut.done()} {fut.wait()} {raised(bad.wait)}"


@case
def remote_to_here():
    return show(rpc.remote(PEER, add, args=(20, 22)).to_here())


@case
def remote_owner():
    r = rpc.remote(PEER, add, args=(1, 1))
    # Not confirmed_by_owner(): torch's answer right after to_here() races
    # with the owner's acknowledgement.
    return show((r.owner(), r.owner_name(), r.is_owner(), r.to_here()))


@case
def remote_self_local_value():
    r = rpc.remote(ME, add, args=(1, 1))
    return show((r.is_owner(), r.local_value(), r.to_here(), r.owner_name()))


@case
def remote_user_local_value():
    r = rpc.remote(PEER, add, args=(1, 1))
    r.to_here()
    try:
        r.local_value()
    except RuntimeError as e:  # the RRef's description before it is each one's own
        return "RuntimeError: " + str(e)[str(e).find("can't call"):]
    return "no error"


@case
def remote_str():
    user, owner = rpc.remote(PEER, add, args=(1, 1)), rpc.remote(ME, add, args=(1, 1))
    return f"{str(user).split('(')[0]} {str(owner).split('(')[0]}"


@case
def remote_error():
    return raised(rpc.remote(PEER, raise_value, args=("in an RRef",)).to_here)


@case(needs_torch=True)
def remote_builtin():
    return show(rpc.remote(PEER, torch.mul, args=(torch.arange(3), 3)).to_here())


@case
def remote_kwargs():
    return show(rpc.remote(PEER, kwonly, args=(1,), kwargs={"b": 2, "c": 4}).to_here())


@case
def rref_to_owner():
    r = rpc.remote(PEER, add, args=(20, 22))
    return show(rpc.rpc_sync(PEER, rref_info, args=(r,)))


@case
def rref_to_self():
    r = rpc.remote(PEER, add, args=(20, 22))
    return show(rpc.rpc_sync(ME, rref_info, args=(r,)))


@case
def rref_owned_here_to_peer():
    r = rpc.remote(ME, add, args=(1, 2))
    return show(rpc.rpc_sync(PEER, rref_info, args=(r,)))


@case
def rref_returned():
    made = rpc.rpc_sync(PEER, make_rref, args=(ME, 9))
    return show((made.is_owner(), made.to_here()))


@case
def rref_in_rref():
    outer = rpc.remote(PEER, make_rref, args=(PEER, 30))
    inner = outer.to_here()
    return show((inner.is_owner(), inner.owner_name(), inner.to_here()))


@case
def rref_list_arg():
    rrefs = [rpc.remote(PEER, add, args=(i, 0)) for i in range(4)]
    rrefs.append(rpc.remote(ME, add, args=(10, 0)))
    return show(rpc.rpc_sync(PEER, rref_sum, args=(rrefs,)))


@case
def rref_local_owner():
    r = rpc.RRef([1, 2])
    return show((r.is_owner(), r.local_value(), rpc.rpc_sync(PEER, rref_info, args=(r,))))


@case
def rref_pickle_outside_rpc():
    import pickle
    r = rpc.remote(PEER, add, args=(1, 1))
    return raised(lambda: pickle.dumps(r), remote=False)


@case
def proxy_sync():
    c = rpc.remote(PEER, Counter, args=(5,))
    return show((c.rpc_sync().get(), c.rpc_sync().increment(2)))


@case
def proxy_async():
    c = rpc.remote(PEER, Counter, args=(5,))
    return show(c.rpc_async().increment(by=3).wait())


@case
def proxy_remote():
    c = rpc.remote(PEER, Counter, args=(5,))
    return show(c.remote().get().to_here())


@case
def proxy_builtin_type():
    lst = rpc.remote(PEER, list, args=([1, 2, 2, 3],))
    return show((lst.rpc_sync().count(2), lst.rpc_async().index(3).wait(),
                 lst.remote().__len__().to_here()))


@case
def proxy_mutation():
    c = rpc.remote(PEER, Counter, args=(5,))
    c.rpc_sync().increment(10)
    return show(c.rpc_sync().get())


@case
def proxy_error():
    c = rpc.remote(PEER, Counter, args=(5,))
    # torch looks the method up on the value's type here, shmrpc on the owner.
    return raised(lambda: c.rpc_sync().no_such_method(), remote=False)


@case
def exc_value():
    return raised(lambda: rpc.rpc_sync(PEER, raise_value, args=("no!",)))


@case(known="torch 1.13's rpc_sync and rpc_async keep only some error types (ValueError, "
      "TypeError, ...) and raise the others as RuntimeError('KeyError: ...'); shmrpc keeps "
      "every type, as torch's to_here() does (README: re-raised with their type)")
def exc_types_kept():
    return " | ".join(raised(lambda: rpc.rpc_sync(PEER, f, args=a)) for f, a in
                      ((raise_key, ("k",)), (raise_custom, ("mine",)), (divide, (1, 0))))


@case
def remote_error_types():
    return " | ".join(raised(rpc.remote(PEER, f, args=a).to_here) for f, a in
                      ((raise_key, ("k",)), (raise_custom, ("mine",)), (divide, (1, 0))))


@case
def exc_type_error_in_call():
    return raised(lambda: rpc.rpc_sync(PEER, add, args=(1, 2, 3)))


@case(known="an error type that cannot be rebuilt from one message: torch 1.13 raises the "
      "TypeError of that attempt, shmrpc a RuntimeError with the remote text")
def exc_two_arg():
    return raised(lambda: rpc.rpc_sync(PEER, raise_two_arg), remote=False)


@case
def exc_nested():
    try:
        rpc.rpc_sync(PEER, raise_nested, args=(ME,))
    except ValueError as e:
        text = str(e)
        m = WORKER_LINE.search(text)
        return (f"ValueError on {m[1] if m else None}, names workers "
                f"{sorted(set(re.findall(r'On WorkerInfo.id=(.)', text)))}, deep={'deep' in text}")
    return "no ValueError"


@case
def exc_unpicklable_arg():
    return raised(lambda: rpc.rpc_sync(PEER, echo, args=(threading.Lock(),)), remote=False)


def _only_here():
    return "ran"


@case
def exc_function_missing_on_callee():
    # Pickled by reference to a name the callee's module does not have.
    _only_here.__qualname__ = _only_here.__name__ = "only_on_worker0"
    globals()["only_on_worker0"] = _only_here
    return raised(lambda: rpc.rpc_sync(PEER, _only_here), remote=False)


@case
def timeout_sync():
    return timed_out(lambda: rpc.rpc_sync(PEER, slow, args=(1.0,), timeout=0.1))


@case
def timeout_async():
    return timed_out(lambda: rpc.rpc_async(PEER, slow, args=(1.0,), timeout=0.1).wait())


@case
def timeout_remote_to_here():
    r = rpc.remote(PEER, slow, args=(1.0,))
    return timed_out(lambda: r.to_here(timeout=0.1))


@case
def timeout_zero_is_none():
    return show(rpc.rpc_sync(PEER, slow, args=(0.2,), timeout=0))


@case
def timeout_not_reached():
    return show(rpc.rpc_sync(PEER, slow, args=(0.05,), timeout=10))


@case
def async_exec_chain():
    return show(rpc.rpc_sync(PEER, async_add_chain, args=(ME, 1, 3)))


@case
def async_exec_hops():
    return show(rpc.rpc_sync(PEER, async_hop, args=(ME, 1)))


@case
def async_exec_rpc_async_and_remote():
    fut = rpc.rpc_async(PEER, async_add_chain, args=(ME, 10, 2))
    r = rpc.remote(PEER, async_add_chain, args=(PEER, 20, 2))
    return show((fut.wait(), r.to_here()))


@case
def async_exec_other_thread():
    return show(rpc.rpc_sync(PEER, async_later, args=(21,)))


@case(known="torch 1.13 returns the exception set on an async_execution Future as the result "
      "(a torch bug); shmrpc raises it")
def async_exec_set_exception():
    return raised(lambda: rpc.rpc_sync(PEER, async_set_exception), remote=False)


@case
def async_exec_raise():
    return raised(lambda: rpc.rpc_sync(PEER, async_raise))


@case
def async_exec_not_future():
    return raised(lambda: rpc.rpc_sync(PEER, async_not_future), remote=False)


@case(needs_torch=True)
def tensor_in_out():
    return show(rpc.rpc_sync(PEER, tensor_add, args=(torch.arange(4.0), torch.ones(4))))


@case(needs_torch=True)
def tensor_dtypes():
    ts = [torch.tensor([1, -2], dtype=torch.int64), torch.tensor([3, 4], dtype=torch.int32),
          torch.tensor([0.5, 1.5], dtype=torch.float64), torch.tensor([1, 255], dtype=torch.uint8),
          torch.tensor([1.25], dtype=torch.float16), torch.tensor([-7], dtype=torch.int8)]
    return show(rpc.rpc_sync(PEER, echo, args=(ts,)))


@case(needs_torch=True)
def tensor_bool():
    return show(rpc.rpc_sync(PEER, echo, args=(torch.tensor([True, False]),)))


@case(needs_torch=True)
def tensor_shapes():
    ts = (torch.tensor(3.5), torch.empty(0, 3), torch.arange(24).reshape(2, 3, 4))
    return show(rpc.rpc_sync(PEER, echo, args=(ts,)))


@case(needs_torch=True)
def tensor_non_contiguous():
    t = torch.arange(6).reshape(2, 3).t()
    return show((rpc.rpc_sync(PEER, echo, args=(t,)), rpc.rpc_sync(PEER, echo, args=(t[1],))))


@case(needs_torch=True)
def tensor_callee_reads():
    return show(rpc.rpc_sync(PEER, tensor_stats, args=(torch.arange(10, dtype=torch.int16),)))


@case(needs_torch=True)
def tensor_callee_writes_arg():
    # The callee changes its copy; the caller's tensor stays as it was.
    t = torch.ones(3)
    back = rpc.rpc_sync(PEER, scale_in_place, args=(t, 4.0))
    return show((t, back))


@case(needs_torch=True)
def tensor_result_is_own():
    a = rpc.rpc_sync(PEER, make_tensor, args=(3,))
    a.add_(1)
    return show((a, rpc.rpc_sync(PEER, make_tensor, args=(3,))))


@case(needs_torch=True)
def tensor_in_structure():
    value = {"w": torch.full((2, 2), 3.0), "list": [torch.zeros(1), 5]}
    return show(rpc.rpc_sync(PEER, echo, args=(value,)))


@case(needs_torch=True)
def tensor_same_twice():
    t = torch.arange(3)
    a, b = rpc.rpc_sync(PEER, echo, args=((t, t),))
    return show((a, b, torch.equal(a, b)))


@case(needs_torch=True)
def tensor_twice_one_object():
    # torch's pickler memoizes a tensor as any object: given (or returned)
    # twice in one message, it arrives one object.
    t = torch.arange(3.0)
    a, b = rpc.rpc_sync(PEER, twice, args=(t,))
    return show((rpc.rpc_sync(PEER, write_first, args=(t, t)),
                 rpc.rpc_sync(PEER, first_two_same, args=([t, t],)), a is b, t))


@case
def rref_twice_one_object():
    # As a tensor: an RRef given twice in one call arrives one object.
    r = rpc.remote(PEER, add, args=(1, 2))
    return show((rpc.rpc_sync(PEER, both_same, args=(r, r)),
                 rpc.rpc_sync(PEER, first_two_same, args=([r, r],)), r.to_here()))


@case(needs_torch=True)
def tensor_sparse_and_many_dims():
    s = torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 2]], [3.0, 4.0, 5.0], (2, 3))
    back = rpc.rpc_sync(PEER, echo, args=(s,))
    many = torch.arange(2 ** 9, dtype=torch.float32).reshape([2] * 9)
    got = rpc.rpc_sync(PEER, echo, args=(many,))
    return show((str(back.layout), back.to_dense(), list(got.shape), torch.equal(got, many)))


@case(needs_torch=True)
def tensor_rref():
    r = rpc.remote(PEER, make_tensor, args=(4,))
    return show((r.to_here(), r.rpc_sync().sum(), rpc.rpc_sync(PEER, deref, args=(r,))))


@case(needs_torch=True)
def tensor_requires_grad():
    try:
        return show(rpc.rpc_sync(PEER, echo, args=(torch.ones(2, requires_grad=True),)))
    except Exception as e:
        return type(e).__name__


@case
def numpy_in_out():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    return show((rpc.rpc_sync(PEER, echo, args=(a,)), rpc.rpc_sync(PEER, array_stats, args=(a,))))


@case
def numpy_dtypes():
    arrs = [np.array([1.5, -2.5]), np.array([1, 2], dtype=np.uint16), np.array([True, False]),
            np.array(["a", "bc"]), np.array([1 + 2j])]
    return show(rpc.rpc_sync(PEER, echo, args=(arrs,)))


@case
def numpy_in_rref():
    r = rpc.remote(PEER, echo, args=(np.linspace(0, 1, 5),))
    return show(r.to_here())


@case(needs_torch=True)
def torch_profiler_keys():
    """Calls made under torch's own (legacy: torch 1.13 profiles RPCs only
    there) autograd profiler appear in it, under torch's keys."""
    with torch.autograd.profiler_legacy.profile() as prof:
        rpc.rpc_sync(PEER, add, args=(1, 2))
        rpc.rpc_async(PEER, add, args=(3, 4)).wait()
        # (Not remote(): torch ends its record when the owner's confirmation
        # comes, which may be after the profiler stopped. tests/python/
        # test_profiling.py checks shmrpc's rpc_remote# record.)
    # The callee's `KEY#remote_op: ...` events are not compared: torch
    # 1.13 does not give them reliably. With tensor arguments its first
    # profile in a job has them for rpc_sync and rpc_async, a second one
    # for rpc_sync only, and here, after the other cases, none at all.
    # tests/python/test_profiling.py checks shmrpc's (the callee's aten::add
    # under each key, on the callee's node, as torch's first profile has).
    return show(sorted({e.name for e in prof.function_events
                        if e.name.startswith("rpc_") and "#remote_op" not in e.name}))

