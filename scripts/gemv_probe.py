"""The one-token GEMV (kernels/gemv.py) against torch's F.linear (cuBLAS) on the real model's 16-bit decode
shapes: us per call, timed over CUDA-graph replays of 100 calls so that launch gaps count as they do in
decode. Usage on a lent GPU: python3 scripts/gemv_probe.py
"""

import torch
import torch.nn.functional as F

from expertstream.kernels.gemv import linear

# (what, N, K): hyper-connection down+inject and up, router, shared expert in and down, the next-layer guess
SHAPES = [("hc proj", 324, 10240), ("hc up", 10240, 320), ("router", 512, 2560), ("shared in", 1025, 2560),
          ("shared down", 2560, 512)]  # fmt: skip


def per_call_us(fn, ws, x, calls: int = 100) -> float:
    """us per call of fn(x, w), the calls cycling over the weights ws (more bytes than L2, as in decode)."""
    fn(x, ws[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(x, ws[i % len(ws)])
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (5 * calls)


for what, n, k in SHAPES:
    mb = n * k * 2 / 1e6
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(8, int(300 / mb)))]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ours, theirs = per_call_us(linear, ws, x), per_call_us(F.linear, ws, x)
    err = (linear(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
    print(f"{what:12s} {n:6d} x {k:6d} {mb:5.1f} MB: gemv {ours:6.2f} us ({mb / ours:5.2f} TB/s), "
          f"F.linear {theirs:6.2f} us ({mb / theirs:5.2f} TB/s); max |diff| {err:.2e}")  # fmt: skip
