"""`expertstream setup SNAPSHOT WORKDIR --dry-run`: every check setup makes, from the headers alone.

Reads config.json and the safetensors headers (no tensor data), then prints the checks, the inventory the
working directory would hold (tensor families, counts, bytes), the disk it needs and the VRAM plan. Seconds
on the 133 GB download, so a wrong or partial snapshot is found before an hour of setup. docs/workdir.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from expertstream.formats.snapshot import SnapshotError
from expertstream.memory_plan import GiB, MemoryPlanError, plan_memory
from expertstream.workdir.inventory import PLE_TABLE, SetupError
from expertstream.workdir.repack import (
    COPY_FILES,
    Plan,
    _fp8_dense,
    budget_report,
    disk_free,
    disk_needed,
    plan_setup,
)


def _families(plan: Plan) -> list[tuple[str, int, int, int]]:
    """(family, tensors, bytes in the snapshot, bytes in the workdir) for every tensor of the snapshot."""
    L, E, bb = plan.num_layers, plan.num_experts, plan.layout.block_bytes
    resident = {i.name for i in plan.resident}
    count = dict.fromkeys(("experts", "scalars", "resident", "ple", "mtp", "vision", "other"), 0)
    nbytes = dict.fromkeys(count, 0)
    for name, info in plan.snap.tensors.items():  # one pass: the real snapshot has ~300k tensors
        if name in plan.experts:
            scalar = plan.family.scalars and plan.experts[name][2].endswith(plan.family.scalars)
            key = "scalars" if scalar else "experts"
        elif name in resident:
            key = "resident"
        elif f".{PLE_TABLE}." in name:
            key = "ple"
        else:
            key = (
                "mtp"
                if name.startswith("mtp.")
                else "vision"
                if name.startswith("model.visual.")
                else "other"
            )
        count[key] += 1
        nbytes[key] += info.nbytes
    rows = [
        ("routed experts -> experts.bin", "experts", L * E * bb),
        ("expert scalars -> expert_scales.safetensors", "scalars", L * E * 2 * 3 * 4),
        ("resident text weights -> resident.safetensors", "resident", plan.resident_bytes),
        ("PLE table and scale (read in place)", "ple", 0),
        ("MTP (dropped)", "mtp", 0),
        ("vision (dropped)", "vision", 0),
        ("other (dropped)", "other", 0),
    ]
    return [(name, count[k], nbytes[k], w) for name, k, w in rows if k != "other" or count[k]]


def _resident_inventory(plan: Plan) -> dict[str, tuple[tuple[int, ...], str]]:
    """The header resident.safetensors would get (workdir names), as `plan_memory` takes it."""
    out = {}
    for info in plan.resident:
        name = plan.family.rname(info.name)
        if plan.fp8_dense and _fp8_dense(plan.family, name):
            out[name] = (info.shape, "F8_E4M3")
            out[f"{name}_scale"] = ((info.shape[0],), "F32")
        else:
            out[name] = (info.shape, info.dtype)
    return out


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB"


def dry_run(
    snapshot: str | os.PathLike,
    workdir: str | os.PathLike,
    *,
    fp8_dense: bool = False,
    copy_ple: bool = False,
    gpu_memory_gb: float | None = None,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int = 32768,
) -> tuple[bool, str]:
    """Run setup's checks on headers only; returns (all passed, the report). Reads no tensor data."""
    workdir = Path(workdir).resolve()
    lines = [f"setup --dry-run: {Path(snapshot).resolve()} -> {workdir} (headers only, no tensor data read)"]
    checked: list[str] = []
    try:
        plan = plan_setup(snapshot, fp8_dense, read_data=False, checked=checked)
    except (SetupError, SnapshotError, OSError) as e:
        lines += [f"  ok    {c}" for c in checked] + [f"  FAIL  {e}"]
        return False, "\n".join(lines)
    need, free = disk_needed(plan, copy_ple), disk_free(workdir)
    disk_ok = need <= free
    checked.append(f"free disk for {workdir}: {_gb(need)} needed, {_gb(free)} free")
    lines += ["checks:"] + [f"  ok    {c}" for c in checked[:-1]]
    lines.append(f"  {'ok  ' if disk_ok else 'FAIL'}  {checked[-1]}")
    if plan.family.data_checks:
        lines.append("left to setup (they need tensor data):")
        lines += [f"  -     {c}" for c in plan.family.data_checks]

    lines.append("inventory:")
    lines.append(f"  {'family':<48} {'tensors':>9} {'snapshot':>13} {'workdir':>13}")
    fams = _families(plan)
    if copy_ple:
        name, n, b, _ = fams[3]
        fams[3] = (
            name.replace("read in place", "copied to ple/"),
            n,
            b,
            sum(i.nbytes for i in plan.ple_infos),
        )
    copied = [plan.snap.path / f for f in COPY_FILES if (plan.snap.path / f).is_file()]
    fams.append(
        ("config, tokenizer, template files (copied)", len(copied), 0, sum(f.stat().st_size for f in copied))
    )
    for name, n, b, w in fams:
        lines.append(f"  {name:<48} {n:>9,} {_gb(b):>13} {_gb(w):>13}")
    lines.append(
        f"  {'total':<48} {sum(f[1] for f in fams):>9,} {_gb(sum(f[2] for f in fams)):>13} {_gb(need):>13}"
    )
    lines += ["budget:"] + [f"  {x}" for x in budget_report(plan).splitlines()]

    lines.append(_vram_plan(plan, gpu_memory_gb, gpu_memory_utilization, max_model_len))
    return disk_ok, "\n".join(lines)


def _vram_plan(plan: Plan, gpu_memory_gb: float | None, utilization: float, max_model_len: int) -> str:
    if gpu_memory_gb is None:
        import torch

        if not torch.cuda.is_available():
            return "VRAM plan: no GPU is visible; give --gpu-memory-gb to plan for a card (e.g. 8)"
        budget = int(torch.cuda.mem_get_info()[0] * utilization)
    else:
        budget = int(gpu_memory_gb * GiB * utilization)
    try:
        mp = plan_memory(
            plan.snap.text_config, _resident_inventory(plan), plan.layout.block_bytes, budget, max_model_len
        )
    except MemoryPlanError as e:
        return f"VRAM plan: {e}"
    return f"{mp.describe()}\n  (for --max-model-len {max_model_len}, resident weights as stored)"
