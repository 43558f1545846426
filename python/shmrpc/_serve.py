"""The requests a worker serves from Python: the handler the C half runs
on an executor thread (set by init_rpc), a call's function run in its
caller's autograd context and under its profilers, a remote call's result
kept live, an RRef fetch answered. Above the calls; below api.
"""
import pickle
import sys
import threading
import traceback
import types

from . import _contexts, _shmrpc, autograd, profiler, server_profiler
from ._calls import RRef, _call_method, _owned
from ._core import RemoteException, WorkerInfo
from ._futures import Future
from ._marshal import _LIVE, _dumps, _immutable, _Named, _named_heads, _unpack_call

_UDF_HINT = ("Default RPC pickler does not serialize function code. Ensure that UDFs are "
             "defined on both caller and callee modules.")


def _run_function(caller, msg_type, context_id, message_id, retain_graph, payload, rrefs, tensors,
                  ops, rref_id, profile):
    """Serves a request of this package that _serve_plain does not, on an
    executor thread (the C half gives its type and autograd metadata,
    worker/python.h). A pickled (func, args, kwargs) runs inside the
    autograd context its FORWARD_AUTOGRAD_REQ names (wrapping a call or a
    remote call: the C half stores a remote call's result in its RRef), its
    result pickled inside it too, and for a call profiled for torch's
    profiler (ops, a list, not None; profile, what its caller's profiler
    asks) under that profiler (profiler.torch_ops); a remote call's result
    (rref_id, not 0) is kept here, live, and its RRef stores _LIVE; a
    PYTHON_RREF_FETCH_CALL pickles such a value; distributed autograd's
    other requests go to shmrpc.autograd.
    Returns the pickled result or RemoteException, and for a
    FORWARD_AUTOGRAD_REQ the reply's autograd message id."""
    try:
        if msg_type == _shmrpc.PYTHON_RREF_FETCH_CALL:
            return _serve_fetch(rrefs[0], caller, context_id)
        if msg_type not in (_shmrpc.PYTHON_CALL, _shmrpc.PYTHON_REMOTE_CALL,
                            _shmrpc.FORWARD_AUTOGRAD_REQ):
            return _dumps(autograd._serve(msg_type, caller, context_id, retain_graph,
                                          (payload, rrefs, tensors)))
        try:
            func, args, kwargs = _unpack_call(payload, rrefs, tensors)
        except (AttributeError, ModuleNotFoundError, ImportError) as e:
            _not_found(e)
        if msg_type != _shmrpc.FORWARD_AUTOGRAD_REQ:
            context_id = None
        reply = _serve_call(func, args, kwargs, caller, context_id, ops, rref_id, profile)
        if msg_type == _shmrpc.FORWARD_AUTOGRAD_REQ:
            return reply + (_contexts._message_id(), reply[0] == _LIVE)
        return reply + (0, True) if reply[0] == _LIVE else reply
    except BaseException as e:  # every error travels back
        return _failed(e)


def _serve_plain(caller, msg_type, payload, rrefs, tensors, rref_id):
    """A PYTHON_CALL or PYTHON_REMOTE_CALL that its caller does not profile
    for torch's profiler, which the C half gives here with only the
    arguments they use (python/_handler.c), unless its fast path serves it
    as this function would (python/_serve_fast.c: a function by name whose
    name this function cached, without RRefs; _fast). The
    checks below and the fast path's must stay the same. What _run_function
    does for them, in fewer steps: no autograd context to enter or leave
    unless this thread is in one or a server profiler records, and a result
    of None, most calls', sent as the empty pickle itself (_dumps' b"",
    without its lists: the C half reads a bare pickle as one with no RRefs
    nor tensors). An empty call makes 4 Python calls here, 10 through
    _run_function (docs/ARCHITECTURE.md)."""
    try:
        try:
            func, args, kwargs = _unpack_call(payload, rrefs, tensors)
        except (AttributeError, ModuleNotFoundError, ImportError) as e:
            _not_found(e)
        if func is _call_method or _contexts._tls.ctx is not None or server_profiler._active:
            reply = _serve_call(func, args, kwargs, caller, None, None, rref_id)
        else:
            result = func(*args, **(kwargs or {}))
            # A plain function has no attributes, so async_execution's mark
            # cannot be there: asked only of others (two lookups and a call).
            if (type(func) is not types.FunctionType or func.__dict__) and \
                    _is_async_execution(func):
                result = _waited(result)
            if result is None:
                return b""
            # A call's result, most often: _dumps without _reply's call.
            reply = _dumps(result) if not rref_id else _reply(result, rref_id)
        return reply + (0, True) if reply[0] == _LIVE else reply
    except BaseException as e:  # every error travels back
        return _failed(e)


def _fast():
    """What the C half's fast path reads (python/_serve_fast.c, set with
    set_handler), in its order: it serves a PYTHON_CALL or
    PYTHON_REMOTE_CALL of a function sent by name, without RRefs, its
    arguments none, pickled or common tensors alone, or a proxy's call in
    the _PROXY form on a value in _owned, as _serve_plain
    would, asking the same objects (_named_heads and each _Named's name,
    _call_method, the thread's context (_shmrpc.set_in_context's), the
    server profiler) and calling
    the same Python for the rest (_reply keeps a remote call's value,
    _unloaded answers arguments that failed to unpickle)."""
    return (_named_heads, _Named, types.FunctionType, _call_method, server_profiler._active, pickle.loads, _serve_call, _is_async_execution, _waited, _dumps,
            _failed, _reply, _unloaded, _owned)


