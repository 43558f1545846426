"""torch.distributed.rpc.api's names, over shmrpc.

torch's own code and tests reach the RPC layer through this module as
well as through the package: `rpc.api._all_gather`, `_barrier`,
`_wait_all_workers` (the graceful shutdown's first step, which tests
replace), the `_wait_all()` context manager, the current agent
(`_get_current_rpc_agent()`), `_ignore_rref_leak`, `_use_rpc_pickler`.
`shmrpc.install_as_torch()` makes torch.distributed.rpc.api resolve here.

_all_gather works as torch's: the worker with the smallest name leads;
the others send it their object with an RPC (_gather_to_leader), and once
it has them all it sends the whole map back to each (_broadcast_to_followers).
"""
import collections
import logging
import sys
import threading
import time

from . import _core, _marshal, _serve, _shmrpc, autograd, options
from ._calls import RRef, remote, rpc_async, rpc_sync
from ._core import (WorkerInfo, _not_initialized, _not_supported,  # noqa: F401 (torch's)
                    get_rpc_timeout, get_worker_info)
from ._futures import _thread_local_var, _wait_all  # noqa: F401 (torch's)
from ._marshal import _use_rpc_pickler  # noqa: F401 (torch's)
from .constants import DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT

__all__ = ["shutdown", "get_worker_info", "remote", "rpc_sync", "rpc_async", "RRef",
           "AllGatherStates"]

logger = logging.getLogger(__name__)

# torch's name for the RRef type its C++ makes (its RRef subclasses it).
PyRRef = RRef


# torch's switch: False makes a graceful shutdown raise "Leaking RRef ..."
# when another worker still holds an RRef this worker owns after every
# worker's _delete_all_user_and_unforked_owner_rrefs (_shutdown_first).
_ignore_rref_leak = True


def _initialized_now():
    return _core._initialized


_gil_profiling = False


def enable_gil_profiling(flag):
    """torch's switch for the agent's `agent.gil_average_wait_time_us`: the
    executors always count their GIL waits (shmrpc's own
    agent.gil_acquisitions and agent.gil_wait_time_ns report them), and
    the average joins the agent's debug info once this is on, as torch's.
    Off again at each init_rpc."""
    global _gil_profiling
    _gil_profiling = bool(flag)


class _Agent:
    """The part of torch's RpcAgent programs and torch's tests reach through
    _get_current_rpc_agent(): the workers and the agent's debug info."""

    def get_worker_info(self, worker_name=None):
        return get_worker_info(worker_name)

    def get_worker_infos(self):
        return [get_worker_info(r) for r in range(_shmrpc.world_size())]

    def get_debug_info(self):
        """torch's agent keys (agent.*), values as strings; shmrpc's own
        agent.server_pending_calls, agent.calls_served,
        agent.gil_acquisitions, agent.gil_wait_time_ns too."""
        info = {k: str(v) for k, v in _shmrpc.debug_info().items() if k.startswith("agent.")}
        info["agent.server_active_async_calls"] = str(_serve._async_serving)
        if not _gil_profiling:
            del info["agent.gil_average_wait_time_us"]
        return info

    def _get_device_map(self, to):
        raise _not_supported("_get_device_map")


def _is_current_rpc_agent_set():
    return _initialized_now()


def _get_current_rpc_agent():
    if not _initialized_now():
        raise RuntimeError("Current RPC agent is not set! Did you initialize the RPC "
                           "framework (e.g. by calling `rpc.init_rpc`)?")
    return _Agent()


def _rref_context_get_debug_info():
    """torch's RRef context counts for this worker, as strings."""
    info = _shmrpc.debug_info()
    return {k: str(info[k]) for k in ("num_owner_rrefs", "num_pending_futures", "num_forks",
                                      "num_pending_users")}


