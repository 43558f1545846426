"""Distributed autograd's state on this worker (shmrpc.autograd tells the
whole design): the contexts, torch's graph nodes of the messages sent and
received in them (SendRpcBackward, RecvRpcBackward), and the hooks the
pickler and the calls use (_Outgoing, _Incoming, _calling, _message_id,
_running_in). Below the pickler; the backward pass itself, which sends
and receives, is shmrpc.autograd's.
"""
import contextlib
import itertools
import threading

from . import _shmrpc


class _ThreadState(threading.local):
    """This thread's: ctx, its context (a _Context); outgoing, see
    _run_engine. None until set, read as plain attributes: a getattr with a
    default that misses raises and catches an AttributeError, which cost
    about half of an empty call's Python work on the caller (_calling).
    Setting ctx tells the C half too (_shmrpc.set_in_context), whose
    common call asks a thread-local flag rather than this object."""
    _ctx = None
    outgoing = None

    @property
    def ctx(self):
        return self._ctx

    @ctx.setter
    def ctx(self, ctx):
        self._ctx = ctx
        _shmrpc.set_in_context(ctx is not None)


_tls = _ThreadState()
_lock = threading.Lock()
_contexts = {}  # context id -> _Context
_counter = itertools.count()
_message_ids = itertools.count()


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("shmrpc.autograd (distributed autograd) needs torch: "
                          "install python3-torch") from None
    return torch


def _my_rank():
    return _shmrpc.worker_info(None)[1]


_nodes = None  # (SendRpcBackward's Function, RecvRpcBackward's Function, anchor), made once


def _graph_nodes():
    """torch's two graph functions as torch.autograd.Functions (made on
    first use: the package imports without torch). Their backward nodes
    are named as torch's C++ ones (node.name(), the profiler's events).

    Send: applied to the tensors that require grad in one message; its node's
    next_functions are their gradient edges, its one output an empty tensor
    to run the engine from, with the gradients received for the message
    set on the node beforehand (node.grads).

    Recv: makes the tensors received in one message its outputs, in place
    (they arrive as plain tensors and become non-leaves whose grad_fn is
    the node, as torch's). A Function needs an input that requires grad to
    make a node: the anchor, an empty leaf that never gets a gradient. Its
    backward hands the gradients to the engine run in progress (_tls.outgoing),
    which sends them to the sender after the run."""
    global _nodes
    if _nodes is not None:
        return _nodes
    torch = _torch()

    class SendRpc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):
            ctx.grads = None
            return torch.empty(0)

        @staticmethod
        def backward(ctx, _):
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise RuntimeError("SendRpcBackward ran without the gradients of its message: "
                                   "only shmrpc.autograd.backward runs it")
            return tuple(grads)

    class RecvRpc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, anchor, *tensors):
            ctx.mark_dirty(*tensors)
            ctx.set_materialize_grads(False)
            return tensors

        @staticmethod
        def backward(ctx, *grads):
            outgoing = _tls.outgoing
            if outgoing is None:
                raise RuntimeError("a tensor received over RPC in a distributed autograd context "
                                   "gets its gradient from shmrpc.autograd.backward(context_id, "
                                   "roots) only, not from torch.autograd")
            outgoing.setdefault(ctx.sender, []).append((ctx.message_id, list(grads)))
            return (None,) * (1 + len(grads))

    SendRpc._backward_cls.__name__ = "torch::distributed::autograd::SendRpcBackward"
    RecvRpc._backward_cls.__name__ = "torch::distributed::autograd::RecvRpcBackward"
    _nodes = (SendRpc, RecvRpc, torch.empty(0, requires_grad=True))
    return _nodes


class _Context:
    def __init__(self, cid):
        self.id = cid
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)  # notified as a pass moves on (_serve_pass)
        self.sends = {}     # autograd message id -> SendRpcBackward's output (grad_fn: the node)
        self.recvs = {}     # autograd message id -> RecvRpcBackward node
        self.grads = {}     # id(tensor) -> (tensor, accumulated gradient)
        self.known = set()  # ranks this context reached or came from
        self.pending = []   # rpc_async futures made in the context
        self.unrun = None   # in a backward pass started here: the sends not run yet
        self.passes = 0     # requests and backward() calls of its passes running here (under _lock)
        self.inbox = None   # in a backward pass started here on a program thread: _Arrivals for it

    def accumulate(self, tensor, grad):
        with self.lock:
            old = self.grads.get(id(tensor))
            self.grads[id(tensor)] = (tensor, grad if old is None else old[1] + grad)

    # torch's DistAutogradContext methods (its tests call them).
    def _context_id(self):
        return self.id

    def _known_worker_ids(self):
        with self.lock:
            return set(self.known) - {_my_rank()}

    def _send_functions(self):
        with self.lock:
            return {k: out.grad_fn for k, out in self.sends.items()}

    def _recv_functions(self):
        with self.lock:
            return dict(self.recvs)


