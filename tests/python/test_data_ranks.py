# shmrun: -n 3 --pool-size 64M
# needs: has("torch")
"""shmrpc.data.DataLoader inside an shmrun job, loading on other ranks of
the job (workers=[...]): the dataset travels to them pickled, and the
batches, their order and the workers' random numbers are still torch's.
A 3-worker job: rank 0 trains, ranks 1 and 2 load (serve: conftest.py)."""
import pytest
import torch
import torch.utils.data as tud

import shmrpc.data as sd
from test_data_order import Shards, Squares, compare

LOADERS = ["worker1", "worker2"]


class Faulty(tud.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 5:
            raise ValueError("item 5 is bad")
        return torch.tensor([i])


def on(mod, **kw):
    """The shmrpc loader loads on LOADERS; torch's forks 2 workers."""
    return {"workers": LOADERS} if mod is not tud else {"num_workers": 2}


DS = Squares(29)
CASES = [
    ("ranks: sequential", lambda m: m.DataLoader(DS, batch_size=4, **on(m)), 1),
    ("ranks: shuffle, 2 epochs",
     lambda m: m.DataLoader(DS, batch_size=3, shuffle=True, **on(m)), 2),
    ("ranks: persistent, 2 epochs",
     lambda m: m.DataLoader(DS, batch_size=5, shuffle=True, persistent_workers=True, **on(m)), 2),
    ("ranks: iterable", lambda m: m.DataLoader(Shards(17), batch_size=4, **on(m)), 1),
]


@pytest.mark.parametrize("what, make, n_epochs", CASES, ids=[c[0] for c in CASES])
def test_as_torch(what, make, n_epochs):
    compare(what, make, n_epochs)


def test_exception_in_a_loading_rank():
    with pytest.raises(ValueError, match=r"(?s)Caught ValueError in DataLoader worker process 0\.\n"
                       r".*item 5 is bad"):
        list(sd.DataLoader(Faulty(), batch_size=2, workers=LOADERS))
