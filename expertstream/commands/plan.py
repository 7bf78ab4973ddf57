"""`expertstream plan [WORKDIR] [engine flags]`: what a configuration gets, before anything loads.

Prints the VRAM plan the engine would make (the same `plan_memory` call and text as at start), where a
token's routed experts come from with the given caches, and the decode time those bytes alone take at the
drive's and the bus's rates, and the same for a 2,048-token and a full-context prompt run in the plan's
spans: lower bounds, the answer to "which flags for this box". Reads the manifest and the resident file's
header only; needs no GPU when `--gpu-memory-gb` is given.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from expertstream.config import EngineConfig
from expertstream.memory_plan import GiB, MemoryPlan, MemoryPlanError, bank_slots, gpu_budget


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)  # WORKDIR (default: the bundled model) and every engine flag, as `serve`
    p.add_argument(
        "--disk-gbps",
        type=float,
        help="the drive's O_DIRECT rate for expert blocks (default: measured now, ~1 s of random block reads "
        "of the working directory's experts.bin at --io-threads)",
    )
    p.add_argument(
        "--pcie-gbps",
        type=float,
        help="pinned host->device rate (default: measured now when a GPU is visible, else not used)",
    )


@dataclass(frozen=True)
class TokenBytes:
    """Where one decode token's routed expert blocks come from, under uniform routing (every block equally
    likely: the worst case for the caches; real routing is skewed, and LFU hits more, `bench routing`). A
    block in the VRAM cache needs no read; the RAM cache is taken to hold other blocks (its LFU counts only
    the requests that reach it, so blocks the VRAM cache serves age out of it)."""

    routed: int  # bytes of the L x K routed blocks
    vram_share: float  # of the model's blocks, held in the VRAM expert cache
    ram_share: float  # ... held in the pinned RAM cache and not in VRAM
    from_disk: int  # expected bytes read from the drive (not in the RAM cache)
    over_bus: int  # expected bytes crossing PCIe (not in the VRAM cache)
    ram_holds_all: bool  # the RAM cache has a row for every block of the model


def token_bytes(
    layers: int, experts: int, k: int, block: int, vram_blocks: int, ram_gb: float, hot_blocks: int = 0
) -> TokenBytes:
    """hot_blocks: what decode reads from VRAM once the RAM cache holds every block (the hot set)."""
    total = layers * experts
    vram = min(1.0, vram_blocks / total)
    rows = int(ram_gb * GiB) // block
    if rows >= total and vram < 1:
        # every block gets a fixed RAM row and decode reads it there, except the hot set's blocks: the
        # rest of a partial VRAM cache serves prompt passes (docs/runtime.md)
        vram = hot_blocks / total
    ram = min(1.0 - vram, rows / total)  # the blocks the VRAM cache does not hold
    routed = layers * k * block
    far, bus = round(routed * (1 - vram - ram)), round(routed * (1 - vram))
    return TokenBytes(routed, vram, ram, far, bus, rows >= total)


# of the machine's RAM, the most the pinned RAM cache should take (the OS, PLE reads, Python need the rest)
RAM_SHARE = 0.75


def physical_ram() -> int:
    """Bytes of RAM in this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def prompt_bytes(tokens: int, span: int, layers: int, experts: int, k: int, block: int, tb: TokenBytes):
    """(spans, bytes from the drive, bytes over PCIe) of a `tokens`-token prompt run in `span`-token spans:
    each span fetches every expert its tokens route to once per layer, E (1 - (1 - K/E)^n) of them for n
    tokens under uniform routing; from the drive unless cached (prompt misses bypass the RAM cache)."""
    spans, far, bus = -(-tokens // span), 0.0, 0.0
    for s in range(spans):
        n = min(span, tokens - s * span)
        fetched = layers * experts * (1 - (1 - k / experts) ** n) * block
        far += fetched * (1 - tb.vram_share - tb.ram_share)
        bus += fetched * (1 - tb.vram_share)
    return spans, round(far), round(bus)


def _budget(cfg: EngineConfig) -> int:
    if cfg.gpu_memory_gb is None:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no GPU is visible: give --gpu-memory-gb to plan for a card (e.g. 8)")
        free, total = torch.cuda.mem_get_info()
        return gpu_budget(None, cfg.gpu_memory_utilization, free, total)
    return int(cfg.gpu_memory_gb * GiB * cfg.gpu_memory_utilization)


def _rates(args, wd, cfg: EngineConfig) -> tuple[float, float | None]:
    """(disk GB/s, PCIe GB/s or None): as given, else measured here."""
    from expertstream.runtime.probes import disk_rate, pcie_rate

    disk = args.disk_gbps or disk_rate(wd.experts_path, wd.layout.block_bytes, cfg.io_threads, n=256)
    if args.pcie_gbps:
        return disk, args.pcie_gbps
    import torch

    return disk, pcie_rate(256 << 20) if torch.cuda.is_available() else None


def report(
    plan: MemoryPlan,
    tb: TokenBytes,
    disk: float,
    pcie: float | None,
    ram_gb: float,
    prompts: dict | None = None,
) -> str:
    """The plan's text, then where a token's experts come from and the decode time they alone take, and
    the same for prompts {tokens: prompt_bytes(...)}."""
    mb = 1e6

    def row(what: str, nbytes: float, rate: float | None = None) -> str:
        time = f" = {nbytes / rate / mb:.1f} ms" if rate else ""
        return f"  {what:<44} {nbytes / mb:9.1f} MB{time}"

    lines = [plan.describe(), "", "Decode, one token (uniform routing: the caches' worst case):"]
    lines.append(row("routed experts", tb.routed))
    lines.append(row(f"in the VRAM cache ({tb.vram_share:.1%} of the blocks)", tb.routed * tb.vram_share))
    lines.append(row(f"in the RAM cache ({tb.ram_share:.1%} of the blocks)", tb.routed * tb.ram_share))
    lines.append(row(f"from the drive, at {disk:.2f} GB/s", tb.from_disk, disk))
    bound = tb.from_disk / disk / 1e9
    if pcie:
        lines.append(row(f"over PCIe, at {pcie:.1f} GB/s", tb.over_bus, pcie))
        bound = max(bound, tb.over_bus / pcie / 1e9)
    lines.append(
        f"  at most {1 / bound:.1f} tok/s from these bytes alone" if bound else "  no expert bytes move"
    )
    lines.append(
        "  (a bound: compute and the dense part add to it; skewed real routing hits the caches more)"
    )
    phys = physical_ram()
    if phys and ram_gb * GiB > RAM_SHARE * phys:
        share = f"{ram_gb * GiB / phys:.0%} of this machine's {phys / GiB:.0f} GiB"
        lines.append(f"  note: --ram-cache-gb {ram_gb:g} pins {share}; leave room for the OS, PLE reads")
    elif phys and tb.from_disk and ram_gb * GiB < RAM_SHARE * phys / 2:
        lines.append(f"  note: this machine has {phys / GiB:.0f} GiB of RAM: a --ram-cache-gb up to about "
                     f"{RAM_SHARE * phys / GiB:.0f} keeps more experts off the drive")  # fmt: skip
    if tb.ram_holds_all:
        lines.append("  note: the RAM cache holds every expert: --preload-experts fills it at start,")
        where = (
            f"reads its hot set ({tb.vram_share:.1%} of the blocks) from VRAM, the rest from RAM"
            if tb.vram_share
            else "reads every block from RAM (too few VRAM cache slots for a hot set)"
        )
        lines.append(f"  and decode then reads no routing back and {where}")
    if prompts:
        lines += ["", "Prompts (each span fetches the experts its tokens route to once per layer; uniform):"]
    for tokens, (spans, far, bus) in (prompts or {}).items():
        t = max(far / disk, bus / pcie if pcie else 0.0) / 1e9
        what = f"{tokens:,} tokens, {spans} span{'s' * (spans > 1)} of {plan.prefill_span:,}"
        moved = f"{far / 1e9:6.1f} GB from the drive, {bus / 1e9:6.1f} GB over PCIe"
        lines.append(f"  {what:<40} {moved}: at least {t:.1f} s")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from expertstream.default_model import resolve_model
    from expertstream.workdir.workdir import Workdir

    args.model = resolve_model(args.model)
    cfg = EngineConfig.from_args(args)
    wd = Workdir(cfg.model)
    max_len = min(cfg.max_model_len, wd.text_config.get("max_position_embeddings", cfg.max_model_len))
    try:
        act = 4 if cfg.dtype == "float32" else 2  # the engine's activations: bf16 on a GPU unless asked
        plan = wd.memory_plan(_budget(cfg), max_len, act, cfg.max_num_seqs)
    except MemoryPlanError as e:
        print(e)
        return 1
    k = wd.text_config["num_experts_per_tok"]
    # the bank's cache slots as the engine sizes them: the plan's three banks and its cache, less staging
    n_slots = plan.slots // wd.layout.block_bytes + plan.vram_cache_blocks
    width = 0 if cfg.no_speculation else cfg.speculation_width
    hot = bank_slots(cfg.stage_guesses, k, n_slots, width, wd.num_experts, wd.num_layers)[2] * wd.num_layers
    tb = token_bytes(wd.num_layers, wd.num_experts, k, wd.layout.block_bytes, plan.vram_cache_blocks,
                     cfg.ram_cache_gb, hot)  # fmt: skip
    disk, pcie = _rates(args, wd, cfg)
    shape = (plan.prefill_span, wd.num_layers, wd.num_experts, k, wd.layout.block_bytes, tb)
    prompts = {n: prompt_bytes(n, *shape) for n in sorted({min(2048, max_len), max_len})}
    print(report(plan, tb, disk, pcie, cfg.ram_cache_gb, prompts))
    return 0
