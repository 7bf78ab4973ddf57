"""`expertstream bench decode`: decode speed of the streaming runtime against the machine's limits.

On a full-shape synthetic model (real per-layer dims, `--layers` of them) it measures, in the same run, the
raw O_DIRECT read rate (expert-sized blocks, the engine's thread count) and the pinned host->device rate,
then decodes in five regimes and reports bytes/token, the bound max(disk, PCIe, GPU) and
efficiency = bound / actual:
  vram:        every expert resident in VRAM (GPU-bound: the compute floor)
  vram eager:  the same without CUDA graphs (what the graphs save)
  ram:         experts in pinned RAM, VRAM cache sized as the 48-layer 8 GiB plan leaves it (PCIe-bound)
  ram, CPU share: the same, with the CPU computing a share of each layer's routed experts in place
               (--cpu-moe-share; -1, the default: the share the rates measured at start balance); its
               bound is max(PCIe bytes / PCIe rate, CPU bytes / CPU kernel rate, GPU)
  disk:        RAM cache = 25% of the expert bytes, the rest read from disk (disk-bound)
  disk, 24 GiB VRAM: the disk regime's RAM cache with the VRAM cache a 24 GiB card's plan leaves
Per-token times are for the bench's layers and scaled to the real 48. Each regime also reports the
next-layer guesses (hit rate, wasted MB/token), the bank's host syncs per token, every synchronising CUDA
call per token (torch's sync debug mode, over two extra tokens), and whether its greedy tokens equal the
first regime's. --baseline adds transformers + accelerate offloading (expertstream/bench/baseline.py).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import warnings
from pathlib import Path

import torch

from expertstream.bench.model import REAL_LAYERS, REAL_VOCAB, bench_layers, ensure_model
from expertstream.bench.split_report import (
    cpu_ms,
    cpu_share_note,
    gpu_split_times,
    needed_pcie_bytes,
    split_fields,
    spread,
)
from expertstream.config import EngineConfig
from expertstream.experts.split_bank import SplitExperts
from expertstream.log import get_logger
from expertstream.memory_plan import GiB
from expertstream.models.attention import kv_bucket
from expertstream.runtime.probes import disk_rate, pcie_rate

log = get_logger(__name__)
BIG_BUDGET_GB = 24  # issue 5's regime 3: a 24 GiB card with the disk regime's RAM cache
TUNE_CAP = 200  # warm-up tokens at most while the auto CPU share tunes itself (a few per share it tries)


def disk_rates(path: Path, block_bytes: int, threads: int, before: float) -> tuple[float, str]:
    """(the bound's disk rate, how it was found): the drive's rate drifts (1.3-1.8 GB/s within an hour on the
    H200 machines), so it is probed again after the regimes and the higher rate is the limit."""
    after = disk_rate(path, block_bytes, threads)
    return max(before, after), f"{before:.2f} before and {after:.2f} GB/s after the regimes, the higher used"


def warm_caches(eng, vram: bool) -> None:
    """Fill the RAM cache and, with `vram`, the VRAM cache, so the timed tokens see the steady state of their
    regime, not a cold start: a RAM cache that holds every block is filled in (layer, expert) order, as
    `--preload-experts` fills it (consecutive rows: a prompt pass over them is one copy), a smaller one with
    as many blocks as it holds, in random order."""
    wd = eng.workdir
    keys = [(layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts)]
    if eng.store.capacity >= len(keys):
        order = list(range(len(keys)))
    else:
        order = torch.randperm(len(keys)).tolist()[: eng.store.capacity]
    for i in range(0, len(order), 64):
        handles = eng.store.request([keys[j] for j in order[i : i + 64]])
        for h in handles:
            h.wait()
            h.release()
    if vram:
        step = eng.bank.cache.n_slots // 2
        for layer in range(wd.num_layers):
            for i in range(0, wd.num_experts, step):
                eng.bank.cache.fetch(layer, list(range(i, min(i + step, wd.num_experts))))
        torch.cuda.synchronize()


def count_cuda_syncs(fn) -> int:
    """Synchronising CUDA calls torch reports while fn() runs (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time a device engine was busy (overlaps once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profile_tokens(step, path: Path, tokens: int = 3) -> dict:
    """torch.profiler over `tokens` calls of step(): the op table by device time (`path`.txt) and a Chrome
    trace (`path`.json, chrome://tracing or Perfetto) to see where a token's time goes.

    Returns ms per token that the GPU ran kernels and that copies ran (each the union over streams): the
    hardware's share of a profiled token, against which the host's share shows."""
    import json

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(tokens):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    prof.export_chrome_trace(str(path.with_suffix(".json")))
    events = json.loads(path.with_suffix(".json").read_text())["traceEvents"]
    spans = {"kernel": [], "gpu_memcpy": []}
    for e in events:
        if e.get("cat") in spans and "dur" in e:
            spans[e["cat"]].append((e["ts"], e["ts"] + e["dur"]))  # microseconds
    return {
        "kernel_ms_per_token": busy_ms(spans["kernel"]) / tokens / 1e3,
        "copy_ms_per_token": busy_ms(spans["gpu_memcpy"]) / tokens / 1e3,
    }


def decode_regime(
    cfg: EngineConfig, vram_cache_blocks: int | None, tokens: int, profile_to: Path | None = None
) -> dict:
    from expertstream.runtime.engine import Engine

    eng = Engine(cfg, vram_cache_blocks=vram_cache_blocks)
    warm_caches(eng, vram=vram_cache_blocks >= eng.workdir.num_layers * eng.workdir.num_experts)
    torch.cuda.reset_peak_memory_stats()  # from here: the prompt, graph captures and decode
    state = eng.new_state()
    # every greedy token after the prompt and its top-2 logit margin (a regime whose tokens differ is
    # reported with the first regime's margin where they part: a near-tie, or a fault)
    generated, margins = [], []

    def step(ids: list[int]) -> int:
        top, idx = eng.forward(state, ids).reshape(-1).topk(2)
        (a, b), tok = top.tolist(), int(idx[0])
        generated.append(tok)
        margins.append(a - b)
        return tok

    tok = step(list(range(1, 17)))
    split = eng.bank if isinstance(eng.bank, SplitExperts) else None  # a CPU share of decode
    for i in range(TUNE_CAP):  # warm-up: kernels compiled, caches in their steady state, the share tuned
        if i >= 4 and not (split and split.tuning):
            break
        tok = step([tok])
    s0, c0, k0 = eng.stats(), dataclasses.replace(eng.bank.cache.stats), eng.store.stats
    cpu0 = split.cpu_bytes if split else 0
    times0 = split.split_times() if split else None
    timed = eng.decode.token_seconds if eng.decode else None
    n0 = len(timed) if timed is not None else 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    walls = []  # each token's wall time: step() reads its logits back, so a token's host work is in it
    for _ in range(tokens):
        t = time.perf_counter()
        tok = step([tok])
        walls.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / tokens
    # the GPU's time a token (CUDA events around its replays; each read at the next token's step)
    gpu_token = list(timed)[n0:] if timed is not None and len(timed) < timed.maxlen else []
    gpu_spread = spread(gpu_token) if gpu_token else None
    # a copy: the sync count and the profile below add to the live counters (they inflated PCIe bytes)
    s1, c1, k1 = eng.stats(), dataclasses.replace(eng.bank.cache.stats), eng.store.stats
    last = generated[-1]
    stall_ms = (s1.stall_seconds - s0.stall_seconds) / tokens * 1e3
    resident, resident_ram = (
        s1.resident_reads - s0.resident_reads,
        s1.resident_ram_reads - s0.resident_ram_reads,
    )
    sync_ms = (s1.bank_sync_seconds - s0.bank_sync_seconds) / tokens * 1e3
    bank_ms = (s1.bank_decode_seconds - s0.bank_decode_seconds) / tokens * 1e3
    if split:
        window, cpu_bytes = split.split_times() - times0, split.cpu_bytes - cpu0
    all_syncs = count_cuda_syncs(lambda: [eng.forward(state, [last]).argmax() for _ in range(2)]) / 2
    gpu_times = gpu_split_times(split, lambda: eng.forward(state, [last])) if split else None
    # the decode graphs' program of a token as the timed ones ran it: its graphs and eager stages
    program = eng.decode.program(state, kv_bucket(state.pos + 1, state.max_model_len)) if eng.decode else None
    profiled = profile_tokens(lambda: eng.forward(state, [last]), profile_to) if profile_to else None
    out = {
        "tokens": generated,
        "margins": margins,
        "ms_per_token": dt * 1e3,
        "gpu_ms_per_token": gpu_spread[1] if gpu_spread else None,  # median
        # a mean far above the median: a few tokens held up (on the GPU; in the wall time, or by the host)
        "gpu_ms_spread": gpu_spread,
        "wall_ms_spread": spread(walls),
        "disk_bytes_per_token": (s1.bytes_read - s0.bytes_read) / tokens,
        # copies, and blocks the decode kernel read from RAM in place
        "pcie_bytes_per_token": (c1.bytes_copied - c0.bytes_copied + s1.bus_read_bytes - s0.bus_read_bytes)
        / tokens,
        # staged guesses the next layer did not route to crossed the bus for nothing: not part of the bound
        "staged_waste_bytes_per_token": (
            (s1.staged_blocks - s0.staged_blocks) - (s1.stage_hits - s0.stage_hits)
        )
        * eng.workdir.layout.block_bytes
        / tokens,
        "stage_hit_rate": (s1.stage_hits - s0.stage_hits) / max(1, s1.staged_blocks - s0.staged_blocks),
        # blocks found through the full location table count as hits of the tier they sit in
        "vram_hit_rate": (c1.hits - c0.hits + resident - resident_ram)
        / max(1, c1.requests - c0.requests + resident),
        "ram_hit_rate": (s1.hits - s0.hits + resident_ram) / max(1, s1.requests - s0.requests + resident_ram),
        "stall_ms_per_token": stall_ms,
        # where a token's time goes: the bank's id read-back waiting for the GPU, the bank's own host work
        # (stall excluded), and everything outside the bank (graph replays, QSA, PLE, embedding, lm_head)
        "sync_ms_per_token": sync_ms,
        "bank_host_ms_per_token": bank_ms - sync_ms - stall_ms,
        "guess_host_ms_per_token": (s1.bank_spec_seconds - s0.bank_spec_seconds) / tokens * 1e3,  # part of it
        "outside_bank_ms_per_token": dt * 1e3 - bank_ms,
        "spec_hit_rate": (s1.spec_used - s0.spec_used) / max(1, s1.spec_issued - s0.spec_issued),
        "spec_wasted_bytes_per_token": (s1.spec_wasted_bytes - s0.spec_wasted_bytes) / tokens,
        "syncs_per_token": (s1.host_syncs - s0.host_syncs) / tokens,
        "all_syncs_per_token": all_syncs,
        "peak_gib": torch.cuda.max_memory_allocated() / GiB,  # against --gpu-memory-gb (x utilization)
        # the CRC32C of each block read from disk, on the reader thread that read it
        "blocks_checked": k1.blocks_checked - k0.blocks_checked,
        "checksum_seconds": k1.checksum_seconds - k0.checksum_seconds,
        "checksum_cpu_seconds": k1.checksum_cpu_seconds - k0.checksum_cpu_seconds,
        "profiled": profiled,
    }
    if split:  # its bytes, the kernel's rate measured at start, where its time went
        out["cpu_bytes_per_token"] = cpu_bytes / tokens
        out["cpu_gbps"] = split.cpu_gbps or 0.0
        out.update(split_fields(split, window, cpu_bytes, tokens, gpu_times, program))
    if s1.staged_blocks > s0.staged_blocks:  # RAM-resident decode acts on guesses only by staging them
        out["spec_hit_rate"] = out["stage_hit_rate"]
        out["spec_wasted_bytes_per_token"] = out["staged_waste_bytes_per_token"]
    eng.close()
    return out


def engine_disk_note(rates: dict[str, float], probe_gbps: float) -> str:
    """A line with the disk rate each regime itself reached (GB/s), flagging where it beat the probe: then
    the drive is faster than the probe says and an efficiency above 1 means "at least at the drive's rate"."""
    if not rates:
        return ""
    parts = [f"{n} {r:.2f}" for n, r in rates.items()]
    faster = [n for n, r in rates.items() if r > probe_gbps]
    flag = (
        f"; faster than the {probe_gbps:.2f} GB/s probe in {', '.join(faster)}: the probe underestimates "
        "this drive there, and efficiencies above 1 mean at least the drive's rate"
        if faster
        else ""
    )
    return f"\nDisk rate the engine reached (disk bytes / wall time, GB/s): {', '.join(parts)}{flag}.\n"


def checksum_note(results: dict[str, dict], disk_gbps: float, block: int, io_threads: int) -> str:
    """A line with the CRC32C cost per block read from disk, and its share of a disk-bound token: a token
    reading n blocks at the drive's rate takes n x block / rate, the checks n x c / io_threads of reader
    time (readers check in parallel, each its own block; c x rate / block with one thread: the worst case).
    c is the readers' CPU time; their wall time also holds the wait to take the GIL back after the check."""
    n = sum(r.get("blocks_checked", 0) for r in results.values())
    if not n:
        return ""
    wall = sum(r.get("checksum_seconds", 0.0) for r in results.values()) / n  # seconds per block
    c = sum(r.get("checksum_cpu_seconds", 0.0) for r in results.values()) / n
    per_block_disk = block / (disk_gbps * 1e9)
    return (
        f"\nBlock checksums (CRC32C, every block read from disk, {n} blocks over the regimes): "
        f"{c * 1e3:.3f} ms of CPU per {block:,} B block ({block / c / 1e9:.1f} GB/s per reader thread; "
        f"{wall * 1e3:.3f} ms wall with the wait for the GIL); "
        f"of a disk-bound token at {disk_gbps:.2f} GB/s: "
        f"{c / io_threads / per_block_disk:.2%} with the {io_threads} readers checking in parallel, "
        f"{c / per_block_disk:.2%} if one thread checked them all.\n"
    )


def same_tokens(r: dict, first: dict, first_name: str) -> str:
    """'yes', or where a regime's greedy tokens part from the first regime's, with that regime's top-2 logit
    margin there (after the first difference the contexts differ, so later tokens say nothing more)."""
    n = min(len(r["tokens"]), len(first["tokens"]))  # a tuning warm-up decodes more tokens
    at = next((i for i, (a, b) in enumerate(zip(r["tokens"][:n], first["tokens"][:n])) if a != b), None)
    if at is None:
        return "yes"
    if "margins" not in first:
        return "NO"
    return f"NO from token {at + 1} ({first_name} top-2 margin {first['margins'][at]:.3g})"


def decode_table(results: dict[str, dict], disk_gbps: float, pcie_gbps: float, layers: int) -> str:
    """Markdown rows of the decode regimes; sets each result's bound_ms and efficiency.

    The GPU floor is the `vram` regime's time when it ran; tokens are compared with the first regime's.
    """
    gpu_ms = results["vram"]["ms_per_token"] if "vram" in results else 0.0
    first_name, first_r = next(iter(results.items()))
    rows = [
        "| regime | ms/token (bench layers) | ms/token x48 | disk MB/token | PCIe MB/token | VRAM hit "
        "| RAM hit | stall ms | sync wait ms | bank host ms | of which guesses ms | outside bank ms "
        "| guess hit | guess waste MB/token | bank syncs/token | CUDA syncs/token | peak GiB | same tokens "
        "| bound ms | efficiency |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in results.items():
        disk_ms = r["disk_bytes_per_token"] / disk_gbps / 1e6
        bound = max(disk_ms, needed_pcie_bytes(r) / pcie_gbps / 1e6, cpu_ms(r), gpu_ms)
        r["bound_ms"], r["efficiency"], r["gpu_ms"] = bound, bound / r["ms_per_token"], gpu_ms
        rows.append(
            f"| {name} | {r['ms_per_token']:.2f} | {r['ms_per_token'] * REAL_LAYERS / layers:.1f} | "
            f"{r['disk_bytes_per_token'] / 1e6:.1f} | {r['pcie_bytes_per_token'] / 1e6:.1f} | "
            f"{r['vram_hit_rate']:.0%} | {r['ram_hit_rate']:.0%} | {r['stall_ms_per_token']:.2f} | "
            f"{r['sync_ms_per_token']:.2f} | {r['bank_host_ms_per_token']:.2f} | "
            f"{r['guess_host_ms_per_token']:.2f} | {r['outside_bank_ms_per_token']:.2f} | "
            f"{r['spec_hit_rate']:.0%} | {r['spec_wasted_bytes_per_token'] / 1e6:.1f} | "
            f"{r['syncs_per_token']:.1f} | {r['all_syncs_per_token']:.1f} | {r['peak_gib']:.2f} | "
            f"{same_tokens(r, first_r, first_name)} | {bound:.2f} | {r['efficiency']:.2f} |"
        )
    profiled = [(name, r) for name, r in results.items() if r.get("profiled")]
    if profiled:
        # the hardware bound: the `vram` regime's profiled kernel time instead of its wall time, which also
        # holds this engine's host work
        floor = results.get("vram", {}).get("profiled") or {}
        for _, r in profiled:
            disk_ms = r["disk_bytes_per_token"] / disk_gbps / 1e6
            pcie_ms = needed_pcie_bytes(r) / pcie_gbps / 1e6
            r["hw_bound_ms"] = max(disk_ms, pcie_ms, cpu_ms(r), floor.get("kernel_ms_per_token", 0.0))
            r["hw_efficiency"] = r["hw_bound_ms"] / r["ms_per_token"]
        parts = [
            f"{n} {r['profiled']['kernel_ms_per_token']:.2f} / {r['profiled']['copy_ms_per_token']:.2f} ms, "
            f"{r['hw_efficiency']:.2f}"
            for n, r in profiled
        ]
        rows.append(
            "\nProfiled tokens (torch.profiler, 3 tokens; the profiler slows the host): GPU busy per token, "
            "kernels / copies, each the union over streams, and the efficiency against the hardware bound "
            "max(disk, PCIe, the `vram` regime's kernel time): " + "; ".join(parts) + "."
        )
    rates = {
        n: r["disk_bytes_per_token"] / r["ms_per_token"] / 1e6
        for n, r in results.items()
        if r["disk_bytes_per_token"]
    }
    notes = (
        engine_disk_note(rates, disk_gbps) + cpu_share_note(results, pcie_gbps, layers) + tokens_note(results)
    )
    return "\n".join(rows) + "\n" + notes


def tokens_note(results: dict[str, dict]) -> str:
    """A line saying whether every regime chose the first regime's greedy tokens (they compute the same
    sums in the same order, so they must), naming those that did not."""
    (first_name, first), *rest = results.items()
    parted = [n for n, r in rest if same_tokens(r, first, first_name) != "yes"]
    verdict = "yes" if not parted else f"NO ({', '.join(f'`{n}`' for n in parted)} differ)"
    return (
        f"\nGreedy tokens identical in every regime ({len(first['tokens'])} tokens, against `{first_name}`): "
        f"{verdict}.\n"
    )


def real_model_plan(wd, budget_gb: float, max_model_len: int):
    """The 48-layer model's memory plan under the same budget and context (the bench model has fewer
    layers, so its own plan leaves far more room than the real model's would)."""
    from expertstream.memory_plan import plan_memory
    from expertstream.workdir.inventory import resident_spec

    tc = dict(wd.text_config)
    interval = tc["full_attention_interval"]
    types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(REAL_LAYERS)]
    tc.update(num_hidden_layers=REAL_LAYERS, layer_types=types, vocab_size=REAL_VOCAB)
    inventory = {name: (shape, dtype) for name, (dtype, shape) in resident_spec(tc).items()}
    return plan_memory(tc, inventory, wd.layout.block_bytes, int(budget_gb * GiB * 0.9), max_model_len)


def real_model_cache_share(wd, budget_gb: float, max_model_len: int) -> float:
    """VRAM cache blocks per layer that the 48-layer model's plan leaves under the same budget."""
    return real_model_plan(wd, budget_gb, max_model_len).vram_cache_blocks / REAL_LAYERS


def bench_model(args, what: str, max_model_len: int):
    """The GPU benches' model and base engine config: (Workdir of the full-shape model, EngineConfig)."""
    from expertstream.bench.baseline import baseline_disk_needed
    from expertstream.workdir.workdir import Workdir

    if not torch.cuda.is_available():
        raise SystemExit(f"bench {what} needs a CUDA GPU (it measures the GPU runtime); none is visible")
    root = Path(args.workdir)
    # --baseline writes its own snapshot and offload folder after the regimes: room is kept, and checked
    # before they run (a full disk midway can take the machine down with it)
    reserve = baseline_disk_needed(root, args.baseline_layers) if args.baseline else 0.0
    args.layers = bench_layers(root, args.layers, reserve)  # the baseline scales by it too
    work = ensure_model(root, args.layers)
    free = shutil.disk_usage(root).free
    if args.baseline and free < reserve:
        raise SystemExit(
            f"--baseline needs ~{reserve / 1e9:.0f} GB free under {root} for its {args.baseline_layers}-layer"
            f" snapshot and offload folder; {free / 1e9:.1f} GB are free beside the {args.layers}-layer"
            " model: free some, use fewer --layers, or point --workdir elsewhere"
        )
    base = EngineConfig(
        model=str(work),
        gpu_memory_gb=args.gpu_memory_gb,
        max_model_len=max_model_len,
        no_speculation=args.no_speculation,
        speculation_width=args.speculation_width,
        threads=getattr(args, "threads", 0) or 0,
    )
    return Workdir(work), base


def decode_regimes(
    wd, base: EngineConfig, stage_guesses: int, cpu_moe_share: float = -1.0
) -> tuple[dict, dict]:
    """The decode regimes {name: (EngineConfig, VRAM cache blocks)} of the bench model `wd` under base's
    budget, and what the table's header says of them (cache share, staged guesses)."""
    from expertstream.memory_plan import stage_guesses_for

    block = wd.layout.block_bytes
    expert_bytes = wd.num_layers * wd.num_experts * block
    real = real_model_plan(wd, base.gpu_memory_gb, base.max_model_len)
    share = real.vram_cache_blocks / REAL_LAYERS
    vram_blocks = int(share * wd.num_layers)
    # the staging rows are not per layer: `ram` gets the 48-layer plan's, on top of its cache share, so that
    # the bank resolves --stage-guesses as the real model's engine would
    k = wd.text_config["num_experts_per_tok"]
    staged = stage_guesses_for(stage_guesses, k, real.slots // block + real.vram_cache_blocks)
    share24 = real_model_cache_share(wd, BIG_BUDGET_GB, base.max_model_len)
    all_in_ram = dataclasses.replace(base, ram_cache_gb=expert_bytes / GiB + 0.1)
    quarter_in_ram = dataclasses.replace(base, ram_cache_gb=0.25 * expert_bytes / GiB)
    # the floor, not an 8 GiB claim: the budget grows by the expert bytes so that every expert fits
    all_in_vram = dataclasses.replace(all_in_ram, gpu_memory_gb=base.gpu_memory_gb + expert_bytes / GiB)
    regimes = {
        "vram": (all_in_vram, wd.num_layers * wd.num_experts),
        "vram eager": (dataclasses.replace(all_in_vram, enforce_eager=True), wd.num_layers * wd.num_experts),
        "ram": (dataclasses.replace(all_in_ram, stage_guesses=staged), vram_blocks + 2 * staged),
        "ram unstaged": (dataclasses.replace(all_in_ram, stage_guesses=0), vram_blocks),
        # the CPU computes a share of each layer's experts in place; the GPU's share takes K copy rows
        "ram, CPU share": (
            dataclasses.replace(all_in_ram, stage_guesses=staged, cpu_moe_share=cpu_moe_share),
            vram_blocks + 2 * staged + k,
        ),
        # every expert in RAM beside a large VRAM cache: decode reads the hot set there (not an issue regime)
        f"ram, {BIG_BUDGET_GB:g} GiB VRAM": (
            dataclasses.replace(all_in_ram, gpu_memory_gb=BIG_BUDGET_GB, stage_guesses=staged),
            int(share24 * wd.num_layers) + 2 * staged,
        ),
        "disk": (quarter_in_ram, vram_blocks),
        f"disk, {BIG_BUDGET_GB:g} GiB VRAM": (
            dataclasses.replace(quarter_in_ram, gpu_memory_gb=BIG_BUDGET_GB),
            int(share24 * wd.num_layers),
        ),
    }
    return regimes, dict(vram_blocks=vram_blocks, share=share, share24=share24, staged=staged)


def decoding_engine(cfg: EngineConfig, blocks: int):
    """(engine, state, next token) of a decode regime in its steady state: caches warmed, a 16-token prompt
    and 6 tokens already decoded (Triton compiles and graph captures done)."""
    from expertstream.runtime.engine import Engine

    eng = Engine(cfg, vram_cache_blocks=blocks)
    warm_caches(eng, vram=blocks >= eng.workdir.num_layers * eng.workdir.num_experts)
    state = eng.new_state()
    tok = int(eng.forward(state, list(range(1, 17))).argmax())
    for _ in range(6):
        tok = int(eng.forward(state, [tok]).argmax())
    return eng, state, tok


def run(args) -> int:
    from expertstream.bench.cli import chosen, emit, regime_slug

    if getattr(args, "model", None):  # an existing working directory, of any family
        from expertstream.bench import workdir_decode

        return workdir_decode.run(args)
    wd, base = bench_model(args, "decode", args.max_model_len)
    block = wd.layout.block_bytes
    expert_bytes = wd.num_layers * wd.num_experts * block
    disk = disk_rate(wd.experts_path, block, base.io_threads)
    pcie, pcie_block = pcie_rate(), pcie_rate(block=block)
    regimes, info = decode_regimes(wd, base, args.stage_guesses, args.cpu_moe_share)
    vram_blocks, share, share24, staged = (info[n] for n in ("vram_blocks", "share", "share24", "staged"))
    results = {}
    for name, (cfg, blocks) in chosen(args, regimes).items():
        where = Path(args.profile) / regime_slug(name) if args.profile else None
        results[name] = decode_regime(cfg, blocks, args.tokens, where)
        log.info("%s: %s", name, results[name])
    disk, disk_note = disk_rates(wd.experts_path, block, base.io_threads, disk)
    table = decode_table(results, disk, pcie, wd.num_layers) + checksum_note(
        results, disk, block, base.io_threads
    )
    head = (
        f"Full-shape synthetic model, {wd.num_layers} layers x {wd.num_experts} experts "
        f"({block:,} B blocks, top-{wd.text_config['num_experts_per_tok']}, random routing), "
        f"--gpu-memory-gb {args.gpu_memory_gb}; measured in this run: O_DIRECT {disk:.2f} GB/s "
        f"({base.io_threads} threads; {disk_note}), pinned H2D {pcie:.1f} GB/s (one 1 GiB copy, the "
        f"bound's rate; {pcie_block:.1f} GB/s a copy call per block at random rows); "
        f"VRAM cache {vram_blocks} blocks "
        f"({share:.1f} per layer, the 48-layer plan's share; {share24:.1f} per layer at "
        f"{BIG_BUDGET_GB} GiB); "
        f"CUDA graphs on except in `vram eager`; `ram` copies {staged} guesses per layer "
        f"to VRAM early (--stage-guesses), `ram unstaged` none; `ram, CPU share` computes a share "
        f"of each layer's experts on the CPU (--cpu-moe-share {args.cpu_moe_share:g}), its split layers "
        f"unstaged (and with {staged} guesses where its share is 0); "
        f"`ram, {BIG_BUDGET_GB:g} GiB VRAM` also reads a hot set "
        "from VRAM (half its cache share); speculation "
        f"{'off' if args.no_speculation else f'on, {args.speculation_width:g} x K guesses'}.\n\n"
    )
    table = head + table
    if args.baseline:
        from expertstream.bench.baseline import baseline_table, run_baseline

        base_ms = {n: r["ms_per_token"] / wd.num_layers for n, r in results.items()}
        table += "\n" + baseline_table(run_baseline(args, expert_bytes, prompt=1), base_ms, "decode") + "\n"
    payload = dict(disk_gbps=disk, pcie_gbps=pcie, pcie_block_gbps=pcie_block, vram_blocks=vram_blocks)
    payload["tokens_identical"] = all(
        r["tokens"] == next(iter(results.values()))["tokens"] for r in results.values()
    )
    payload.update(results)
    emit(args, "Decode", torch.cuda.get_device_name(), table, payload)
    return 0
