"""Where a Python call's time goes, phase by phase, in a real two-worker
job: no perf needed (the 16-core device machine has none). Prints

  BENCH py_phases op=rpc_sync|remote_to_here|echo mode=MODE calls= total_ns=
        caller_send_ns= to_callee_ns= queued_ns= callee_in_ns= callee_out_ns=
        to_caller_ns= caller_return_ns= python_pct=

Rank 0 makes empty calls to rank 1 (rpc_sync, and remote()+to_here() of
None with its RRef dropped), and with torch the rpc_sync echo of a 1 KiB
tensor of the pool (shmrpc.empty), in batches, each call between two
time.perf_counter_ns() stamps; the function called stamps when it runs.
After each batch both workers' flight recorders are read
(shmrpc-inspect --json --trace) and each call's records found by its
message id; the recorder's times and Python's stamps are both
CLOCK_MONOTONIC. The phases, medians over the calls:

  caller_send    the caller's Python and C until the request is sent (SENT)
  to_callee      the request's hand-off, until the callee took it
                 (RECEIVED, or recv+start)
  queued         waiting for an executor (RECEIVED to STARTED; 0 for a
                 request run at once, whose one record, recv+start, is
                 its arrival)
  callee_in      the executor's work until the function runs: the GIL,
                 the handler's arguments, the payload unpacked (STARTED,
                 or recv+start, to the function's stamp)
  callee_out     from the function's stamp until the reply is sent: its
                 result pickled, the handler's return, the reply copied
                 (FINISHED)
  to_caller      the reply's hand-off, until the caller took it (COMPLETED)
  caller_return  from there to the call's return: the waiting thread's
                 wake-up, the GIL, the result unpacked (and for
                 remote_to_here, to_here and the RRef's drop; in spin
                 mode its to_here returns on the RRef entry's READY, before
                 the reply is taken, and to_caller runs to the return)

The medians of the phases need not add up to total_ns's, each a median of
its own. python_pct: caller_send, callee_in, callee_out and caller_return
(the phases holding the two sides' Python and the binding's C) over the
sum of all the phases' medians. A phase's floor on the C side is
bench/rpc's (its flight_recorder lines time the same records).

Run by bench/run.sh (every bench/*.py) with Debian's /usr/bin/python3;
the build is $SHMRPC_BUILD (default build). -q: fewer calls; --wait MODE:
the job's wait mode (default: shmrun's default, then spin).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from shmrpcjob import package_build, run_job  # noqa: E402

BATCH = 100  # calls between two reads of the recorders: a thread's lane keeps 512 records

STAMPS = []  # rank 1: when each call's function ran


def stamp():
    STAMPS.append(time.perf_counter_ns())


def stamp_echo(t):
    STAMPS.append(time.perf_counter_ns())
    return t


def take_stamps():
    out = STAMPS[:]
    del STAMPS[:]
    return out


PHASES = ("caller_send", "to_callee", "queued", "callee_in", "callee_out", "to_caller",
          "caller_return")
PYTHON = ("caller_send", "callee_in", "callee_out", "caller_return")


def recorder(inspect, rank):
    out = subprocess.run([inspect, "--json", "--trace", str(rank), str(os.getppid())],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["records"]


def by_msg(records, kinds, peer):
    """{msg_id: {kind: time_ns}} of the records of kinds with peer. A
    request run at once by the thread that took it has one record for
    both, recv+start, at its arrival: its received and started times."""
    out = {}
    for r in records:
        if r["peer"] != peer:
            continue
        if r["kind"] == "recv+start" and "started" in kinds:
            out.setdefault(r["msg_id"], {}).update(received=r["time_ns"], started=r["time_ns"])
        elif r["kind"] in kinds:
            out.setdefault(r["msg_id"], {})[r["kind"]] = r["time_ns"]
    return out


def phases_of(calls, mine, theirs, stamps):
    """Each call's phases (a dict), for the calls whose records were all
    found; calls: (t0, t1) pairs, in order."""
    sent = sorted((t, m) for m, k in mine.items() if "sent" in k for t in [k["sent"]])
    out = []
    for t0, t1 in calls:
        ids = [m for t, m in sent if t0 <= t <= t1]
        ran = [s for s in stamps if t0 <= s <= t1]
        if len(ids) != 1 or len(ran) != 1:
            continue  # a record overwritten, or a call that sent twice
        m, s = ids[0], ran[0]
        c, o = mine[m], theirs.get(m, {})
        if "completed" not in c or "started" not in o or "finished" not in o:
            continue
        received = o.get("received", o["started"])
        # In spin mode to_here on remote()'s creator returns on the RRef
        # entry's READY, before the reply is taken: the reply's hand-off
        # and the caller's return are then one phase, to_caller.
        completed = min(c["completed"], t1)
        out.append({"caller_send": c["sent"] - t0, "to_callee": received - c["sent"],
                    "queued": o["started"] - received, "callee_in": s - o["started"],
                    "callee_out": o["finished"] - s, "to_caller": completed - o["finished"],
                    "caller_return": t1 - completed, "total": t1 - t0})
    return out


def measure(rpc, op, batches, inspect):
    got = []
    for _ in range(3):  # warm
        op()
    rpc.rpc_sync("w1", take_stamps)
    for _ in range(batches):
        calls = []
        for _ in range(BATCH):
            t0 = time.perf_counter_ns()
            op()
            calls.append((t0, time.perf_counter_ns()))
        stamps = rpc.rpc_sync("w1", take_stamps)
        mine = by_msg(recorder(inspect, 0), ("sent", "completed"), 1)
        theirs = by_msg(recorder(inspect, 1), ("received", "started", "finished"), 0)
        got += phases_of(calls, mine, theirs, stamps)
    return got


def worker(out, quick):
    import shmrpc as rpc

    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"w{rank}")
    if rank == 0:
        inspect = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(rpc.__file__)))), "bin", "shmrpc-inspect")
        batches = 5 if quick else 30
        ops = {"rpc_sync": lambda: rpc.rpc_sync("w1", stamp),
               "remote_to_here": lambda: rpc.remote("w1", stamp).to_here()}
        try:
            import torch  # noqa: F401 (the echo's tensor is a torch tensor)
            t = rpc.empty(1024, "uint8", like="torch")
            ops["echo"] = lambda: rpc.rpc_sync("w1", stamp_echo, args=(t,))
        except ImportError:
            pass
        fig = {name: measure(rpc, op, batches, inspect) for name, op in ops.items()}
        with open(out, "w") as f:
            json.dump(fig, f)
    rpc.shutdown()


def median(values):
    return sorted(values)[len(values) // 2]


def report(fig, mode):
    for name, calls in fig.items():
        if not calls:
            print(f"python_rpc_phases: no call of {name} had all its records", file=sys.stderr)
            return 1
        med = {p: median([c[p] for c in calls]) for p in PHASES + ("total",)}
        whole = sum(med[p] for p in PHASES)
        fields = " ".join(f"{p}_ns={med[p]}" for p in PHASES)
        pct = 100 * sum(med[p] for p in PYTHON) / whole if whole > 0 else 0
        print(f"BENCH py_phases op={name} mode={mode} calls={len(calls)} "
              f"total_ns={med['total']} {fields} python_pct={pct:.1f}", flush=True)
    return 0


def main():
    quick = "-q" in sys.argv
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1], quick)
        return 0
    build = package_build("python_rpc_phases")
    if build is None:
        return 0
    modes = ([sys.argv[sys.argv.index("--wait") + 1]] if "--wait" in sys.argv
             else ["default", "spin"])
    rc = 0
    with tempfile.TemporaryDirectory(prefix="shmrpc-py-phases.") as tmp:
        for mode in modes:
            rc |= report(run_job(build, __file__, os.path.join(tmp, f"{mode}.json"), quick,
                                 [] if mode == "default" else [f"--wait={mode}"]), mode)
    return rc


if __name__ == "__main__":
    sys.exit(main())
