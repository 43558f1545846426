# shmrun: none
# needs: has("torch") and (shutil.which("cc") or shutil.which("gcc"))
"""A native pipeline: shmrpc.data.NativeTransform runs a C function
(tests/python/native_transform.c, compiled here) on each collated batch in
its pool block, in the worker; the trainer gets the transformed bytes. A
failing C function fails the batch with the worker's id."""
import os
import shutil
import subprocess
import tempfile

import pytest
import torch
import torch.utils.data as tud

import shmrpc.data as sd


class Rows(tud.Dataset):
    def __init__(self, dtype):
        self.dtype = dtype

    def __len__(self):
        return 21

    def __getitem__(self, i):
        return torch.arange(6, dtype=self.dtype) + i


def test_native_transform():
    cc = shutil.which("cc") or shutil.which("gcc")
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "libtransform.so")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", lib,
                        os.path.join(here, "native_transform.c")], check=True)
        native = sd.NativeTransform(lib, "twice_plus_one")
        got = list(sd.DataLoader(Rows(torch.float32), batch_size=4, num_workers=2,
                                 collate_fn=native))
        want = [2 * b + 1 for b in tud.DataLoader(Rows(torch.float32), batch_size=4)]
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), \
            f"native transform: {got[:1]} vs {want[:1]}"
        # A failing native transform fails the batch.
        with pytest.raises(RuntimeError, match=r"(?s)Caught RuntimeError in DataLoader worker "
                           r"process 0.*twice_plus_one .* returned -22"):
            list(sd.DataLoader(Rows(torch.int64), batch_size=4, num_workers=2, collate_fn=native))