def _get_debug_info():
    """torch's rpc._get_debug_info() for this worker, with torch's keys and
    value types: the agent's as strings (agent.thread_pool_size,
    agent.num_idle_threads, agent.client_active_calls,
    agent.server_active_calls, agent.server_active_async_calls, and once
    enable_gil_profiling(True) ran agent.gil_average_wait_time_us: how
    long executor threads waited for the GIL before running Python, on
    average, in whole microseconds), the RRef counts as strings
    (num_owner_rrefs, num_pending_futures: owned RRefs still waiting for
    their value, num_forks: other workers holding an owned RRef, one per
    worker and RRef, num_pending_users: forks received and not yet
    confirmed by their owner), and distributed autograd's as ints
    (num_autograd_contexts, num_current_backward_passes). shmrpc's own,
    as strings: agent.server_pending_calls (received, not started),
    agent.calls_served, agent.gil_acquisitions and agent.gil_wait_time_ns
    (their total wait)."""
    if not _initialized_now():
        raise _not_initialized()
    info = _rref_context_get_debug_info()
    info.update(_get_current_rpc_agent().get_debug_info())
    info.update(autograd._debug_info())
    return info


def _init_rpc_states():
    """init_rpc's last step: the worker names _all_gather defaults to, and
    the agent's switches back to their defaults."""
    global _ALL_WORKER_NAMES, _gil_profiling
    _ALL_WORKER_NAMES = {w.name for w in _Agent().get_worker_infos()}
    _gil_profiling = False


def _job_left():
    """shutdown's last step: the next job's gathers count from 0 (each
    init_rpc makes a new job, every worker of which starts there). Not at
    init: a peer's first gather may reach us as soon as our agent serves."""
    with _all_gather_dict_lock:
        _all_gather_sequence_id.clear()
        _all_gather_sequence_id_to_states.clear()


def _delete_all_user_and_unforked_owner_rrefs(timeout=None):
    """torch's second step of a graceful shutdown, which torch's tests
    replace: every reference this worker holds on another worker's RRef
    goes now (its RRef objects hold nothing from then on). The RRefs it
    owns go with its agent, as in every shutdown."""
    if not _initialized_now():
        raise _not_initialized()
    _shmrpc.rref_drop_users()


# ---- _wait_all: every rpc_async of a block waited for at its end ----


class AllGatherStates:
    """One _all_gather's objects by worker name, and the signal that they
    are all there (on the leader: all received; on a follower: the
    leader's map arrived)."""

    def __init__(self):
        self.gathered_objects = {}
        self.proceed_signal = threading.Event()


_ALL_WORKER_NAMES = set()
_all_gather_dict_lock = threading.RLock()


# The number of _all_gathers begun, by their workers' names: the workers
# of one gather number it alike.
_all_gather_sequence_id = {}


_all_gather_sequence_id_to_states = collections.defaultdict(AllGatherStates)


def _gather_to_leader(sequence_id, worker_name, obj, worker_names=None):
    """On the leader: worker_name's object; the signal once all are in."""
    with _all_gather_dict_lock:
        if not worker_names:
            worker_names = _ALL_WORKER_NAMES
            if worker_name not in worker_names:
                raise RuntimeError(f"_all_gather: {worker_name} is not expected by leader "
                                   f"{get_worker_info().name}")
        states = _all_gather_sequence_id_to_states[sequence_id]
        if worker_name in states.gathered_objects:
            raise RuntimeError(f"_all_gather: {worker_name} reported intent sequence id "
                               f"{sequence_id} twice")
        states.gathered_objects[worker_name] = obj
        if set(worker_names) == set(states.gathered_objects):
            states.proceed_signal.set()


def _broadcast_to_followers(sequence_id, objects_map):
    """On a follower: the leader's map of every worker's object."""
    with _all_gather_dict_lock:
        states = _all_gather_sequence_id_to_states[sequence_id]
    if states.proceed_signal.is_set():
        raise RuntimeError(f"_all_gather: sequence id {sequence_id} was signalled twice")
    states.gathered_objects = objects_map
    states.proceed_signal.set()


# How often a gather's wait looks for the workers it waits for having gone.
_WATCH_S = 0.05


