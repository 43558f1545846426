"""Futures: what rpc_async returns (torch.futures.Future's interface, and
a torch.futures.Future too once torch.futures is loaded), wait_all,
collect_all, async_execution's decorator, and the futures an api._wait_all
block collects. Below the calls.
"""
import contextlib
import threading
import traceback

from . import _shmrpc
from ._core import _c_wait
from ._marshal import _result

class Future:
    """torch.futures.Future's interface: the result of rpc_async, or one
    made by user code (set_result / set_exception), e.g. for
    @functions.async_execution."""

    def __new__(cls, *args, **kwargs):
        # Once torch.futures is loaded, a Future is also a
        # torch.futures.Future (_TorchFuture): torch's C++ code that takes
        # one (the profiler's end callbacks, torch.jit) then takes ours.
        if cls is Future and _TorchFuture is not None:
            cls = _TorchFuture
        return super().__new__(cls)

    def __init__(self, _c=None):
        # A plain lock, not a Condition (an RLock and a Python object of
        # its own, about half of an rpc_async's Python work): a thread that
        # must block in wait() adds a lock of its own to _waiters, which
        # _finish releases.
        self._lock = threading.Lock()
        self._waiters = None
        self._have = False
        self._value = None
        self._error = None
        self._callbacks = []
        self._c = _c  # the call in flight, if any
        self._settling = False
        self._hooked = False  # the call completes us by itself (a callback is waiting)

    def _from_call(self):
        """The call completed: its result becomes ours (once, from the
        completion callback or from wait(), whichever comes first)."""
        with self._lock:
            if self._have or self._settling:
                return
            self._settling = True
        try:
            value = _result(_c_wait(self._c.wait))
        except BaseException as e:
            self.set_exception(e)
        else:
            self.set_result(value)

    def _finish(self, value, error):
        with self._lock:
            if self._have:
                raise RuntimeError("Future can only be marked completed once")
            self._value, self._error, self._have = value, error, True
            callbacks, self._callbacks = self._callbacks, []
            waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            waiter.release()
        self._settle_torch(value, error)
        for cb in callbacks:
            self._run(cb)

    def _settle_torch(self, value, error):
        """Completes the torch.futures.Future this one also is (_TorchFuture)."""

    def _run(self, cb):
        try:
            cb(self)
        except Exception:
            traceback.print_exc()  # as torch: a failing callback does not fail the Future

    def set_result(self, result):
        self._finish(result, None)

    def set_exception(self, result):
        self._finish(None, result)

    def wait(self):
        # _have is set after _value and _error, and never unset: once it
        # reads True (the GIL orders the three), neither the lock nor the
        # call is needed. The C wait usually completes us itself: a hooked
        # call's hook runs in the waiting thread (worker/future.c).
        if not self._have:
            self._wait_slow()
        if self._error is not None:
            raise self._error
        return self._value

    def _wait_slow(self):
        if self._c is not None:
            try:
                # The C wait releases the GIL, and on an executor thread it
                # runs what the call needs and is counted out of the pool
                # meanwhile (worker/executor.h): a nested call cannot starve
                # the pool waiting for its own completion callback.
                self._c.wait()
            except Exception:
                pass  # _from_call raises it below
            if not self._have:
                self._from_call()
        waiter = None
        with self._lock:
            if not self._have:
                waiter = threading.Lock()
                waiter.acquire()  # _finish releases it
                if self._waiters is None:
                    self._waiters = []
                self._waiters.append(waiter)
        if waiter is not None:
            # On an executor thread, what completes us may be queued
            # behind us: the pool runs it on another thread while this
            # one is counted out (worker/executor.h).
            _shmrpc.blocking(True)
            try:
                waiter.acquire()
            finally:
                _shmrpc.blocking(False)

    def value(self):
        if not self._have:
            raise RuntimeError("Future.value() before the Future completed")
        return self.wait()

    def done(self):
        return self._have or (self._c is not None and self._c.done())

    def add_done_callback(self, callback):
        with self._lock:
            if not self._have:
                self._callbacks.append(callback)
                # Only now does the call need to complete us by itself:
                # a plain wait() costs no executor job and no GIL hand-off.
                hook, self._hooked = self._c is not None and not self._hooked, True
                if not hook:
                    return
            else:
                hook = False
        if hook:
            self._c.add_done_callback(self._from_call)
        else:
            self._run(callback)

    def then(self, callback):
        """A new Future holding callback(self)'s result, or its error as
        torch's RuntimeError ("Got the following error when running the
        callback: ...")."""
        if not callable(callback):
            raise TypeError("then(): incompatible function arguments. The callback must be "
                            f"callable, not {type(callback).__name__}")
        nxt = Future()

        def chain(fut):
            try:
                nxt.set_result(callback(fut))
            except BaseException as e:
                nxt.set_exception(RuntimeError("Got the following error when running the "
                                               f"callback: {type(e).__name__}: {e}"))
        self.add_done_callback(chain)
        return nxt


