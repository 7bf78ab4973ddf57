"""This machine's disk and host->device rates, measured the way the engine reads and copies expert blocks.

`expertstream plan` and the benches take them as the limits that a token's bytes cross.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def disk_rate(path: Path, block_bytes: int, threads: int, n: int = 768) -> float:
    """GB/s of O_DIRECT reads of `n` random expert blocks with `threads` readers, after the page cache's
    writeback of a just-written model has finished (it otherwise shares the drive with the measurement)."""
    from expertstream.store.reader import BlockReader, alloc_aligned

    os.sync()

    reader = BlockReader(path)
    blocks = path.stat().st_size // block_bytes
    offsets = (torch.randperm(blocks)[:n] * block_bytes).tolist()
    bufs = threading.local()

    def read(off):
        if not hasattr(bufs, "b"):
            bufs.b = alloc_aligned(block_bytes)
        reader.read_into(bufs.b, off)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, offsets))
    dt = time.perf_counter() - t0
    reader.close()
    return len(offsets) * block_bytes / dt / 1e9


def pcie_rate(nbytes: int = 1 << 30, block: int | None = None, repeats: int = 5) -> float:
    """GB/s of pinned host->device copies of `nbytes`: one copy (the bus's rate, the bound's), or with
    `block` one copy call per block at random rows, as decode's routed blocks cross (context only: on the
    H200 2.76 MB blocks cross at ~0.94 of the one-copy rate). The best of `repeats`, each timed by CUDA
    events: at an engine's start the store's readers share the host, and a host clock around the copies
    read 38-54 GB/s on one H100 box."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    if block is None:
        pairs = [(dev, host)]
    else:
        rows = nbytes // block
        src, dst = host[: rows * block].view(rows, block), dev[: rows * block].view(rows, block)
        pairs = [(dst[i], src[r]) for i, r in enumerate(torch.randperm(rows).tolist())]
    moved = sum(d.numel() for d, _ in pairs)

    def copy(_: int) -> None:
        for d, src_row in pairs:
            d.copy_(src_row, non_blocking=True)

    return moved / _best_seconds(copy, repeats) / 1e9


def _best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` calls run(1) .. run(repeats) on the GPU by CUDA events, after an untimed
    run(0) (a first copy, a kernel's compile)."""
    run(0)
    torch.cuda.synchronize()
    best = math.inf
    for i in range(1, repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(i)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def stage_rate(block_bytes: int, k: int, repeats: int = 5) -> float:
    """GB/s of the staging kernel (kernels/stage_blocks.py) copying half a layer's k expert blocks (the GPU's
    side of a split near balance) from pinned RAM rows into VRAM rows: how a CPU share's GPU side crosses the
    bus (`SplitExperts.split_gpu`). The SMs' reads of pinned RAM can be slower than the copy engine (40-41
    GB/s against 54.6 on an H100 box, docs/benchmarks.md). The best of `repeats`, each from other rows."""
    from expertstream.kernels.stage_blocks import stage_blocks

    blocks = max(1, k // 2)
    rows = 4 * blocks  # expert e sits in RAM row e (loc -1 - e); each run copies blocks of its own
    host = torch.ones(rows, block_bytes, dtype=torch.uint8).pin_memory()  # written: no shared zero pages
    slots = torch.empty(blocks, block_bytes, dtype=torch.uint8, device="cuda")
    loc = -1 - torch.arange(rows, dtype=torch.int32, device="cuda")
    out = torch.empty_like(loc)

    def stage(i: int) -> None:
        stage_blocks(torch.arange(blocks, device="cuda") + (i % 4) * blocks, loc, host, slots, 0, out)

    return blocks * block_bytes / _best_seconds(stage, repeats) / 1e9
