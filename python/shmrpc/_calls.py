"""The calls a worker makes: rpc_sync, rpc_async, remote, and the RRef
(its value, proxies, type, backward). Above the pickler, the futures and
distributed autograd; the server is above it.
"""
import pickle
import re
import sys
import threading
import types

from . import _contexts, _core, _marshal, _shmrpc, autograd, profiler
from ._core import (UNSET_RPC_TIMEOUT, WorkerInfo, _c_wait, _not_initialized, _not_supported,
                    _rank_of, _timeout_ms, get_worker_info)
from ._futures import Future, _note_future
from ._marshal import _LIVE, _dumps, _func_name, _immutable, _pack_call, _result, _rref_of

def _send_call(dst, func, args, kwargs, timeout, kind):
    """The C call in flight: a PYTHON_CALL, or inside a distributed autograd
    context a FORWARD_AUTOGRAD_REQ wrapping it (as torch, for every Python
    call made in a context); profiled for torch's profiler when it runs in
    this thread (shmrpc.profiler)."""
    if not _core._initialized:
        raise _not_initialized()
    cid = _contexts._calling(dst)
    data, rrefs, tensors = _pack_call(func, args, kwargs)
    torch_profile = profiler.torch_profiling()
    # Every argument positional: a keyword makes the C half look up each
    # name left in a dict (python/_calls.c).
    try:
        if cid is None:
            call = _shmrpc.call(dst, data, rrefs, tensors, _timeout_ms(timeout), kind,
                                _func_name(func), _shmrpc.PYTHON_CALL, -1, 0, False,
                                torch_profile)
        else:
            call = _shmrpc.call(dst, data, rrefs, tensors, _timeout_ms(timeout), kind,
                                _func_name(func), _shmrpc.FORWARD_AUTOGRAD_REQ, cid,
                                _contexts._message_id(), False, torch_profile)
    except RuntimeError as e:
        raise _NotSent(str(e)) from None
    if torch_profile:
        profiler.torch_called(call)
    return call


class _NotSent(RuntimeError):
    """A call the C half could not send (its worker has left the job or
    died, the message cannot be made): rpc_async gives it through its
    Future, as torch's agent does; the arguments' own errors are raised."""


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    try:
        # The common call is sent in C, as rpc_sync's (below).
        call = _shmrpc.rpc_async_call(to, func, args, kwargs, timeout)
        if call is _GENERAL:
            call = _send_call(_rank_of(to), func, args, kwargs, timeout, "rpc_async")
        fut = Future(_c=call)
    except _NotSent as e:
        fut = Future()
        fut.set_exception(e)
        return fut
    if _contexts._tls.ctx is not None:  # _contexts._called's question, without its call
        _contexts._called(fut)
    _note_future(fut)
    return fut


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    # The common call is made in C (python/_calls.c, rpc_sync), which reads
    # the same state as the path below; any other comes back _GENERAL, with
    # nothing done.
    result = _shmrpc.rpc_sync(to, func, args, kwargs, timeout)
    if result is not _GENERAL:
        return result
    call = _send_call(_rank_of(to), func, args, kwargs, timeout, "rpc_sync")
    return _result(_c_wait(call.wait))


# What python/_calls.c's rpc_sync, rpc_remote and rref_value return for
# what they leave to the Python path.
_GENERAL = object()