_TorchFuture = None  # Future's torch.futures.Future form, once torch.futures is loaded


def _adopt_torch_futures(torch_futures):
    """From now on a new Future is also a torch.futures.Future: a subclass of
    both, completing its torch side as torch's set_result/set_exception do
    (about 2 µs a Future here: made only once torch.futures is loaded, so a
    program that never loads torch pays nothing)."""
    global _TorchFuture
    if _TorchFuture is not None:
        return
    torch_c_future = torch_futures.Future.__mro__[1]  # torch._C.Future

    def raise_error(error):
        raise error

    class TorchFuture(Future, torch_futures.Future):
        __doc__ = Future.__doc__

        def __init__(self, _c=None):
            Future.__init__(self, _c)
            torch_c_future.__init__(self, [])
            if _c is not None:
                # torch's C++ code waits on the torch side without asking
                # us: the call must complete it by itself.
                self._hooked = True
                _c.add_done_callback(self._from_call)

        def _settle_torch(self, value, error):
            if error is not None:
                torch_c_future._set_unwrap_func(self, raise_error)
                value = error
            torch_c_future.set_result(self, value)

    TorchFuture.__name__ = TorchFuture.__qualname__ = "Future"
    TorchFuture.__module__ = Future.__module__
    _TorchFuture = TorchFuture


def wait_all(futures):
    """The values of all futures, once all completed; the first error to
    occur is raised as soon as it does, as torch's."""
    futures = list(futures)
    if all(f.done() for f in futures):
        return [f.wait() for f in futures]
    first = Future()  # completes with the first error, or once all are done
    left = [len(futures)]
    lock = threading.Lock()

    def one(f):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if first.done():
            return
        try:
            f.wait()
        except BaseException as e:  # noqa: BLE001 (the future's error, for the waiter)
            with lock:
                if not first.done():
                    first.set_exception(e)
            return
        if last:
            with lock:
                if not first.done():
                    first.set_result(None)
    for f in futures:
        f.add_done_callback(one)
    first.wait()
    return [f.wait() for f in futures]


def collect_all(futures):
    """A Future completed with the list of futures once all are done."""
    futures = list(futures)
    out = Future()
    left = [len(futures)]
    lock = threading.Lock()
    if not futures:
        out.set_result([])

    def one(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result(futures)
    for f in futures:
        f.add_done_callback(one)
    return out


class functions:
    """shmrpc.functions.async_execution, as torch.distributed.rpc.functions."""

    @staticmethod
    def async_execution(fn):
        """The decorated function returns a Future; the reply goes when it
        completes. (shmrpc waits for it on the executor thread that ran the
        function: a chain of such functions needs as many threads.)"""
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)
        wrapper._shmrpc_async_execution = True
        return wrapper


_thread_local_var = threading.local()


@contextlib.contextmanager
def _wait_all():
    """The futures rpc_async returns in this thread inside the block are
    waited for when it ends (the first error raised), as torch's."""
    _thread_local_var.future_list = []
    try:
        yield
    finally:
        try:
            wait_all(_thread_local_var.future_list)
        finally:
            del _thread_local_var.future_list


def _note_future(fut):
    """rpc_async's hook: fut joins the enclosing _wait_all block's, if any."""
    # Its dict (this thread's), not getattr: a miss costs no AttributeError.
    # (future_list is absent outside a block: torch's tests look.)
    futures = _thread_local_var.__dict__.get("future_list")
    if futures is not None:
        futures.append(fut)


# ---- torch's own ----
