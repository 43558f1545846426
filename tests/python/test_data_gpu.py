# shmrun: none
# needs: has("torch") and __import__("torch").cuda.is_available()
# unmet: needs a GPU (torch.cuda.is_available() is false)
"""shmrpc.data with a GPU trainer: pin_memory=True registers the loader's
pool with CUDA, so batches arrive pinned in the pool (no pinned copy) and
go to the device asynchronously. Skipped without CUDA (the needs line)."""
import torch
import torch.utils.data as tud

import shmrpc.data as sd


class Rows(tud.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.arange(1024, dtype=torch.float32) + i


def test_pinned_batches_to_the_gpu():
    want = list(tud.DataLoader(Rows(), batch_size=8))
    loader = sd.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory=True,
                           persistent_workers=True)
    got = list(loader)
    assert loader._workers.pinned is not None, "the pool was not registered with CUDA"
    assert all(b.is_pinned() for b in got), "batches are not pinned"
    on_gpu = [b.to("cuda", non_blocking=True) for b in got]
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), w) for g, w in zip(on_gpu, want)), "device copies differ"
    loader.close()
