"""Runs torch's RPC suites against shmrpc (shmrpc_suite.py) and prints one
line per test, `PASS|FAIL|SKIP|ERROR name (seconds)`, then
`N passed, N failed, N skipped`. Exits 1 if any test failed.

    python3 tests/torch_suite/run.py [-k SUBSTRING]... [--tests FILE] [-v]

-k keeps the tests whose name holds the substring (any of them); --tests
keeps those listed in FILE (one `Class.test_name` a line, # comments); -v
prints each failure's traceback. Run from the top folder with the built
package on PYTHONPATH (make torch-suite does).
"""
import os
import sys
import time
import unittest

# torch's per-test limit (common_distributed reads it at import): 300 s
# by default; a test that hangs on shmrpc should not hold the run that long.
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "60")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shmrpc_suite  # noqa: E402


def wanted_names(argv):
    subs, listed, i = [], None, 0
    while i < len(argv):
        if argv[i] == "-k":
            subs.append(argv[i + 1])
            i += 1
        elif argv[i] == "--tests":
            with open(argv[i + 1]) as f:
                listed = {ln.split("#")[0].strip() for ln in f} - {""}
            i += 1
        i += 1
    return subs, listed


def all_tests():
    loader = unittest.TestLoader()
    for name in sorted(vars(shmrpc_suite)):
        cls = getattr(shmrpc_suite, name)
        if isinstance(cls, type) and name.startswith("Shmrpc") and issubclass(cls, unittest.TestCase):
            for t in loader.loadTestsFromTestCase(cls):
                yield f"{name}.{t._testMethodName}", t


class Result(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcome = None
        self.detail = ""

    def addSuccess(self, test):
        self.outcome = "PASS"

    def addFailure(self, test, err):
        self.outcome, self.detail = "FAIL", self._exc_info_to_string(err, test)

    def addError(self, test, err):
        self.outcome, self.detail = "FAIL", self._exc_info_to_string(err, test)

    def addSkip(self, test, reason):
        self.outcome, self.detail = "SKIP", reason

    def addExpectedFailure(self, test, err):
        self.outcome = "PASS"

    def addUnexpectedSuccess(self, test):
        self.outcome = "FAIL"


def main(argv):
    subs, listed = wanted_names(argv)
    verbose = "-v" in argv
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for name, test in all_tests():
        if subs and not any(s in name for s in subs):
            continue
        if listed is not None and name not in listed:
            continue
        res = Result()
        t0 = time.monotonic()
        test.run(res)
        outcome = res.outcome or "FAIL"
        counts[outcome] += 1
        extra = f": {res.detail}" if outcome == "SKIP" else ""
        print(f"{outcome} {name} ({time.monotonic() - t0:.1f} s){extra}", flush=True)
        if outcome == "FAIL" and verbose:
            print(res.detail, flush=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
