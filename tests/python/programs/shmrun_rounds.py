"""A shmrun worker that starts RPC four times (tests/python/test_shmrun_rounds.py).
Each round prints one line per result; the checks are the test's."""
import os
import sys
from unittest import mock

import shmrpc as rpc
from shmrpc import api


def add(a, b):
    return a + b


def say(*words):
    # One write: the two workers share shmrun's stdout.
    os.write(1, (" ".join(map(str, words)) + "\n").encode())


def main():
    rank = int(os.environ["SHMRPC_RANK"])
    other = f"r{1 - rank}"
    kept = None
    for rnd in range(4):
        rpc.init_rpc(f"r{rank}")
        say(rnd, rank, "call", rpc.rpc_sync(other, add, args=(rank, rnd)))
        say(rnd, rank, "remote", rpc.remote(other, add, args=(rnd, 10)).to_here())
        if rnd == 0:
            kept = rpc.remote(other, add, args=(1, 1))
            kept.to_here()
        elif rnd == 1:
            try:
                kept.to_here()
                say(rnd, rank, "stale", "no error")
            except RuntimeError as e:
                say(rnd, rank, "stale", "shut down" in str(e))
        held = rpc.remote(other, add, args=(rnd, 100))
        held.to_here()
        api._ignore_rref_leak = rnd < 2
        try:
            if rnd == 2:
                # torch's test_rref_leak: the users keep their RRefs.
                with mock.patch.object(api, "_delete_all_user_and_unforked_owner_rrefs"):
                    rpc.shutdown()
            else:
                rpc.shutdown()
            say(rnd, rank, "leak", "none")
        except RuntimeError as e:
            say(rnd, rank, "leak", str(e).splitlines()[0])
    api._ignore_rref_leak = True
    return 0


sys.exit(main())
