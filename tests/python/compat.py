"""The compatibility suite (issue 7): the cases of compat_cases.py run once on
torch.distributed.rpc and once on shmrpc, and must give the same results.

    shmrun -n 2 -- python3 compat.py shmrpc   # a worker of a shmrun job
    python3 compat.py torch                   # starts its two workers itself
    python3 compat.py compare A B             # exits 1 when A and B differ

worker0 runs every case and writes "NAME: RESULT" lines to $COMPAT_OUT (or
stdout); it exits 1 when a case crashed (raised where it should have given
a result), unless the case is a known difference. compare skips the known
differences, printing them with their reason.
"""
import faulthandler
import os
import socket
import subprocess
import sys
import tempfile
import traceback

CASE_LIMIT_S = 60  # a hung case: dump the stacks and exit


def run_cases(rpc, rank, opts):
    import compat_cases

    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    crashed = []
    if rank == 0:
        path = os.environ.get("COMPAT_OUT")
        out = open(path, "w") if path else sys.stdout
        for name, fn in compat_cases.CASES:
            faulthandler.dump_traceback_later(CASE_LIMIT_S, exit=True)
            try:
                result = fn()
            except Exception as e:
                traceback.print_exc()
                result = f"CRASH {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if name not in compat_cases.KNOWN:
                    crashed.append(name)
            faulthandler.cancel_dump_traceback_later()
            print(f"{name}: {result}".replace("\n", "\\n"), file=out, flush=True)
        if path:
            out.close()
        print(f"compat: {len(compat_cases.CASES)} cases on {compat_cases.IMPL}, "
              f"{len(crashed)} crashed {crashed}", file=sys.stderr)
    rpc.shutdown()
    return 1 if crashed else 0


def shmrpc_worker():
    import shmrpc as rpc

    class Opts:  # what the torch run sets
        num_worker_threads = 4
        rpc_timeout = 20

    return run_cases(rpc, int(os.environ["SHMRPC_RANK"]), Opts())


def torch_worker(rank, port):
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=20,
                                           init_method=f"tcp://127.0.0.1:{port}")
    return run_cases(rpc, rank, opts)


def torch_job():
    """Starts the two torch workers on a free port; 0 when both exit 0.
    Their stderr (torch prints every remote error's traceback there) is
    shown only when one fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, COMPAT_IMPL="torch", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logs = [tempfile.TemporaryFile("w+") for _ in (0, 1)]
    procs = [subprocess.Popen([sys.executable, __file__, "torch", str(rank)], env=env,
                              stderr=logs[rank]) for rank in (0, 1)]
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=180))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            rcs.append(p.wait())
    for rank, log in enumerate(logs):
        log.seek(0)
        if any(rcs):
            sys.stderr.write(f"---- torch worker{rank}'s stderr\n{log.read()}")
        log.close()
    print(f"compat: the torch workers exited {rcs}", file=sys.stderr)
    return 1 if any(rcs) else 0


def read_results(path):
    results = {}
    with open(path) as f:
        for line in f:
            name, _, result = line.rstrip("\n").partition(": ")
            results[name] = result
    return results


def compare(path_a, path_b):
    from compat_cases import CASES, KNOWN

    a, b = read_results(path_a), read_results(path_b)
    same, known, differ = 0, 0, 0
    for name in [n for n, _ in CASES] + sorted((set(a) | set(b)) - {n for n, _ in CASES}):
        ra, rb = a.get(name, "(missing)"), b.get(name, "(missing)")
        if name in KNOWN:
            known += 1
            print(f"known difference {name}: {KNOWN[name]}\n  {path_a}: {ra}\n  {path_b}: {rb}")
        elif ra == rb:
            same += 1
        else:
            differ += 1
            print(f"DIFFERENT {name}\n  {path_a}: {ra}\n  {path_b}: {rb}")
    print(f"compat: {same} cases the same, {differ} different, {known} known differences")
    return 1 if differ else 0


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "compare" and len(sys.argv) == 4:
        return compare(sys.argv[2], sys.argv[3])
    if mode == "shmrpc":
        os.environ["COMPAT_IMPL"] = "shmrpc"
        return shmrpc_worker()
    if mode == "torch" and len(sys.argv) == 3:
        return torch_worker(int(sys.argv[2]), int(os.environ["MASTER_PORT"]))
    if mode == "torch":
        return torch_job()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
