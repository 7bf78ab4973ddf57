"""Probe: can a kernel read pinned host RAM (the expert RAM cache) over PCIe as fast as the copy engine?

Times, on one buffer of registered host memory (the store's `pinned_alloc`): the copy engine (H2D
cudaMemcpyAsync), and a Triton kernel summing the same bytes straight from host memory (passed as a tensor,
and as an int64 address cast to a pointer), next to the same kernel on device memory.

    python scripts/zero_copy_probe.py [MiB]
"""

import sys

import torch
import triton
import triton.language as tl

from expertstream.experts.gpu_bank import pinned_alloc


@triton.jit
def _sum_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr, ADDRESS: tl.constexpr):
    if ADDRESS:  # src_ptr holds the buffer's address as an int64: the cast a location table would use
        src_ptr = tl.load(src_ptr).to(tl.pointer_type(tl.int32))
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.int32)
    for s in tl.static_range(STEPS):
        offs = base + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def timed(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps / 1e3


def main(mib: int = 512) -> None:
    n = mib << 20
    host = pinned_alloc(n)
    host.view(torch.int32).random_(0, 7)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    gb = n / 1e9
    print(f"{torch.cuda.get_device_name()}, {mib} MiB")
    print(f"copy engine H2D: {gb / timed(lambda: dev.copy_(host, non_blocking=True)):.1f} GB/s")
    words = n // 4
    ref = int(host.view(torch.int32).sum())
    addr = torch.tensor([host.data_ptr()], dtype=torch.int64, device="cuda")
    for block, steps, warps in ((1024, 4, 4), (1024, 16, 4), (2048, 8, 8), (512, 8, 4), (4096, 4, 8)):
        grid = (triton.cdiv(words, block * steps),)
        out = torch.zeros(grid[0], dtype=torch.int32, device="cuda")
        meta = dict(BLOCK=block, STEPS=steps, num_warps=warps)

        def rate(src, address=False, out=out, grid=grid, meta=meta) -> float:
            return gb / timed(lambda: _sum_kernel[grid](src, out, words, ADDRESS=address, **meta))

        row = f"BLOCK {block} x {steps}, {warps} warps:"
        for name, src in (("device", dev.view(torch.int32)), ("host tensor", host.view(torch.int32))):
            try:
                row += f" {name} {rate(src):.1f} GB/s;"
            except Exception as e:  # noqa: BLE001 - a probe reports what failed
                row += f" {name} failed ({type(e).__name__}: {str(e)[:80]});"
        gbps = rate(addr, address=True)
        ok = int(out.sum()) == ref
        row += f" host address {gbps:.1f} GB/s (sum {'ok' if ok else 'WRONG'})"
        print(row)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