def _unloaded(e):
    """The reply to a call whose arguments' pickle raised e, for the C
    half's fast path, which unpickled them: as _serve_plain answers it,
    torch's hint for a name not found. Answered there rather than left to
    _serve_plain, which would run the pickle (the code its objects name) a
    second time."""
    if not isinstance(e, (AttributeError, ModuleNotFoundError, ImportError)):
        return _failed(e)
    try:
        _not_found(e)
    except RuntimeError as found:
        return _failed(found)


def _not_found(e):
    """Raises the error for a call whose function or arguments this worker
    cannot find (e, unpickling them), with torch's hint. Raised here, so
    that its traceback (_failed's text) is this frame whichever handler
    met e: _serve_plain, _run_function, or _unloaded for the C half's fast
    path."""
    raise RuntimeError(f"{e}. {_UDF_HINT}") from None


def _failed(e):
    """The reply to a request that raised e: the pickled RemoteException
    with its type, text and traceback; the callee logs it too, as torch's.
    The traceback starts below this module's handlers (their last frame
    is kept if nothing is below it): the same text whichever way served
    the call, these handlers or the C half's fast path (which calls a
    function, or _serve_call, without a frame of its own)."""
    # From the agent: a call can come before init_rpc has returned here.
    me = WorkerInfo._of(*_shmrpc.worker_info(None))
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_globals is globals():
        tb = tb.tb_next
    text = f"On {me!r}:\n{e!r}\n" + "".join(traceback.format_exception(type(e), e, tb))
    print(text, file=sys.stderr, flush=True)
    try:
        return _dumps(RemoteException(text, type(e)))
    except Exception:  # noqa: BLE001  a type pickle cannot name (a function's own class)
        return _dumps(RemoteException(text, RuntimeError))  # its words still go


# async_execution functions whose Future this worker is waiting for
# (torch's agent.server_active_async_calls), under _async_lock.
_async_serving = 0


_async_lock = threading.Lock()


def _serve_call(func, args, kwargs, caller, context_id, ops, rref_id=0, profile=0):
    """The pickled result of a call served here: run inside the caller's
    autograd context, under torch's profiler when ops is a list. A remote
    call's (rref_id) is kept live instead, under its RRef's id."""
    if context_id is None and ops is None and _contexts._current() is None and \
            not server_profiler._active:
        # Most calls: no context to enter or leave, no profiler; the
        # context managers would cost more than the rest of the handler.
        return _reply(_call(func, args, kwargs), rref_id)
    with _contexts._running_in(context_id, caller):
        with profiler.torch_ops(ops, profile), server_profiler.recorded():
            result = _call(func, args, kwargs)
        return _reply(result, rref_id)


def _reply(result, rref_id):
    """What the C half sends or stores for a result: its pickle, also for a
    remote call's value that no code can change (everyone reads it from the
    RRef table, and it cannot go stale); any other remote call's value is
    kept here, live, and the RRef stores the live mark."""
    if not rref_id or _immutable(result):
        return _dumps(result)
    _owned[rref_id] = result
    return _LIVE, [], []


def _serve_fetch(r, caller, context_id):
    """PYTHON_RREF_FETCH_CALL of r (a C RRef): the pickle of our RRef's live
    value as it is now, inside the caller's autograd context (-1: none), so
    that tensors that require grad in it are recorded as sends, as torch's
    fetch does. The value is read from _owned itself: a fetch comes once the
    value is stored, and the RRef's local_value would cost four Python
    calls more (the RRef made, its owner asked twice)."""
    if not r.is_owner():
        raise RuntimeError(f"a fetch came in for {RRef(_c=r)}, which this worker does not own")
    value = _owned.get(r.id(), _owned)
    if value is _owned:  # not stored (a C function's value) or gone: as local_value says
        value = RRef(_c=r).local_value()
    if context_id < 0:
        return _dumps(value)
    with _contexts._running_in(context_id, caller):
        return _dumps(value)


def _is_async_execution(func):
    """Decorated with shmrpc's or torch's functions.async_execution. A
    bound method (a proxy's) is asked through its function: a method's
    missing attribute is looked up on the method, then on the function,
    each miss an AttributeError made and caught (1.6 us against 0.3)."""
    if type(func) is types.MethodType:
        func = func.__func__
    return (getattr(func, "_shmrpc_async_execution", False)
            or hasattr(func, "_wrapped_async_rpc_function"))


def _call(func, args, kwargs):
    """func's result; an async_execution function's Future waited for. A
    proxy's call runs the live value's method itself (torch's proxies honour
    an async_execution method too)."""
    if func is _call_method:
        func, args = getattr(args[1].local_value(), args[0]), args[2:]
    result = func(*args, **(kwargs or {}))
    return _waited(result) if _is_async_execution(func) else result


def _waited(result):
    """The value of the Future an async_execution function returned, waited
    for (counted in _async_serving meanwhile)."""
    global _async_serving
    torch_future = sys.modules.get("torch.futures")
    if not isinstance(result, Future) and not (torch_future is not None
                                               and isinstance(result, torch_future.Future)):
        raise RuntimeError(
            "Functions decorated with @rpc.async_function must return a "
            "torch.futures.Future object, but got "
            f"{type(result).__module__}.{type(result).__qualname__}")
    with _async_lock:
        _async_serving += 1
    try:
        return result.wait()
    finally:
        with _async_lock:
            _async_serving -= 1
