"""shmrpc: torch.distributed.rpc's API over shared memory, for one machine.

Change ``import torch.distributed.rpc as rpc`` to ``import shmrpc as rpc``
and start the program with ``shmrun -n N -- python3 prog.py``.

Functions travel by reference (module and qualified name) with pickle, as
torch's default RPC pickler does: define them on both sides. What torch
offers that shmrpc does not do yet raises NotImplementedError saying so.
"""
import os

from . import _core, _shmrpc, server_profiler
from . import backend_registry, constants, profiler  # noqa: F401  (torch's submodules' names)
from . import autograd  # noqa: F401  (shmrpc.autograd)
from . import api
from ._calls import RRef, _owned, _release_owned, remote, rpc_async, rpc_sync  # noqa: F401
from ._core import (UNSET_RPC_TIMEOUT, RemoteException, WorkerInfo,  # noqa: F401
                    _DEFAULT_INIT_METHOD, _DEFAULT_NUM_WORKER_THREADS,
                    _DEFAULT_RPC_TIMEOUT_SEC, _UNSET_RPC_TIMEOUT, _set_rpc_timeout,
                    get_rpc_timeout, get_worker_info, is_available)
from ._futures import Future, collect_all, functions, wait_all  # noqa: F401
from ._marshal import empty  # noqa: F401
from ._serve import _fast, _run_function, _serve_plain
from .api import (  # noqa: F401  (torch's names, as torch.distributed.rpc has them)
    PyRRef, _get_current_rpc_agent, _get_debug_info, _is_current_rpc_agent_set,
    _rref_context_get_debug_info, enable_gil_profiling, shutdown)
from .options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions  # noqa: F401

__all__ = [
    "empty", "init_rpc", "shutdown", "get_worker_info", "WorkerInfo", "rpc_sync",
    "rpc_async", "remote", "RRef", "Future", "RemoteException", "wait_all", "collect_all",
    "functions", "autograd", "BackendType", "RpcBackendOptions", "TensorPipeRpcBackendOptions",
    "get_rpc_timeout", "enable_gil_profiling", "is_available", "install_as_torch",
]


# The process's state that shmrpc._core keeps, readable here too (__getattr__).
_STATE = frozenset(("_initialized", "_joined", "_shut_down", "_rpc_timeout", "_timeout_override"))

# A worker shmrun started: (rank, world size, job inode, inits so far). Its
# first init_rpc joins shmrun's job; each later one (after shutdown) meets
# the job's other workers at a rendezvous named after that job and count.
_shmrun_slot = None


# The job shmrun gave this process when it started (its segment's inode),
# if any: shmrpc.data's loader gives the trainer jobs of its own later.
_START_JOB_INO = os.environ.get("SHMRPC_JOB_INO")


_init_pid = None  # the process that joined (a child forked from it has not)


def init_rpc(name, backend=None, rank=None, world_size=None, rpc_backend_options=None):
    """Joins the job. Under shmrun, rank and world size come from it.
    Elsewhere (torch.multiprocessing.spawn, mp.Process, torchrun's
    convention) the processes meet at rpc_backend_options.init_method
    (env://, the default: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE;
    tcp://HOST:PORT; file://PATH), on this machine (shmrpc._rendezvous)."""
    global _init_pid, _shmrun_slot
    api._check_init_args(backend, rpc_backend_options)
    _core._wait_left()
    _core._rpc_timeout, _core._timeout_override = _DEFAULT_RPC_TIMEOUT_SEC, False
    _core._state_changed()
    joined = None
    if _core._initialized and _init_pid != os.getpid():
        # The C init refuses it too, in its words for C programs.
        raise RuntimeError("init_rpc: this process was forked from a worker whose RPC agent "
                           "was running, and cannot start one: start it with "
                           "multiprocessing's spawn or forkserver method (as "
                           "torch.multiprocessing.spawn does), or fork before init_rpc")
    if _shmrun_slot is not None and not _core._initialized and not _started_by_shmrun():
        from . import _rendezvous
        joined = _join_again(name, rank, world_size, rpc_backend_options)
    elif "SHMRPC_RANK" in os.environ and not _started_by_shmrun():
        from . import _rendezvous
        _rendezvous.clear_env()  # a worker's, inherited: not this process's
    if "SHMRPC_RANK" not in os.environ:
        from . import _rendezvous
        if _core._initialized:
            raise RuntimeError("RPC is already initialized")
        joined = _rendezvous.join(name, rank, world_size, rpc_backend_options)
    try:
        env_rank = int(os.environ.get("SHMRPC_RANK", "-1"))
        env_world = int(os.environ.get("SHMRPC_WORLD_SIZE", "-1"))
        if env_rank < 0:
            raise RuntimeError("init_rpc: this process is not a shmrpc worker: start it with "
                               "shmrun -n N -- python3 prog.py")
        if rank is not None and rank != env_rank:
            raise ValueError(f"init_rpc: rank {rank} given, but shmrun started this worker as rank {env_rank}")
        if world_size is not None and world_size != env_world:
            raise ValueError(f"init_rpc: world_size {world_size} given, but the job has {env_world} workers")
        threads, timeout_ms, maps = 0, 0, []
        if rpc_backend_options is not None:
            threads = int(getattr(rpc_backend_options, "num_worker_threads", 0) or 0)
            t = getattr(rpc_backend_options, "rpc_timeout", None)
            if t is not None:
                timeout_ms = -1 if t == 0 else int(t * 1000)
                _core._rpc_timeout = float(t)
            maps = _device_map_entries(getattr(rpc_backend_options, "device_maps", None) or {})
            _warn_ignored(rpc_backend_options, joined=joined is not None)
        _shmrpc.set_handler(_run_function, _serve_plain, _fast())
        _shmrpc.set_live_release(_release_owned)
        # Initialized before the agent serves: a peer's call can come before
        # init returns here, and the function it runs may call out.
        was, _core._initialized, _init_pid = _core._initialized, True, os.getpid()
        _core._state_changed()
        try:
            _shmrpc.init(name, threads, timeout_ms, maps)
        except BaseException:
            _core._initialized = was
            _core._state_changed()
            raise
    except BaseException:
        if joined is not None:
            joined.leave()
            joined.close_unused()
        raise
    finally:
        if joined is not None:
            _rendezvous.clear_env()
    _core._joined = joined
    if joined is None and _START_JOB_INO and os.environ.get("SHMRPC_JOB_INO") == _START_JOB_INO:
        _shmrun_slot = (env_rank, env_world, _START_JOB_INO, 1)
    elif joined is not None and _shmrun_slot is not None:
        _shmrun_slot = _shmrun_slot[:3] + (_shmrun_slot[3] + 1,)
    api._init_rpc_states()


