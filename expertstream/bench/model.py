"""The full-shape synthetic bench model on disk: how many of its layers this machine holds, made once.

`bench decode` and `bench prefill` run on it, and the offloading baseline sizes its disk from it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from expertstream.log import get_logger

log = get_logger(__name__)
# the emulated model: Qwen3.8-Flash-Next's layer count and vocabulary (the synthetic one keeps a tiny vocab)
REAL_LAYERS = 48
REAL_VOCAB = 248320


# a full-shape bench model on disk: its experts twice (snapshot and working directory) and 10 % more of dense
# weights a layer, with a tenth of the free disk and 2 GB more left over
LAYER_DISK, DISK_USE, DISK_SPARE = 2.2, 0.9, 2e9


def disk_needed(layers: int, layer_expert_bytes: int) -> float:
    """Free disk a full-shape bench model of `layers` layers needs."""
    return (layers * LAYER_DISK * layer_expert_bytes + DISK_SPARE) / DISK_USE


def layers_that_fit(free_disk: int, host_ram: int, layer_expert_bytes: int) -> tuple[int, int]:
    """(by disk, by RAM): full-shape layers that fit, on the disk (the inverse of `disk_needed`) and in
    half the RAM (the `ram` regime pins every expert block)."""
    by_disk = int((DISK_USE * free_disk - DISK_SPARE) // (LAYER_DISK * layer_expert_bytes))
    return max(0, by_disk), host_ram // 2 // layer_expert_bytes


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def full_shape_layer_bytes() -> int:
    """Expert bytes of one full-shape layer (512 blocks of 2,764,800 B)."""
    from expertstream.formats.expert_block import ExpertLayout
    from expertstream.synth.synth import preset_dims

    tc = preset_dims("full-shape")
    block = ExpertLayout.for_dims(tc["hidden_size"], tc["moe_intermediate_size"]).block_bytes
    return tc["num_experts"] * block


def bench_layers(root: Path, layers: int, reserve: float = 0.0) -> int:
    """--layers, where 0 (the default) is issue 5's "as many layers as the disk allows": as many as this
    machine's free disk (less `reserve` bytes that the run writes beside the model) and RAM hold
    (`layers_that_fit`), up to the real 48, or the largest full-shape model already under `root` if that
    has more. A model that cannot fit on the disk is refused before anything is written."""
    made = [int(p.name[5:-3]) for p in root.glob("full-*-wd") if (p / "manifest.json").exists()]
    if layers in made:
        return layers
    layer_expert_bytes = full_shape_layer_bytes()
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free - reserve
    by_disk, by_ram = layers_that_fit(free, host_ram_bytes(), layer_expert_bytes)
    n = layers or max([min(REAL_LAYERS, by_disk, by_ram), *made]) or 1
    if n > by_disk and n not in made:
        need = disk_needed(n, layer_expert_bytes)
        raise SystemExit(
            f"a {n}-layer full-shape bench model needs ~{need / 1e9:.0f} GB free under {root} (snapshot and "
            f"working directory); {free / 1e9:.1f} GB are free{' beside the baseline' if reserve else ''}: "
            "free some, or point --workdir elsewhere"
        )
    log.info("--layers %d: %d full-shape layers (%.0f GB free disk; fit by disk %d, by RAM %d; made: %s)",
             layers, n, free / 1e9, by_disk, by_ram, made or "none")  # fmt: skip
    return n


def ensure_model(root: Path, layers: int) -> Path:
    """The working directory of a full-shape synthetic model of `layers` layers under root, made once."""
    from expertstream.synth.synth import write_synthetic
    from expertstream.workdir.repack import setup_workdir

    snap, work = root / f"full-{layers}", root / f"full-{layers}-wd"
    if not (work / "manifest.json").exists():
        if not (snap / "config.json").exists():
            write_synthetic(snap, preset="full-shape", layers=layers, progress=True)
        setup_workdir(snap, work, fp8_dense=True)
    return work
