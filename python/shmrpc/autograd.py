"""Distributed autograd over shmrpc (issue 10): torch.distributed.autograd's
FAST mode, in Python on top of the package, over torch's own graph and
engine.

    with shmrpc.autograd.context() as cid:
        loss = rpc.rpc_sync("worker1", layer1, args=(x,)).sum()
        shmrpc.autograd.backward(cid, [loss])
        grads = shmrpc.autograd.get_gradients(cid)   # {tensor: gradient} here

Every call made inside a context carries its id; the callee runs the
function inside the same id (so calls it makes carry it on). The graph is
torch's: the tensors that require grad in one message sent inside a
context (a call's arguments, a result) get one SendRpcBackward node whose
next_functions are their gradient edges, recorded in the sender's context
under the message's autograd message id (_send_functions()); they travel
detached with (context id, sender rank, that id), and on the receiver
they become the outputs of one RecvRpcBackward node (they are not leaves:
their grad_fn is it), recorded under the same id (_recv_functions()). Both
are torch.autograd.Functions whose nodes carry torch's names.

backward() runs torch's engine (torch.autograd.backward) on each worker:
from the roots on the caller; a RecvRpcBackward it reaches hands its
gradients over, and after the run they go to the sender, which runs the
engine from that message's SendRpcBackward with them (and so on across
workers). A leaf's gradient goes through its AccumulateGrad node as in a
local backward, so its hooks and the node's post hooks run and torch's
rules for keeping a gradient without a copy hold; .grad is borrowed for
the run and put back, the gradient kept in the context's table on that
worker (not in .grad). As torch's FAST mode, backward() on a worker
returns once every send it made in the context ran: one whose result the
roots do not use never does, and backward() waits forever, as torch's.
On a program's thread (not an executor's), the runs that requests bring
for that worker's sends are handed to the thread that called backward(),
so its whole part runs there, under its profiler and thread-local state.
Leaving the context releases it here and on every worker it reached.

The messages are torch's (docs/PROTOCOL.md): a call made inside a context
goes as FORWARD_AUTOGRAD_REQ [context id, autograd message id, PYTHON_CALL]
and is answered FORWARD_AUTOGRAD_RESP wrapping the PYTHON_RET likewise; a
remote() made there as FORWARD_AUTOGRAD_REQ wrapping the PYTHON_REMOTE_CALL,
answered FORWARD_AUTOGRAD_RESP wrapping REMOTE_RET (the owner stores the
result; a to_here() in the context fetches it as a message of the owner's
in that context, with its SendRpcBackward there); the gradients of a
worker's sends go to it as BACKWARD_AUTOGRAD_REQ, leaving a context as
CLEANUP_AUTOGRAD_CONTEXT_REQ, RRef.backward on a user as RREF_BACKWARD_REQ.
A message's autograd message id travels in the pickle beside its tensors.

Outside a context, a tensor that requires grad arrives as a leaf that
requires grad, cut from the sender's graph (as torch 1.13 does).

An RRef's value is its owner's live object (as torch's), so a parameter
behind an RRef is the tensor the owner's model uses: its gradients in a
context, and an optimizer stepping it (shmrpc.optim), are that tensor's.

A worker that dies fails the backward passes that need it, with an error
naming it ("worker 2 (worker2) died: ..."); leaving a context skips the
dead workers it reached. A worker that learns of a death that way (a call
to the dead worker failing) also releases the contexts the dead worker had
made, here and on the workers they reached: nobody else would.

Differences from torch: calls made inside a context carry it even without
tensors that require grad (torch only propagates it with such tensors);
a worker other than the caller runs the engine once per request that
brings gradients (torch runs one graph task per pass there, with all its
sends as roots), so a node two sends share runs once for each, the
senders' graphs are always retained until the context is left, and only
the caller's run honours retain_graph=False; one engine run at a time per
worker (the borrowed .grad); leaving a context waits for the rpc_async
calls made in it, but not for remote() calls still running (one that
starts after the context was left re-creates it on its worker); tensors
that go through the pickle rather than the pool (bool, bfloat16, empty)
arrive without graph connection.
"""
import contextlib
import functools
import re
import threading

