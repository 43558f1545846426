"""How the Python tests run: pytest modules, alone or as every rank of a job.

Each tests/python/test_NAME.py is one entry of make check, build/tests/py_NAME
(tests/python_test.c, linked once per module). The module's first lines
tell that program how to run it:

    # shmrun: -n 3 --pool-size 64M   a job: these shmrun arguments, then
                                     `-- python3 -m pytest test_NAME.py`
    # shmrun: none                   a plain `python3 -m pytest test_NAME.py`
                                     (shmrpc.data's loader starts its workers)
    # needs: has("torch")            optional: a Python expression that
                                     must be true, else the entry is
                                     skipped (77); has(module) finds a
                                     module without importing it, shutil
                                     is imported (shutil.which("cc")); a
                                     module has() misses fails the entry
                                     instead, naming its Debian package
    # unmet: needs a GPU             optional: the skip reason printed when
                                     the needs line is false (the runner's
                                     allow-list, .ci/allowed-skips, matches it)

The entry fails when pytest (or shmrun) exits non-zero, when the job left
RRefs in the RRef table or files in /dev/shm. By hand, from the top folder:

    SHMRPC_BUILD=build build/bin/shmrpc-test-runner -v build/tests/py_futures
    PYTHONPATH=build/python build/bin/shmrun -n 2 --pool-size 64M -- \\
        /usr/bin/python3 -m pytest tests/python/test_futures.py -k wait_all

Under shmrun every rank runs pytest on the one module, and this file makes
them one job:

- Every rank collects the module, so a function or class sent by RPC is
  found by the same name (test_NAME.fn) on every rank. Then each rank keeps
  its own tests only: those marked @pytest.mark.rank(R, ...) run on the
  ranks R, every other test on rank 0. The rest are deselected.
- After collection every rank starts RPC: the module's rpc_init(rank) when
  it has one (backend options, state a rank must hold before calls come, a
  look at something before init_rpc, kept for a test to assert on), else
  rpc.init_rpc(f"worker{rank}").
- Each rank runs its tests. A rank with none (a serving rank) goes straight
  to the end of the session, where every rank calls rpc.shutdown(): that
  waits for all the ranks, so serving ranks serve until rank 0's tests
  are done; gc.collect() first, so that RRefs in reference cycles are
  released and not reported as left in the table.
- A module whose tests start and shut down RPC themselves (other worker
  names, several inits in one job) sets rpc_init = None: this file then
  does neither; its tests, marked for every rank that takes part, do
  (test_param_server.py: the tutorial's functions, one role per rank).

Failures: a failed test fails its rank's pytest (exit 1) after the rank has
shut down with the others, and shmrun exits 1. A rank whose rpc_init or
shutdown raises exits non-zero too, and shmrun (--on-failure=abort, its
default) stops the others; a hang is ended by the runner's timeout. Code that
must run on a serving rank, and its asserts, runs there by RPC from the
test on rank 0: an AssertionError raised there comes back to the caller with
its message (every rank imported the module through pytest's assertion
rewriting); or it is a test marked for that rank.

Converting a script: name it test_NAME.py (make links build/tests/py_NAME
for it); put the header lines first: the shmrun arguments of its job
(its entry in the former tests/python_rpc.c table), a needs line for what
it skipped without (torch, CUDA: then import torch at the top); make each
section of rank 0's work a test_ function (pytest runs them in the file's
order), each check(cond, what) an `assert cond, what`, each
try/check(False)/except a `with pytest.raises(...)`; move what every rank did before or at init_rpc
into rpc_init(rank); a check another rank made goes there by RPC, or into
a test marked for that rank. Helpers another module uses are imported
from it (test_data_ranks.py from test_data_order.py). A module run as a
script by its own test keeps a __main__ section (test_optim.py's
dead-worker job, which has roles and shmrun options of its own).
"""
import gc
import os
import traceback

import pytest

RANK = int(os.environ["SHMRPC_RANK"]) if "SHMRPC_RANK" in os.environ else None

module = None  # the module under test, in a job
rpc_started = False


def default_init(rank):
    import shmrpc as rpc

    rpc.init_rpc(f"worker{rank}")


def ranks_of(item):
    marker = item.get_closest_marker("rank")
    return marker.args if marker else (0,)


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect: the module is seen
def pytest_collection_modifyitems(config, items):
    global module
    if RANK is None:
        return
    modules = {item.module for item in items}
    if len(modules) > 1:
        raise pytest.UsageError("a shmrun job runs one test module, not "
                                f"{sorted(m.__name__ for m in modules)}")
    module = modules.pop() if modules else None
    mine = [item for item in items if RANK in ranks_of(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in mine])
    items[:] = mine


def pytest_collection_finish(session):
    global rpc_started
    if module is None:
        return
    init = getattr(module, "rpc_init", default_init)
    if init is None:
        return
    try:
        init(RANK)
    except Exception:
        traceback.print_exc()
        pytest.exit(f"rank {RANK}: RPC did not start", returncode=pytest.ExitCode.TESTS_FAILED)
    rpc_started = True


def pytest_sessionfinish(session):
    if RANK is None:
        return
    if rpc_started:
        import shmrpc as rpc

        gc.collect()
        try:
            rpc.shutdown()
        except Exception:
            traceback.print_exc()
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # A serving rank has no tests of its own: that is no failure.
    if module is not None and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK
