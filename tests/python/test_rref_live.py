# shmrun: -n 3 --pool-size 64M
"""An RRef's value is its owner's live object, as torch's (issue 18):
state changed through it stays, local_value() is the same object every
time, proxies act on it (async_execution methods too, from a third worker
holding a forked RRef), objects that cannot be pickled are values, an
object may make RRef(self) in its __init__, a user's to_here() sees the
value as it is when it asks, and the owner's objects go when their RRefs
go: after deletes, after a user's death (test_rref_live_death.py) and at
shutdown (counted here: the live-release hook empties the table).
"""
import gc
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


def owned_count():
    gc.collect()
    return len(rpc._owned)


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


def test_remote_error_not_kept():
    before = rpc.rpc_sync("worker1", owned_count)
    r = rpc.remote("worker1", Counter.add, args=(None, 1))  # AttributeError on the owner
    with pytest.raises(AttributeError):
        r.to_here()
    assert rpc.rpc_sync("worker1", owned_count) == before, "an error is stored, not kept live"
    del r