from . import _shmrpc
from ._contexts import (  # noqa: F401  (torch.distributed.autograd's names too)
    _tls, _lock, _contexts, _torch, _my_rank, _graph_nodes, DistAutogradContext, is_available,
    _current_context, _new_context, _is_valid_context, _retrieve_context, _get_max_id,
    _retrieve, _num_contexts, _current, _message_id)
from ._futures import Future
from ._marshal import _dumps, _loads, _rref_of

__all__ = ["context", "backward", "get_gradients"]
_backward_passes = 0  # contexts with a backward pass running here (under _lock)


# One local engine run at a time on this worker: each borrows the .grad of
# the leaves it reaches (_run_engine).
_engine_lock = threading.RLock()


# The C half's text for a call to a worker that died (worker/agent.c).
_DIED = re.compile(r"worker (\d+) \([^)]*\) died")


def _release_context(context_id):
    """torch's: releases the context here and on the workers it reached."""
    _retrieve(context_id)
    if getattr(_current(), "id", None) == context_id:
        _tls.ctx = None
    _release(context_id, _my_rank())


def _get_debug_info():
    """torch's dist_autograd._get_debug_info()."""
    return _debug_info()


def _debug_info():
    """torch's dist_autograd._get_debug_info(): the contexts this worker
    holds and the backward passes running on it."""
    with _lock:
        return {"num_autograd_contexts": len(_contexts),
                "num_current_backward_passes": _backward_passes}


@contextlib.contextmanager
def context():
    """A distributed autograd context: yields its id, unique in the job."""
    ctx = _new_context()
    cid = ctx.id
    try:
        yield cid
    finally:
        _tls.ctx = None
        _wait_all(ctx.pending)  # their errors: the caller saw them, or will
        _release(cid, _my_rank())


def _release(cid, caller):
    """Drops the context here, then on the workers it reached (each drops
    it once: the first release that finds it passes it on)."""
    with _lock:
        ctx = _contexts.pop(cid, None)
    if ctx is None:
        return
    me = _my_rank()
    # Best effort, as torch's: a worker that died or left has nothing to release.
    _wait_all([_send(w, _shmrpc.CLEANUP_AUTOGRAD_CONTEXT_REQ, cid, "_release")
               for w in sorted(ctx.known - {me, caller})])


def _send(dst, msg_type, cid, name, obj=None, rref=None, retain_graph=False):
    """A Future for the autograd request msg_type to rank dst in context
    cid: a BACKWARD_AUTOGRAD_REQ carries obj pickled (its tensors through
    the pool), an RREF_BACKWARD_REQ rref and retain_graph (worker/python.h).
    Its reply holds None or the error raised there. A request that cannot
    even start (its worker is gone) gives a Future holding the error. name:
    the profiler's."""
    try:
        data, rrefs, tensors = _dumps(obj) if obj is not None else (b"", [], [])
        if rref is not None:
            rrefs = [rref._r]
        return Future(_c=_shmrpc.call(dst, data, rrefs, tensors, _shmrpc.TIMEOUT_DEFAULT,
                                      "rpc_async", name, msg_type, cid, _message_id(),
                                      retain_graph))
    except Exception as e:
        fut = Future()
        fut.set_exception(e)
        return fut


class _BackwardFailed:
    """A backward pass's error on its way back to the caller: torch's text,
    "Error on Node N: what", made once where it happened, so that it
    arrives as it was, not nested in each hop's RemoteException."""

    def __init__(self, text):
        self.text = text


def _node_error(e):
    """e, raised by this worker's part of a backward pass, as torch's
    RuntimeError("Error on Node N: ..."); one made on another node as it is."""
    if isinstance(e, RuntimeError) and str(e).startswith("Error on Node "):
        return e
    return RuntimeError(f"Error on Node {_my_rank()}: {e}")


def _outcome(fut):
    """fut's value, a _BackwardFailed raised as its RuntimeError."""
    value = fut.wait()
    if isinstance(value, _BackwardFailed):
        raise RuntimeError(value.text)
    return value


