# shmrun: none
"""init_rpc in processes that shmrun did not start (issue 19): each way
torch's processes meet, on one machine. mp.Process children (fork and
spawn), torchrun's convention (processes started with RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT and calling init_rpc(name) alone),
file:// and tcp:// init methods; a SIGKILLed rank under each route fails
the calls pending on it, naming it; world_size=1; duplicate names refused
with torch's text, duplicate ranks refused; a rendezvous on another host
refused with a sentence saying shmrpc is single-node; rank and world_size
missing; a world_size that is not the job's; a keeper whose starter
ended before anyone joined ends with it; init_rpc again after
shutdown; a segment header overwritten while the job runs stops it, as
shmrun's watch would (the keeper's). After each case no process is left (children joined, the job's
keeper gone) and nothing is left in /dev/shm or as a socket.
(tests/python/test_join_torch.py: torch.multiprocessing.spawn.)"""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import types

import pytest

import shmrpc as rpc

HERE = os.path.dirname(os.path.abspath(__file__))
WAIT = 60  # seconds a child may take


@pytest.fixture(autouse=True, scope="module")
def stop_resource_tracker():
    """The spawn start method starts multiprocessing's resource tracker,
    which outlives the module otherwise (a process left behind)."""
    yield
    from multiprocessing import resource_tracker
    resource_tracker._resource_tracker._stop()


def add(a, b):
    return a + b


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def opts(init_method):
    return types.SimpleNamespace(init_method=init_method) if init_method else None


def run_case(rank, world, init_method, case, q, name=None):
    """One worker: joins, runs its case, says how it went on q."""
    out = {"rank": rank}
    try:
        kwargs = {} if rank is None else {"rank": rank, "world_size": world}
        rank = int(os.environ["RANK"]) if rank is None else rank
        out["rank"] = rank
        if case == "reinit":
            # torch's tests init_rpc again after shutdown in one process:
            # each round is a new job, with a new keeper. The names turn
            # round by round: "w0" (one str object, as a program's
            # constant) names another rank in each round's job.
            out["rounds"], out["w0"] = [], []
            for i in range(3):
                rpc.init_rpc(f"w{(rank + i) % world}", rpc_backend_options=opts(init_method),
                             **kwargs)
                out["keeper"] = rpc._joined.keeper_pid
                out["rounds"].append(rpc.rpc_sync((rank + 1) % world, add, args=(rank, i)))
                out["w0"].append(rpc.rpc_sync("w0", os.getpid))
                out.setdefault("pids", []).append(os.getpid())
                rpc.shutdown()
                out.setdefault("keepers", []).append(out["keeper"])
            out["ok"] = True
            q.put(out)
            return
        rpc.init_rpc(name or f"w{rank}", rpc_backend_options=opts(init_method), **kwargs)
        out["keeper"] = rpc._joined.keeper_pid
        out["env_clear"] = "SHMRPC_RANK" not in os.environ and "SHMRPC_JOB_FD" not in os.environ
        if case == "ring":
            out["result"] = rpc.rpc_sync(f"w{(rank + 1) % world}", add, args=(rank, 100))
            out["info"] = (rpc.get_worker_info().name, rpc.get_worker_info().id)
        elif case == "scribble":
            # The keeper's watch: worker 0 overwrites the header's world
            # size, as a stray process could; the keeper stops the job.
            if rank == 0:
                scribble_world_size(77)
            time.sleep(WAIT)  # its SIGTERM ends us
        elif case == "death" and rank == 0:
            # Rank 1 kills itself serving this call: it fails, naming rank 1.
            q.put({"rank": 0, "keeper": out["keeper"], "pending": True})
            try:
                rpc.rpc_sync("w1", die)
                out["error"] = "no error"
            except Exception as e:  # noqa: BLE001
                out["error"] = str(e)
            # A call to it now: rpc_async's Future holds the error (as torch's).
            fut = rpc.rpc_async("w1", add, args=(1, 2))
            try:
                fut.wait()
                out["later"] = "no error"
            except RuntimeError as e:
                out["later"] = str(e)
        rpc.shutdown()
        out["ok"] = True
    except BaseException as e:  # noqa: BLE001
        out["exc"] = f"{type(e).__name__}: {e}"
    out["memfds"] = memfds()
    q.put(out)


