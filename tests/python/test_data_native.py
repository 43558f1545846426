"""A native pipeline: shmrpc.data.NativeTransform runs a C function
(tests/python/native_transform.c, compiled here) on each collated batch in
its pool block, in the worker; the trainer gets the transformed bytes. A
failing C function fails the batch with the worker's id."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.utils.data as tud

import shmrpc.data as sd
from checks import check, failed


class Rows(tud.Dataset):
    def __init__(self, dtype):
        self.dtype = dtype

    def __len__(self):
        return 21

    def __getitem__(self, i):
        return torch.arange(6, dtype=self.dtype) + i


def main():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("skip: no C compiler to build the transform", file=sys.stderr)
        return 77
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "libtransform.so")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", lib,
                        os.path.join(here, "native_transform.c")], check=True)
        native = sd.NativeTransform(lib, "twice_plus_one")
        got = list(sd.DataLoader(Rows(torch.float32), batch_size=4, num_workers=2,
                                 collate_fn=native))
        want = [2 * b + 1 for b in tud.DataLoader(Rows(torch.float32), batch_size=4)]
        check(len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)),
              f"native transform: {got[:1]} vs {want[:1]}")
        try:
            list(sd.DataLoader(Rows(torch.int64), batch_size=4, num_workers=2, collate_fn=native))
            check(False, "a failing native transform fails the batch")
        except RuntimeError as e:
            check(re.search(r"Caught RuntimeError in DataLoader worker process 0.*"
                            r"twice_plus_one .* returned -22", str(e), re.S),
                  f"native transform error: {e}")
    return failed()


if __name__ == "__main__":
    sys.exit(main())