def _serve(msg_type, caller, cid, retain_graph, msg):
    """On the callee: the autograd request msg_type from caller (msg: the
    C half's (pickle, [RRef], [Tensor])); its result (a backward's error as
    a _BackwardFailed)."""
    try:
        if msg_type == _shmrpc.BACKWARD_AUTOGRAD_REQ:
            return _backward_from_sends(cid, _loads(msg))
        if msg_type == _shmrpc.RREF_BACKWARD_REQ:
            return _rref_backward_on_owner(_rref_of(msg[1][0]), cid, retain_graph)
    except RuntimeError as e:
        if str(e).startswith("Error on Node "):
            return _BackwardFailed(str(e))
        raise
    if msg_type == _shmrpc.CLEANUP_AUTOGRAD_CONTEXT_REQ:
        return _release(cid, caller)
    raise RuntimeError(f"message type {msg_type} is not one of distributed autograd's")


def _wait_all(futs):
    """Waits for every future; their errors, in order. An error saying a
    worker died releases the contexts that worker made (see the module's
    docstring)."""
    errors = []
    for fut in futs:
        try:
            _outcome(fut)
        except Exception as e:
            errors.append(e)
            for rank in {int(r) for r in _DIED.findall(str(e))}:
                _orphaned_by(rank)
    return errors


def _orphaned_by(rank):
    """rank died: release the contexts it made."""
    with _lock:
        orphans = [cid for cid in _contexts if cid >> 48 == rank]
    for cid in orphans:
        _release(cid, rank)


def _leaves(roots, anchor):
    """The leaves (tensors that require grad and have no grad_fn) that the
    graphs of roots (non-leaves) reach, but the anchor."""
    leaves, seen, stack = {}, set(), [r.grad_fn for r in roots]  # roots have one (backward())
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf's
        if var is not None and var is not anchor:
            leaves[id(var)] = var
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return list(leaves.values())


def _unshared(seen, grad):
    """A leaf's last hook in an engine run: a gradient that another leaf of
    the run got too is copied. torch's distributed engine holds every
    gradient it captured until all are accumulated, so such a gradient is
    copied for each leaf; the local engine would let the last leaf keep it."""
    key = (grad._values() if grad.is_sparse else grad).data_ptr()
    if key in seen:
        return grad.clone()
    seen.add(key)
    return None