class RRef:
    """A reference to a value on its owner (from remote(), or RRef(value)
    made on the owner itself). As torch's: the value is the owner's live
    object, kept under the RRef's id until the RRef is deleted everywhere
    (docs/RREF.md, "Python values"); local_value() and proxies act on it,
    and to_here() on a user pickles it as it is then."""

    def __class_getitem__(cls, item):
        """RRef[T] in annotations, as torch's RRef is generic. Where torch
        is loaded, torch's own RRef[T], which TorchScript understands in a
        scripted function's signature (shmrpc runs no TorchScript: such a
        function cannot take a shmrpc RRef, but its module imports)."""
        torch_api = _core._torch_api()
        torch_rref = getattr(torch_api, "RRef", None)
        return torch_rref[item] if torch_rref is not None else cls

    def __init__(self, value=None, type_hint=None, _c=None):
        if _c is None:
            # A local owner RRef, ready at once, holding value as a remote
            # call's result is held (_reply): the object itself, kept here
            # under the RRef's id, or a value no code can change, pickled.
            if not _core._initialized:
                raise _not_initialized()
            pickled, _, out_of_line = _dumps(value) if _immutable(value) else (None, 0, 0)
            if pickled is not None and not out_of_line:
                _c = _shmrpc.rref_local(pickled, False)
            else:
                # No one else knows the id before this returns.
                _c = _shmrpc.rref_local(_LIVE, True)
                _owned[_c.id()] = value
        self._r = _c

    def to_here(self, timeout=UNSET_RPC_TIMEOUT):
        """The value: on the owner the object itself (as torch's), on a
        user a copy made by the owner now (PYTHON_RREF_FETCH_CALL), once
        the remote call has stored it."""
        # A user's read of a value that came pickled, in C
        # (python/_calls.c, rref_value), which asks what the lines below do.
        value = _shmrpc.rref_value(self._r, timeout)
        if value is not _GENERAL:
            return value
        if not _core._initialized:
            raise RuntimeError(f"{self} was deleted when RPC shut down. Cannot call to_here() "
                               "on it after deletion.")
        if self._r.is_owner():
            return self._owned(timeout)
        msg = _c_wait(self._r.to_here, _timeout_ms(timeout))
        if msg[0] == _LIVE:
            msg = _c_wait(self._fetch(timeout).wait)
        return _result(msg)

    def local_value(self):
        """The value, on the owner: the same object every time."""
        # Only an owner keeps values in _owned: found there, no more to ask
        # (a proxy's every call on the owner comes here).
        value = _owned.get(self._r.id(), _owned)
        if value is not _owned:
            return value
        if not self._r.is_owner():
            # The RRef as torch's C++ prints it in this error.
            ref = re.sub(r"UserRRef\(RRefId = (.*), ForkId = (.*)\)$",
                         r"UserRRef(rref_id=\1, fork_id=\2)", str(self))
            raise RuntimeError(f"For {ref}, can't call localValue() on user "
                               f"{get_worker_info()!r}. Call it on owner {self.owner()!r}")
        return self._owned(UNSET_RPC_TIMEOUT)

    def _owned(self, timeout):
        """On the owner: the live value, once stored (the remote call's
        error raised, as to_here's)."""
        value = _owned.get(self._r.id(), _owned)
        if value is not _owned:
            return value
        msg = _c_wait(self._r.to_here, _timeout_ms(timeout))  # waits; the error raised
        if msg[0] == _LIVE:
            return _owned[self._r.id()]
        return _result(msg)  # a value that cannot change (a copy), or a C function's

    def _fetch(self, timeout):
        """The owner's pickle of the value now: PYTHON_RREF_FETCH_CALL,
        inside the caller's autograd context if any (as torch's to_here,
        which records the tensors that require grad it receives)."""
        owner = self._r.owner()
        cid = _contexts._calling(owner)
        return _shmrpc.call(owner, b"", [self._r], [], _timeout_ms(timeout), "rpc_sync",
                            "to_here", _shmrpc.PYTHON_RREF_FETCH_CALL,
                            -1 if cid is None else cid)

    # _get_type's: the owner's answer (a Future), and the type once it came.
    _type_future = None
    _type = None

    def _get_type(self, timeout=UNSET_RPC_TIMEOUT, blocking=True):
        """The type of the value, asked of the owner once (one
        _rref_typeof_on_owner call, its Future kept), or with blocking=False
        that Future itself, as torch's. A proxy's every call asks it: once
        known, the type is returned without the Future's wait."""
        if blocking and self._type is not None:
            return self._type
        fut = self._type_future
        if fut is None:
            if self._r.is_owner():
                fut = Future()
                fut.set_result(type(self.local_value()))
            else:
                fut = rpc_async(self._r.owner(), _rref_typeof_on_owner, args=(self,),
                                timeout=timeout)
            self._type_future = fut
        if not blocking:
            return fut
        self._type = fut.wait()
        return self._type

    def _get_future(self):
        """A Future completed (with None) once the owner has stored the
        value, or with the remote call's error, as torch's."""
        if self._r.is_owner() and self._r.confirmed_by_owner():
            fut = Future()
            fut.set_result(None)
            return fut
        return self._future_of(_rref_created)

    def _get_profiling_future(self):
        """torch's: completes once the remote() that made this RRef, and so
        its profiled event, have completed: the value stored, and the reply
        that ends the event in (a user can read the value from the RRef
        table before that reply has come: the event would end after the
        future)."""
        def created_and_replied(rref):
            _rref_created(rref)
            rref._r.profiled()  # waits for the reply of a profiled remote()
        return self._future_of(created_and_replied)

    def _future_of(self, wait):
        """A Future completed (with None) once wait(self) returns, or with
        its error; wait runs on a thread of its own."""
        fut = Future()

        def run():  # this RRef itself: on its creator it knows remote()'s request
            try:
                wait(self)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)
        threading.Thread(target=run, name="shmrpc-rref-future", daemon=True).start()
        return fut

    def backward(self, dist_autograd_ctx_id=-1, retain_graph=False):
        """Backward from the value (a scalar tensor) on the owner: in the
        given distributed autograd context, or with -1 (on the owner only)
        torch.autograd's local backward, as torch's."""
        return autograd._rref_backward(self, dist_autograd_ctx_id, retain_graph)

    def owner(self):
        return WorkerInfo._of(self._r.owner_name(), self._r.owner())

    def owner_name(self):
        return self._r.owner_name()

    def is_owner(self):
        return self._r.is_owner()

    def confirmed_by_owner(self):
        return self._r.confirmed_by_owner()

    def rpc_sync(self, timeout=UNSET_RPC_TIMEOUT):
        """rref.rpc_sync().method(*args): the method runs on the owner."""
        return _Proxy(self, rpc_sync, timeout)

    def rpc_async(self, timeout=UNSET_RPC_TIMEOUT):
        return _Proxy(self, rpc_async, timeout)

    def remote(self, timeout=UNSET_RPC_TIMEOUT):
        return _Proxy(self, remote, timeout)

    def _serialize(self):
        """The hook of torch's own RPC pickler (torch.distributed.rpc.internal),
        which finds shmrpc's RRef as torch.distributed.rpc.PyRRef: shmrpc's
        RRefs travel in its calls' arguments only."""
        if not _core._initialized:
            raise RuntimeError(f"{self} was deleted when RPC shut down. Cannot call fork an "
                               "UserRRef after deletion.")
        raise _not_supported("pickling an RRef with torch's RPC pickler (pass it in a call's "
                             "arguments or result instead)")

    def __reduce__(self):
        # Only the RPC pickler (its reducer_override) may carry an RRef, as in torch.
        raise RuntimeError("Can not pickle rref in python pickler, rref can only be pickled "
                           "when using RPC (as an argument or a result of rpc_sync, rpc_async "
                           "or remote)")

    def __str__(self):
        return str(self._r)

    __repr__ = __str__


