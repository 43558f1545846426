# shmrun: -n 3 --pool-size 64M
"""An RRef's value is its owner's live object, as torch's (issue 18):
state changed through it stays, local_value() is the same object every
time, proxies act on it (async_execution methods too, from a third worker
holding a forked RRef), objects that cannot be pickled are values, an
object may make RRef(self) in its __init__, a user's to_here() sees the
value as it is when it asks, and the owner's objects go when their RRefs
go: after deletes, and (the job test_user_death_and_shutdown runs) after a
user's death and at shutdown.
"""
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import shmrpc as rpc


class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n

    def get(self):
        return self.n

    @rpc.functions.async_execution
    def add_later(self, k):
        """Completes on another thread: the proxy waits for the Future."""
        fut = rpc.Future()

        def done():
            fut.set_result(self.add(k))
        threading.Timer(0.01, done).start()
        return fut


class Locked:
    """Holds what pickle refuses: a lock and a running thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ticks = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(0.001):
            with self.lock:
                self.ticks += 1

    def alive_ticks(self):
        with self.lock:
            return self.thread.is_alive(), self.ticks

    def close(self):
        self.stop.set()
        self.thread.join()
        return not self.thread.is_alive()


class SelfRef:
    """Makes an RRef to itself while half built, as the RL tutorial's Agent."""

    def __init__(self, tag):
        self.me = rpc.RRef(self)
        self.tag = tag

    def check(self):
        return self.me.local_value() is self, self.me.local_value().tag


alive = {"n": 0}  # Tracked objects alive on this worker


class Tracked:
    def __init__(self):
        alive["n"] += 1

    def __del__(self):
        alive["n"] -= 1


def tracked_alive():
    gc.collect()
    return alive["n"], len(rpc._owned)


def owned_ids():
    return set(rpc._owned)


def same_object_twice(rref):
    return rref.local_value() is rref.local_value() and rref.to_here() is rref.local_value()


def bump_through(rref, k):
    """A UDF given the RRef, on the owner: changes the live value."""
    return rref.local_value().add(k)


def proxy_from_here(rref, k):
    """On a third worker holding a fork: proxies to the owner's object."""
    return (rref.rpc_sync().add(k), rref.rpc_async().add_later(k).wait(),
            rref.remote().get().to_here())