def _run_engine(ctx, tensors, grads, retain_graph):
    """One run of torch's engine on this worker, from tensors with grads.
    The gradients of the leaves it reaches accumulate in ctx, as torch's
    distributed engine does it: through each leaf's AccumulateGrad, so that
    the leaf's hooks and the node's post hooks run and a gradient is kept
    without a copy where torch keeps it; .grad is borrowed for the run (put
    back after it, hence one run at a time here). Returns what the
    RecvRpcBackward nodes it ran handed back: {sender rank: [(message id,
    gradients)]}."""
    torch = _torch()
    leaves = _leaves(tensors, _graph_nodes()[2])
    with _engine_lock:
        saved = [leaf.grad for leaf in leaves]
        seen = set()
        handles = [leaf.register_hook(functools.partial(_unshared, seen)) for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        outer, _tls.outgoing = _tls.outgoing, {}
        try:
            torch.autograd.backward(tensors, grads, retain_graph=retain_graph)
        except Exception as e:
            raise _node_error(e) from e
        finally:
            outgoing, _tls.outgoing = _tls.outgoing, outer
            for h in handles:
                h.remove()
            got = [leaf.grad for leaf in leaves]
            for leaf, old in zip(leaves, saved):
                leaf.grad = old
    for leaf, grad in zip(leaves, got):
        if grad is not None:
            ctx.accumulate(leaf, grad)
    return outgoing


@contextlib.contextmanager
def _pass_running(ctx):
    """Counts ctx's backward pass as running here (_debug_info: torch
    counts one per context, however many requests it takes here)."""
    global _backward_passes
    with _lock:
        ctx.passes += 1
        _backward_passes += ctx.passes == 1
    try:
        yield
    finally:
        with _lock:
            ctx.passes -= 1
            _backward_passes -= ctx.passes == 0


def _send_back(ctx, outgoing):
    """The gradients an engine run got for received tensors on their way to
    their senders, each of which goes on with them (torch's FAST mode): the
    futures of those requests."""
    return [_send(w, _shmrpc.BACKWARD_AUTOGRAD_REQ, ctx.id, "_backward_from_sends", obj=items)
            for w, items in outgoing.items()]


def _raise_first(futs):
    errors = _wait_all(futs)  # all of them, then the first error
    if errors:
        raise errors[0]


class _Arrival:
    """A request's gradients [(message id, gradients)] for sends of a
    context: its engine step, run by the thread that serves the context's
    backward pass here if there is one (_serve_pass), else (or given back
    unrun as that pass ends) by the request's."""

    def __init__(self, items):
        self.items = items
        self.ran = threading.Event()
        self.futs = None
        self.error = None

    def run(self, ctx):
        try:
            torch = _torch()
            with ctx.lock:
                outs = [ctx.sends.get(message_id) for message_id, _ in self.items]
            for out, (message_id, _) in zip(outs, self.items):
                if out is None:
                    raise RuntimeError(f"Error on Node {_my_rank()}: gradients came for message "
                                       f"{message_id}, which this worker did not send in "
                                       f"context {ctx.id}")
            # A send may get gradients from several requests (a receiver
            # whose engine runs reached its RecvRpcBackward more than once):
            # each sets them and runs, the two under the engine lock.
            with _engine_lock:
                for out, (_, grads) in zip(outs, self.items):
                    out.grad_fn.grads = grads
                # Retained: another request may bring gradients for sends that share it.
                outgoing = _run_engine(ctx, outs, [torch.empty(0)] * len(outs), True)
            self.futs = _send_back(ctx, outgoing)
            with ctx.lock:
                if ctx.unrun is not None:
                    ctx.unrun.difference_update(message_id for message_id, _ in self.items)
                    ctx.done.notify_all()
        except BaseException as e:
            self.error = e
        finally:
            self.ran.set()


def _backward_from_sends(cid, items):
    """On a sender: the gradients [(message id, gradients)] of its sends in
    context cid; the backward pass goes on from their SendRpcBackward nodes."""
    ctx = _retrieve(cid)
    job = _Arrival(items)
    with _pass_running(ctx):
        with ctx.lock:
            handed = ctx.inbox is not None  # never this thread's own: an executor's
            if handed:
                ctx.inbox.append(job)
                ctx.done.notify_all()
        if handed:
            with _counted_out():
                job.ran.wait()
        if not handed or job.futs is None and job.error is None:  # or given back unrun
            job.run(ctx)
        if job.error is not None:
            raise job.error
        _raise_first(job.futs)


@contextlib.contextmanager
def _counted_out():
    """Around a wait for another thread: an executor thread is counted out
    of the pool meanwhile, so that what it waits for runs on another
    (worker/executor.h; Future.wait's reason)."""
    _shmrpc.blocking(True)
    try:
        yield
    finally:
        _shmrpc.blocking(False)


def _serve_pass(ctx, futs):
    """The rest of a backward pass started on this thread: waits for futs.
    As torch's FAST mode, it also waits until each of this worker's sends
    in ctx ran: one whose result the roots do not use never does, and it
    waits forever. A thread of the program (not an executor's) runs
    meanwhile the engine steps of the requests that bring gradients for
    those sends (handed over by _backward_from_sends), so that this
    worker's whole part of the pass runs on it, under its profiler and
    thread-local state, as torch's engine does."""
    if ctx.inbox is None:  # on an executor: the requests run their steps
        _raise_first(futs)
        with _counted_out(), ctx.lock:
            while ctx.unrun:
                ctx.done.wait()
        return

    def wake(_):
        with ctx.lock:
            ctx.done.notify_all()

    for fut in futs:
        fut.add_done_callback(wake)
    while True:
        with ctx.lock:
            jobs, ctx.inbox = ctx.inbox, []
            settled = all(f.done() for f in futs)
            unrun = bool(ctx.unrun)
        if not jobs:
            # (_failed may complete a Future here, running wake: not under ctx.lock.)
            if settled and (not unrun or _failed(futs)):
                break
            with ctx.lock:
                if (not ctx.inbox and all(f.done() for f in futs) == settled
                        and bool(ctx.unrun) == unrun):
                    # wake needs an executor to run: look again now and
                    # then should none be free.
                    ctx.done.wait(None if settled else 0.05)
            continue
        for job in jobs:
            job.run(ctx)
            for fut in job.futs or ():  # waited for by the job's own request too
                fut.add_done_callback(wake)
                futs.append(fut)
    _raise_first(futs)


def _failed(futs):
    """Whether one of the completed futs failed (without waiting, nor
    _wait_all's cleanup: that comes once the pass ends)."""
    for fut in futs:
        try:
            _outcome(fut)
        except Exception:
            return True
    return False


def backward(context_id, roots, retain_graph=False):
    """Runs the backward pass from roots (scalars) across every worker the
    context's forward reached; the gradients accumulate in the context
    (get_gradients on each worker). As torch's FAST mode, it returns once
    every send this worker made in the context got its gradients: one whose
    result the roots do not use never does, and backward() waits forever."""
    torch = _torch()
    if not isinstance(context_id, int) or not isinstance(roots, (list, tuple)):
        raise TypeError("backward(): incompatible function arguments. The following argument "
                        "types are supported: (context_id: int, roots: List[Tensor], "
                        f"retain_graph: bool = False); got {type(context_id).__name__}, "
                        f"{type(roots).__name__}")
    ctx = _retrieve(context_id)
    roots = list(roots)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for r in roots:
        if not isinstance(r, torch.Tensor) or not r.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if r.numel() != 1:
            raise RuntimeError(" is not a scalar, all roots need to be scalar")
        if r.grad_fn is None:
            raise RuntimeError(" does not have a valid gradient function.")
    with torch.autograd.profiler.record_function("torch::distributed::autograd::backward"), \
            _pass_running(ctx):
        with ctx.lock:
            if ctx.unrun is not None:
                raise RuntimeError("a distributed backward pass is already running in context "
                                   f"{context_id} on this worker: two at once in one context "
                                   "are not supported yet; run them one after the other")
            ctx.unrun = set(ctx.sends)
            # An executor thread is not this pass's alone (it may run
            # queued work a call it waits for needs): the requests run
            # their steps themselves then.
            if not _shmrpc.on_executor():
                ctx.inbox = []
        try:
            _serve_pass(ctx, _send_back(ctx, _run_engine(
                ctx, roots, [torch.ones_like(r) for r in roots], retain_graph)))
        finally:
            with ctx.lock:
                left, ctx.unrun, ctx.inbox = ctx.inbox or [], None, None
            for job in left:  # handed over too late: given back to their requests
                job.ran.set()


def get_gradients(context_id):
    """{tensor: gradient} accumulated in the context on this worker."""
    ctx = _retrieve(context_id)
    with ctx.lock:
        return {t: g for t, g in ctx.grads.values()}


def _rref_backward_on_owner(rref, context_id, retain_graph):
    """On the owner: backward from the RRef's value in the context."""
    torch = _torch()
    value = rref.local_value()
    if not isinstance(value, torch.Tensor):
        raise RuntimeError("RRef should contain a tensor for .backward()")
    backward(context_id, [value], retain_graph)


def _rref_backward(rref, dist_autograd_ctx_id, retain_graph):
    """RRef.backward: on the owner, or through a call to it; without a
    context (-1) torch.autograd's local backward on the owner, as torch's."""
    if dist_autograd_ctx_id == -1:
        if not rref.is_owner():
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        value = rref.local_value()
        if not isinstance(value, _torch().Tensor):
            raise RuntimeError("RRef should contain a tensor for .backward()")
        return _torch().autograd.backward(value, retain_graph=retain_graph)
    if rref.is_owner():
        return _rref_backward_on_owner(rref, dist_autograd_ctx_id, retain_graph)
    return _outcome(_send(rref.owner().id, _shmrpc.RREF_BACKWARD_REQ, dist_autograd_ctx_id,
                          "_rref_backward_on_owner", rref=rref, retain_graph=retain_graph))
