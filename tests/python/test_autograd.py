# shmrun: -n 3 --pool-size 64M
# needs: has("torch")
"""Distributed autograd (issue 10) over 3 workers (model parallel): worker0
drives, worker1 and worker2 hold weights and serve (conftest.py); the
gradients that shmrpc.autograd computes across workers must equal those of
the same model run in one process with plain torch autograd.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import shmrpc as rpc


def weights(rows, cols, scale):
    """Fixed weights, the same in every process, that require grad."""
    w = torch.linspace(-1.0, 1.0, rows * cols, dtype=torch.float64).reshape(rows, cols) * scale
    return w.requires_grad_(True)


W = {}  # this worker's weights, by name (made at start: worker1 has W1, worker2 W3)


def rpc_init(rank):
    # Before init_rpc: calls may come as soon as it returns.
    W.update({1: {"W1": weights(5, 6, 0.3)}, 2: {"W3": weights(6, 2, 0.8)}}.get(rank, {}))
    rpc.init_rpc(f"worker{rank}")


def layer1(x):
    """On worker1: relu(x @ W1)."""
    return torch.relu(x @ W["W1"])


def layer3(x):
    """On worker2: tanh(x @ W3)."""
    return torch.tanh(x @ W["W3"])


def nested(x):
    """On worker1: layer1, then layer3 on worker2, inside the caller's context."""
    return rpc.rpc_sync("worker2", layer3, args=(layer1(x) * 2.0,)) + x.sum()


def get_w1():
    return W["W1"]


def double(x):
    return x * 2.0


def loss_of(x):
    """On worker1: a scalar (for RRef.backward)."""
    return (layer1(x) ** 2).sum()


def info(x):
    return (x.requires_grad, x.is_leaf)


def echo(x):
    return x


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


def boom(x):
    return Boom.apply(x * 3.0)


def local_backward():
    """On worker1: RRef.backward() of an owner RRef, no context: torch.autograd's
    local backward from the live value, into .grad."""
    w = W["W1"]
    w.grad = None
    rpc.RRef((w * 2).sum()).backward()
    ok = w.grad is not None and torch.equal(w.grad, torch.full_like(w, 2.0))
    w.grad = None
    return ok


SEND = "torch::distributed::autograd::SendRpcBackward"
RECV = "torch::distributed::autograd::RecvRpcBackward"


def graph_here(cid):
    """This worker's part of context cid's graph, by node names: for each
    send (in the order made) the names of its next functions, for each
    receive its name."""
    ctx = rpc.autograd._retrieve_context(cid)
    sends = [(node.name(), [nxt.name() for nxt, _ in node.next_functions])
             for node in ctx._send_functions().values()]
    return sends, [node.name() for node in ctx._recv_functions().values()]


def my_grads(cid):
    """This worker's gradients in context cid, by weight name."""
    grads = rpc.autograd.get_gradients(cid)
    return {name: grads[w] for name, w in W.items() if w in grads}


def num_contexts():
    return rpc.autograd._num_contexts()


def sent():
    """The requests this worker sent, by message type (the C half's counts)."""
    return rpc._shmrpc.sent_counts()


INSPECT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    rpc.__file__)))), "bin", "shmrpc-inspect")


