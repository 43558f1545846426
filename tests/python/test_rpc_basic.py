# shmrun: -n 2 --pool-size 64M
"""shmrpc's Python API in a 2-worker job: both workers run every test at
once, each calling the other (as the script did before it was a pytest
module), so both directions and a callee busy with its own calls are
covered (conftest.py: a module-wide rank mark).
"""
import pickle
import time
import warnings

import pytest

import shmrpc as rpc


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


init_warnings = []  # what init_rpc warned of, on this rank


def rpc_init(rank):
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
    init_warnings.extend(str(w.message) for w in said)


pytestmark = pytest.mark.rank(0, 1)


def test_ignored_options_warning():
    texts = init_warnings
    assert len(texts) == 1 and "init_method, _transports" in texts[0] \
        and "devices" not in texts[0], f"the warning about ignored options: {texts}"


@pytest.fixture
def me():
    return rpc.get_worker_info()


@pytest.fixture
def peer(me):
    return rpc.get_worker_info(f"worker{1 - me.id}")


def test_worker_info(me, peer):
    rank = rpc._shmrpc.rank()
    assert me.name == f"worker{rank}" and me.id == rank, f"get_worker_info: {me!r}"
    assert peer.id == 1 - rank, f"peer info {peer!r}"


def test_calls(me, peer):
    # The three ways to name a destination.
    for to in (peer, peer.name, peer.id):
        assert rpc.rpc_sync(to, add, args=(2, 3)) == 5, f"rpc_sync to {to!r}"
    class Name(str):
        pass
    assert rpc.rpc_sync(Name(peer.name), add, args=(1, 1)) == 2, "a str subclass as the name"
    # Names the job does not have: a prefix of one, one longer, one empty.
    for to in ("worker", peer.name + "0", ""):
        with pytest.raises(RuntimeError, match=f'could not find destination {to}: no worker '
                                               f'named "{to}" in this job'):
            rpc.rpc_sync(to, add, args=(1, 1))
    # A NUL inside a name does not end it: "worker1\0x" is no worker (as in
    # torch), neither to a call nor to get_worker_info.
    for to in (peer.name + "\0x", peer.name + "\0"):
        with pytest.raises(RuntimeError, match="could not find destination"):
            rpc.rpc_sync(to, add, args=(1, 1))
        with pytest.raises(RuntimeError, match="could not find destination"):
            rpc.get_worker_info(to)
    with pytest.raises(UnicodeEncodeError):
        rpc.rpc_sync("w\ud800", add, args=(1, 1))
    with pytest.raises(TypeError, match="to must be a worker name, a rank or a WorkerInfo"):
        rpc.rpc_sync(b"worker1", add, args=(1, 1))
    assert rpc.rpc_sync(peer, add, args=(2,), kwargs={"b": 40}) == 42, "kwargs"
    assert rpc.rpc_sync(peer, whoami) == peer.name, "the callee runs it"
    assert rpc.rpc_sync(me, whoami) == me.name, "a call to oneself"
    assert rpc.rpc_sync(peer, len, args=([1, 2, 3],)) == 3, "a builtin"
    some = bytes(range(256)) * 64
    assert rpc.rpc_sync(peer, bytes, args=(some,)) == some, "16 KiB of bytes both ways"
    big = some * 64  # a pickle larger than a frame travels in the pool
    assert rpc.rpc_sync(peer, bytes, args=(big,)) == big, "1 MiB of pickled bytes both ways"
    words = {str(i): [i] * 10 for i in range(5000)}
    assert rpc.rpc_sync(peer, dict, args=(words,)) == words, "a large dict both ways"


def test_rpc_async(peer):
    futs = [rpc.rpc_async(peer, add, args=(i, i)) for i in range(200)]
    assert [f.wait() for f in futs] == [2 * i for i in range(200)], "200 rpc_async"
    assert all(f.done() for f in futs), "done() after wait()"


def test_remote_exceptions(peer):
    # Remote exceptions keep their type and carry the remote traceback.
    with pytest.raises(ValueError) as e:
        rpc.rpc_sync(peer, boom, args=("no!",))
    text = str(e.value)
    assert "no!" in text and f"On {peer!r}" in text and "Traceback" in text, \
        f"ValueError text: {text}"
    with pytest.raises(Exception) as e:  # its type cannot be rebuilt from the text
        rpc.rpc_sync(peer, weird)
    assert "Weird" in str(e.value), \
        f"an exception whose type cannot be rebuilt: {e.type} {e.value}"
    # A class pickle cannot name: RuntimeError, with the real words.
    with pytest.raises(RuntimeError, match="Local\\('the real message'\\)"):
        rpc.rpc_sync(peer, local_class_error)


def local_class_error():
    class Local(Exception):
        pass
    raise Local("the real message")


def test_timeout(peer):
    with pytest.raises(TimeoutError, match="timeout"):
        rpc.rpc_sync(peer, slow, args=(2.0,), timeout=0.1)


def test_nested(me, peer):
    # Nested calls back and forth.
    assert rpc.rpc_sync(peer, nested, args=(6, me.name)) in (0, 1), "nested chain"


def test_rrefs(me, peer):
    rref = rpc.remote(peer, add, args=(20, 22))
    assert rref.to_here() == 42, "remote + to_here"
    assert rref.owner() == peer and rref.owner_name() == peer.name, "owner"
    assert not rref.is_owner(), "is_owner on a user"
    assert str(rref).startswith("UserRRef(RRefId = GloballyUniqueId("), f"str: {rref}"
    with pytest.raises(RuntimeError, match=r"can't call localValue\(\) on user"):
        rref.local_value()
    mine = rpc.remote(me, add, args=(1, 1))
    assert mine.is_owner() and mine.local_value() == 2, "an owner RRef's local_value"
    assert str(mine).startswith("OwnerRRef("), f"str: {mine}"
    bad = rpc.remote(peer, boom, args=("in an RRef",))
    with pytest.raises(ValueError, match="in an RRef"):
        bad.to_here()

    # RRefs as arguments (to the owner and to others) and as results.
    assert rpc.rpc_sync(peer, deref, args=(rref,)) == 42, "an RRef passed to its owner"
    assert rpc.rpc_sync(me, deref, args=(rref,)) == 42, "an RRef passed to oneself"
    made = rpc.rpc_sync(peer, make_rref, args=(me.name, 9))
    assert isinstance(made, rpc.RRef) and made.is_owner() and made.to_here() == 10, \
        f"an RRef returned by a call: {made}"
    nested_ref = rpc.remote(peer, make_rref, args=(peer.name, 30))
    assert nested_ref.to_here().to_here() == 31, "an RRef stored in an RRef"

    # The proxies: methods of the value, run on the owner.
    lst = rpc.remote(peer, list, args=([1, 2, 2, 3],))
    assert lst.rpc_sync().count(2) == 2, "rpc_sync proxy"
    assert lst.rpc_async().index(3).wait() == 3, "rpc_async proxy"
    assert lst.remote().__len__().to_here() == 4, "remote proxy"
    with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
        pickle.dumps(rref)
