# shmrun: -n 2 --pool-size 64M
"""What a waiting executor thread runs (worker/executor.h): only what its
own call needs, so a request that waits for what a frame below it on the
same thread produces never runs above that frame.

The deadlock this guards against (issue 21): make() reads an RRef that is
still being made, and a thread waiting there used to run built(), which
waits for the RRef that make() itself produces; the thread hung until the
call timed out, within ~1000 rounds. Also a burst of 100,000 requests
that each make a nested call (issue 21's figure; about 55 s on 2 cores),
on a pool of 4 threads (RecursionError at ~3,000 before: every request
nested on one stack), and a ping-pong chain deeper
than a thread helps (64 hops), which the pool finishes on more threads.
"""
import shmrpc as rpc


def make(r):
    return [r.local_value()]


def built(r):
    return r.local_value()


def inner(i):
    return i + 1


def outer(i):
    # Half back to the caller, half to ourselves.
    to = "worker0" if i % 2 == 0 else rpc.get_worker_info().name
    return 2 * rpc.rpc_sync(to, inner, args=(i,))


def ping_pong(depth, other):
    if depth == 0:
        return 0
    me = rpc.get_worker_info().name
    return 1 + rpc.rpc_sync(other, ping_pong, args=(depth - 1, me))


class Opts:
    num_worker_threads = 4
    rpc_timeout = 60


def rpc_init(rank):
    rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts())


def test_rref_made_while_read():
    # On worker0 itself: x, make and built all run on this worker's pool.
    for i in range(2000):
        x = rpc.RRef([i])
        y = rpc.remote("worker0", make, args=(x,))
        got = rpc.rpc_sync("worker0", built, args=(y,), timeout=10)
        assert got == [[i]], f"round {i}: built() returned {got!r}"


def test_burst_of_nested_calls():
    n = 100000
    # No deadline (0): the last call waits behind the whole burst, about
    # 55 s on 2 cores, and a timing must not decide the test; the runner's
    # limit on the test still catches a hang.
    futs = [rpc.rpc_async("worker1", outer, args=(i,), timeout=0) for i in range(n)]
    got = [f.wait() for f in futs]
    bad = [(i, g) for i, g in enumerate(got) if g != 2 * (i + 1)]
    assert not bad, f"{len(bad)} of {n} wrong, first {bad[:3]}"


def test_chain_deeper_than_a_thread_helps():
    depth = 1000  # 64 hops per thread (EXECUTOR_HELP_LEVELS)
    assert rpc.rpc_sync("worker1", ping_pong, args=(depth, "worker0")) == depth
