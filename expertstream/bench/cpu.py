"""`expertstream bench cpu`: the CPU expert kernel against the memory rate, and the demo model's decode.

Measured in one run, in ROUNDS rounds that interleave a read sweep of 1 GiB of RAM on the kernel's own thread
pool (what a memory-bound kernel can reach) with a pass of the kernel over SPREAD layers of a full-shape
layer's ten routed experts (2560 x 640, 27.6 MB of blocks a layer, 1.1 GB in all: past the last-level cache)
for 1 and 4 tokens; each is reported as the median over the rounds, and the kernel's fraction of the memory
rate as the median of each round's kernel rate over the same round's read rate (a shared box's load moves
both within seconds). With `--with-copy` (a GPU) the 1-token pass runs again while the copy engine streams
pinned RAM to the GPU, as the bus does during a CPU share of GPU decode. Then the split server (the CPU share
of GPU decode's thread) answering one layer's ten experts a request, the times of its calls at rest and with
one core kept busy by another process (a thread the scheduler parks mid-item: the tail the server rescues),
and the bundled demo model's greedy decode (the README's first command) at rest and beside that process.
"""

from __future__ import annotations

import argparse
import statistics
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
ROUNDS = 7  # interleaved rounds of read sweep and kernel passes
READ_BYTES = 1 << 30
COPY_BYTES = 256 << 20  # pinned RAM one copy streams to the GPU


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


class Layers:
    """SPREAD layers' K full-shape experts in RAM; `pass_seconds` times the kernel on one layer after
    another, for `tokens` tokens: seconds a layer."""

    def __init__(self, spread: int):
        self.spread = spread
        self.layout, self.rows, self.ws2 = full_shape_blocks(spread * K)
        self.layer_bytes = K * self.layout.payload_bytes

    def pass_seconds(self, threads: int, tokens: int) -> float:
        x, wt = torch.randn(tokens, H), torch.rand(K, tokens)
        t0 = time.perf_counter()
        for layer in range(self.spread):
            cpu_moe.moe([self.rows[layer * K + j] for j in range(K)], self.ws2, wt, x, self.layout, threads)
        return (time.perf_counter() - t0) / self.spread


def kernel_rate(threads: int, tokens: int, rounds: int = 3) -> tuple[float, float]:
    """(ms, GB/s) of one layer's K experts for `tokens` tokens, best of `rounds` passes over SPREAD layers."""
    layers = Layers(SPREAD)
    best = min(layers.pass_seconds(threads, tokens) for _ in range(rounds))
    return best * 1e3, layers.layer_bytes / best / 1e9