def _join_again(name, rank, world_size, opts):
    """init_rpc after shutdown in a worker shmrun started (its agent closed
    what shmrun gave): the job's workers meet again at a rendezvous named
    after shmrun's job and how many times they joined, in a new job of
    their own (shmrpc._rendezvous), with shmrun's rank and world size."""
    from . import _rendezvous
    slot_rank, slot_world, job, inits = _shmrun_slot
    if rank is not None and rank != slot_rank:
        raise ValueError(f"init_rpc: rank {rank} given, but shmrun started this worker as rank "
                         f"{slot_rank}")
    if world_size is not None and world_size != slot_world:
        raise ValueError(f"init_rpc: world_size {world_size} given, but the job has "
                         f"{slot_world} workers")
    _rendezvous.clear_env()
    return _rendezvous.join(name, slot_rank, slot_world, opts,
                            key=f"shmrun:{job}:{inits}")


def _started_by_shmrun():
    """Whether shmrun's variables in the environment are this process's:
    a process a worker starts (multiprocessing, a shell) inherits them, but
    is not that worker. Started with its fds closed (mp's spawn), it holds
    another file at SHMRPC_JOB_FD, or none; forked from a worker that had
    joined, init_rpc refuses it; forked before, the C init refuses the
    second of the two to join (its slot is taken)."""
    try:
        st = os.fstat(int(os.environ["SHMRPC_JOB_FD"]))
    except (KeyError, ValueError, OSError):
        return False
    return str(st.st_ino) == os.environ.get("SHMRPC_JOB_INO")


def _device_index(d):
    """The index of a CUDA device of a device map, given as torch takes
    one: an int, a string "cuda:N" or a torch.device."""
    if isinstance(d, int) and not isinstance(d, bool):
        return d
    if isinstance(d, str):
        kind, _, index = d.partition(":")
        index = int(index) if index.isdigit() else None
    else:
        kind, index = getattr(d, "type", None), getattr(d, "index", None)
        if kind is None:
            raise TypeError(f"a device map takes ints, 'cuda:N' strings and torch.device "
                            f"objects, not {type(d).__name__}")
    if kind != "cuda":
        raise ValueError(f"`set_devices` expect a list of CUDA devices, but got device type {kind}.")
    if index is None:
        raise ValueError(f"a device map needs device indices: {d!r} names none (give cuda:N)")
    return index


def _device_map_entries(device_maps):
    """torch's device_maps (a dict: worker name -> {device: device}, as
    TensorPipeRpcBackendOptions and its set_device_map keep them) as
    (name, from, to) triples for the library, which checks them with every
    worker's at init (worker/devmap.h)."""
    return [(str(to), _device_index(k), _device_index(v))
            for to, m in device_maps.items() for k, v in m.items()]


def _warn_ignored(opts, joined=False):
    """One warning naming the backend options set to something shmrpc does
    not use: under shmrun the workers meet through shmrun's shared memory,
    not a rendezvous (a process that joins without shmrun uses
    init_method), and the rings are the only transport. torch's `devices`
    (the devices the agent may use) is not needed either: every device of
    the machine is reachable through CUDA IPC."""
    ignored = [name for name in ("init_method", "devices", "_transports", "_channels")
               if getattr(opts, name, None) not in (None, "env://", [], ())
               and not (joined and name == "init_method")]
    if ignored:
        import warnings
        warnings.warn("shmrpc ignores rpc_backend_options " + ", ".join(ignored) + ": the "
                      "workers of a shmrun job meet and talk through shared memory",
                      stacklevel=3)


def _init_rpc_backend(backend=None, store=None, name=None, rank=-1, world_size=None,
                      rpc_backend_options=None):
    """torch's last step of init_rpc, which torch's tests call with a store
    of their own rendezvous: init_rpc. shmrpc's workers meet at
    rpc_backend_options.init_method, not through the store (which is not
    used)."""
    del store
    init_rpc(name, backend, None if rank is None or rank < 0 else rank, world_size,
             rpc_backend_options)


def _hook_torch():
    from . import as_torch
    as_torch.torch_hooks()


_hook_torch()


def __getattr__(name):
    """The process's RPC state, which shmrpc._core keeps (_initialized,
    _joined...), and torch's _server_process_global_profile, which needs
    torch: made when first asked for (shmrpc.server_profiler)."""
    if name in _STATE:
        return getattr(_core, name)
    if name == "_server_process_global_profile":
        return server_profiler._server_process_global_profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install_as_torch():
    """torch.distributed.rpc, .autograd and DistributedOptimizer resolve to
    shmrpc from now on (shmrpc.as_torch says exactly what is replaced)."""
    from . import as_torch
    as_torch.install()
