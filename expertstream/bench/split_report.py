"""`bench decode`'s report of the CPU share of decode (`ram, CPU share`, experts/split_bank.py): where a split
layer's time goes, measured, and what the split can reach on this box by its model.

A split layer costs about d + max(CPU kernel, the GPU's share over the bus), where the bus alone costs d +
all K blocks over the bus: d, the layer's dense GPU work, is in both (the CPU needs the layer's x, the next
layer needs its sum), so the split pays only where max(...) < K blocks over the bus. The CPU's side holds
the split server's two bus round trips through the mailbox besides its kernel.
"""

from __future__ import annotations

from expertstream.experts.split_bank import SplitExperts, SplitTimes, cpu_experts, expert_seconds

GPU_TIMED_TOKENS = 4  # tokens decoded again with CUDA events per split layer, after the timed ones


def gpu_split_times(split: SplitExperts, step, tokens: int = GPU_TIMED_TOKENS) -> SplitTimes:
    """The split layers' times over `tokens` calls of step(), with the GPU's (CUDA events) in them."""
    split.gpu_timing = True
    try:
        a = split.split_times()
        for _ in range(tokens):
            step()
        return split.split_times() - a
    finally:
        split.gpu_timing = False


def split_fields(
    split: SplitExperts,
    window: SplitTimes,
    cpu_bytes: int,
    tokens: int,
    gpu: SplitTimes | None,
    program: list[tuple[bool, list]] | None = None,
) -> dict:
    """The regime's split fields: the server's kernel in ms a token over the timed tokens (`window`, in which
    the CPU read `cpu_bytes`), the GPU's from `gpu` (ms a token over GPU_TIMED_TOKENS, the dense part in ms a
    layer), the shapes the model needs, and with the decode graphs' `program` of a token (its runs:
    (graphable, stages)) the graphs it replays and the eager stages between them."""
    ms = 1e3 / tokens
    out = {
        "split_layers_per_token": window.calls / tokens,
        "split_kernel_ms": window.kernel * ms,
        "cpu_experts": split.n_cpu,
        "cpu_threads": split.threads(),
        "k": split.k,
        "payload_bytes": split.layout.payload_bytes,
        "block_bytes": split.layout.block_bytes,
    }
    if program is not None:
        out["graphs_per_token"] = sum(graphable for graphable, _ in program)
        out["eager_stages_per_token"] = sum(len(stages) for graphable, stages in program if not graphable)
    if window.kernel > 0:  # the kernel's rate in place: beside the bus's reads of the same RAM
        out["cpu_gbps_in_place"] = cpu_bytes / window.kernel / 1e9
    calls = split.kernel_log(window.calls) if window.calls else []
    if calls:  # a parked thread or a late wake-up holds a call up
        out["split_kernel_call_ms"] = spread(calls)[1:]
    if gpu is not None and gpu.timed:
        g = 1e3 / GPU_TIMED_TOKENS
        out.update(split_gpu_share_ms=gpu.gpu_share * g, split_gpu_idle_ms=gpu.gpu_idle * g)
        if gpu.dense_gaps:
            out["split_gpu_dense_ms_per_layer"] = gpu.gpu_dense / gpu.dense_gaps * 1e3
    return out


def needed_pcie_bytes(r: dict) -> float:
    """A regime's PCIe bytes per token that count toward its bound: staged guesses nobody routed to crossed
    the bus for nothing."""
    return r["pcie_bytes_per_token"] - r.get("staged_waste_bytes_per_token", 0.0)


def cpu_ms(r: dict) -> float:
    """A regime's CPU share of a token at the CPU kernel's measured rate (0 without a CPU share)."""
    return r["cpu_bytes_per_token"] / r["cpu_gbps"] / 1e6 if r.get("cpu_gbps") else 0.0


def cpu_share_note(results: dict[str, dict], pcie_gbps: float, layers: int) -> str:
    """Lines per regime with a CPU share: experts a layer on the CPU, its MB/token and rate, the bound's
    three terms and its speed against the regimes without the share that ran; then where its time went and
    the model's reach (module docstring), each layer's dense GPU work d from the `vram` regime."""
    lines = []
    for name, r in results.items():
        if "cpu_gbps" not in r:
            continue
        vs = "".join(
            f"; {results[n]['ms_per_token'] / r['ms_per_token']:.2f}x `{n}`"
            for n in ("ram", "ram unstaged")
            if n in results
        )
        lines.append(
            f"\n`{name}`: {r['cpu_experts']} routed experts a layer on the CPU, "
            f"{r['cpu_bytes_per_token'] / 1e6:.1f} MB/token at {r['cpu_gbps']:.1f} GB/s (the kernel's rate "
            f"measured at start); bound terms PCIe {needed_pcie_bytes(r) / pcie_gbps / 1e6:.2f} ms, CPU "
            f"{cpu_ms(r):.2f} ms, GPU "
            f"{r.get('gpu_ms', 0.0):.2f} ms{vs}.\n"
        )
        if r.get("split_layers_per_token"):
            lines.append(breakdown(name, r) + model(r, results, pcie_gbps, layers))
    return "".join(lines)