def wait_for(cond, what, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_counter_keeps_state():
    c = rpc.remote("worker1", Counter)
    got = (c.rpc_sync().add(1), c.rpc_sync().add(1), c.rpc_sync().get())
    assert got == (1, 2, 2), f"torch answers (1, 2, 2) to add(1), add(1), get(): got {got}"
    assert c.to_here().n == 2  # a copy made at fetch time
    assert rpc.rpc_sync("worker1", bump_through, args=(c, 5)) == 7
    assert c.rpc_async().get().wait() == 7
    assert c.remote().add(1).to_here() == 8
    assert c.to_here().n == 8, "to_here() returns the value as it is at fetch time"


def test_local_value_identity():
    c = rpc.remote("worker1", Counter)
    assert rpc.rpc_sync("worker1", same_object_twice, args=(c,))
    mine = rpc.RRef(Counter())
    v = mine.local_value()
    assert mine.local_value() is v and mine.to_here() is v
    v.add(3)
    assert rpc.rpc_sync("worker1", proxy_from_here, args=(mine, 1)) == (4, 5, 5)
    assert v.n == 5, "the proxies changed the owner's object itself"
    with pytest.raises(RuntimeError, match="can't call localValue"):
        c.local_value()


def test_async_execution_through_proxies():
    c = rpc.remote("worker1", Counter)
    assert c.rpc_sync().add_later(2) == 2
    assert c.rpc_async().add_later(3).wait() == 5
    assert c.remote().add_later(4).to_here() == 9
    # From a third worker holding a forked RRef.
    assert rpc.rpc_sync("worker2", proxy_from_here, args=(c, 1)) == (10, 11, 11)
    assert c.rpc_sync().get() == 11


class Odd:
    """Methods whose answers and failures a proxy's call carries back."""
    def __init__(self):
        self.items = []

    def keep(self, *xs):
        self.items.extend(xs)

    def items_of(self):
        return list(self.items)

    def fail(self, text):
        raise KeyError(text)

    @property
    def broken(self):
        raise ValueError("broken property")


def test_proxy_calls_served_as_python():
    # A proxy's call with scalar arguments is served in C on the owner
    # (python/_serve_fast.c, proxy_serve), the others by _serve_plain:
    # the same answers, errors and live state either way.
    o = rpc.remote("worker1", Odd)
    assert o.rpc_sync().keep(1, "a", None, 2.5) is None, "None, scalars sent"
    assert o.rpc_sync().keep([2], {"k": 3}) is None, "a list and a dict: pickled"
    assert o.rpc_sync().keep(x := 4) is None and x == 4
    assert o.rpc_sync().items_of() == [1, "a", None, 2.5, [2], {"k": 3}, 4]
    assert o.rpc_async().items_of().wait()[-1] == 4
    assert o.remote().items_of().to_here()[0] == 1, "remote(): a live value of its own"
    with pytest.raises(KeyError, match="nope") as e:
        o.rpc_sync().fail("nope")
    assert "in fail" in str(e.value), f"the method's traceback: {e.value}"
    with pytest.raises(KeyError, match="nope"):
        o.rpc_sync().fail(text="nope")  # a keyword: the pickled form
    with pytest.raises(ValueError, match="broken property"):
        o.rpc_sync().broken()
    with rpc.autograd.context():  # served inside the context: _serve_call
        assert o.rpc_sync().items_of()[1] == "a"


def test_unpicklable_value():
    r = rpc.remote("worker1", Locked)
    alive, ticks = r.rpc_sync().alive_ticks()
    assert alive
    time.sleep(0.05)
    assert r.rpc_sync().alive_ticks()[1] > ticks, "the owner's thread keeps running"
    with pytest.raises(Exception, match="pickle"):
        r.to_here()  # leaving the owner needs a pickle: torch fails the same way
    assert r.rpc_sync().close()


def test_rref_self_in_init():
    r = rpc.remote("worker1", SelfRef, args=("a",))
    assert r.rpc_sync().check() == (True, "a")
    local = rpc.RRef(SelfRef("b"))
    assert local.local_value().check() == (True, "b")


def test_objects_go_with_their_rrefs():
    base = rpc.rpc_sync("worker1", tracked_alive)
    rrefs = [rpc.remote("worker1", Tracked) for _ in range(20)]
    wait_for(lambda: rpc.rpc_sync("worker1", tracked_alive)[0] == base[0] + 20,
             "20 Tracked objects alive on the owner")
    # A fork on a third worker keeps the value after our delete.
    assert rpc.rpc_sync("worker2", proxy_hold, args=(rrefs[0],)) is None
    del rrefs
    gc.collect()
    wait_for(lambda: rpc.rpc_sync("worker1", tracked_alive)[0] == base[0] + 1,
             "the owner freed 19 objects; the one worker2 holds stays")
    rpc.rpc_sync("worker2", proxy_drop)
    wait_for(lambda: rpc.rpc_sync("worker1", tracked_alive)[0] == base[0],
             "the owner's Tracked objects back to where they were")
    assert rpc.rpc_sync("worker1", tracked_alive)[1] <= base[1], "nothing left in its table"


held = []  # RRefs a test asked this worker to keep


def proxy_hold(rref):
    held.append(rref)


def proxy_drop():
    held.clear()
    gc.collect()


def tuple_with_list():
    return (1, "a", [])


def append_to(rref, x):
    """On the owner: changes the list inside the live tuple."""
    rref.local_value()[2].append(x)


def fetches():
    return rpc._shmrpc.sent_counts()["PYTHON_RREF_FETCH_CALL"]


def test_never_stale():
    """A user reads a value no code can change from the owner's pickle,
    without a message; any other value is fetched from the owner at each
    to_here(), so no change made on the owner is ever missed."""
    n = fetches()
    r = rpc.remote("worker1", tuple_with_list)  # a tuple holding a list: mutable
    for i in range(3):
        rpc.rpc_sync("worker1", append_to, args=(r, i))
        assert r.to_here() == (1, "a", list(range(i + 1))), "to_here sees every change"
    assert fetches() == n + 3, "a mutable value is fetched at each to_here()"
    frozen = rpc.remote("worker1", add_pair, args=((1, 2.5), ("x", b"y", None, frozenset({3}))))
    assert frozen.to_here() == ((1, 2.5), ("x", b"y", None, frozenset({3})))
    assert fetches() == n + 3, "a value that cannot change is read without a message"


def add_pair(a, b):
    return (a, b)


def test_remote_error_not_kept():
    # By ids, not by a count: the owner may still be letting go of the
    # values of earlier tests' RRefs in the background (deletes, then its
    # sweep), which only ever removes ids.
    before = rpc.rpc_sync("worker1", owned_ids)
    r = rpc.remote("worker1", Counter.add, args=(None, 1))  # AttributeError on the owner
    with pytest.raises(AttributeError):
        r.to_here()
    after = rpc.rpc_sync("worker1", owned_ids)
    assert r._r.id() not in after and after <= before, "an error is stored, not kept live"
    del r


def test_user_death_and_shutdown():
    """Runs this module as a script: the owner's objects go when the user
    holding their RRefs is killed, and every one goes at shutdown."""
    shmrun = os.readlink(f"/proc/{os.getppid()}/exe")  # a worker's parent is shmrun
    argv = [shmrun, "-n", "3", "--on-failure=continue", "--pool-size", "64M", "--timeout", "60",
            "--", sys.executable, os.path.abspath(__file__)]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 1, f"the job exits 1 (worker2 was killed): {r.returncode}\n{r.stdout}"
    for rank in (0, 1):
        assert f"live-death rank {rank}: ok" in r.stdout, f"rank {rank} passed\n{r.stdout}"


def make_held(n):
    """On a user: n RRefs to Tracked objects on worker0, kept here."""
    held.extend(rpc.remote("worker0", Tracked) for _ in range(n))


def death_job(rank):
    """A rank of the job: worker0 owns, worker1 and worker2 hold RRefs,
    worker2 is killed."""
    rpc.init_rpc(f"worker{rank}")
    if rank == 0:
        rpc.rpc_sync("worker2", make_held, args=(5,))
        rpc.rpc_sync("worker1", make_held, args=(2,))
        mine = [rpc.RRef(Tracked()) for _ in range(3)]
        wait_for(lambda: tracked_alive() == (10, 10), "10 objects owned")
        os.kill(rpc.rpc_sync("worker2", os.getpid), signal.SIGKILL)
        wait_for(lambda: tracked_alive() == (5, 5), "worker2's 5 objects go with it")
        assert mine[0].local_value() is mine[0].local_value()
    if rank == 2:
        signal.pause()  # waits for its SIGKILL
        return 1
    rpc.shutdown()
    if rank == 0:
        # worker1's RRefs and our own still exist: the agent's end releases
        # their values all the same (the owner is gone for them).
        assert tracked_alive() == (0, 0), f"nothing owned after shutdown: {tracked_alive()}"
    print(f"live-death rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(death_job(int(os.environ["SHMRPC_RANK"])))
