"""What the Python benches share on shmrpc's side: the build they measure
and a two-worker job running a bench's own file again as its workers."""
import json
import os
import subprocess
import sys


def package_build(bench):
    """$SHMRPC_BUILD (default build) if it holds the Python package; else
    None, said on stderr in bench's name (the bench is skipped)."""
    build = os.environ.get("SHMRPC_BUILD", "build")
    if os.path.exists(os.path.join(build, "python", "shmrpc", "_shmrpc.abi3.so")):
        return build
    print(f"{bench}: no shmrpc Python package in {build}/python: skipped", file=sys.stderr)
    return None


def run_job(build, script, out, quick, shmrun_args=(), worker_args=(), env=None):
    """Runs `script --worker out [-q] worker_args` as a two-worker job
    under build's shmrun (with shmrun_args; env: more environment), the
    package on its path; what its rank 0 wrote to out, as JSON."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.path.join(build, "python") + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [os.path.join(build, "bin", "shmrun"), "-n", "2", "--quiet", "--timeout", "600",
           *shmrun_args, "--", sys.executable, os.path.abspath(script), "--worker", out,
           *(["-q"] if quick else []), *worker_args]
    subprocess.run(cmd, env=env, check=True)
    with open(out) as f:
        return json.load(f)
