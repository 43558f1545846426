# shmrun: none
"""init_rpc again after shutdown in a worker shmrun started (issue 19), and
torch's RRef leak check at a graceful shutdown: programs/shmrun_rounds.py
starts RPC four times in each of two workers. Every round's calls and
remote() work; an RRef kept from round 0 fails in round 1 with a sentence
(its job has shut down); with _ignore_rref_leak False and the users'
RRefs kept (torch's test_rref_leak mocks
_delete_all_user_and_unforked_owner_rrefs), each owner's shutdown raises
"Leaking RRef ..." naming the RRef and its holder; without the mock the
held RRefs are deleted and none leaks. shmrun reports no process left,
and nothing is left in /dev/shm."""
import os
import subprocess
import sys

PROG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "shmrun_rounds.py")
BUILD = os.environ.get("SHMRPC_BUILD", "build")


def shm_names():
    return {n for n in os.listdir("/dev/shm") if "shmrpc" in n}


def test_rounds_and_leaks():
    before = shm_names()
    r = subprocess.run([os.path.join(BUILD, "bin", "shmrun"), "-n", "2", "--",
                        sys.executable, PROG], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "left" not in r.stderr, r.stderr
    lines = set(r.stdout.splitlines())
    for rnd in range(4):
        for rank in range(2):
            assert f"{rnd} {rank} call {rank + rnd}" in lines, (rnd, rank, r.stdout)
            assert f"{rnd} {rank} remote {rnd + 10}" in lines, (rnd, rank, r.stdout)
            leak = [line for line in lines if line.startswith(f"{rnd} {rank} leak ")]
            assert len(leak) == 1, (rnd, rank, r.stdout)
            if rnd == 2:
                # Each worker owns the RRef the other made in this round.
                assert leak[0].startswith(f"{rnd} {rank} leak Leaking RRef GloballyUniqueId("
                                          f"created_on={1 - rank}, "), leak
                assert leak[0].endswith(f"held by worker {1 - rank} (r{1 - rank}): "
                                        "1 reference"), leak
            else:
                assert leak == [f"{rnd} {rank} leak none"], leak
        assert f"1 {rank} stale True" in lines, r.stdout
    assert shm_names() <= before, shm_names() - before