def _wait_for(states, timeout, names):
    """Waits until states' signal is set: True, or False once timeout
    seconds (None: no limit) passed. Raises RuntimeError as soon as one of
    the workers names has died or left the job, which torch's waits would
    not notice."""
    ranks = [get_worker_info(n).id for n in names]
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step = _WATCH_S if deadline is None else min(_WATCH_S, deadline - time.monotonic())
        if step <= 0:
            return states.proceed_signal.is_set()
        if states.proceed_signal.wait(step):
            return True
        for r in ranks:
            gone = _shmrpc.peer_gone(r)
            if gone is not None:
                raise RuntimeError(f"_all_gather on {get_worker_info().name} cannot complete: "
                                   f"{gone[1]}")


def _all_gather(obj, worker_names=None, timeout=UNSET_RPC_TIMEOUT):
    """{worker name: obj} of every worker of worker_names (all by default),
    each of which calls this; as torch's. timeout: the RPCs' and the
    wait's, in seconds (unset: the default RPC timeout and no limit on the
    wait; 0: none)."""
    if not _initialized_now():
        raise _not_initialized()
    worker_names = set(worker_names or _ALL_WORKER_NAMES)
    leader_name = min(worker_names)
    self_name = get_worker_info().name

    with _all_gather_dict_lock:
        concat_names = "".join(sorted(worker_names))
        sequence_num = _all_gather_sequence_id.get(concat_names, 0)
        _all_gather_sequence_id[concat_names] = sequence_num + 1
        sequence_id = concat_names + str(sequence_num)

    if timeout == UNSET_RPC_TIMEOUT:
        rpc_timeout, signal_timeout = get_rpc_timeout(), None
    elif timeout == DEFAULT_SHUTDOWN_TIMEOUT:
        rpc_timeout, signal_timeout = timeout, None
    else:
        rpc_timeout = signal_timeout = timeout

    is_leader = leader_name == self_name
    if is_leader:
        _gather_to_leader(sequence_id, self_name, obj, worker_names)
    else:
        rpc_sync(leader_name, _gather_to_leader, args=(sequence_id, self_name, obj, worker_names),
                 timeout=rpc_timeout)

    with _all_gather_dict_lock:
        states = _all_gather_sequence_id_to_states[sequence_id]
    try:
        # Any worker of the gather gone: the leader cannot complete it.
        if not _wait_for(states, signal_timeout, worker_names - {self_name}):
            missing = sorted(worker_names - set(states.gathered_objects)) if is_leader \
                else [leader_name]
            raise RuntimeError(f"_all_gather on {self_name} timed out after "
                               f"{signal_timeout:.2f} seconds waiting for {missing}")
    except RuntimeError:
        with _all_gather_dict_lock:
            _all_gather_sequence_id_to_states.pop(sequence_id, None)
        raise

    if is_leader:
        futures = {name: rpc_async(name, _broadcast_to_followers,
                                   args=(sequence_id, states.gathered_objects),
                                   timeout=rpc_timeout)
                   for name in sorted(worker_names - {leader_name})}
        errors = []
        for name, fut in futures.items():
            try:
                fut.wait()
            except RuntimeError as e:
                errors.append((name, e))
        if errors:
            raise RuntimeError(f"Followers {[e[0] for e in errors]} timed out in _all_gather "
                               f"after {rpc_timeout:.2f} seconds. The first exception is "
                               f"{errors[0][1]}")

    with _all_gather_dict_lock:
        states = _all_gather_sequence_id_to_states.pop(sequence_id)
    return states.gathered_objects


def _barrier(worker_names):
    """Returns once every worker of worker_names called it (a failure is
    logged, as torch's)."""
    if not _initialized_now():
        raise _not_initialized()
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError as e:
        logger.error(f"Failed to complete barrier, got error {e}")


def _shutdown_first(graceful, timeout):
    """shutdown's first steps, as torch's when graceful: _wait_all_workers,
    _delete_all_user_and_unforked_owner_rrefs (both of which programs and
    torch's tests replace), then, unless _ignore_rref_leak, a second
    gather (torch's agent join: every worker has dropped its references)
    and the leak check. Returns the leak check's text ("": none)."""
    if not graceful:
        return ""
    if not _gather_at_shutdown(timeout):
        # Cut short by a death, as torch's would fail: the others may still
        # run, and this worker's references go with its agent, as always.
        return ""
    _delete_all_user_and_unforked_owner_rrefs()
    if _ignore_rref_leak or not _gather_at_shutdown(timeout):
        return ""
    return _shmrpc.rref_leaks()


