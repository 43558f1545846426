"""The data-loader bench (issue 8): shmrpc.data.DataLoader beside
torch.utils.data.DataLoader in the same run, batch 32, num_workers=2, for
4 KiB, 1 MiB and 16 MiB float32 samples, and the one-write limit: writing
a batch's bytes once with memset into a buffer of that size (warm pages).
For reference, memcpy of a batch's bytes between two such buffers: what a
collate, which reads every byte as it writes it, costs on one core.

The first WARMUP batches are not measured, nor the epoch's end. The
dataset holds 33 samples in memory and returns a view of one (no write), so what a loader costs beyond that is its collate (each byte
written into the batch) and its hand-over. Prints per size

  BENCH dataloader size=4KiB samples_per_s= GBps= trainer_cpu_us_per_batch=
        torch_samples_per_s= torch_GBps= torch_trainer_cpu_us_per_batch=
        memset_GBps= memcpy_GBps= vs_torch= vs_memset=

vs_torch is shmrpc's throughput over torch's (higher is better), vs_memset
shmrpc's GB/s over the one-write limit's (1 is the limit). Then what a
short epoch feels (issue 23): workers not persistent, 4 KiB samples, the
median of SHORT_RUNS fresh epochs of SHORT_BATCHES batches each (shmrpc's
and torch's strictly in turn)

  BENCH dataloader_first_batch ms= torch_ms= vs_torch=
  BENCH dataloader_short_epoch batches=16 ms= torch_ms= vs_torch=

(vs_torch: torch's time over shmrpc's, higher is better; the first batch
counts from iter(loader), the workers' start included; where that time
goes, phase by phase: bench/dataloader_phases.py). -q: fewer batches;
--size=4KiB (or 1MiB, 16MiB; repeatable): only those sizes.
"""
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.join(os.environ.get("SHMRPC_BUILD", "build"), "python"))

import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402

import shmrpc.data as sd  # noqa: E402

BATCH = 32
WORKERS = 2
# (sample bytes, name, batches measured on shmrpc, on torch); before them
# WARMUP batches are not: the workers start, and the pool's blocks are
# first touched (a page fault per 4 KiB page, slow on virtual machines)
# until they are reused. torch gets fewer at 16 MiB: it takes seconds each.
SIZES = [(4 << 10, "4KiB", 3000, 3000), (1 << 20, "1MiB", 100, 60),
         (16 << 20, "16MiB", 40, 12)]
WARMUP = 8


class Samples(tud.Dataset):
    def __init__(self, nbytes, n):
        self.n = n
        self.data = torch.rand(33, nbytes // 4)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.data[i % 33]


def run(module, nbytes, batches, **extra):
    """(samples/s, bytes/s, trainer CPU seconds per batch) over one epoch."""
    ds = Samples(nbytes, (WARMUP + batches) * BATCH)
    loader = module.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, **extra)
    it = iter(loader)
    for _ in range(WARMUP):
        next(it)
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    t1, c1 = t0, c0
    for batch in it:
        n += 1
        del batch
        t1, c1 = time.perf_counter(), time.process_time()
    # Up to the last batch: the epoch's end (stopping the workers; freeing
    # shmrpc's pool, 3.5 GiB at 16 MiB) is not a batch's cost, and with -q
    # it would be shared among a few batches.
    dt, cpu = t1 - t0, c1 - c0
    del it
    return n * BATCH / dt, n * BATCH * nbytes / dt, cpu / max(n, 1)


SHORT_BATCHES = 16
SHORT_RUNS = 15


def short_epoch(module, ds):
    """(seconds to the first batch, seconds for the whole epoch) of a fresh
    loader of SHORT_BATCHES batches."""
    loader = module.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    for _ in it:
        pass
    return first, time.perf_counter() - t0


