"""shmrpc.data.DataLoader inside an shmrun job, loading on other ranks of
the job (workers=[...]): the dataset travels to them pickled, and the
batches, their order and the workers' random numbers are still torch's.
Run as a 3-worker job: rank 0 trains, ranks 1 and 2 load."""
import os
import re
import sys

try:
    import torch
    import torch.utils.data as tud
except ImportError:  # the loader compares with torch's: nothing to test without it
    print("skip: no torch")
    sys.exit(0)

import shmrpc as rpc
from checks import check, failed
from data_order import Shards, Squares, compare

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


def main():
    ds = Squares(29)
    compare("ranks: sequential", lambda m: m.DataLoader(ds, batch_size=4, **on(m)))
    compare("ranks: shuffle, 2 epochs",
            lambda m: m.DataLoader(ds, batch_size=3, shuffle=True, **on(m)), n_epochs=2)
    compare("ranks: persistent, 2 epochs",
            lambda m: m.DataLoader(ds, batch_size=5, shuffle=True, persistent_workers=True,
                                   **on(m)), n_epochs=2)
    compare("ranks: iterable", lambda m: m.DataLoader(Shards(17), batch_size=4, **on(m)))
    import shmrpc.data as sd
    try:
        list(sd.DataLoader(Faulty(), batch_size=2, workers=LOADERS))
        check(False, "ranks: an exception in a loading rank is raised")
    except ValueError as e:
        check(re.search(r"Caught ValueError in DataLoader worker process 0\.\n.*item 5 is bad",
                        str(e), re.S), f"ranks: the worker's error: {e}")
    return failed()


if __name__ == "__main__":
    rank = int(os.environ["SHMRPC_RANK"])
    rpc.init_rpc(f"worker{rank}")
    rc = main() if rank == 0 else 0
    rpc.shutdown()
    sys.exit(rc)
