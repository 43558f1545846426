"""The process's RPC state, and what every layer of the package uses:
worker names and ranks, timeouts, the errors it raises. The lowest Python
layer (docs/ARCHITECTURE.md, "The Python package"): it imports no other
module of the package but the C half and the constants.
"""
import atexit
import os
import sys

from . import _shmrpc, constants

UNSET_RPC_TIMEOUT = constants.UNSET_RPC_TIMEOUT  # torch's sentinel: the default timeout
_UNSET_RPC_TIMEOUT = UNSET_RPC_TIMEOUT
_DEFAULT_RPC_TIMEOUT_SEC = constants.DEFAULT_RPC_TIMEOUT_SEC
_DEFAULT_INIT_METHOD = constants.DEFAULT_INIT_METHOD
_DEFAULT_NUM_WORKER_THREADS = constants.DEFAULT_NUM_WORKER_THREADS


# The default timeout in seconds (0: none): the backend options', or one
# _set_rpc_timeout set; _timeout_override says the latter (the calls then
# name it, instead of the agent's default that init set).
_rpc_timeout = _DEFAULT_RPC_TIMEOUT_SEC


_timeout_override = False
_initialized = False
_joined = None  # shmrpc._rendezvous.Joined: this process joined without shmrun
_shut_down = False  # shutdown ran once in this process
# A data loader's job that this process is leaving in a thread of its own
# after its epoch (shmrpc._data_job): a lock that thread holds until it is
# done. Until then this process is still in that job, so init_rpc, the next
# loader's start and the interpreter's exit wait for it (_wait_left).
_leaving = None
# What that thread raised, set before it releases the lock: a bare thread's
# exception would only be printed as unraisable, so _wait_left raises it.
_leave_error = None


def _wait_left():
    """Returns once no loader's job is being left in the background; raises
    what went wrong in that leave."""
    global _leaving, _leave_error
    leaving, _leaving = _leaving, None
    if leaving is not None:
        leaving.acquire()
    err, _leave_error = _leave_error, None
    if err is not None:
        raise RuntimeError(
            "shmrpc.data: leaving the last epoch's loader job (workers not persistent), "
            f"done in the background after its last batch, failed: {type(err).__name__}: "
            f"{err}. That epoch's batches were all delivered; the error is raised here, at "
            "the next point that waits for that leave (a loader's start, init_rpc or the "
            "interpreter's exit)") from err


def _wait_left_at_exit():
    """The interpreter's exit: as _wait_left, its error printed with the
    leave's traceback (atexit would print it as "Exception ignored")."""
    try:
        _wait_left()
    except RuntimeError:
        import traceback
        print("shmrpc: at the interpreter's exit:", file=sys.stderr)
        traceback.print_exc()


def _forget_leaving():
    """In a child forked meanwhile: the thread leaving is the parent's."""
    global _leaving, _leave_error
    _leaving = _leave_error = None


atexit.register(_wait_left_at_exit)
os.register_at_fork(after_in_child=_forget_leaving)


class WorkerInfo:
    """A worker's name and rank (torch's WorkerInfo: .name, .id)."""

    __slots__ = ("name", "id")

    def __init__(self, name, id):
        # torch's check of a WorkerInfo made by hand (the job's own names
        # are checked when workers join).
        if not (0 < len(name) < 128) or not all(c.isascii() and (c.isalnum() or c in "-_:")
                                                for c in name):
            raise RuntimeError("Worker name must match ^[A-Za-z0-9-_:]*$, and must be "
                               f"non-empty and shorter than 128 chars, but got {name}")
        self.name = name
        self.id = id

    @classmethod
    def _of(cls, name, id):
        """A job's worker, as the job names it (no check)."""
        info = cls.__new__(cls)
        info.name, info.id = name, id
        return info

    def __eq__(self, other):
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self):
        return hash((self.name, self.id))

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, name={self.name})"


class RemoteException:
    """An exception raised by a remote function, as it travels back."""

    def __init__(self, msg, exception_type):
        self.msg = msg
        self.exception_type = exception_type


class _RpcTimeout(TimeoutError, RuntimeError):
    """A call or an RRef that ran out of time: torch raises RuntimeError for
    it, the C half TimeoutError; this is both, so either except catches it."""


def _c_wait(wait, *args):
    """The C half's wait(*args), its timeout raised as _RpcTimeout."""
    try:
        return wait(*args)
    except TimeoutError as e:
        raise _RpcTimeout(*e.args) from None


def _not_supported(what):
    return NotImplementedError(f"{what} is not supported yet by shmrpc")


def _not_initialized():
    return RuntimeError("RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.")


def _timeout_ms(timeout):
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        if not _timeout_override:
            return _shmrpc.TIMEOUT_DEFAULT
        timeout = _rpc_timeout
    if timeout == 0:
        return 0  # no timeout, as torch's 0
    if timeout < 0:
        raise ValueError(f"timeout {timeout}: give seconds above 0, 0 for none, or leave it unset")
    return max(1, int(timeout * 1000))


def is_available():
    return True


def get_rpc_timeout():
    """The default timeout of calls, in seconds (0: none), as torch's."""
    return _rpc_timeout


def _set_rpc_timeout(rpc_timeout):
    """Sets the default timeout of calls made from now on, in seconds (0:
    none), as torch's private helper (its tests use it)."""
    global _rpc_timeout, _timeout_override
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout {rpc_timeout}: give seconds, 0 for none")
    _rpc_timeout, _timeout_override = float(rpc_timeout), True
    _state_changed()


def _state_changed():
    """Tells the calls made in C (python/_calls.c, state_common) whether
    the state now lets a call be the common one: initialized, no timeout of
    _set_rpc_timeout's, the default pickler checked (_marshal._pickler_ok).
    Whoever changes _initialized, _timeout_override, _marshal._default_pickler
    or _marshal._pickler_ok calls it after: C reads one flag, not the four
    module attributes, on every call."""
    marshal = sys.modules.get(__package__ + "._marshal")
    _shmrpc.set_call_state(_initialized and not _timeout_override and marshal is not None
                           and marshal._default_pickler is marshal._pickler_ok)


def _worker(who, ask=_shmrpc.worker_info):
    """ask(who): by default (name, rank) of a worker name or rank (None:
    this worker); an unknown name in torch's words too."""
    if not _initialized:
        raise _not_initialized()
    try:
        return ask(who)
    except RuntimeError as e:
        if isinstance(who, str):
            raise RuntimeError(f"could not find destination {who}: {e}") from None
        raise


def get_worker_info(worker_name=None):
    return WorkerInfo._of(*_worker(worker_name))


def _rank_of(to):
    # A name first: most calls are addressed so, and each asks for the rank.
    if isinstance(to, str):
        return _worker(to, _shmrpc.rank_of)
    if isinstance(to, WorkerInfo):
        return to.id
    if isinstance(to, int) and not isinstance(to, bool):
        return to
    if isinstance(to, float):
        raise ValueError(f"to {to}: a rank is a whole number")
    raise TypeError(f"to must be a worker name, a rank or a WorkerInfo, not {type(to).__name__}")


_torch_api_module = None  # torch's torch.distributed.rpc.api, once shmrpc's replaced it


def _torch_api():
    """torch's own torch.distributed.rpc.api module, if loaded."""
    here = sys.modules.get("torch.distributed.rpc.api")
    return _torch_api_module if here is None or here is sys.modules.get("shmrpc.api") else here


# ---- the pickler ----