# RRef id -> the live value of an RRef this worker owns, until the RRef
# goes everywhere (the C half's live-release hook calls _release_owned).
_owned = {}


def _release_owned(rref_id):
    """The RRef rref_id went (deleted everywhere, or this worker stops): its
    value is dropped here, on its owner (its __del__ runs here, now)."""
    _owned.pop(rref_id, None)


def _rref_typeof_on_owner(rref):
    return type(rref.local_value())


def _rref_created(rref):
    """On an RRef's holder: returns once its value is stored (raises its error)."""
    msg = _c_wait(rref._r.to_here, _timeout_ms(UNSET_RPC_TIMEOUT))
    if msg[0] != _LIVE:
        _result(msg)


def _call_method(name, rref, *args, **kwargs):
    """On the owner: rref's value's method name (the proxies' function; _call
    runs it as the method itself, honouring async_execution)."""
    return getattr(rref.local_value(), name)(*args, **kwargs)


def _check_method(value_type, name):
    """As torch's proxies: the method is looked up on the value's type
    first, so a missing one raises AttributeError on the caller (a
    ScriptModule's methods are not its type's)."""
    torch = sys.modules.get("torch")
    if torch is None or not issubclass(value_type, (torch.jit.ScriptModule,
                                                    torch._C.ScriptModule)):
        getattr(value_type, name)