def interleaved(layers: Layers, threads: int, rounds: int = ROUNDS, read_bytes: int = READ_BYTES) -> dict:
    """`rounds` rounds of one read sweep, then a kernel pass for 1 and for 4 tokens: per round the read
    rate (GB/s), each pass's ms and GB/s a layer and its fraction of that round's read rate."""
    buf = torch.ones(read_bytes // 4)
    cpu_moe.read_seconds(buf, threads)  # pages faulted in, pool up
    layers.pass_seconds(threads, 1)
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        read = read_bytes / cpu_moe.read_seconds(buf, threads) / 1e9
        out.setdefault("read_gbps", []).append(read)
        for t in (1, 4):
            s = layers.pass_seconds(threads, t)
            out.setdefault(f"layer_{t}_ms", []).append(s * 1e3)
            out.setdefault(f"layer_{t}_gbps", []).append(layers.layer_bytes / s / 1e9)
            out.setdefault(f"layer_{t}_of_read", []).append(layers.layer_bytes / s / 1e9 / read)
    return out


def with_copy(layers: Layers, threads: int, rounds: int = ROUNDS) -> dict:
    """The 1-token kernel pass while the copy engine streams pinned RAM to the GPU (copies queued for
    about twice the pass, on a side stream), against the pass alone in the same rounds; the copies' rate
    alone and while the kernel ran (over all of a round's copies, whose tail runs after the pass)."""
    dev = torch.device("cuda")
    src = torch.ones(COPY_BYTES // 4, pin_memory=True)
    dst = torch.empty_like(src, device=dev)
    stream = torch.cuda.Stream(dev)

    def copies(n: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for _ in range(n):
                dst.copy_(src, non_blocking=True)
            end.record()
        return start, end

    a, b = copies(4)
    b.synchronize()
    copy_alone = 4 * COPY_BYTES / (a.elapsed_time(b) / 1e3) / 1e9
    layers.pass_seconds(threads, 1)  # pool up
    out: dict[str, list[float]] = {"copy_alone_gbps": [copy_alone]}
    for _ in range(rounds):
        alone = layers.pass_seconds(threads, 1)
        n = max(2, round(2 * alone * layers.spread * copy_alone * 1e9 / COPY_BYTES))
        a, b = copies(n)
        busy = layers.pass_seconds(threads, 1)
        b.synchronize()
        out.setdefault("alone_gbps", []).append(layers.layer_bytes / alone / 1e9)
        out.setdefault("busy_ms", []).append(busy * 1e3)
        out.setdefault("busy_gbps", []).append(layers.layer_bytes / busy / 1e9)
        out.setdefault("copy_gbps", []).append(n * COPY_BYTES / (a.elapsed_time(b) / 1e3) / 1e9)
    return out


SERVER_REQUESTS = 400  # split server requests timed (each another of the SPREAD layers)


def server_calls(layers: Layers, threads: int, busy: int, requests: int = SERVER_REQUESTS) -> list[float]:
    """Seconds of the split server's calls, each one layer's K experts for one token, posted and taken
    through the host twins of the mailbox 0.3 ms apart (the GPU's part of a layer), with `busy` spinning
    processes."""
    from expertstream.kernels import mailbox

    h = layers.layout.hidden_size
    rows = layers.rows
    addr = (torch.arange(rows.shape[0], dtype=torch.long) * rows.stride(0) + rows.data_ptr()).view(-1, K)
    ws2 = layers.ws2[:1].expand(rows.shape[0], 3).reshape(-1, K, 3).contiguous()
    packed, out = torch.zeros(2 * cpu_moe.NMAX + h), torch.empty(h)
    box, seq = mailbox.new_box(pin=False), torch.zeros(1, dtype=torch.int32)
    request = torch.cat((torch.arange(K).float(), torch.rand(K), torch.randn(h)))
    part = torch.zeros(1, h)
    server = cpu_moe.SplitServer(addr, ws2, packed, out, box, layers.layout, threads, idle_s=1e-3)
    spinners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.2)
        for i in range(requests + layers.spread):  # the first pass over the layers warms the pool
            seq += 1
            mailbox.post(request, packed, seq, box, i % layers.spread, K)
            mailbox.take(part, out, seq, box)
            time.sleep(3e-4)
        return server.stats(last=requests)[2]
    finally:
        server.close()
        for p in spinners:
            p.kill()
            p.wait()


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
    copy = getattr(args, "with_copy", False)
    if copy and not torch.cuda.is_available():
        raise SystemExit("bench cpu --with-copy needs a CUDA GPU to stream pinned RAM to; none is visible")
    if cpu_moe.library() is None:
        raise SystemExit("bench cpu needs the CPU expert kernel, which needs a C compiler (cc)")
    threads = CpuThreads(getattr(args, "threads", 0) or 0)
    time.sleep(0.6)  # one measuring period of the free cores
    n = threads()
    med = statistics.median
    payload = {"threads": n, "cores": threads.cores, "rounds": ROUNDS}
    bw1 = cpu_moe.read_rate(threads=1)
    layers = Layers(SPREAD)
    r = interleaved(layers, n)
    payload.update(read_gbps_1=bw1, **{key: med(v) for key, v in r.items()}, samples=r)
    rows = [
        f"| RAM read, 1 GiB, 1 thread (best of 3) | {bw1:.1f} GB/s | | |",
        f"| RAM read, 1 GiB, {n} threads | {med(r['read_gbps']):.1f} GB/s (range {min(r['read_gbps']):.1f}-"
        f"{max(r['read_gbps']):.1f}) | | |",
    ]
    for t in (1, 4):
        ms, gbps, frac = r[f"layer_{t}_ms"], r[f"layer_{t}_gbps"], r[f"layer_{t}_of_read"]
        rows.append(
            f"| {K} full-shape experts, {t} token(s), {n} threads | {med(ms):.2f} ms (range {min(ms):.2f}-"
            f"{max(ms):.2f}) | {med(gbps):.1f} GB/s | {med(frac):.0%} (range {min(frac):.0%}-"
            f"{max(frac):.0%}) |"
        )
    if copy:
        c = with_copy(layers, n)
        payload["with_copy"] = c
        busy, alone = med(c["busy_gbps"]), med(c["alone_gbps"])
        rows.append(
            f"| ... 1 token while pinned RAM streams to the GPU at {med(c['copy_gbps']):.1f} GB/s "
            f"({c['copy_alone_gbps'][0]:.1f} alone) | {med(c['busy_ms']):.2f} ms | {busy:.1f} GB/s "
            f"({busy / alone:.0%} of {alone:.1f} alone, same rounds) | {busy / med(r['read_gbps']):.0%} |"
        )
    for busy in (0, 1):
        calls = sorted(v * 1e3 for v in server_calls(layers, n, busy))
        at = {f"p{q}": calls[round(q / 100 * (len(calls) - 1))] for q in (50, 90, 99)}
        at.update(max=calls[-1], mean=statistics.mean(calls))
        payload[f"server_ms_busy{busy}"] = at
        ms = " / ".join(f"{at[k]:.2f}" for k in ("p50", "p90", "p99", "max"))
        rows.append(
            f"| split server, {K} experts a request, {n} threads, {busy} core(s) kept busy: call median / "
            f"p90 / p99 / max (mean) | {ms} ms ({at['mean']:.2f}) | | |"
        )
    if args.tokens:
        for busy in (0, 1):
            tps = demo_decode(args.tokens, busy)
            payload[f"demo_tps_busy{busy}"] = tps
            rows.append(f"| demo model decode, {busy} core(s) kept busy | {tps:.1f} tok/s | | |")
    table = (
        f"Medians of {ROUNDS} rounds, each a read sweep then the kernel's passes; the fraction is each "
        "round's kernel rate over the same round's read rate.\n\n"
        "| what | time / rate | read rate | of RAM read |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    device = f"{threads.cores}-core CPU, {threads.cores} cores allowed, {n} threads"
    emit(args, "CPU experts", device, table, payload)
    return 0