def spread(seconds) -> list[float]:
    """Mean, median, p90 and max of some durations, in ms."""
    s = sorted(seconds)
    return [sum(s) / len(s) * 1e3, s[len(s) // 2] * 1e3, s[len(s) * 9 // 10] * 1e3, s[-1] * 1e3]


def breakdown(name: str, r: dict) -> str:
    """Where a token's split layers' time went: the server's kernel, then the GPU's."""
    rate = f" ({r['cpu_gbps_in_place']:.1f} GB/s in place)" if "cpu_gbps_in_place" in r else ""
    rate += f" on {r['cpu_threads']} threads" if "cpu_threads" in r else ""
    if "split_kernel_call_ms" in r:  # a mean far above the median: a few calls held up
        med, p90, top = r["split_kernel_call_ms"]
        rate += f" (a call: median {med:.3f} ms, p90 {p90:.3f}, max {top:.3f})"
    text = (
        f"\n`{name}` a token ({r['split_layers_per_token']:.0f} split layers, posted to the split server): "
        f"CPU kernel {r['split_kernel_ms']:.2f} ms{rate}"
    )
    if r.get("gpu_ms_per_token"):  # the wall time less the host's work between tokens
        text += f"; the GPU's time a token {r['gpu_ms_per_token']:.2f} ms (median, CUDA events around it)"
    for what, key in (("GPU", "gpu_ms_spread"), ("wall", "wall_ms_spread")):
        if r.get(key):  # a mean far above the median: a few tokens held up
            mean, med, p90, top = r[key]
            text += (
                f"; a token's {what} time: mean {mean:.2f} ms, median {med:.2f}, p90 {p90:.2f}, max {top:.2f}"
            )
    if "graphs_per_token" in r:
        text += (
            f"; a token replays {r['graphs_per_token']} graphs around {r['eager_stages_per_token']} eager "
            "stages"
        )
    if "split_gpu_share_ms" in r:
        text += (
            f"; GPU (CUDA events, {GPU_TIMED_TOKENS} more tokens): its share {r['split_gpu_share_ms']:.2f} "
            f"ms, then idle until the CPU's answer {r['split_gpu_idle_ms']:.2f} ms"
        )
        if "split_gpu_dense_ms_per_layer" in r:
            text += (
                f", from the CPU's answer to the next layer's send {r['split_gpu_dense_ms_per_layer']:.3f} "
                "ms a layer (the add, the dense work and, in these eager tokens, the host's launches)"
            )
    return text + ".\n"


def model(r: dict, results: dict[str, dict], pcie_gbps: float, layers: int) -> str:
    """The split's reach by the module docstring's model, against the bus alone, at this run's rates."""
    if "vram" not in results:  # the timed gap between split layers holds the host's launches too
        return "\nModel: needs the `vram` regime (d, a layer's dense GPU work).\n"
    d, where = results["vram"]["ms_per_token"] / layers, "the `vram` regime's ms a token / layers"
    k, n, block = r["k"], r["cpu_experts"], r["block_bytes"]
    cpu = r.get("cpu_gbps_in_place", r["cpu_gbps"])
    per_layer = r["split_layers_per_token"]
    alone = d + expert_seconds(k, 0, block, cpu, pcie_gbps) * 1e3
    split = d + expert_seconds(k, n, block, cpu, pcie_gbps) * 1e3
    best = cpu_experts(k, cpu, pcie_gbps, block)
    reach = d + expert_seconds(k, best, block, cpu, pcie_gbps) * 1e3
    measured = r["ms_per_token"] / per_layer
    ram = "".join(
        f", `{m}` {results[m]['ms_per_token'] / layers:.2f}" for m in ("ram", "ram unstaged") if m in results
    )
    text = (
        f"\nModel a layer (d = {d:.3f} ms, {where}; CPU kernel {cpu:.1f} GB/s, bus {pcie_gbps:.1f} GB/s): "
        f"the bus alone d + {k} blocks = {alone:.3f} ms; split d + max(CPU {n}, bus {k - n} blocks) = "
        f"{split:.3f} ms; measured: split {measured:.3f}{ram}. The model's best share at these rates: {best} "
        f"of {k} experts, {reach:.3f} ms a layer, {alone / reach:.2f}x the bus alone."
    )
    if r.get("split_gpu_share_ms") and k > n:  # the GPU's share read beside the CPU's reads of the same RAM
        bus = (k - n) * block / (r["split_gpu_share_ms"] / per_layer / 1e3) / 1e9
        best = cpu_experts(k, cpu, bus, block, alone_gbps=pcie_gbps)
        reach = d + expert_seconds(k, best, block, cpu, bus if best else pcie_gbps) * 1e3
        text += (
            f" With the GPU's share at its measured rate ({bus:.1f} GB/s, CUDA events): best {best} of {k}, "
            f"{reach:.3f} ms a layer, {alone / reach:.2f}x the bus alone."
        )
    return text + "\n"
