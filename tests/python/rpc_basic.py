"""shmrpc's Python API under shmrun -n 2 (run by tests/python_rpc.c).

Each check prints what failed and the script exits 1; 0 when all pass.
"""
import os
import sys
import time
import warnings

import shmrpc as rpc

from checks import check, failed


def add(a, b=0):
    return a + b


def whoami():
    return rpc.get_worker_info().name


def boom(msg):
    raise ValueError(msg)


class Weird(Exception):
    def __init__(self, a, b):  # cannot be rebuilt from one message
        super().__init__(a, b)


def weird():
    raise Weird(1, 2)


def slow(sec):
    time.sleep(sec)
    return sec


def nested(depth, other):
    if depth == 0:
        return rpc.get_worker_info().id
    return rpc.rpc_sync(other, nested, args=(depth - 1, rpc.get_worker_info().name))


def deref(r):
    return r.to_here()


def make_rref(owner, x):
    return rpc.remote(owner, add, args=(x, 1))


def main():
    rank = int(os.environ["SHMRPC_RANK"])
    # torch's options: the ones shmrpc uses are taken, the others named in
    # one warning.
    class Opts:
        num_worker_threads = 4
        rpc_timeout = 30
        init_method = "tcp://127.0.0.1:29500"
        devices = []
        _transports = ["uv"]

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rpc.init_rpc(f"worker{rank}", rpc_backend_options=Opts())
    texts = [str(w.message) for w in said]
    check(len(texts) == 1 and "init_method, _transports" in texts[0] and "devices" not in texts[0],
          f"the warning about ignored options: {texts}")
    me = rpc.get_worker_info()
    check(me.name == f"worker{rank}" and me.id == rank, f"get_worker_info: {me!r}")
    peer = rpc.get_worker_info(f"worker{1 - rank}")
    check(peer.id == 1 - rank, f"peer info {peer!r}")

    # The three ways to name a destination.
    for to in (peer, peer.name, peer.id):
        check(rpc.rpc_sync(to, add, args=(2, 3)) == 5, f"rpc_sync to {to!r}")
    check(rpc.rpc_sync(peer, add, args=(2,), kwargs={"b": 40}) == 42, "kwargs")
    check(rpc.rpc_sync(peer, whoami) == peer.name, "the callee runs it")
    check(rpc.rpc_sync(me, whoami) == me.name, "a call to oneself")
    check(rpc.rpc_sync(peer, len, args=([1, 2, 3],)) == 3, "a builtin")
    some = bytes(range(256)) * 64
    check(rpc.rpc_sync(peer, bytes, args=(some,)) == some, "16 KiB of bytes both ways")
    big = some * 64  # a pickle larger than a frame travels in the pool
    check(rpc.rpc_sync(peer, bytes, args=(big,)) == big, "1 MiB of pickled bytes both ways")
    words = {str(i): [i] * 10 for i in range(5000)}
    check(rpc.rpc_sync(peer, dict, args=(words,)) == words, "a large dict both ways")

    futs = [rpc.rpc_async(peer, add, args=(i, i)) for i in range(200)]
    check([f.wait() for f in futs] == [2 * i for i in range(200)], "200 rpc_async")
    check(all(f.done() for f in futs), "done() after wait()")

    # Remote exceptions keep their type and carry the remote traceback.
    try:
        rpc.rpc_sync(peer, boom, args=("no!",))
        check(False, "boom did not raise")
    except ValueError as e:
        check("no!" in str(e) and f"On {peer!r}" in str(e) and "Traceback" in str(e),
              f"ValueError text: {e}")
    try:
        rpc.rpc_sync(peer, weird)
        check(False, "weird did not raise")
    except Exception as e:  # its type cannot be rebuilt from the text
        check("Weird" in str(e), f"an exception whose type cannot be rebuilt: {type(e)} {e}")

    # A timeout.
    try:
        rpc.rpc_sync(peer, slow, args=(2.0,), timeout=0.1)
        check(False, "slow did not time out")
    except TimeoutError as e:
        check("timeout" in str(e), f"timeout text: {e}")

    # Nested calls back and forth.
    check(rpc.rpc_sync(peer, nested, args=(6, me.name)) in (0, 1), "nested chain")

    # remote() and RRefs.
    rref = rpc.remote(peer, add, args=(20, 22))
    check(rref.to_here() == 42, "remote + to_here")
    check(rref.owner() == peer and rref.owner_name() == peer.name, "owner")
    check(not rref.is_owner(), "is_owner on a user")
    check(str(rref).startswith("UserRRef(RRefId = GloballyUniqueId("), f"str: {rref}")
    try:
        rref.local_value()
        check(False, "local_value on a user")
    except RuntimeError as e:
        check("can't call localValue() on user" in str(e), f"local_value text: {e}")
    mine = rpc.remote(me, add, args=(1, 1))
    check(mine.is_owner() and mine.local_value() == 2, "an owner RRef's local_value")
    check(str(mine).startswith("OwnerRRef("), f"str: {mine}")
    bad = rpc.remote(peer, boom, args=("in an RRef",))
    try:
        bad.to_here()
        check(False, "the RRef's error did not raise")
    except ValueError as e:
        check("in an RRef" in str(e), f"RRef error text: {e}")

    # RRefs as arguments (to the owner and to others) and as results.
    check(rpc.rpc_sync(peer, deref, args=(rref,)) == 42, "an RRef passed to its owner")
    check(rpc.rpc_sync(me, deref, args=(rref,)) == 42, "an RRef passed to oneself")
    made = rpc.rpc_sync(peer, make_rref, args=(me.name, 9))
    check(isinstance(made, rpc.RRef) and made.is_owner() and made.to_here() == 10,
          f"an RRef returned by a call: {made}")
    nested_ref = rpc.remote(peer, make_rref, args=(peer.name, 30))
    check(nested_ref.to_here().to_here() == 31, "an RRef stored in an RRef")

    # The proxies: methods of the value, run on the owner.
    lst = rpc.remote(peer, list, args=([1, 2, 2, 3],))
    check(lst.rpc_sync().count(2) == 2, "rpc_sync proxy")
    check(lst.rpc_async().index(3).wait() == 3, "rpc_async proxy")
    check(lst.remote().__len__().to_here() == 4, "remote proxy")
    import pickle
    try:
        pickle.dumps(rref)
        check(False, "pickling an RRef outside an RPC did not raise")
    except RuntimeError as e:
        check("only picklable inside an RPC" in str(e), f"pickle text: {e}")
    del rref, mine, bad, made, nested_ref, lst

    rpc.shutdown()
    return failed()


if __name__ == "__main__":
    sys.exit(main())