def flight_recorder():
    """This worker's flight recorder (shmrpc-inspect --trace), or None
    without the inspector (it is built beside the package)."""
    if not os.access(INSPECT, os.X_OK):
        return None
    out = subprocess.run([INSPECT, "--json", "--trace", os.environ["SHMRPC_RANK"],
                          str(os.getppid())], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def received_in_graph(t):
    """t arrived in a context as torch makes it: requiring grad, its
    grad_fn the RecvRpcBackward node the context records for its message."""
    node = t.grad_fn
    return (t.requires_grad and node is not None
            and node.name() == "torch::distributed::autograd::RecvRpcBackward"
            and node in rpc.autograd._current_context()._recv_functions().values())


def close(a, b):
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(a, b)


def newer(records, trace):
    """The records newer than trace's: past its last index in their lane
    (the recorder's lanes number their records each). Not by time: each
    read converts the counter's ticks to ns anew, and a record's time can
    differ by a nanosecond between two reads."""
    last = {}
    for r in trace["records"]:
        last[r["lane"]] = max(last.get(r["lane"], -1), r["index"])
    return [r for r in records if r["index"] > last.get(r["lane"], -1)]


def records_since(trace):
    """This worker's flight-recorder records made after trace was read."""
    return newer(flight_recorder()["records"], trace)


def test_model_parallel_mlp():
    x = weights(4, 5, 0.5)
    w2 = weights(6, 3, 0.7)
    with rpc.autograd.context() as cid:
        h = rpc.rpc_sync("worker1", layer1, args=(x,))
        assert received_in_graph(h), \
            f"a result that requires grad arrives as RecvRpcBackward's output: {h.grad_fn}"
        loss = ((h @ w2) ** 2).sum()
        rpc.autograd.backward(cid, [loss])
        got = rpc.autograd.get_gradients(cid)
        remote = rpc.rpc_sync("worker1", my_grads, args=(cid,))
        assert x.grad is None and w2.grad is None, "gradients go to the context, not .grad"
    xr, w1r, w2r = weights(4, 5, 0.5), weights(5, 6, 0.3), weights(6, 3, 0.7)
    ((torch.relu(xr @ w1r) @ w2r) ** 2).sum().backward()
    assert close(got.get(x), xr.grad), f"MLP: x's gradient {got.get(x)} vs {xr.grad}"
    assert close(got.get(w2), w2r.grad), "MLP: W2's gradient (local layer)"
    assert close(remote.get("W1"), w1r.grad), f"MLP: W1's gradient on worker1: {remote}"
    assert len(got) == 2, f"worker0's table holds x and W2 only: {len(got)} entries"


def test_graph_nodes():
    """The context records torch's graph: a SendRpcBackward per message sent
    with tensors that require grad, whose next functions are their
    gradient edges, and a RecvRpcBackward per such message received, whose
    outputs the received tensors are (worker0 -> worker1 -> worker2 and back)."""
    x = weights(3, 5, 0.4)
    with rpc.autograd.context() as cid:
        y = rpc.rpc_sync("worker1", nested, args=(x,))
        ctx = rpc.autograd._current_context()
        (send,) = ctx._send_functions().values()
        (recv,) = ctx._recv_functions().values()
        assert send.name() == SEND and len(send.next_functions) == 1, \
            f"one send for x's message: {send.name()} {send.next_functions}"
        accumulate = send.next_functions[0][0]
        assert accumulate.name() == "torch::autograd::AccumulateGrad" and accumulate.variable is x, \
            "the send's next function is x's AccumulateGrad"
        assert y.grad_fn is recv and recv.name() == RECV and not y.is_leaf, \
            f"the result is its RecvRpcBackward's output: {y.grad_fn}"
        on1 = rpc.rpc_sync("worker1", graph_here, args=(cid,))
        on2 = rpc.rpc_sync("worker2", graph_here, args=(cid,))
        rpc.autograd.backward(cid, [(y ** 2).sum()])
        got = rpc.autograd.get_gradients(cid)
    assert on1 == ([(SEND, ["MulBackward0"]), (SEND, ["AddBackward0"])], [RECV, RECV]), \
        f"worker1 sent layer1(x) * 2 on and its result back, received x and layer3's: {on1}"
    assert on2 == ([(SEND, ["TanhBackward0"])], [RECV]), f"worker2: {on2}"
    xr, w1r, w3r = weights(3, 5, 0.4), weights(5, 6, 0.3), weights(6, 2, 0.8)
    ((torch.tanh((torch.relu(xr @ w1r) * 2.0) @ w3r) + xr.sum()) ** 2).sum().backward()
    assert close(got.get(x), xr.grad), "the gradient through those nodes"


class KeepGrad(torch.autograd.Function):
    """Identity whose backward notes where its gradient's data is."""
    ptr = None

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        KeepGrad.ptr = grad.data_ptr()
        return grad


def test_hooks_and_accumulation():
    """Leaves accumulate through their AccumulateGrad as torch's distributed
    engine does: tensor hooks and the node's post hooks run, the gradient
    goes to the context (not .grad) without a copy where torch keeps it."""
    x = weights(4, 5, 0.5)
    x.grad = torch.full_like(x, 7.0)
    hook = x.register_hook(lambda g: g * 3.0)
    posts = []
    accumulate = (x * 1.0).grad_fn.next_functions[0][0]
    accumulate.register_hook(lambda grads_in, grads_out: posts.append(1))
    try:
        with rpc.autograd.context() as cid:
            h = rpc.rpc_sync("worker1", double, args=(x,))
            rpc.autograd.backward(cid, [h.sum()])
            got = rpc.autograd.get_gradients(cid)[x]
        assert torch.equal(got, torch.full_like(x, 6.0)), f"the hook tripled 2: {got}"
        assert posts == [1], f"the AccumulateGrad's post hook ran once: {posts}"
        assert torch.equal(x.grad, torch.full_like(x, 7.0)), ".grad is left as it was"
    finally:
        hook.remove()
    with rpc.autograd.context() as cid:
        rpc.autograd.backward(cid, [KeepGrad.apply(x)[1][0]])
        got = rpc.autograd.get_gradients(cid)[x]
    assert got.data_ptr() == KeepGrad.ptr, "a gradient nobody else holds is kept, not copied"


def test_sent_twice():
    x = weights(2, 5, 1.0)
    with rpc.autograd.context() as cid:
        a = rpc.rpc_sync("worker1", double, args=(x,))
        b = rpc.rpc_sync("worker1", double, args=(x,))
        r1 = rpc.rpc_sync("worker1", get_w1)
        r2 = rpc.rpc_sync("worker1", get_w1)
        loss = (a + 3.0 * b).sum() + (2.0 * r1 + r2).sum()
        rpc.autograd.backward(cid, [loss])
        gx = rpc.autograd.get_gradients(cid).get(x)
        gw = rpc.rpc_sync("worker1", my_grads, args=(cid,)).get("W1")
    assert close(gx, torch.full((2, 5), 8.0, dtype=torch.float64)), \
        f"a tensor sent twice: gradients accumulate (2 + 3*2): {gx}"
    assert close(gw, torch.full((5, 6), 3.0, dtype=torch.float64)), \
        f"a tensor returned twice: gradients accumulate on its owner: {gw}"


def test_nested_rpc_and_retain_graph():
    x = weights(3, 5, 0.4)
    with rpc.autograd.context() as cid:
        y = rpc.rpc_sync("worker1", nested, args=(x,))
        loss = (y ** 2).sum()
        rpc.autograd.backward(cid, [loss], retain_graph=True)
        rpc.autograd.backward(cid, [loss])  # twice: gradients add up
        gx = rpc.autograd.get_gradients(cid).get(x)
        g1 = rpc.rpc_sync("worker1", my_grads, args=(cid,)).get("W1")
        g3 = rpc.rpc_sync("worker2", my_grads, args=(cid,)).get("W3")
        live = [rpc.rpc_sync(f"worker{r}", num_contexts) for r in (1, 2)]
        assert live == [1, 1], f"the context reached worker1 and worker2: {live}"
    xr, w1r, w3r = weights(3, 5, 0.4), weights(5, 6, 0.3), weights(6, 2, 0.8)
    ((torch.tanh((torch.relu(xr @ w1r) * 2.0) @ w3r) + xr.sum()) ** 2).sum().backward()
    assert close(gx, 2 * xr.grad), f"nested: x's gradient {gx} vs 2 * {xr.grad}"
    assert close(g1, 2 * w1r.grad), "nested: W1's gradient on worker1"
    assert close(g3, 2 * w3r.grad), "nested: W3's gradient on worker2 (reached through worker1)"


def test_remote_layer():
    """A layer reached through remote() inside a context: the remote goes as
    FORWARD_AUTOGRAD_REQ wrapping PYTHON_REMOTE_CALL and is answered
    FORWARD_AUTOGRAD_RESP; the owner stores the value, and the gradients
    flow back through it from to_here() (as torch's)."""
    x, w2 = weights(4, 5, 0.5), weights(6, 3, 0.7)
    trace = flight_recorder()
    before = sent()
    with rpc.autograd.context() as cid:
        rr = rpc.remote("worker1", layer1, args=(x,))
        during = sent()
        h = rr.to_here()
        assert received_in_graph(h), \
            f"an RRef's value that requires grad arrives as RecvRpcBackward's output: {h.grad_fn}"
        if trace is not None:
            forward_on_wire(trace)
        loss = ((h @ w2) ** 2).sum()
        rpc.autograd.backward(cid, [loss])
        got = rpc.autograd.get_gradients(cid)
        remote = rpc.rpc_sync("worker1", my_grads, args=(cid,))
    grew = {k: during[k] - before[k] for k in during}
    assert grew["FORWARD_AUTOGRAD_REQ"] == 1 and grew["PYTHON_REMOTE_CALL"] == 0, \
        f"remote() in a context is a FORWARD_AUTOGRAD_REQ, not a PYTHON_REMOTE_CALL: {grew}"
    before = sent()
    outside = rpc.remote("worker1", double, args=(x,))
    grew = {k: v - before[k] for k, v in sent().items()}
    assert grew["PYTHON_REMOTE_CALL"] == 1 and grew["FORWARD_AUTOGRAD_REQ"] == 0, \
        f"remote() outside a context is a PYTHON_REMOTE_CALL: {grew}"
    assert close(outside.to_here().detach(), 2.0 * x.detach()), "and its value is stored"
    xr, w1r, w2r = weights(4, 5, 0.5), weights(5, 6, 0.3), weights(6, 3, 0.7)
    ((torch.relu(xr @ w1r) @ w2r) ** 2).sum().backward()
    assert close(got.get(x), xr.grad), f"remote: x's gradient {got.get(x)} vs {xr.grad}"
    assert close(got.get(w2), w2r.grad), "remote: W2's gradient (local layer)"
    assert close(remote.get("W1"), w1r.grad), f"remote: W1's gradient on its owner: {remote}"


def forward_on_wire(trace):
    """Since trace, remote() in a context sent one FORWARD_AUTOGRAD_REQ to
    worker1 and no PYTHON_REMOTE_CALL; the reply, FORWARD_AUTOGRAD_RESP, may
    come after the value is stored: waited for."""
    sends = [r for r in records_since(trace) if r["kind"] == "sent"
             and r["type"] in ("FORWARD_AUTOGRAD_REQ", "PYTHON_REMOTE_CALL")]
    assert [(r["type"], r["peer"]) for r in sends] == [("FORWARD_AUTOGRAD_REQ", 1)], \
        f"remote() in a context sent {sends}"
    for _ in range(250):
        done = [r["type"] for r in records_since(trace)
                if r["kind"] == "completed" and r["msg_id"] == sends[0]["msg_id"]]
        if done:
            break
        time.sleep(0.02)
    assert done == ["FORWARD_AUTOGRAD_RESP"], f"the remote's reply: {done}"


def test_rref_backward():
    x = weights(4, 5, 0.5)
    with rpc.autograd.context() as cid:
        rr = rpc.remote("worker1", loss_of, args=(x,))
        rr.backward(cid)
        gx = rpc.autograd.get_gradients(cid).get(x)
        g1 = rpc.rpc_sync("worker1", my_grads, args=(cid,)).get("W1")
    xr, w1r = weights(4, 5, 0.5), weights(5, 6, 0.3)
    (torch.relu(xr @ w1r) ** 2).sum().backward()
    assert close(gx, xr.grad), "RRef.backward: x's gradient on the caller"
    assert close(g1, w1r.grad), "RRef.backward: W1's gradient on the owner"
    with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id'"):
        rr.backward()  # without a context: the owner's only, as torch's
    assert rpc.rpc_sync("worker1", local_backward), "RRef.backward() on the owner: torch.autograd's"


def test_errors():
    x = weights(2, 5, 1.0)
    with rpc.autograd.context() as cid:
        y = rpc.rpc_sync("worker1", boom, args=(x,))
        # torch's text, made where it happened, not nested at each hop.
        with pytest.raises(RuntimeError) as e:
            rpc.autograd.backward(cid, [y.sum()])
        assert str(e.value) == "Error on Node 1: boom in backward", \
            f"an error in backward names node 1: {e.value!s:.300}"
        for bad, what in (([x * 2.0], "is not a scalar"),
                          ([torch.ones(())], "requires_grad not set")):
            with pytest.raises(RuntimeError, match=what):
                rpc.autograd.backward(cid, bad)
        with pytest.raises(RuntimeError, match="Already have an autograd context"):
            with rpc.autograd.context():
                pass
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        rpc.autograd.backward(cid, [(x * 2.0).sum()])


def test_message_types():
    """Autograd's traffic goes as torch's message types (counted where each
    request is sent): a call in a context as FORWARD_AUTOGRAD_REQ, never a
    PYTHON_CALL; gradients as BACKWARD_AUTOGRAD_REQ, both ways; leaving as
    CLEANUP_AUTOGRAD_CONTEXT_REQ; RRef.backward on a user as RREF_BACKWARD_REQ.
    A remote() in a context goes as FORWARD_AUTOGRAD_REQ too. Outside a
    context a call is a PYTHON_CALL."""
    x = weights(4, 5, 0.5)
    before1 = rpc.rpc_sync("worker1", sent)
    trace = flight_recorder()
    before = sent()
    with rpc.autograd.context() as cid:
        h = rpc.rpc_sync("worker1", layer1, args=(x,))
        rpc.autograd.backward(cid, [h.sum()])
    # A context of its own: in torch's FAST mode a pass waits on each worker
    # until every send that worker made in the context got its gradients,
    # and rr's graph does not reach h's.
    with rpc.autograd.context() as cid:
        rr = rpc.remote("worker1", loss_of, args=(x,))
        rr.backward(cid)
        inside = sent()
    after = sent()
    if trace is None:
        print(f"autograd: no {INSPECT}: the flight recorder is not looked at", file=sys.stderr)
    else:
        # A request run at once by the thread that took it off the ring
        # is one record, received and started.
        seen = {("received" if r["kind"] == "recv+start" else r["kind"], r["type"])
                for r in records_since(trace)}
        want = {("sent", "FORWARD_AUTOGRAD_REQ"), ("completed", "FORWARD_AUTOGRAD_RESP"),
                ("sent", "BACKWARD_AUTOGRAD_REQ"), ("completed", "BACKWARD_AUTOGRAD_RESP"),
                ("received", "BACKWARD_AUTOGRAD_REQ"), ("finished", "BACKWARD_AUTOGRAD_RESP"),
                ("sent", "RREF_BACKWARD_REQ"), ("completed", "RREF_BACKWARD_RESP"),
                ("sent", "CLEANUP_AUTOGRAD_CONTEXT_REQ"),
                ("completed", "CLEANUP_AUTOGRAD_CONTEXT_RESP")}
        assert want <= seen, f"the flight recorder misses {want - seen}"
        assert (not {("sent", "PYTHON_CALL"), ("completed", "PYTHON_RET"),
                   ("sent", "PYTHON_REMOTE_CALL"), ("completed", "REMOTE_RET")} & seen), \
            f"no PYTHON_CALL or PYTHON_REMOTE_CALL in the context's traffic: {sorted(seen)}"
    after1 = rpc.rpc_sync("worker1", sent)
    grew = {k: after[k] - before[k] for k in after}
    assert sent()["PYTHON_CALL"] == after["PYTHON_CALL"] + 1, \
        "a call outside a context is a PYTHON_CALL"
    assert inside["PYTHON_CALL"] == before["PYTHON_CALL"], \
        f"no PYTHON_CALL inside the context: {before} -> {inside}"
    assert grew["FORWARD_AUTOGRAD_REQ"] == 2, f"the forward call and the remote: {grew}"
    assert grew["BACKWARD_AUTOGRAD_REQ"] == 1, f"h's gradient to worker1: {grew}"
    assert grew["RREF_BACKWARD_REQ"] == 1, f"rr.backward: {grew}"
    assert grew["CLEANUP_AUTOGRAD_CONTEXT_REQ"] == 2, f"leaving releases worker1's: {grew}"
    assert grew["PYTHON_CALL"] == 0 and grew["PYTHON_REMOTE_CALL"] == 0, \
        f"no PYTHON_CALL or PYTHON_REMOTE_CALL for the context: {grew}"
    back = after1["BACKWARD_AUTOGRAD_REQ"] - before1["BACKWARD_AUTOGRAD_REQ"]
    assert back == 2, f"worker1 sent x's gradients back, for h and for rr: {back}"
    assert after1["FORWARD_AUTOGRAD_REQ"] == before1["FORWARD_AUTOGRAD_REQ"], \
        "worker1 made no call"


def test_outside_context():
    x = torch.ones(2, requires_grad=True)
    assert rpc.rpc_sync("worker1", info, args=(x,)) == (True, True), \
        "outside a context a tensor that requires grad arrives as a leaf that requires grad"
    back = rpc.rpc_sync("worker1", echo, args=(x,))
    assert back.requires_grad and back.is_leaf and torch.equal(back.detach(), x.detach()), \
        "and comes back the same way"


def test_no_context_left():
    live = [rpc.rpc_sync(f"worker{r}", num_contexts) for r in range(3)]
    assert live == [0, 0, 0], f"no context left on any worker: {live}"


def make_linear():
    torch.manual_seed(3)
    return torch.nn.Linear(5, 2)


def forward_through(layer_rref, x):
    """On the owner: the live module's forward."""
    return layer_rref.local_value()(x)


def grads_keyed_by_parameters(layer_rref, cid):
    """On the owner: the context's gradients are keyed by the very tensors
    local_value().parameters() returns, and match a local computation."""
    grads = rpc.autograd.get_gradients(cid)
    params = list(layer_rref.local_value().parameters())
    return [p in grads for p in params], [grads[p].clone() for p in params if p in grads]


def test_gradients_of_live_parameters():
    x = weights(4, 5, 0.5).detach().float()
    layer = rpc.remote("worker1", make_linear)
    with rpc.autograd.context() as cid:
        out = rpc.rpc_sync("worker1", forward_through, args=(layer, x))
        rpc.autograd.backward(cid, [(out ** 2).sum()])
        present, got = rpc.rpc_sync("worker1", grads_keyed_by_parameters, args=(layer, cid))
    assert present == [True, True], "get_gradients is keyed by the owner's parameters"
    ref = make_linear()
    (ref(x) ** 2).sum().backward()
    assert close(got[0], ref.weight.grad) and close(got[1], ref.bias.grad)
