"""`expertstream bench prefill`: prompt processing of the streaming runtime against its I/O bound.

On the full-shape synthetic model of `bench decode`, under --gpu-memory-gb, it prefills prompts of
--prompts tokens (default 2,451 and 32,768) in three regimes: `vram` (every expert resident in VRAM, the
budget raised by the expert bytes: the engine's compute floor for that prompt), `ram` (every expert in the
pinned RAM cache) and `disk` (RAM cache = 25 % of the expert bytes; prompt misses bypass it). It reports
time, expert bytes from disk and over PCIe, expert passes per layer (one fetch + three launches each; in
brackets the passes the slots force), peak VRAM against the budget, and the bound max(disk bytes / disk
rate, PCIe bytes / PCIe rate, the `vram` time of the same prompt); efficiency = bound / actual.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from expertstream.bench.model import REAL_LAYERS
from expertstream.bench.runtime import (
    bench_model,
    disk_rates,
    engine_disk_note,
    profile_tokens,
    real_model_plan,
    warm_caches,
)
from expertstream.config import EngineConfig
from expertstream.log import get_logger
from expertstream.memory_plan import GiB
from expertstream.runtime.probes import disk_rate, pcie_rate

log = get_logger(__name__)
PROMPTS = (2451, 32768)


@dataclass(slots=True)
class PrefillPlan:
    prompt: int  # tokens
    piece: int  # tokens per attention call and per MoE launch (the memory plan's prefill piece)
    span: int  # tokens per layer-major span (the memory plan's prefill span)
    spans: int
    group: int  # experts per pass: half the VRAM slots
    max_passes_per_layer: int  # every span routes to min(E, tokens x K) distinct experts
    max_expert_bytes_per_layer: int  # each distinct expert fetched once per span


def plan_prefill(
    prompt: int, piece: int, span: int, n_slots: int, num_experts: int, k: int, block_bytes: int
):
    """What a prefill of `prompt` tokens does at most, per layer, with GpuExperts' grouping by slots (a
    bank with slots to spare, e.g. `vram`, may split passes further by its row budget: they fetch nothing)."""
    group = max(1, n_slots // 2)
    sizes = [min(span, prompt - i) for i in range(0, prompt, span)]
    distinct = [min(num_experts, t * k) for t in sizes]
    return PrefillPlan(
        prompt=prompt,
        piece=piece,
        span=span,
        spans=len(sizes),
        group=group,
        max_passes_per_layer=sum(-(-d // group) for d in distinct),
        max_expert_bytes_per_layer=sum(distinct) * block_bytes,
    )


def prefill_regime(
    cfg: EngineConfig,
    vram_cache_blocks: int,
    prompt: int,
    split: tuple[int, int, int],
    profile_to=None,
    repeats: int = 1,
) -> dict:
    """One prompt in one regime, timed `repeats` times from a new state, the fastest run reported (its
    counters too; every run's seconds in `seconds_all`); `split`: (piece, span, chunk) as the 48-layer plan
    has them. With `profile_to` (a path without suffix) the prompt runs once more under torch.profiler."""
    from expertstream.runtime.engine import Engine

    eng = Engine(cfg, vram_cache_blocks=vram_cache_blocks)
    eng.set_prefill(*split)  # each span fetches its distinct experts again
    try:
        warm_caches(eng, vram=vram_cache_blocks >= eng.workdir.num_layers * eng.workdir.num_experts)
        gen = torch.Generator().manual_seed(prompt)
        ids = torch.randint(0, eng.args.vocab_size, (prompt,), generator=gen)
        # two full pieces and one as long as the prompt's last, first: kernels of every shape the prompt meets
        # are compiled before timing (a compile inside the timed run cost the first regime ~0.8 s)
        eng.forward(eng.new_state(), ids[: min(prompt, 2 * split[0] + prompt % split[0])])
        wd = eng.workdir
        plan = plan_prefill(
            prompt,
            eng.prefill_piece,
            eng.prefill_span,
            eng.bank.cache.n_slots,
            wd.num_experts,
            eng.args.num_experts_per_tok,
            wd.layout.block_bytes,
        )
        runs = []  # (seconds, counter deltas, peak) of each run
        tokens = set()  # the greedy next token of each run (deterministic kernels: one value)
        for _ in range(max(1, repeats)):
            state = eng.new_state()
            s0, c0, p0 = eng.stats(), dataclasses.replace(eng.bank.cache.stats), eng.bank.prefill_passes
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                logits = eng.forward(state, ids)
                torch.cuda.synchronize()
            except torch.cuda.OutOfMemoryError as e:
                log.error("prefill of %d tokens ran out of the VRAM budget: %s", prompt, e)
                return {"prompt": prompt, "oom": True, "plan": dataclasses.asdict(plan)}
            dt = time.perf_counter() - t0
            tokens.add(int(logits.argmax()))
            # copies: the profiled run below adds to the live counters (it doubled the profiled rows' bytes)
            s1, c1, p1 = eng.stats(), dataclasses.replace(eng.bank.cache.stats), eng.bank.prefill_passes
            counts = {
                "disk_bytes": s1.bytes_read - s0.bytes_read,
                "pcie_bytes": c1.bytes_copied - c0.bytes_copied,
                "passes": p1 - p0,
                "stall_seconds": s1.stall_seconds - s0.stall_seconds,
            }
            runs.append((dt, counts, torch.cuda.max_memory_allocated() / GiB))
            del state  # before the next run's (its KV cache must not count twice in the budget)
        dt, counts, _ = min(runs, key=lambda r: r[0])
        layers = eng.workdir.num_layers
        profiled = None
        if profile_to is not None:  # GPU busy time of the same prompt: the floor that wall time hides
            profiled = profile_tokens(lambda: eng.forward(eng.new_state(), ids), profile_to, tokens=1)
        return {
            "profiled": profiled,
            "prompt": prompt,
            "oom": False,
            "seconds": dt,
            "seconds_all": [r[0] for r in runs],
            "disk_bytes": counts["disk_bytes"],
            "pcie_bytes": counts["pcie_bytes"],
            "passes_per_layer": counts["passes"] / layers,
            "stall_seconds": counts["stall_seconds"],
            "peak_gib": max(r[2] for r in runs),
            "next_tokens": sorted(tokens),
            "plan": dataclasses.asdict(plan),
        }
    finally:
        eng.close()


def _same(r: dict, floor: dict) -> str:
    # the greedy token after the prompt against the `vram` row's (every run of both): yes, no, or - (no floor)
    if floor.get("oom", True) or "next_tokens" not in floor:
        return "-"
    return "yes" if r["next_tokens"] == floor["next_tokens"] and len(r["next_tokens"]) == 1 else "no"


def prefill_table(results: dict[str, dict], disk_gbps: float, pcie_gbps: float, layers: int, budget_gib):
    """Markdown rows, one per (regime, prompt); sets each result's bound_s and efficiency."""
    rows = [
        "| regime | prompt tokens | span / piece | s (bench layers) | s x48 | tok/s x48 | disk GB | PCIe GB "
        "| passes/layer (max) | stall s | peak GiB (budget) | bound s | efficiency | same next token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        regime, plan = name.split("/")[0], r["plan"]
        lead = f"| {regime} | {r['prompt']} | {plan['span']} / {plan['piece']} |"
        if r.get("skipped"):
            gb = plan["max_expert_bytes_per_layer"] / 1e9
            what = f"{plan['spans']} spans fetch up to {gb:.0f} GB of experts per layer"
            rows.append(
                f"{lead} not run: {what}, >= {r['estimate_s']:.0f} s at the measured rate |" + " |" * 10
            )
            continue
        if r["oom"]:
            rows.append(f"{lead} out of VRAM budget |" + " |" * 10)
            continue
        floor = results.get(f"vram/{r['prompt']}", {})  # the compute floor: same prompt, experts in VRAM
        gpu_s = 0.0 if floor.get("oom", True) else floor["seconds"]
        bound = max(r["disk_bytes"] / disk_gbps / 1e9, r["pcie_bytes"] / pcie_gbps / 1e9, gpu_s)
        r["bound_s"], r["efficiency"] = bound, bound / r["seconds"]
        scale = REAL_LAYERS / layers
        rows.append(
            f"{lead} {r['seconds']:.2f} | {r['seconds'] * scale:.1f} "
            f"| {r['prompt'] / (r['seconds'] * scale):.0f} | {r['disk_bytes'] / 1e9:.2f} "
            f"| {r['pcie_bytes'] / 1e9:.2f} | {r['passes_per_layer']:.0f} ({plan['max_passes_per_layer']}) "
            f"| {r['stall_seconds']:.2f} | {r['peak_gib']:.2f} ({budget_gib:.2f}) | {bound:.2f} "
            f"| {r['efficiency']:.2f} | {_same(r, floor)} |"
        )
    rates = {
        n: r["disk_bytes"] / r["seconds"] / 1e9
        for n, r in results.items()
        if r.get("disk_bytes") and r.get("seconds")
    }
    return "\n".join(rows) + "\n" + engine_disk_note(rates, disk_gbps)


def run(args) -> int:
    from expertstream.bench.cli import chosen, emit

    prompts = args.prompts or list(PROMPTS)
    wd, base = bench_model(args, "prefill", max(args.max_model_len, *prompts))
    block = wd.layout.block_bytes
    expert_bytes = wd.num_layers * wd.num_experts * block
    disk, pcie = disk_rate(wd.experts_path, block, base.io_threads), pcie_rate()
    real = real_model_plan(wd, args.gpu_memory_gb, base.max_model_len)
    vram_blocks = int(real.vram_cache_blocks / REAL_LAYERS * wd.num_layers)
    piece = args.prefill_piece or real.prefill_piece
    span = max(piece, args.prefill_span or real.prefill_span)
    chunk = piece if args.prefill_piece or args.prefill_span else real.prefill_chunk
    all_in_ram = dataclasses.replace(base, ram_cache_gb=expert_bytes / GiB + 0.1)
    regimes = {
        # the floor, not an 8 GiB claim: the budget grows by the expert bytes so that every expert fits
        "vram": (
            dataclasses.replace(all_in_ram, gpu_memory_gb=args.gpu_memory_gb + expert_bytes / GiB),
            wd.num_layers * wd.num_experts,
        ),
        "ram": (all_in_ram, vram_blocks),
        "disk": (dataclasses.replace(base, ram_cache_gb=0.25 * expert_bytes / GiB), vram_blocks),
    }
    results = {}
    k = wd.text_config["num_experts_per_tok"]
    for name, (cfg, blocks) in chosen(args, regimes).items():
        rate = {"vram": 0.0, "disk": disk}.get(name, pcie)  # GB/s the expert bytes come at, at best
        for prompt in prompts:
            plan = plan_prefill(prompt, piece, span, 2, wd.num_experts, k, block)  # bytes: not slot-dependent
            estimate = plan.max_expert_bytes_per_layer * wd.num_layers / 1e9 / rate if rate else 0.0
            if estimate > args.max_seconds:  # spans re-fetch their experts: say what a run would take
                results[f"{name}/{prompt}"] = {"prompt": prompt, "skipped": True, "estimate_s": estimate,
                                               "oom": False, "plan": dataclasses.asdict(plan)}  # fmt: skip
            else:
                prof = args.profile / f"{name}_{prompt}" if args.profile and prompt == min(prompts) else None
                results[f"{name}/{prompt}"] = prefill_regime(
                    cfg, blocks, prompt, (piece, span, chunk), prof, args.repeats
                )
            log.info("%s/%d: %s", name, prompt, results[f"{name}/{prompt}"])
    disk, disk_note = disk_rates(wd.experts_path, block, base.io_threads, disk)
    budget = args.gpu_memory_gb * base.gpu_memory_utilization
    origin = (
        "set by --prefill-piece/--prefill-span"
        if args.prefill_piece or args.prefill_span
        else "the 48-layer plan's"
    )
    head = (
        f"Full-shape synthetic model, {wd.num_layers} layers x {wd.num_experts} experts ({block:,} B "
        f"blocks), --gpu-memory-gb {args.gpu_memory_gb}, max_model_len {base.max_model_len}; measured in "
        f"this run: O_DIRECT {disk:.2f} GB/s ({disk_note}), pinned H2D {pcie:.1f} GB/s; VRAM cache "
        f"{vram_blocks} blocks "
        f"and {span}-token spans of {piece}-token pieces ({origin}; each span fetches its experts once per "
        "layer). "
        "Bound = max(disk, PCIe, the `vram` time of the same prompt); the `vram` rows ran with the budget "
        f"raised by the expert bytes. Each row is the fastest of {args.repeats} runs from a new state "
        "(every run's seconds in the --json results); `same next token`: the greedy token after the prompt, "
        "in every run, equals the `vram` row's.\n\n"
    )
    table = head + prefill_table(results, disk, pcie, wd.num_layers, budget)
    profiled = [(n, r["profiled"]) for n, r in results.items() if r.get("profiled")]
    if profiled:
        table += (
            "\nProfiled prompts (torch.profiler, one more run each): GPU busy, kernels / copies, each the "
        )
        table += (
            "union over streams: "
            + "; ".join(
                f"{n} {p['kernel_ms_per_token'] / 1e3:.2f} / {p['copy_ms_per_token'] / 1e3:.2f} s"
                for n, p in profiled
            )
            + ".\n"
        )
    if args.baseline:
        from expertstream.bench.baseline import baseline_table, run_baseline

        ours = {n: r["seconds"] * 1e3 / wd.num_layers for n, r in results.items() if "seconds" in r}
        table += "\n" + baseline_table(run_baseline(args, expert_bytes, prompt=min(prompts)), ours, "prefill")
    payload = {"disk_gbps": disk, "pcie_gbps": pcie, "vram_blocks": vram_blocks, **results}
    emit(args, "Prefill", torch.cuda.get_device_name(), table, payload)
    return 0
