"""What every tests/python script uses: check() records a failed check and
says which rank it was on; failed() is the script's exit code."""
import os
import sys

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"rank {os.environ.get('SHMRPC_RANK')}: FAILED: {what}", file=sys.stderr)


def failed():
    return 1 if failures else 0
