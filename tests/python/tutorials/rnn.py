"""An RNN with a remote embedding table and decoder, as in PyTorch's RPC
tutorial ("Distributed RNN using Distributed Autograd and Distributed
Optimizer"): the trainer (rank 0) makes EmbeddingTable and Decoder on "ps"
with remote() and keeps the LSTM; the forward goes through the RRefs
(rref.local_value() on the owner); DistributedOptimizer gets every parameter
as an RRef (the ps's from rref.local_value().parameters()). The remote
layers must change, and the ps's gradients be keyed by its own parameters.
Rank 0 prints each step's loss, then "RESULT {json}".

    shmrun -n 2 -- python3 rnn.py shmrpc
    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python3 rnn.py torch
"""
import json
import os
import sys

import torch
import torch.nn as nn
from torch import optim

if (sys.argv[1:] or [os.environ.get("TUT_RPC", "torch")])[0] == "shmrpc":
    import shmrpc as rpc
    import shmrpc.autograd as dist_autograd
    from shmrpc.optim import DistributedOptimizer
    RANK, WORLD = int(os.environ["SHMRPC_RANK"]), int(os.environ["SHMRPC_WORLD_SIZE"])
else:
    import torch.distributed.rpc as rpc
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
RRef = rpc.RRef

EPOCHS, BATCHES = 4, 2


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module):
    param_rrefs = []
    for param in module.parameters():
        param_rrefs.append(RRef(param))
    return param_rrefs


def _parameter_values(module):
    return [p.detach().clone() for p in module.parameters()]


def _gradients_keyed_by_parameters(module, context_id):
    """On the ps: does the context's gradient table hold every parameter?"""
    grads = dist_autograd.get_gradients(context_id)
    return all(p in grads for p in module.parameters())


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp, dropout):
        super(EmbeddingTable, self).__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        # A generator of its own: the ps builds both modules at once.
        self.encoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(1))

    def forward(self, input):
        return self.drop(self.encoder(input)).cpu()


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super(Decoder, self).__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(2))
        self.decoder.bias.data.zero_()

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.0):
        super(RNNModel, self).__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params

    def remote_values(self):
        return (_remote_method(_parameter_values, self.emb_table_rref)
                + _remote_method(_parameter_values, self.decoder_rref))


def run_trainer():
    batch, ntoken, ninp, nhid, nindices, nlayers = 5, 10, 4, 6, 3, 2
    torch.manual_seed(0)
    hidden = (torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=2.0)
    criterion = torch.nn.CrossEntropyLoss()
    before = model.remote_values()
    generator = torch.Generator().manual_seed(3)

    batches = []
    for _ in range(BATCHES):
        data = torch.randint(0, ntoken, (batch, nindices), generator=generator)
        batches.append((data, (data + 1) % ntoken))  # to learn: the next token

    def get_next_batch():
        yield from batches

    result = {"losses": [], "grads_keyed": []}
    for epoch in range(EPOCHS):
        for step, (data, target) in enumerate(get_next_batch()):
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output.view(-1, ntoken), target.view(-1))
                dist_autograd.backward(context_id, [loss])
                result["grads_keyed"].append(
                    _remote_method(_gradients_keyed_by_parameters, model.emb_table_rref, context_id)
                    and _remote_method(_gradients_keyed_by_parameters, model.decoder_rref, context_id))
                opt.step(context_id)
            print(f"epoch {epoch} step {step} loss {loss.item():.6f}")
            result["losses"].append(loss.item())
    result["remote_param_change"] = max((a - b).abs().max().item()
                                        for a, b in zip(model.remote_values(), before))
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if RANK == 0:
        rpc.init_rpc("trainer", rank=RANK, world_size=WORLD)
        run_trainer()
    else:
        rpc.init_rpc("ps", rank=RANK, world_size=WORLD)
    rpc.shutdown()