def scribble_world_size(value):
    """Writes the job segment's header field world_size (shm/layout.h: at
    byte 24) through this process's memfd of the segment."""
    import mmap
    import struct
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shmrpc-job"):
                with mmap.mmap(int(fd), 4096) as m:
                    m[24:28] = struct.pack("<I", value)
                return
        except OSError:
            pass
    raise AssertionError("no memfd of the job's segment")


def memfds():
    """The job memfds this process still holds (none once it has left)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return n


def torchrun_main():
    """A process started as torchrun starts one: everything in the environment."""
    import json
    q = types.SimpleNamespace(items=[], put=lambda x: q.items.append(x))
    run_case(None, int(os.environ["WORLD_SIZE"]), None, os.environ["JOIN_CASE"], q)
    print("RESULT " + json.dumps(q.items), flush=True)


def keeper_gone(pid, timeout=10):
    """The job's keeper exits once its last worker has gone."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # exited; its reaper collects it
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def sock_name(key):
    """The keeper's abstract socket for a rendezvous key (launcher/keeper.c)."""
    h = 0xcbf29ce484222325
    for b in key.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xffffffffffffffff
    return f"@shmrpc-{os.getuid()}-{h:016x}"


def key_of(init_method, port, tmp_path=None):
    if init_method == "file":
        return f"file:{tmp_path}/rendezvous"
    return f"tcp:{port}"


def nothing_left(keepers, keys=()):
    """The keepers have exited and no socket of these rendezvous is left
    (other jobs may run on the machine meanwhile: only ours are looked at)."""
    for pid in keepers:
        assert keeper_gone(pid), f"the job's keeper (pid {pid}) is still running"
    # A keeper whose pid the case did not learn (a refused init) goes with
    # its sockets, a moment after its last worker.
    names = {sock_name(k) for k in keys}
    end = time.monotonic() + 10
    while True:
        with open("/proc/net/unix") as f:
            socks = [line for line in f if line.split()[-1] in names]
        if not socks or time.monotonic() > end:
            break
        time.sleep(0.02)
    assert not socks, f"rendezvous sockets left: {socks}"
    # /dev/shm: the runner compares it before and after the module (other
    # jobs on the machine may have files there meanwhile); the job's
    # memory is memfds, and test cases check that no process holds one.


def run_procs(ctx, world, init_method, case, names=None, reports_due=None):
    """world mp.Process children; their reports (reports_due of them, one
    per rank by default) and exit codes."""
    q = ctx.Queue()
    procs = [ctx.Process(target=run_case,
                         args=(r, world, init_method, case, q, names[r] if names else None))
             for r in range(world)]
    for p in procs:
        p.start()
    reports = []
    try:
        while len(reports) < (world if reports_due is None else reports_due):
            reports.append(q.get(timeout=WAIT))
    finally:
        for p in procs:
            p.join(WAIT)
            if p.exitcode is None:
                p.kill()
                p.join()
    return reports, [p.exitcode for p in procs]


def final(reports):
    """The last report of each rank."""
    return {r["rank"]: r for r in reports}


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("init_method", [None, "tcp", "file"])
def test_ring(start, init_method, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    im = {None: None, "tcp": f"tcp://localhost:{port}",
          "file": f"file://{tmp_path}/rendezvous"}[init_method]
    keys = [key_of(init_method, port, tmp_path)]
    reports, codes = run_procs(mp.get_context(start), 3, im, "ring")
    got = final(reports)
    assert codes == [0, 0, 0], (codes, reports)
    for r in range(3):
        assert got[r].get("ok"), got[r]
        assert got[r]["result"] == r + 100
        assert got[r]["info"] == (f"w{r}", r)
        assert got[r]["env_clear"]
        assert got[r]["memfds"] == 0, got[r]
    assert len({got[r]["keeper"] for r in range(3)}) == 1  # one keeper for the job
    nothing_left({got[0]["keeper"]}, keys)


@pytest.mark.parametrize("init_method", [None, "tcp", "file"])
def test_death(init_method, tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    im = {None: None, "tcp": f"tcp://127.0.0.1:{port}",
          "file": f"file://{tmp_path}/rendezvous"}[init_method]
    keys = [key_of(init_method, port, tmp_path)]
    # rank 0's "pending" and the final reports of ranks 0 and 2 (rank 1 dies)
    reports, codes = run_procs(mp.get_context("fork"), 3, im, "death", reports_due=3)
    got = {r["rank"]: r for r in reports if not r.get("pending")}
    assert codes == [0, -signal.SIGKILL, 0], (codes, reports)
    assert got[0].get("ok") and got[2].get("ok"), reports
    assert "worker 1 (w1)" in got[0]["error"] and "died" in got[0]["error"], got[0]
    assert "worker 1 (w1)" in got[0]["later"], got[0]
    nothing_left({got[0]["keeper"]}, keys)


def start_torchrun_style(world, port, case, extra_env=None):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               JOIN_CASE=case, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    procs = []
    for r in range(world):
        env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c",
                                       "import test_join; test_join.torchrun_main()"],
                                      env=env_r, stdout=subprocess.PIPE, text=True))
    return procs