class _Proxy:
    """rref.rpc_sync(), rpc_async(), remote(): proxy.method(*args) is how
    (the call) of method on rref's value, on its owner. Every attribute
    but a dunder is such a method, as torch's: __getattribute__ rather than
    __getattr__, which the interpreter calls only once its own lookup has
    failed, an AttributeError made (and dropped) for every method call."""
    __slots__ = ("_sent",)  # (rref, how, timeout)

    def __init__(self, rref, how, timeout):
        self._sent = (rref, how, timeout)  # a store: __getattribute__ is not asked

    def __getattribute__(self, name):
        if name[:2] == "__":  # the proxy's own, else the value's (__getitem__...)
            try:
                return object.__getattribute__(self, name)
            except AttributeError:
                pass
        rref, how, timeout = _proxy_sent.__get__(self)
        if how is rpc_async:
            return _async_method(rref, name, timeout)

        def call(*args, **kwargs):
            _check_method(rref._get_type(timeout), name)
            # The owner's rank: what rpc_sync makes of a WorkerInfo, without
            # making one; arguments by position, as rpc_sync and remote take them.
            return how(rref._r.owner(), _call_method, (name, rref) + args, kwargs, timeout)
        return call


def _async_method(rref, name, timeout):
    """rref.rpc_async().name: it does not wait for the value's type: the
    check and the call follow it, their error or result in the Future
    returned."""
    def call(*args, **kwargs):
        result = Future()

        def typed(type_fut):
            try:
                _check_method(type_fut.wait(), name)
                fut = rpc_async(rref._r.owner(), _call_method, (name, rref) + args, kwargs,
                                timeout)
            except BaseException as e:  # noqa: BLE001 (the caller's, in result)
                result.set_exception(e)
                return
            fut.add_done_callback(lambda f: _settle(result, f))
        rref._get_type(timeout, blocking=False).add_done_callback(typed)
        return result
    return call


_proxy_sent = _Proxy._sent


def _settle(fut, done):
    """fut completes as done did."""
    try:
        value = done.wait()
    except BaseException as e:  # noqa: BLE001 (done's error, passed on)
        fut.set_exception(e)
    else:
        fut.set_result(value)


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """A PYTHON_REMOTE_CALL, or inside a distributed autograd context a
    FORWARD_AUTOGRAD_REQ wrapping it (as _send_call's)."""
    rref = _shmrpc.rpc_remote(to, func, args, kwargs, timeout)  # the common call, as rpc_sync's
    if rref is not _GENERAL:
        return rref
    if not _core._initialized:
        raise _not_initialized()
    dst = _rank_of(to)
    cid = _contexts._calling(dst)
    data, rrefs, tensors = _pack_call(func, args, kwargs)
    torch_profile = profiler.torch_profiling()
    if cid is None:  # all positional, as _send_call's
        r = _shmrpc.remote(dst, data, rrefs, tensors, _timeout_ms(timeout), _func_name(func),
                           _shmrpc.PYTHON_REMOTE_CALL, -1, 0, torch_profile)
    else:
        r = _shmrpc.remote(dst, data, rrefs, tensors, _timeout_ms(timeout), _func_name(func),
                           _shmrpc.FORWARD_AUTOGRAD_REQ, cid, _contexts._message_id(),
                           torch_profile)
    if torch_profile:
        profiler.torch_called(r)
    return _rref_of(r)


_marshal.set_rref_type(RRef)
_marshal.set_proxy_func(_call_method)
_shmrpc.rpc_sync_setup(_GENERAL, _marshal, types.FunctionType,
                       _marshal._named, _result, _core.RemoteException, _NotSent,
                       _core._RpcTimeout, pickle.dumps, pickle.loads, pickle.HIGHEST_PROTOCOL,
                       RRef, object.__new__)
