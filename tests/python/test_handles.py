# shmrun: -n 2 --pool-size 64M
"""Who holds a reply's tensor handles on the callee (python/_handler.c,
msg_keep): a Tensor of the reply that nothing else holds gives its
handle's reference to the agent, one the callee still holds keeps its own.
Either way the callee ends up holding in the pool exactly what its program
keeps (shmrpc-inspect's holder table): nothing is freed twice, nothing
leaks, after echoes, a Tensor the callee keeps and uses after replying, a
reply that fails halfway through its tensors, and one whose sending fails
after every handle went to the agent.
"""
import json
import os
import subprocess
import time

import pytest

import shmrpc as rpc

torch = pytest.importorskip("torch")

CALLEE = "worker1"
INSPECT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    rpc.__file__)))), "bin", "shmrpc-inspect")


def pool_refs(rank):
    """The pool references rank holds (shmrpc-inspect's holder table)."""
    out = subprocess.run([INSPECT, "--json", str(os.getppid())], check=True,
                         capture_output=True, text=True)
    return {h["rank"]: h["refs"] for h in json.loads(out.stdout)["pool"]["holders"]}[rank]


def settles(rank, want):
    """Whether rank's pool references come to want: a reply's pins go at the
    caller's TENSOR_ACK, a moment after the call returned."""
    deadline = time.monotonic() + 10
    while pool_refs(rank) != want:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def echo(x):
    return x


_kept = {}


def fresh(n, value):
    """A pool tensor of the callee's, not kept: its handle is the reply's alone."""
    t = rpc.empty(n, "float32", like="torch")
    t.fill_(value)
    return t


def keeping(what):
    """The plain handler (_serve_plain), wrapped so that the callee also
    keeps what of each reply: "tensors" (its Tensor objects, in a list of
    the test's), "list" (the reply's own list of them), "reply" (the reply
    itself); None: the package's handler again."""
    from shmrpc._serve import _fast, _run_function, _serve_plain

    def plain(*args):
        reply = _serve_plain(*args)
        if type(reply) is tuple:
            _kept[what] = {"tensors": lambda: list(reply[2]), "list": lambda: reply[2],
                           "reply": lambda: reply}[what]()
        return reply
    if what:  # without the fast path, which would serve most calls around plain
        rpc._shmrpc.set_handler(_run_function, plain)
    else:
        rpc._shmrpc.set_handler(_run_function, _serve_plain, _fast())


def use_kept(what):
    """The reply's Tensors the callee kept: each still holds its handle
    (none was emptied by the reply), its block as the caller saw it."""
    kept = _kept.pop(what)
    tensors = kept[2] if what == "reply" else kept
    return [(h.data_ptr() != 0, float(torch.utils.dlpack.from_dlpack(h).sum()))
            for h in tensors]


class Refuses:
    def __reduce__(self):
        raise ValueError("this object refuses to be pickled")


def fails_halfway(n):
    """A reply whose pickling fails after two of its tensors got handles."""
    return [fresh(n, 1.0), fresh(n, 2.0), Refuses(), fresh(n, 3.0)]


def fill_pool_then_reply(count):
    """Takes every free byte of the pool, then replies with count small
    plain tensors: more than a frame carries inline, so the agent copies the
    rest into pool blocks as it sends, and fails. The pool is given back
    after (drop_filler)."""
    blocks, size = [], 32 << 20
    while size >= 64:
        try:
            blocks.append(rpc.empty(size, "uint8"))
        except (RuntimeError, MemoryError):
            size //= 2
    _kept["filler"] = blocks
    return [torch.full((256,), float(i)) for i in range(count)]


def drop_filler():
    _kept.pop("filler", None)


def test_echoes_leave_nothing_held():
    base = pool_refs(1)
    t = rpc.empty(1024, "float32", like="torch")
    t.copy_(torch.arange(1024, dtype=torch.float32))
    for _ in range(50):
        back = rpc.rpc_sync(CALLEE, echo, args=(t,))
        assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)
    for i in range(50):
        got = rpc.rpc_sync(CALLEE, fresh, args=(4096, float(i)))
        assert got.shape == (4096,) and bool((got == i).all()), "the callee's fresh tensor"
    del back, got
    assert settles(1, base), f"the callee holds {pool_refs(1)} references, {base} before"


