# shmrun: none
# needs: has("torch")
"""shmrpc.data.DataLoader gives the batches torch.utils.data.DataLoader
gives, in the same order, for the same seeds: map-style and iterable
datasets, shuffle with a generator and with the global seed, drop_last,
custom collate, sampler and batch_sampler, no batching, num_workers
0/1/2/4, persistent workers over epochs, and per-worker random numbers
(the workers are seeded as torch seeds them)."""
import random
import sys

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import shmrpc.data as sd


class Squares(tud.Dataset):
    def __init__(self, n, shape=(3,)):
        self.n, self.shape = n, shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        # torch.rand, np.random and random: the worker's seeds decide them,
        # so they check the seeding.
        return {"x": torch.full(self.shape, float(i * i)), "r": torch.rand(2), "i": i,
                "np": np.arange(4, dtype=np.float32) + i, "npr": np.random.randint(1 << 30),
                "pyr": random.random(), "name": f"s{i}"}


class Shards(tud.IterableDataset):
    """Each worker yields its own share, as torch's docs shard."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        info = tud.get_worker_info()
        lo, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(lo, self.n, step):
            yield torch.tensor([i, i + 1], dtype=torch.int32), float(i)


class Big(tud.Dataset):
    """4 MiB samples: a batch of 4 is streamed into its block (a contiguous
    sample), or stacked by torch (a transposed one, and the short last
    batch)."""

    def __len__(self):
        return 9

    def __getitem__(self, i):
        return (torch.arange(1 << 20, dtype=torch.float32) * i,
                (torch.arange(1 << 20, dtype=torch.float32) + i).view(1024, 1024).t())


def pairs_collate(batch):
    return [b["i"] for b in batch], torch.stack([b["x"] for b in batch])


def same(a, b, path="batch"):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b)) or print(f"{path}: {a!r} != {b!r}", file=sys.stderr)
    if isinstance(a, dict):
        return (type(a) is type(b) and a.keys() == b.keys()
                and all(same(a[k], b[k], f"{path}[{k!r}]") for k in a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b))))
    return a == b or print(f"{path}: {a!r} != {b!r}", file=sys.stderr)


def epochs(make, n_epochs=1, seed=1234):
    """The batches of n_epochs epochs of the loader make(module) builds."""
    out = {}
    for name, mod in (("torch", tud), ("shmrpc", sd)):
        torch.manual_seed(seed)
        np.random.seed(seed)  # what num_workers=0 draws in this process
        random.seed(seed)
        loader = make(mod)
        out[name] = ([list(loader) for _ in range(n_epochs)], len(loader))
        if hasattr(loader, "close"):
            loader.close()
    return out["torch"], out["shmrpc"]


def compare(what, make, n_epochs=1):
    (t, tlen), (s, slen) = epochs(make, n_epochs)
    assert tlen == slen, f"{what}: len {slen}, torch says {tlen}"
    assert len(t) == len(s) and all(len(a) == len(b) for a, b in zip(t, s)), \
        f"{what}: {[len(e) for e in s]} batches per epoch, torch {[len(e) for e in t]}"
    assert same(t, s), f"{what}: batches differ from torch's"


DS = Squares(37)
IT = Shards(23)


def generator():
    return torch.Generator().manual_seed(7)


# (what, make(module) -> its loader, epochs)
CASES = [(f"sequential nw={nw}",
          lambda m, nw=nw: m.DataLoader(DS, batch_size=5, num_workers=nw), 1)
         for nw in (0, 1, 2, 4)] + [
    (f"shuffle nw={nw}",
     lambda m, nw=nw: m.DataLoader(DS, batch_size=4, shuffle=True, num_workers=nw), 1)
    for nw in (0, 1, 2, 4)] + [
    ("shuffle with generator, drop_last",
     lambda m: m.DataLoader(DS, batch_size=6, shuffle=True, generator=generator(), drop_last=True,
                            num_workers=2), 1),
    ("custom collate and sampler",
     lambda m: m.DataLoader(DS, batch_size=3, sampler=tud.SubsetRandomSampler(range(0, 37, 2)),
                            collate_fn=pairs_collate, num_workers=2), 1),
    ("batch_sampler",
     lambda m: m.DataLoader(DS, batch_sampler=tud.BatchSampler(
         tud.SequentialSampler(range(20)), 7, False), num_workers=2), 1),
    ("no batching (batch_size=None)",
     lambda m: m.DataLoader(DS, batch_size=None, num_workers=2), 1),
    ("worker_init_fn and prefetch_factor",
     lambda m: m.DataLoader(DS, batch_size=4, num_workers=2, prefetch_factor=3,
                            worker_init_fn=lambda wid: torch.manual_seed(99 + wid)), 1),
    ("persistent workers, 3 epochs",
     lambda m: m.DataLoader(DS, batch_size=4, shuffle=True, num_workers=2,
                            persistent_workers=True), 3),
    ("non-persistent, 2 epochs",
     lambda m: m.DataLoader(DS, batch_size=4, shuffle=True, num_workers=2), 2),
    ("large batches", lambda m: m.DataLoader(Big(), batch_size=4, num_workers=2), 1),
] + [(f"iterable nw={nw}",
      lambda m, nw=nw: m.DataLoader(IT, batch_size=4, num_workers=nw), 1)
     for nw in (0, 1, 2, 4)] + [
    ("iterable, drop_last",
     lambda m: m.DataLoader(IT, batch_size=4, num_workers=2, drop_last=True), 1),
    ("iterable, persistent, 2 epochs",
     lambda m: m.DataLoader(IT, batch_size=5, num_workers=2, persistent_workers=True), 2),
]


@pytest.mark.parametrize("what, make, n_epochs", CASES, ids=[c[0] for c in CASES])
def test_as_torch(what, make, n_epochs):
    compare(what, make, n_epochs)


def test_batches_kept():
    # A batch kept after its epoch (and its workers) ended still reads its bytes.
    kept = list(sd.DataLoader(Squares(8, (1024,)), batch_size=4, num_workers=2))
    assert all(float(b["x"][1, 0]) == float(b["i"][1] ** 2) for b in kept), \
        "batches kept after the epoch read wrong bytes"
    # Batches really come through the pool: a worker sees its own pid in none.
    assert all(b["x"].is_shared() is False for b in kept), "pool tensors are plain tensors"


def test_numpy_seeded_at_import(tmp_path, monkeypatch):
    """numpy 2 imports numpy.random at its first use: a worker seeds it as
    its import ends (_data_worker._SeedAtImport), which a stand-in module
    checks here (numpy 1 imports numpy.random with numpy)."""
    from shmrpc import _data_worker
    (tmp_path / "seeded_late").mkdir()
    (tmp_path / "seeded_late" / "__init__.py").write_text(
        "state = None\ndef seed(s):\n    global state\n    state = s\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = _data_worker._SeedAtImport("seeded_late", [7, 8])
    try:
        import importlib.util
        assert importlib.util.find_spec("seeded_late") is not None
        assert finder in sys.meta_path, "a find_spec without an import took the finder away"
        import seeded_late
    finally:
        finder.cancel()
    assert seeded_late.state == [7, 8], "the module was not seeded at its import"
    assert finder not in sys.meta_path, "the finder stayed after the import"
    assert type(seeded_late.__loader__).__name__ != "_SeedAfterExec", \
        "the module keeps the seeding loader, not its own"