def _gather_at_shutdown(timeout):
    """_wait_all_workers, where a worker that died is not an error: the
    agent's own shutdown barrier, next, counts it out, as shmrpc's shutdown
    always has. False when a death cut the gather short."""
    try:
        _wait_all_workers(timeout)
    except RuntimeError:
        gone = [_shmrpc.peer_gone(r) for r in range(_shmrpc.world_size())]
        if not any(g is not None and g[0] for g in gone):
            raise
        return False
    return True


def _wait_all_workers(timeout=DEFAULT_SHUTDOWN_TIMEOUT):
    """Returns once every worker called it: a graceful shutdown's first step."""
    if not _initialized_now():
        raise _not_initialized()
    try:
        _all_gather(None, timeout=timeout)
    except RuntimeError as e:
        logger.error(f"Failed to respond to 'Shutdown Proceed' in time, got error {e}")
        raise



# ---- init_rpc's arguments ----


_OPTION_NAMES = ("rpc_timeout", "init_method", "num_worker_threads", "device_maps")


# torch's C++ base classes of its options (torch's TensorPipeRpcBackendOptions
# is a Python subclass of the second).
_TORCH_OPTIONS_BASES = {"RpcBackendOptions": "RpcBackendOptions",
                        "TensorPipeRpcBackendOptions": "_TensorPipeRpcBackendOptionsBase"}


def _options_types(name):
    """shmrpc's options class of that name, and torch's where torch is loaded
    (a program may build torch's own TensorPipeRpcBackendOptions)."""
    types = [getattr(options, name)]
    torch_rpc = sys.modules.get("torch._C._distributed_rpc")
    torch_type = getattr(torch_rpc, _TORCH_OPTIONS_BASES[name], None)
    if torch_type is not None:
        types.append(torch_type)
    return tuple(types)


def _check_init_args(backend, rpc_backend_options):
    """torch's checks of init_rpc's backend and options, in its words: the
    backend a BackendType member; the options an RpcBackendOptions (shmrpc's
    or torch's; or, shmrpc's own leniency, any object with attributes among
    those shmrpc reads), from which a missing backend must be inferable."""
    import enum
    if backend is not None and not (isinstance(backend, enum.Enum)
                                    and type(backend).__name__ == "BackendType"):
        raise TypeError("Argument backend must be a member of BackendType")
    opts = rpc_backend_options
    if opts is None:
        return
    if isinstance(opts, _options_types("RpcBackendOptions")):
        if backend is None and not isinstance(opts, _options_types("TensorPipeRpcBackendOptions")):
            raise TypeError(f"Could not infer backend for options {opts}")
    elif not any(hasattr(opts, name) for name in _OPTION_NAMES):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")


def shutdown(graceful=True, timeout=0):
    """Graceful: waits until every worker is done (api._wait_all_workers,
    then the agent's barrier), then all leave together."""
    try:
        try:
            leaks = _shutdown_first(graceful, timeout)
        except BaseException:
            _shmrpc.shutdown(False, 0)  # torch's: the local shutdown, then the error
            raise
        _shmrpc.shutdown(bool(graceful), int(timeout * 1000) if timeout else 0)
        if leaks:
            # torch's RRefContext::checkRRefLeaks, raised after the local
            # shutdown as torch's _finalize_shutdown does.
            raise RuntimeError(leaks)
    finally:
        # The agent is gone either way: a process that joined leaves its
        # keeper's job (the keeper releases what it still held there).
        joined, _core._joined = _core._joined, None
        if joined is not None:
            joined.leave(wait_keeper=bool(graceful))
        _core._initialized = False
        _core._state_changed()
        _core._shut_down = True
        _job_left()


def __getattr__(name):
    """torch's api._default_pickler: the pickler in effect, which
    shmrpc._marshal keeps (the calls check it; _use_rpc_pickler sets it)."""
    if name == "_default_pickler":
        return _marshal._default_pickler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