def short_epochs(modules):
    """Per module, (first batch, whole epoch): medians over SHORT_RUNS
    rounds of 4 KiB samples. The modules' epochs strictly alternate
    (A B A B ...), so that no epoch follows one of its own module: an
    shmrpc epoch's workers leave after its last batch, in the background
    (docs/ARCHITECTURE.md, "A DataLoader's short epoch"), and the next
    loader's start waits for that; two shmrpc epochs in a row would charge
    one's end to the other, which a program that trains between its
    epochs does not see. Taken in turn, a load that other programs put
    on the machine for a while weighs on both alike."""
    ds = Samples(4 << 10, SHORT_BATCHES * BATCH)
    times = {m: [] for m in modules}
    for _ in range(SHORT_RUNS):
        for m in modules:
            times[m].append(short_epoch(m, ds))
    mid = SHORT_RUNS // 2
    return [(sorted(f for f, _ in times[m])[mid], sorted(w for _, w in times[m])[mid])
            for m in modules]


def memset_rate(nbytes):
    buf = ctypes.create_string_buffer(nbytes * BATCH)
    ctypes.memset(buf, 1, len(buf))  # pages in
    reps = max(3, (1 << 30) // len(buf))
    t0 = time.perf_counter()
    for _ in range(reps):
        ctypes.memset(buf, 2, len(buf))
    return reps * len(buf) / (time.perf_counter() - t0)


def memcpy_rate(nbytes):
    src, dst = (ctypes.create_string_buffer(nbytes * BATCH) for _ in range(2))
    ctypes.memset(src, 1, len(src))  # pages in
    ctypes.memset(dst, 1, len(dst))
    reps = max(3, (1 << 30) // len(dst))
    t0 = time.perf_counter()
    for _ in range(reps):
        ctypes.memmove(dst, src, len(dst))
    return reps * len(dst) / (time.perf_counter() - t0)


def main():
    args = sys.argv[1:]
    quick = "-q" in args
    only = {a.split("=", 1)[1] for a in args if a.startswith("--size=")}
    unknown = only - {name for _, name, _, _ in SIZES}
    if unknown or any(a != "-q" and not a.startswith("--size=") for a in args):
        sys.exit(f"usage: {sys.argv[0]} [-q] [--size={{{','.join(n for _, n, _, _ in SIZES)}}}]...")
    for nbytes, name, s_batches, t_batches in SIZES:
        if only and name not in only:
            continue
        if quick:
            s_batches, t_batches = max(4, s_batches // 5), max(4, t_batches // 5)
        pool = max(256 << 20, (WORKERS * 2 + 3) * BATCH * nbytes)
        s_rate, s_bw, s_cpu = run(sd, nbytes, s_batches, pool_size=pool)
        t_rate, t_bw, t_cpu = run(tud, nbytes, t_batches)
        m_bw, c_bw = memset_rate(nbytes), memcpy_rate(nbytes)
        print(f"BENCH dataloader size={name} samples_per_s={s_rate:.0f} GBps={s_bw / 1e9:.3f} "
              f"trainer_cpu_us_per_batch={s_cpu * 1e6:.0f} torch_samples_per_s={t_rate:.0f} "
              f"torch_GBps={t_bw / 1e9:.3f} torch_trainer_cpu_us_per_batch={t_cpu * 1e6:.0f} "
              f"memset_GBps={m_bw / 1e9:.2f} memcpy_GBps={c_bw / 1e9:.2f} "
              f"vs_torch={s_rate / t_rate:.2f} vs_memset={s_bw / m_bw:.2f}", flush=True)
    (s_first, s_all), (t_first, t_all) = short_epochs([sd, tud])
    print(f"BENCH dataloader_first_batch ms={s_first * 1e3:.1f} torch_ms={t_first * 1e3:.1f} "
          f"vs_torch={t_first / s_first:.2f}", flush=True)
    print(f"BENCH dataloader_short_epoch batches={SHORT_BATCHES} ms={s_all * 1e3:.1f} "
          f"torch_ms={t_all * 1e3:.1f} vs_torch={t_all / s_all:.2f}", flush=True)


if __name__ == "__main__":
    main()