def collect(procs):
    import json
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        codes.append(p.returncode)
        for line in out.splitlines():
            if line.startswith("RESULT "):
                outs += json.loads(line[7:])
    return outs, codes


def test_torchrun_convention():
    port = free_port()
    procs = start_torchrun_style(3, port, "ring")
    reports, codes = collect(procs)
    got = final(reports)
    assert codes == [0, 0, 0], (codes, reports)
    for r in range(3):
        assert got[r].get("ok"), got[r]
        assert got[r]["result"] == r + 100
    nothing_left({got[0]["keeper"]}, [f"tcp:{port}"])


def test_torchrun_convention_death():
    port = free_port()
    procs = start_torchrun_style(3, port, "death")
    reports, codes = collect(procs)
    got = {r["rank"]: r for r in reports if not r.get("pending")}
    assert codes == [0, -signal.SIGKILL, 0], (codes, reports)
    assert "worker 1 (w1)" in got[0]["error"], got[0]
    nothing_left({got[0]["keeper"]}, [f"tcp:{port}"])


def test_keeper_watches_header(tmp_path):
    port = free_port()
    err = tmp_path / "stderr"
    with open(err, "w") as f:  # the keeper's stderr is its starter's
        procs = [subprocess.Popen([sys.executable, "-c", "import test_join; test_join.torchrun_main()"],
                                  env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                           WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r),
                                           JOIN_CASE="scribble",
                                           PYTHONPATH=os.pathsep.join([HERE, os.environ.get(
                                               "PYTHONPATH", "")])),
                                  stdout=subprocess.PIPE, stderr=f, text=True) for r in range(2)]
        _, codes = collect(procs)
    assert codes == [-signal.SIGTERM] * 2, (codes, err.read_text())
    nothing_left((), [f"tcp:{port}"])
    text = err.read_text()
    assert ("shmrpc keeper: the segment header is corrupt: its world_size is not what shmrpc "
            "keeper wrote") in text and "the job is stopped" in text, text


