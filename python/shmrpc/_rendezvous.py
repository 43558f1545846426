"""init_rpc in a process that shmrun did not start: the rendezvous.

torch's processes meet through an init_method (env://, tcp://host:port,
file://path); shmrpc's meet on one machine, at an abstract unix socket
named after that rendezvous, where the job's keeper hands each one the
job's shared memory (python/_join.c, launcher/keeper.h). This module reads
the rendezvous as torch does, refuses one on another machine, and joins.
"""
import ipaddress
import os
import select
import socket
import sys
import urllib.parse

from . import _shmrpc

_POOL_DEFAULT = 256 << 20  # shmrun's --pool-size default
_JOIN_TIMEOUT_MS = 60000
_KEEPER_END_S = 5.0  # how long a graceful shutdown waits for its keeper's end
_ENV_VARS = ("SHMRPC_RANK", "SHMRPC_WORLD_SIZE", "SHMRPC_JOB_FD", "SHMRPC_POOL_FD",
             "SHMRPC_RREF_FD", "SHMRPC_JOB_INO", "SHMRPC_NAME", "SHMRPC_LOCAL_RANK")

SINGLE_NODE = ("shmrpc is single-node: its workers share memory, so every process of a job "
               "runs on one machine. Point the rendezvous at this machine (MASTER_ADDR="
               "127.0.0.1, or tcp://127.0.0.1:PORT), or use torch.distributed.rpc's TensorPipe "
               "backend for a job that spans machines.")


def _int_env(name):
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"init_rpc: {name}={v!r} is not an integer") from None


def _pool_bytes():
    """SHMRPC_POOL_SIZE (bytes, or with K, M or G), else shmrun's default."""
    v = os.environ.get("SHMRPC_POOL_SIZE", "").strip()
    if not v:
        return _POOL_DEFAULT
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1].upper(), 1)
    try:
        return int(v[:-1] if scale > 1 else v) * scale
    except ValueError:
        raise ValueError(f"SHMRPC_POOL_SIZE={v!r}: give bytes, or a number with K, M or G") from None


def _is_this_machine(host):
    """True when host names one of this machine's addresses: loopback, or
    one a socket can bind to (only a local interface's can be bound)."""
    if host in ("", "localhost"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise RuntimeError(f"init_rpc: cannot resolve the rendezvous host {host!r} ({e}). "
                           + SINGLE_NODE) from None
    for family, _, _, _, addr in infos:
        try:
            if ipaddress.ip_address(addr[0].split("%")[0]).is_loopback:
                return True
        except ValueError:
            pass
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0) if family == socket.AF_INET else (addr[0], 0, 0, addr[3]))
            return True
        except OSError:
            continue
    return False


def _key(init_method):
    """The rendezvous's key (the name of its socket, hashed), with the
    rank and world size its URL gives (torch's ?rank=R&world_size=N)."""
    url = urllib.parse.urlsplit(init_method)
    q = urllib.parse.parse_qs(url.query)
    given = {k: int(v[0]) for k, v in q.items() if k in ("rank", "world_size")}
    if url.scheme == "env":
        host = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        for var, v in (("MASTER_ADDR", host), ("MASTER_PORT", port)):
            if not v:
                raise ValueError(f"Error initializing torch.distributed using env:// rendezvous: "
                                 f"environment variable {var} expected, but not set")
        where = f"MASTER_ADDR={host}"
    elif url.scheme == "tcp":
        host, port = url.hostname, url.port
        if not host or not port:
            raise ValueError(f"init_rpc: init_method {init_method!r}: give tcp://HOST:PORT")
        where = f"init_method {init_method}"
    elif url.scheme == "file":
        path = urllib.parse.unquote(url.netloc + url.path)
        if not path:
            raise ValueError(f"init_rpc: init_method {init_method!r}: give file:///PATH")
        return "file:" + os.path.abspath(path), given
    else:
        raise ValueError(f"init_rpc: init_method {init_method!r}: shmrpc's processes meet "
                         "through env://, tcp://HOST:PORT or file://PATH")
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"init_rpc: port {port!r} of the rendezvous is not a number") from None
    if not _is_this_machine(host):
        raise RuntimeError(f"init_rpc: the rendezvous ({where}) is on another machine. "
                           + SINGLE_NODE)
    # One machine: the port alone names the rendezvous, whichever of the
    # machine's names each process was given.
    return f"tcp:{port}", given


class Joined:
    """This process's place in a job it joined: the keeper's connection,
    open while the process is in the job, and the keeper's pid."""

    def __init__(self, conn, keeper_pid, fds):
        self.conn = conn
        self.keeper_pid = keeper_pid
        # The memfds as received: (number, (device, inode)).
        self.fds = [(fd, _identity(fd)) for fd in fds]

    def close_unused(self):
        """After a failed init: the memfds the agent did not take (it
        closes what it attached; a number reused since names another file)."""
        for fd, ident in self.fds:
            if ident is not None and _identity(fd) == ident:
                os.close(fd)
        self.fds = []

    def leave(self, wait_keeper=False):
        """Leaves the keeper's job. wait_keeper (a graceful shutdown, where
        every worker leaves together): returns once the keeper, whose job
        ends with its last worker, has ended too (at most _KEEPER_END_S),
        so that a launcher waiting for this process finds nothing of the
        job left running."""
        if self.conn is None:
            return
        _shmrpc.leave(self.conn)
        self.conn = None
        if not wait_keeper:
            return
        try:
            fd = os.pidfd_open(self.keeper_pid)
        except OSError:
            return  # ended already
        try:
            select.select([fd], [], [], _KEEPER_END_S)  # readable once it has ended
        finally:
            os.close(fd)


def _python():
    """The interpreter a keeper this process starts runs in (python/_join.c):
    this one, when it is a file that can be run."""
    exe = sys.executable or ""
    return exe if os.path.isabs(exe) and os.access(exe, os.X_OK) else ""


def _identity(fd):
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    except OSError:
        return None


def join(name, rank, world_size, opts, key=None):
    """Meets the job at the rendezvous (opts.init_method's, or key) and
    sets what the agent's init reads (SHMRPC_RANK, SHMRPC_WORLD_SIZE, the
    memfds: see clear_env)."""
    given = {}
    if key is None:
        key, given = _key(getattr(opts, "init_method", None) or "env://")
    if rank is None:
        rank = given.get("rank", _int_env("RANK"))
    if world_size is None:
        world_size = given.get("world_size", _int_env("WORLD_SIZE"))
    if rank is None or world_size is None:
        raise ValueError("init_rpc: rank and world_size are needed outside shmrun: pass "
                         "init_rpc(name, rank=R, world_size=N), or set RANK and WORLD_SIZE "
                         "(env://), or start the program with shmrun -n N -- PROG")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_rpc: rank {rank} is out of range for world_size {world_size}")
    conn, seg, pool, rrefs, keeper = _shmrpc.join(key, rank, world_size, name, _pool_bytes(),
                                                  _JOIN_TIMEOUT_MS, _python())
    os.environ.update({"SHMRPC_RANK": str(rank), "SHMRPC_WORLD_SIZE": str(world_size),
                       "SHMRPC_JOB_FD": str(seg), "SHMRPC_POOL_FD": str(pool),
                       "SHMRPC_RREF_FD": str(rrefs)})
    return Joined(conn, keeper, (seg, pool, rrefs))


def clear_env():
    """After the agent's init: the variables go, so that a process started
    from this one is not taken for a shmrun worker, and a later init_rpc
    (after shutdown) joins again."""
    for var in _ENV_VARS:
        os.environ.pop(var, None)
