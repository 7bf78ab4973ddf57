"""`expertstream bench cpu`: the CPU expert kernel against the memory rate, and the demo model's decode.

Measured in one run: the read rate of 1 GiB of RAM on the kernel's own thread pool (what a memory-bound
kernel can reach), a full-shape layer's ten routed experts (2560 x 640, 27.6 MB of blocks) for 1 and 4
tokens over blocks spread across 1.1 GB (past the last-level cache), and the bundled demo model's greedy
decode (the README's first command) at rest and with one core kept busy by another process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from expertstream.bench.cli import emit
from expertstream.formats import nvfp4
from expertstream.formats.expert_block import PROJ, ExpertLayout
from expertstream.kernels import cpu_moe
from expertstream.runtime.cpu_threads import CpuThreads

H, I, K = 2560, 640, 10  # the real model's expert dims and experts per token
SPREAD = 40  # layers' worth of distinct blocks, so each timed layer reads RAM, not cache


def full_shape_blocks(n: int) -> tuple[ExpertLayout, torch.Tensor, torch.Tensor]:
    """n copies of one random full-shape expert block as rows [n, block_bytes], and [n, 3] global scales."""
    layout = ExpertLayout.for_dims(H, I)
    g = torch.Generator().manual_seed(0)
    tensors, ws2 = {}, torch.empty(3)
    for j, (proj, shape) in enumerate(zip(PROJ, ((I, H), (I, H), (H, I)))):
        q, s, s2 = nvfp4.quantize(torch.randn(shape, generator=g) * 0.02)
        tensors[f"{proj}.weight"], tensors[f"{proj}.weight_scale"], ws2[j] = q, s, s2
    block = torch.frombuffer(bytearray(layout.pack(tensors)), dtype=torch.uint8)
    rows = torch.empty(n, layout.block_bytes, dtype=torch.uint8)
    rows[:] = block  # written, so every page is resident before timing
    return layout, rows, ws2.expand(K, 3)


def kernel_rate(threads: int, tokens: int, rounds: int = 3) -> tuple[float, float]:
    """(ms, GB/s) of one layer's K experts for `tokens` tokens, best of `rounds` passes over SPREAD layers."""
    layout, rows, ws2 = full_shape_blocks(SPREAD * K)
    x, wt = torch.randn(tokens, H), torch.rand(K, tokens)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for layer in range(SPREAD):
            cpu_moe.moe([rows[layer * K + j] for j in range(K)], ws2, wt, x, layout, threads)
        best = min(best, (time.perf_counter() - t0) / SPREAD)
    return best * 1e3, K * layout.payload_bytes / best / 1e9


def demo_decode(tokens: int, busy: int) -> float:
    """Greedy decode tok/s of the bundled demo model (auto threads) with `busy` spinning processes."""
    from expertstream.config import EngineConfig
    from expertstream.default_model import resolve_model
    from expertstream.generate import SamplingParams, stream_generate
    from expertstream.runtime.engine import Engine

    spinners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(busy)]
    try:
        engine = Engine(EngineConfig(model=resolve_model(""), device="cpu"))
        try:
            params = SamplingParams(max_tokens=tokens, temperature=0.0)
            for _ in range(2):  # the first pass warms the RAM cache and lets the thread count settle
                last = list(stream_generate(engine, "And God said", params))[-1]
            return last.generation_tps
        finally:
            engine.close()
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def run(args: argparse.Namespace) -> int:
    if cpu_moe.library() is None:
        raise SystemExit("bench cpu needs the CPU expert kernel, which needs a C compiler (cc)")
    threads = CpuThreads(getattr(args, "threads", 0) or 0)
    time.sleep(0.6)  # one measuring period of the free cores
    n = threads()
    rows, payload = [], {"threads": n, "cores": threads.cores}
    bw1, bwn = cpu_moe.read_rate(threads=1), cpu_moe.read_rate(threads=n)
    payload.update(read_gbps_1=bw1, read_gbps=bwn)
    rows.append(f"| RAM read, 1 GiB, 1 thread | {bw1:.1f} GB/s | | |")
    rows.append(f"| RAM read, 1 GiB, {n} threads | {bwn:.1f} GB/s | | |")
    for t in (1, 4):
        ms, gbps = kernel_rate(n, t)
        payload[f"layer_{t}_ms"], payload[f"layer_{t}_gbps"] = ms, gbps
        rows.append(f"| {K} full-shape experts, {t} token(s), {n} threads | {ms:.2f} ms | {gbps:.1f} GB/s | "
                    f"{gbps / bwn:.0%} |")  # fmt: skip
    for busy in (0, 1):
        tps = demo_decode(args.tokens or 48, busy)
        payload[f"demo_tps_busy{busy}"] = tps
        rows.append(f"| demo model decode, {busy} core(s) kept busy | {tps:.1f} tok/s | | |")
    table = "| what | time / rate | read rate | of RAM read |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    device = f"{threads.cores}-core CPU, {threads.cores} cores allowed, {n} threads"
    emit(args, "CPU experts", device, table, payload)
    return 0
