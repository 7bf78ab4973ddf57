"""Probe: how fast do expert-sized host->device copies cross the bus, by host memory kind and copy size?

For pinned memory from cudaHostAlloc (`pin_memory`), the RAM cache's registered anonymous mapping
(`pinned_alloc`, 4 KiB pages), and the same mapping with transparent huge pages asked for before it is
registered: the copy engine moving one large buffer, then one copy call per expert block at random rows
(as decode's misses go up) on one stream and spread over two, and a Triton kernel summing the buffer in
place (the read mode's reads). GB/s from CUDA events.

    python scripts/h2d_probe.py [block bytes] [MiB]
"""

import mmap
import sys
import weakref

import torch
import triton

from expertstream.experts.gpu_bank import pinned_alloc
from scripts.zero_copy_probe import _sum_kernel, timed


def huge_pinned(nbytes: int) -> torch.Tensor:
    mm = mmap.mmap(-1, nbytes)
    mm.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
    buf.fill_(1)  # fault the pages in (as huge pages where the kernel grants them) before registering
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0
    weakref.finalize(mm, cudart.cudaHostUnregister, buf.data_ptr())
    return buf


def _sum(host: torch.Tensor) -> None:
    # the fastest shape of zero_copy_probe.py: 1024 x 16 words per program, 4 warps
    words = host.numel() // 4
    grid = (triton.cdiv(words, 1024 * 16),)
    out = torch.empty(grid[0], dtype=torch.int32, device="cuda")
    _sum_kernel[grid](host.view(torch.int32), out, words, BLOCK=1024, STEPS=16, ADDRESS=False, num_warps=4)


def main(block: int = 2_764_800, mib: int = 1024) -> None:
    n = (mib << 20) // block * block
    rows = n // block
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    slots = dev[: 64 * block].view(64, block)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    order = torch.randperm(rows).tolist()[:200]
    print(f"{torch.cuda.get_device_name()}, {n / 2**20:.0f} MiB, blocks of {block:,} B")
    kinds = {
        "pin_memory": lambda: torch.empty(n, dtype=torch.uint8).pin_memory(),
        "registered 4 KiB pages": lambda: pinned_alloc(n),
        "registered, huge pages asked": lambda: huge_pinned(n),
    }
    for name, make in kinds.items():
        host = make()
        host.view(torch.int32)[:: 1 << 10].random_(0, 7)
        hrows = host.view(rows, block)

        def blocks(n_streams: int, hrows=hrows) -> None:
            for s in streams[:n_streams]:
                s.wait_stream(torch.cuda.current_stream())
            for i, r in enumerate(order):
                with torch.cuda.stream(streams[i % n_streams]):
                    slots[i % 64].copy_(hrows[r], non_blocking=True)
            for s in streams[:n_streams]:
                torch.cuda.current_stream().wait_stream(s)

        one = n / 1e9 / timed(lambda host=host: dev.copy_(host, non_blocking=True), reps=3)
        per1 = len(order) * block / 1e9 / timed(lambda: blocks(1), reps=3)
        per2 = len(order) * block / 1e9 / timed(lambda: blocks(2), reps=3)
        kern = n / 1e9 / timed(lambda host=host: _sum(host), reps=3)
        print(
            f"{name}: one copy {one:.1f} GB/s; a copy per block {per1:.1f} GB/s on one stream, {per2:.1f} "
            f"on two; kernel reading in place {kern:.1f} GB/s"
        )
        del host, hrows


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
