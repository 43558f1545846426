# shmrun: none
# needs: has("torch")
"""A fixed, fast subset of torch's own RPC tests (tests/torch_suite/check.txt),
run against shmrpc as `make torch-suite` runs all of them: every one must
pass. Each runs as torch runs it, its ranks forked by torch's
MultiProcessTestCase and meeting at a file:// rendezvous without shmrun.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(HERE, "..", "torch_suite")


def test_subset_passes():
    listed = os.path.join(SUITE, "check.txt")
    with open(listed) as f:
        wanted = {ln.split("#")[0].strip() for ln in f} - {""}
    r = subprocess.run([sys.executable, os.path.join(SUITE, "run.py"), "--tests", listed, "-v"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    passed = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("PASS ")}
    assert r.returncode == 0 and passed == wanted, \
        f"missing or failed: {sorted(wanted - passed)}\n{r.stdout[-6000:]}"