def test_world_size_one(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    reports, codes = run_procs(mp.get_context("fork"), 1, None, "ring")
    assert codes == [0] and reports[0].get("ok") and reports[0]["result"] == 100, reports
    nothing_left({reports[0]["keeper"]}, [f"tcp:{port}"])


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_reinit_after_shutdown(start, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    reports, codes = run_procs(mp.get_context(start), 2, None, "reinit")
    got = final(reports)
    assert codes == [0, 0], (codes, reports)
    for r in range(2):
        assert got[r].get("ok"), got[r]
        assert got[r]["rounds"] == [r + i for i in range(3)], got[r]
    # Round i's w0 is rank -i mod 2.
    for r in range(2):
        assert got[r]["w0"] == [got[-i % 2]["pids"][i] for i in range(3)], got
    nothing_left(set(got[0]["keepers"]) | set(got[1]["keepers"]), [f"tcp:{port}"])


def test_duplicate_names(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    # Ranks 0 and 2 share a name: every rank is refused with torch's text,
    # those in the job when the second knocks and rank 3, which comes after.
    names = ["same", "w1", "same", "w3"]
    procs = [ctx.Process(target=run_case, args=(r, 4, None, "ring", q, names[r]))
             for r in range(4)]
    for p in procs[:3]:
        p.start()
    reports = [q.get(timeout=WAIT) for _ in range(3)]
    procs[3].start()
    reports.append(q.get(timeout=WAIT))
    for p in procs:
        p.join(WAIT)
    assert [p.exitcode for p in procs] == [0] * 4, reports
    excs = {r["rank"]: r.get("exc", "") for r in reports}
    text = "RPC worker name same is not unique. Workers {} and {} share the same name."
    for r in range(4):
        assert text.format(0, 2) in excs[r] or text.format(2, 0) in excs[r], (r, excs)
    assert [r["memfds"] for r in reports] == [0] * 4, reports  # a failed init keeps none
    nothing_left(set(), [f"tcp:{port}"])


def test_duplicate_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    # Two processes claim rank 0 of a job of 2: the second is refused while
    # the first waits for rank 1, which comes after that (had it come
    # before, the job could be over by the time the second knocks, and a
    # knock after a job is a new job's).
    procs = [ctx.Process(target=run_case, args=(r, 2, None, "ring", q, f"n{i}"))
             for i, r in enumerate([0, 0, 1])]
    procs[0].start()
    procs[1].start()
    reports = [q.get(timeout=WAIT)]
    procs[2].start()
    reports += [q.get(timeout=WAIT) for _ in range(2)]
    for p in procs:
        p.join(WAIT)
    excs = [r.get("exc", "") for r in reports]
    assert sum("has already joined this rendezvous" in e for e in excs) == 1, reports
    nothing_left({r["keeper"] for r in reports if "keeper" in r}, [f"tcp:{port}"])


@pytest.mark.parametrize("how", ["env", "tcp"])
def test_other_host(how, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")  # TEST-NET-1: never this machine
    monkeypatch.setenv("MASTER_PORT", "29500")
    im = None if how == "env" else "tcp://192.0.2.7:29500"
    with pytest.raises(RuntimeError, match="shmrpc is single-node") as e:
        rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=opts(im))
    assert "192.0.2.7" in str(e.value) and "TensorPipe" in str(e.value)
    assert "SHMRPC_RANK" not in os.environ
    nothing_left(set(), ["tcp:29500"])


def test_missing_rank(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="rank and world_size are needed outside shmrun"):
        rpc.init_rpc("w0")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="MASTER_PORT expected, but not set"):
        rpc.init_rpc("w0", rank=0, world_size=2)
    nothing_left(set(), ["tcp:29500"])


def test_world_size_mismatch(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    first = ctx.Process(target=run_case, args=(0, 2, None, "ring", q))
    first.start()
    try:
        # Its keeper is up once the rendezvous's socket is.
        end = time.monotonic() + WAIT
        while time.monotonic() < end:
            with open("/proc/net/unix") as f:
                if any(line.split()[-1] == sock_name(f"tcp:{port}") for line in f):
                    break
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="world_size 3, but the job at this rendezvous "
                                               "has 2 workers"):
            rpc.init_rpc("w1", rank=1, world_size=3)
        assert "SHMRPC_RANK" not in os.environ
    finally:
        # It waits for a rank 1 that never comes, or has not had its own
        # knock taken yet (the keeper then ends with it: test_starter_gone_before_join).
        first.kill()
        first.join()
    nothing_left(set(), [f"tcp:{port}"])


def start_keeper_only(key, q):
    """A first worker whose join times out right after it started the
    keeper, before it knocked (as one killed there would): it says whether
    the keeper's socket was up, and exits."""
    from shmrpc import _rendezvous, _shmrpc
    try:
        _shmrpc.join(key, 0, 2, "w0", _rendezvous._pool_bytes(), 0, _rendezvous._python())
        q.put("joined")
    except TimeoutError:
        with open("/proc/net/unix") as f:
            q.put(any(line.split()[-1] == sock_name(key) for line in f))


def test_starter_gone_before_join():
    # The keeper ends with the worker that started it when nobody joined:
    # the race test_world_size_mismatch loses under load (its rank 1 heard
    # the refusal, and its first process was killed, before the keeper
    # took the first's knock) left the keeper waiting 60 s for anyone.
    key = f"tcp:{free_port()}"
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    first = ctx.Process(target=start_keeper_only, args=(key, q))
    first.start()
    try:
        assert q.get(timeout=WAIT) is True  # its keeper is up, nobody in the job
    finally:
        first.join()
    nothing_left(set(), [key])