DistAutogradContext = _Context


def is_available():
    return True


def _current_context():
    """torch's: this thread's context; RuntimeError outside one."""
    ctx = _current()
    if ctx is None:
        raise RuntimeError("Current thread doesn't have a valid autograd context. Please wrap "
                           "your code using: `with torch.distributed.autograd.context() as "
                           "context_id` to generate a valid context")
    return ctx


def _new_context():
    """torch's: a new context made current in this thread (leave it with
    _release_context)."""
    _torch()
    if _current() is not None:
        raise RuntimeError("Already have an autograd context id for this thread.")
    ctx = _get_or_create((_my_rank() << 48) | next(_counter))
    _tls.ctx = ctx
    return ctx


def _is_valid_context(context_id):
    with _lock:
        return context_id in _contexts


def _retrieve_context(context_id):
    return _retrieve(context_id)


def _get_max_id():
    """The largest context id this worker can make (torch's: its rank's range)."""
    return (_my_rank() << 48) | ((1 << 48) - 1)


def _missing(cid):
    return RuntimeError(f"Could not find autograd context with id: {cid}")


def _retrieve(cid):
    with _lock:
        ctx = _contexts.get(cid)
    if ctx is None:
        raise _missing(cid)
    return ctx


def _get_or_create(cid):
    with _lock:
        ctx = _contexts.get(cid)
        if ctx is None:
            ctx = _contexts[cid] = _Context(cid)
        return ctx


def _num_contexts():
    """How many contexts this worker holds (torch: num_autograd_contexts)."""
    with _lock:
        return len(_contexts)


def _current():
    return _tls.ctx


@contextlib.contextmanager
def _running_in(cid, caller):
    """On the callee: the function runs inside the caller's context (None:
    none)."""
    ctx = None
    if cid is not None:
        ctx = _get_or_create(cid)
        with ctx.lock:
            ctx.known.add(caller)
    saved, _tls.ctx = _current(), ctx
    try:
        yield
    finally:
        _tls.ctx = saved


# The hooks of the pickler and the calls (shmrpc._marshal, shmrpc._calls).


def _calling(dst):
    """A call to rank dst is being packed: the context id it carries."""
    ctx = _tls.ctx  # _current(), without a call: every call asks
    if ctx is None:
        return None
    with ctx.lock:
        ctx.known.add(dst)
    return ctx.id


def _message_id():
    """A new autograd message id, unique in the job (torch's: the rank in
    the top 16 bits)."""
    return (_my_rank() << 48) | next(_message_ids)


def _called(fut):
    """An rpc_async call made in the context: leaving waits for it."""
    ctx = _current()
    if ctx is not None:
        with ctx.lock:
            ctx.pending.append(fut)


class _Outgoing:
    """The tensors that require grad in one message being pickled (the
    package's pickler makes one at the first of them): each travels with
    (context id or None outside one, sender rank, autograd message id);
    sent() records them, in a context, as one SendRpcBackward under that
    id, as torch does for each message."""

    def __init__(self):
        self.ctx = _current()
        self.meta = (None if self.ctx is None else self.ctx.id, _my_rank(), _message_id())
        self.tensors = []

    def add(self, tensor):
        self.tensors.append(tensor)
        return self.meta

    def sent(self):
        if self.ctx is None:
            return
        torch = _torch()
        with torch.enable_grad():  # a node even where the sender turned grad mode off
            out = _graph_nodes()[0].apply(*self.tensors)
        with self.ctx.lock:
            self.ctx.sends[self.meta[2]] = out


class _Incoming:
    """The tensors that required grad in one message being unpickled (the
    package's unpickler makes one at the first of them). mode: "call" (a
    callee's arguments: the context is created here if need be) or
    "result" (a reply: attached only while the context lives here)."""

    def __init__(self, mode):
        self.mode = mode
        self.meta = None
        self.tensors = []

    def add(self, tensor, meta):
        """The tensor as the program gets it: not a view (RecvRpcBackward
        makes it its output in place, which a view's autograd forbids)."""
        tensor = tensor.detach()
        self.meta = meta
        self.tensors.append(tensor)
        return tensor

    def received(self):
        """The message is unpickled: in a context, its tensors become one
        RecvRpcBackward's outputs, recorded under the sender's message id;
        outside one, leaves that require grad (torch 1.13's)."""
        cid, sender, message_id = self.meta
        ctx = None
        if cid is not None:
            if self.mode == "call":
                ctx = _get_or_create(cid)
            else:
                with _lock:
                    ctx = _contexts.get(cid)
        if ctx is None:
            for t in self.tensors:
                t.requires_grad_(True)
            return
        _, recv, anchor = _graph_nodes()
        with _torch().enable_grad():
            node = recv.apply(anchor, *self.tensors)[0].grad_fn
        node.sender, node.message_id = sender, message_id
        with ctx.lock:
            ctx.recvs[message_id] = node
            ctx.known.add(sender)


# The user's API.