def test_reply_tensors_the_callee_keeps():
    base = pool_refs(1)
    for what in ("tensors", "list", "reply"):
        rpc.rpc_sync(CALLEE, keeping, args=(what,))
        got = rpc.rpc_sync(CALLEE, fresh, args=(1000, 3.0))
        rpc.rpc_sync(CALLEE, keeping, args=(None,))
        assert float(got.sum()) == 3000.0, what
        assert settles(1, base + 1), f"{what}: the callee's kept Tensor holds its block, " \
            f"and only that ({pool_refs(1)} references, {base} before)"
        assert rpc.rpc_sync(CALLEE, use_kept, args=(what,)) == [(True, 3000.0)], \
            f"{what}: a Tensor the callee keeps is not emptied by its reply"
        del got
        assert settles(1, base), f"{what}: the callee holds {pool_refs(1)} references, " \
            f"{base} before"


def test_reply_failing_halfway():
    base = pool_refs(1)
    with pytest.raises(Exception, match="refuses to be pickled"):
        rpc.rpc_sync(CALLEE, fails_halfway, args=(4096,))
    got = rpc.rpc_sync(CALLEE, fresh, args=(16, 7.0))
    assert bool((got == 7.0).all()), "the callee serves on"
    del got
    assert settles(1, base), f"the callee holds {pool_refs(1)} references, {base} before"


def test_reply_failing_as_it_is_sent():
    base = pool_refs(1)
    with pytest.raises(Exception, match="pool exhausted"):
        rpc.rpc_sync(CALLEE, fill_pool_then_reply, args=(4096,))
    rpc.rpc_sync(CALLEE, drop_filler)
    got = rpc.rpc_sync(CALLEE, fresh, args=(16, 9.0))
    assert bool((got == 9.0).all()), "the callee serves on"
    del got
    assert settles(1, base), f"the callee holds {pool_refs(1)} references, {base} before"


def keep_arg(x):
    """Keeps its argument past the call (and says whether the C way served
    it: neither package handler on the stack), returning it."""
    import sys
    from shmrpc import _serve
    frame, way = sys._getframe(), "C"
    while frame is not None:
        if frame.f_code in (_serve._serve_plain.__code__, _serve._run_function.__code__):
            way = frame.f_code.co_name
        frame = frame.f_back
    _kept.setdefault("args", []).append((way, x))
    return x


def kept_args():
    """The ways that served keep_arg, and the sums of the tensors kept."""
    return [(way, float(x.sum())) for way, x in _kept.pop("args")]


def test_taken_handles_outlive_their_messages():
    """The C ways give a received message's handle to the torch tensor made
    of it (the handle spent, its reference moved: python_tensor_take): the
    callee's argument and the caller's reply outlive their messages, and
    blocks freed meanwhile do not take their bytes; once dropped, each side
    holds what it held before."""
    base0, base1 = pool_refs(0), pool_refs(1)
    calls = rpc._shmrpc.common_calls()
    rpc.rpc_sync(CALLEE, keep_arg, args=(torch.zeros(1),))  # the callee caches the name
    mine = [rpc.empty(256, "float32", like="torch").fill_(i) for i in range(6)]
    back = [rpc.rpc_sync(CALLEE, keep_arg, args=(t,)) for t in mine]
    assert rpc._shmrpc.common_calls() - calls == 7, "the caller's C way made the calls"
    del mine  # the replies hold the blocks now, with the callee's kept tensors
    churn = [rpc.empty(256, "float32", like="torch").fill_(-1) for _ in range(32)]
    del churn
    assert [float(t.sum()) for t in back] == [256.0 * i for i in range(6)]
    assert rpc.rpc_sync(CALLEE, kept_args) == \
        [("_serve_plain", 0.0)] + [("C", 256.0 * i) for i in range(6)]
    del back
    assert settles(1, base1), f"the callee holds {pool_refs(1)} references, {base1} before"
    assert settles(0, base0), f"the caller holds {pool_refs(0)} references, {base0} before"
