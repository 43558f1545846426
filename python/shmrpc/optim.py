"""shmrpc.optim.DistributedOptimizer: torch.distributed.optim's, over shmrpc.

    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
    with shmrpc.autograd.context() as cid:
        ...forward...
        shmrpc.autograd.backward(cid, [loss])
        opt.step(cid)

As torch's: the parameters' RRefs are grouped by owner; each owner makes
one local optimizer over its parameters (RRef.local_value() there: the
parameters themselves, see shmrpc.autograd); step(context_id) runs every
owner's optimizer with that context's gradients on it
(shmrpc.autograd.get_gradients), in parallel, waits for all of them and
raises the first error. Steps on one worker are serialized, as torch's.

Like torch's TorchScript optimizers (the default for SGD, Adam and the
others torch has functional versions of), a step updates only the
parameters that have a gradient in the context. Each local optimizer is
the live value of an RRef its owner holds (remote()), as torch's: it goes
when the DistributedOptimizer does.
"""
import threading

from . import autograd
from ._calls import RRef, rpc_async

__all__ = ["DistributedOptimizer"]

_step_lock = threading.Lock()  # one step at a time on this worker (torch's global_lock)


class _LocalOptimizer:
    def __init__(self, optimizer_class, param_rrefs, args, kwargs):
        self.params = [rref.local_value() for rref in param_rrefs]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id):
        grads = autograd.get_gradients(context_id)
        with _step_lock:
            for p in self.params:
                p.grad = grads.get(p)  # None: the optimizer leaves p alone
            self.optim.step()


def _new_local_optimizer(optimizer_class, param_rrefs, args, kwargs):
    """On the owner: the local optimizer, made here, in an RRef of its own
    (torch's); its construction's error raised to the caller."""
    return RRef(_LocalOptimizer(optimizer_class, param_rrefs, args, kwargs))


def _local_step(optimizer_rref, context_id):
    optimizer_rref.local_value().step(context_id)


def _wait_for_all(futs):
    """Every future's value; the first error once all are done."""
    results, error = [], None
    for fut in futs:
        try:
            results.append(fut.wait())
        except Exception as e:
            results.append(e)
            if error is None:
                error = e
    if error is not None:
        raise error
    return results


class DistributedOptimizer:
    """optimizer_class(params, *args, **kwargs) on each worker owning some
    of params_rref (RRefs to parameters), stepped together by step()."""

    def __init__(self, optimizer_class, params_rref, *args, **kwargs):
        per_owner = {}
        for rref in params_rref:
            per_owner.setdefault(rref.owner(), []).append(rref)
        # The first error of any owner's construction is raised here, as torch's.
        self.remote_optimizers = _wait_for_all(
            [rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
             for owner, rrefs in per_owner.items()])

    def step(self, context_id):
        """One step of every owner's optimizer with the gradients of
        context_id; returns when all are done."""
        autograd._retrieve(context_id)  # the context must live here (torch's check)
        _wait_for_all([rpc_async(r.owner(), _local_step, args=(r, context_id))
                       for r in self.remote_optimizers])
