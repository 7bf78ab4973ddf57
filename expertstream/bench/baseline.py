"""The `--baseline` of `expertstream bench decode|prefill`: transformers + accelerate offloading.

transformers' Qwen4ExpForCausalLM holds the bf16 twin of a full-shape synthetic model (the NVFP4 snapshot
dequantized, as `expertstream check` builds it); accelerate places whole decoder layers on the GPU up to
--gpu-memory-gb, then in CPU RAM up to the bench's disk-regime RAM share (25 % of the bf16 model), then on
disk (offload folder), and streams them in on every forward. Reported per layer, beside the engine's.
It needs `accelerate` and `transformers`; --baseline-layers keeps the dequantized model inside host RAM
(the reference is built in FP32 first: ~20 GB per full-shape layer).
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from expertstream.log import get_logger
from expertstream.memory_plan import GiB

log = get_logger(__name__)
DECODER_LAYER = "Qwen4ExpTextDecoderLayer"  # accelerate never splits one across devices
BF16_PER_BLOCK = 32 / 9  # bf16 expert bytes per NVFP4 block byte (16 bits against 4 + 8/16)


def max_memory(gpu_memory_gb: float | None, cpu_bytes: int) -> dict:
    """accelerate's max_memory: the GPU budget (None: CPU and disk only), the CPU share; the rest: disk."""
    out = {0: f"{gpu_memory_gb}GiB"} if gpu_memory_gb else {}
    out["cpu"] = f"{cpu_bytes / GiB:.3f}GiB"
    return out


def time_offloaded(snapshot: Path, memory: dict, prompt: int, reps: int = 3) -> dict:
    """Seconds of one no-cache forward over `prompt` random tokens of the offloaded bf16 model."""
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        raise SystemExit("--baseline needs accelerate (pip install accelerate)") from None
    from expertstream.commands.check import build_reference

    model = build_reference(snapshot, dtype=torch.bfloat16, device="cpu")
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=[DECODER_LAYER])
    cuda = torch.cuda.is_available() and 0 in memory
    with tempfile.TemporaryDirectory(prefix="offload-", dir=snapshot.parent) as folder:
        # a folder that does not exist yet: dispatch_model writes the disk share only into a new one
        offload = Path(folder) / "weights"
        model = dispatch_model(model, device_map, main_device=0 if cuda else "cpu", offload_dir=offload)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        ids = ids.to("cuda" if cuda else "cpu")
        times = []
        with torch.no_grad():
            for _ in range(reps + 1):  # the first forward warms up (page cache, kernels)
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
    placed = Counter(str(v) for k, v in device_map.items() if ".layers." in f".{k}.")
    return {
        "layers": model.config.num_hidden_layers,
        "prompt": prompt,
        "seconds": min(times[1:]),
        "placement": dict(placed),
    }


def run_baseline(args, expert_bytes: int, prompt: int) -> dict:
    """The baseline on a `--baseline-layers` full-shape snapshot next to the bench's model."""
    from expertstream.synth.synth import write_synthetic

    layers = args.baseline_layers
    snap = Path(args.workdir) / f"full-{layers}"
    if not (snap / "config.json").exists():
        write_synthetic(snap, preset="full-shape", layers=layers, progress=True)
    # the CPU share mirrors the disk regime's 25 % RAM cache
    bf16_bytes = expert_bytes / args.layers * layers * BF16_PER_BLOCK
    out = time_offloaded(snap, max_memory(args.gpu_memory_gb, int(0.25 * bf16_bytes)), prompt)
    log.info("baseline: %s", out)
    return out


def baseline_disk_needed(root: Path, layers: int) -> float:
    """Free disk --baseline writes at most: its NVFP4 snapshot (unless made) and accelerate's offload
    folder, at most the whole bf16 twin; dense weights 10 % more, and DISK_SPARE."""
    from expertstream.bench.model import DISK_SPARE, full_shape_layer_bytes

    snapshot = 0.0 if (root / f"full-{layers}" / "config.json").exists() else 1.0
    return layers * full_shape_layer_bytes() * (snapshot + BF16_PER_BLOCK) * 1.1 + DISK_SPARE


def baseline_table(base: dict, ours_ms_per_layer: dict[str, float], what: str) -> str:
    """Markdown: the baseline's ms per layer beside each engine regime's."""
    ms = base["seconds"] * 1e3 / base["layers"]
    where = ", ".join(f"{n} on {d}" for d, n in sorted(base["placement"].items()))
    rows = [
        f"Baseline ({what}, {base['prompt']} tokens): transformers + accelerate offloading, bf16, "
        f"{base['layers']} layers ({where}): {ms:.1f} ms per layer.\n",
        "| engine regime | engine ms/layer | baseline ms/layer | speed-up |",
        "|---|---:|---:|---:|",
    ]
    rows += [f"| {n} | {v:.2f} | {ms:.1f} | {ms / v:.1f}x |" for n, v in ours_ms_per_layer.items()]
    return "\n".join(rows) + "\n"
