"""`expertstream bench decode --model WORKDIR`: decode speed of an existing working directory of any family.

The regimes are where the blocks come from. On CUDA the engine runs the CUDA expert bank (NVFP4 or MXFP4
blocks): `vram` (every block in a VRAM slot: the budget grows by the expert bytes), `ram` (every block in the
pinned RAM cache, no VRAM expert cache beside the plan's slots: the kernels read each block over the bus) and
`disk` (a RAM cache of a quarter of the expert bytes, at least two layers' routed experts, the rest read from
the drive, no VRAM expert cache). Without CUDA the engine's CPU bank (StreamedExperts) runs `ram` and `disk`.
Each reports ms per token and per layer, the disk bytes per token and the drive's bound on them (the rate is
measured in the same run), the RAM cache's hit rate, the stall waiting for blocks, and whether the greedy
tokens equal the first regime's.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from expertstream.bench.runtime import disk_rates, same_tokens, warm_caches
from expertstream.config import EngineConfig
from expertstream.log import get_logger
from expertstream.memory_plan import GiB
from expertstream.runtime.probes import disk_rate

log = get_logger(__name__)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def regime(cfg: EngineConfig, tokens: int, vram_cache_blocks: int) -> dict:
    """One regime's greedy decode; vram_cache_blocks: the CUDA bank's VRAM expert cache (the CPU bank has
    none)."""
    from expertstream.runtime.engine import Engine

    eng = Engine(cfg, vram_cache_blocks=vram_cache_blocks)
    try:
        warm_caches(eng, vram=vram_cache_blocks >= eng.workdir.num_layers * eng.workdir.num_experts)
        state, generated = eng.new_state(), []

        def step(ids: list[int]) -> int:
            top, idx = eng.forward(state, ids).reshape(-1).topk(2)
            generated.append(int(idx[0]))
            margins.append(float(top[0] - top[1]))
            return generated[-1]

        margins: list[float] = []
        tok = step(list(range(1, 17)))
        for _ in range(4):
            tok = step([tok])
        s0 = eng.stats()
        _sync()
        t0 = time.perf_counter()
        for _ in range(tokens):
            tok = step([tok])
        _sync()
        dt = (time.perf_counter() - t0) / tokens
        s1 = eng.stats()
        ram_reads = s1.resident_ram_reads - s0.resident_ram_reads
        return {
            "tokens": generated,
            "margins": margins,
            "ms_per_token": dt * 1e3,
            "disk_bytes_per_token": (s1.bytes_read - s0.bytes_read) / tokens,
            # blocks the CUDA bank reads through its fixed "ram" layout are RAM hits without a request
            "ram_hit_rate": (s1.hits - s0.hits + ram_reads) / max(1, s1.requests - s0.requests + ram_reads),
            "stall_ms_per_token": (s1.stall_seconds - s0.stall_seconds) / tokens * 1e3,
            "device": str(eng.device),
            "bank": type(eng.bank).__name__,
        }
    finally:
        eng.close()


def regimes(wd, base: EngineConfig, cuda: bool) -> dict[str, tuple[EngineConfig, int]]:
    """{name: (config, VRAM expert cache blocks)}: none beside the plan's slots in ram and disk."""
    block = wd.layout.block_bytes
    expert_bytes = wd.num_layers * wd.num_experts * block
    all_in_ram = dataclasses.replace(base, ram_cache_gb=expert_bytes / GiB + 0.1)
    # a layer's K blocks are held at once, the next layer's guesses read beside them
    some = max(0.25 * expert_bytes, 2 * wd.text_config["num_experts_per_tok"] * block)
    out = {"ram": (all_in_ram, 0), "disk": (dataclasses.replace(base, ram_cache_gb=some / GiB), 0)}
    if cuda:  # the CUDA bank: every block in a slot, the budget grown to hold them
        vram = dataclasses.replace(all_in_ram, gpu_memory_gb=base.gpu_memory_gb + expert_bytes / GiB)
        out = {"vram": (vram, wd.num_layers * wd.num_experts), **out}
    return out


def run(args) -> int:
    from expertstream.bench.cli import chosen, emit
    from expertstream.workdir.workdir import Workdir

    wd = Workdir(args.model)
    block = wd.layout.block_bytes
    base = EngineConfig(
        model=str(wd.path),
        max_model_len=args.max_model_len,
        gpu_memory_gb=args.gpu_memory_gb,
        threads=args.threads,
    )
    disk = disk_rate(wd.experts_path, block, base.io_threads)
    results = {}
    for name, (cfg, blocks) in chosen(args, regimes(wd, base, torch.cuda.is_available())).items():
        results[name] = regime(cfg, args.tokens, blocks)
        log.info("%s: %s", name, results[name])
    disk, disk_note = disk_rates(wd.experts_path, block, base.io_threads, disk)
    first_name, first = next(iter(results.items()))
    rows = [
        "| regime | ms/token | ms/layer | disk MB/token | disk bound ms | RAM hit | stall ms | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        r["bound_ms"] = r["disk_bytes_per_token"] / disk / 1e6
        rows.append(
            f"| {name} | {r['ms_per_token']:.1f} | {r['ms_per_token'] / wd.num_layers:.2f} | "
            f"{r['disk_bytes_per_token'] / 1e6:.1f} | {r['bound_ms']:.1f} | {r['ram_hit_rate']:.0%} | "
            f"{r['stall_ms_per_token']:.2f} | {same_tokens(r, first, first_name)} |"
        )
    tc = wd.text_config
    head = (
        f"{wd.manifest['model_type']} working directory {wd.path.name}: {wd.num_layers} layers x "
        f"{wd.num_experts} experts ({block:,} B {wd.layout.fmt} blocks, top-{tc['num_experts_per_tok']}, "
        f"the synthetic model's routing), {first['bank']} on {first['device']}; "
        f"O_DIRECT {disk:.2f} GB/s ({disk_note}); {args.tokens} tokens a regime.\n\n"
    )
    table = head + "\n".join(rows) + "\n"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    emit(args, "Decode", device, table, dict(disk_gbps=disk, **results))
    return 0
