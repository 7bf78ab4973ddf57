"""`expertstream setup SNAPSHOT WORKDIR`: check a Hugging Face snapshot, then write the working directory.

Everything is checked before anything is written (model type, quant config, every tensor's dtype and shape
from config.json, shard sizes, free disk). The manifest goes last and atomically, so an interrupted or failed
setup never leaves a directory that `Workdir` accepts. Format: docs/workdir.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from expertstream.formats.expert_block import PROJ, ExpertLayout
from expertstream.formats.fp8 import quantize_fp8_rows
from expertstream.formats.snapshot import (
    Snapshot,
    SnapshotError,
    TensorInfo,
    bytes_to_tensor,
    header_bytes,
    iter_tensor_bytes,
)
from expertstream.log import get_logger
from expertstream.workdir.checksum import ALGORITHM, checksum, file_checksum
from expertstream.workdir.families import Family, family_of
from expertstream.workdir.inventory import (
    EXPERT_TENSOR,
    SetupError,
    check_side_files,
    check_tensor,
    plan_ple,
    ple_heads,
)
from expertstream.workdir.workdir import EXPERT_SCALES, FORMAT, MANIFEST, PLE_COPY, VERSION, write_manifest

log = get_logger(__name__)

COPY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
REPLACED = ("experts.bin", "resident.safetensors", EXPERT_SCALES, PLE_COPY)
WRITES_IN_FLIGHT = 8  # blocks queued to the writer thread (bounds RAM to ~8 blocks)
PROGRESS = "setup.progress.json"  # blocks durably written so far: a rerun after an interruption skips them
PROGRESS_EVERY = 256  # blocks between journal updates (~700 MB for the real model)


@dataclass(slots=True)
class Plan:
    snap: Snapshot
    family: Family
    layout: ExpertLayout
    num_layers: int
    num_experts: int
    top_k: int
    experts: dict[str, tuple[int, int, str]]  # snapshot tensor name -> (layer, expert, "gate_proj.weight"...)
    resident: list[TensorInfo]  # in file order; their workdir name is `info.name` minus the prefix
    fp8_dense: bool
    resident_bytes: int  # as it will be stored
    resident_bytes_bf16: int
    resident_bytes_fp8: int
    ple: dict | None  # manifest block, shards pointing into the snapshot
    ple_infos: list[TensorInfo]  # table shards in row order


def plan_setup(
    snapshot: str | os.PathLike, fp8_dense: bool, read_data: bool = True, checked: list[str] | None = None
) -> Plan:
    """Read and check everything a setup needs; raises SetupError/SnapshotError before any write.

    read_data=False (setup --dry-run) reads config.json and the safetensors headers only; `checked` collects
    one line per check passed."""
    done = checked if checked is not None else []
    snap = Snapshot(snapshot)
    shards = sorted({i.path for i in snap.tensors.values()})
    done.append(
        f"{len(shards)} safetensors headers read: {len(snap.tensors):,} tensors, each inside its file "
        f"({sum(p.stat().st_size for p in shards) / 1e9:.2f} GB)"
    )
    family = family_of(snap.config, snap.path / "config.json")
    family.check_config(snap.config, snap.path / "config.json")
    done.append(f"{', '.join(check_side_files(snap))}: parse")
    tc = snap.text_config
    L, E, K = family.dims(tc)
    done.append(f"config.json: model_type {family.model_type}; {family.check_quant(snap, L)}")
    layout = family.layout(tc)
    experts = family.expert_tensors(snap, layout)
    done.append(f"{len(experts):,} routed-expert tensors ({L} layers x {E} experts): dtypes and shapes")

    spec = family.resident_spec(tc)
    for name, (dtype, shape) in spec.items():
        sname = family.snapshot_name(name)
        check_tensor(snap.tensors.get(sname), sname, dtype, shape, snap)
    done.append(f"{len(spec):,} resident tensors the model needs: dtypes and shapes from text_config")
    # every text tensor except experts and the PLE table; vision (model.visual.*) and MTP (mtp.*) are dropped
    resident = [info for name, info in snap.tensors.items() if family.is_text(name) and name not in experts]
    # an expert tensor outside the config's layers x experts means the config and the weights disagree
    stray = [i.name for i in resident if EXPERT_TENSOR.search(i.name) or ".ffn.experts." in i.name]
    if stray:
        raise SetupError(f"{snap.path}: unexpected expert tensor {stray[0]} (expert count or names differ?)")
    resident.sort(key=lambda i: (str(i.path), i.offset))

    bf16 = sum(i.nbytes for i in resident)
    fp8 = bf16 - sum(
        i.nbytes - math.prod(i.shape) - 4 * i.shape[0]
        for i in resident
        if _fp8_dense(family, family.rname(i.name))
    )
    ple, ple_infos = plan_ple(snap, tc, read_data) if family.model_type == "qwen4_exp" else (None, [])
    if ple is not None:
        done.append(
            f"PLE table: {len(ple_infos)} F8_E4M3 shards, {ple['rows']:,} rows x {ple['width']} and its scale"
        )
    return Plan(
        snap=snap,
        family=family,
        layout=layout,
        num_layers=L,
        num_experts=E,
        top_k=K,
        experts=experts,
        resident=resident,
        fp8_dense=fp8_dense,
        resident_bytes=fp8 if fp8_dense else bf16,
        resident_bytes_bf16=bf16,
        resident_bytes_fp8=fp8,
        ple=ple,
        ple_infos=ple_infos,
    )


def _fp8_dense(family: Family, name: str) -> bool:
    return family.fp8_dense is not None and family.fp8_dense.fullmatch(name) is not None


def _existing_dir(p: Path) -> Path:
    while not p.exists():
        p = p.parent
    return p


def disk_needed(plan: Plan, copy_ple: bool) -> int:
    """Bytes the working directory takes: experts, scales, resident, copied files (+ the PLE table)."""
    L, E = plan.num_layers, plan.num_experts
    need = L * E * plan.layout.block_bytes + plan.resident_bytes + L * E * 3 * 4 * 2
    need += sum((plan.snap.path / f).stat().st_size for f in COPY_FILES if (plan.snap.path / f).is_file())
    if copy_ple:
        need += sum(i.nbytes for i in plan.ple_infos)
    return need


def disk_free(workdir: Path) -> int:
    # files a rerun replaces give their space back
    free = shutil.disk_usage(_existing_dir(workdir)).free
    return free + sum(f.stat().st_size for f in map(workdir.joinpath, REPLACED) if f.is_file())


def check_disk(plan: Plan, workdir: Path, copy_ple: bool) -> None:
    need, free = disk_needed(plan, copy_ple), disk_free(workdir)
    if need > free:
        raise SetupError(
            f"not enough free disk for {workdir}: setup needs {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
        )


def _progress_key(plan: Plan) -> dict:
    """What a journal must match to be resumed: the same snapshot files (name, size, modification time: a
    re-downloaded shard starts over), config and block layout."""
    shards = sorted({info.path for info in plan.snap.tensors.values()})
    return {
        "snapshot": str(plan.snap.path),
        "config_sha256": plan.snap.config_sha256,
        "shards": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in shards],
        "layout": plan.layout.to_json(),
        "num_layers": plan.num_layers,
        "num_experts": plan.num_experts,
        "checksum": ALGORITHM,  # a journal of another algorithm's block checksums is not resumed
    }


def _resumable(plan: Plan, workdir: Path) -> dict[int, int]:
    """{block index: CRC32C} of blocks an interrupted setup of the same snapshot wrote durably, else {}."""
    journal, experts = workdir / PROGRESS, workdir / "experts.bin"
    if not journal.is_file() or not experts.is_file():
        return {}
    try:
        data = json.loads(journal.read_text())
    except ValueError:
        return {}
    size = plan.num_layers * plan.num_experts * plan.layout.block_bytes
    if data.get("key") != _progress_key(plan) or experts.stat().st_size != size:
        return {}
    return {int(i): crc for i, crc in data["done"].items()}


def _write_experts(
    plan: Plan, path: Path, progress: bool, done: dict[int, int]
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Read each shard's expert tensors in file order; pwrite each finished block at its offset.

    Blocks in `done` (index -> CRC32C, from an interrupted run) are kept: their codes are not read again, only
    their scalars. Every PROGRESS_EVERY blocks the file is synced and the journal rewritten, so it never lists
    a block that is not on disk."""
    L, E, layout = plan.num_layers, plan.num_experts, plan.layout
    bb = layout.block_bytes
    checksums = [done.get(i, 0) for i in range(L * E)]
    written = dict(done)  # index -> crc of blocks on disk (journaled after the next fsync)
    # weight_scale_2, input_scale (NVFP4); 1, the identity, for a format without global scales (MXFP4)
    scalar_names = plan.family.scalars
    scalars = torch.full((2, L, E, 3), float("nan") if scalar_names else 1.0, dtype=torch.float32)
    pending: dict[tuple[int, int], list] = {}  # (layer, expert) -> [block bytearray, parts still missing]
    journal = path.parent / PROGRESS
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if done else os.O_TRUNC), 0o644)
    writes: deque = deque()

    def write(idx: int, block: bytearray) -> None:
        n = os.pwrite(fd, block, idx * bb)
        if n != bb:
            raise OSError(f"{path}: short write of block {idx} ({n} / {bb} bytes): disk full?")
        checksums[idx] = checksum(block)

    def checkpoint() -> None:
        os.fsync(fd)
        tmp = journal.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": _progress_key(plan), "done": written}))
        os.replace(tmp, journal)

    def needed(name: str) -> bool:
        l, e, sub = plan.experts[name]
        return l * E + e not in done or sub.split(".")[-1] in scalar_names

    try:
        os.ftruncate(fd, L * E * bb)
        bar = tqdm(total=L * E * bb, unit="B", unit_scale=True, desc="experts", disable=not progress)
        bar.update(len(done) * bb)
        since = 0
        with ThreadPoolExecutor(1) as writer, bar:
            for info, data in iter_tensor_bytes(plan.snap.tensors[n] for n in plan.experts if needed(n)):
                l, e, sub = plan.experts[info.name]
                resumed = l * E + e in done
                parts = len(PROJ) * len(scalar_names) + (0 if resumed else len(layout.parts))
                slot = pending.setdefault((l, e), [None if resumed else bytearray(bb), parts])
                proj, kind = sub.split(".")
                if kind in scalar_names:
                    scalars[scalar_names.index(kind), l, e, PROJ.index(proj)] = struct.unpack("<f", data)[0]
                else:
                    part = layout.part(sub)
                    slot[0][part.offset : part.offset + part.nbytes] = data
                slot[1] -= 1
                if slot[1]:
                    continue
                if scalar_names:
                    _check_scales(scalars[0, l, e], plan, l, e)
                del pending[(l, e)]
                if resumed:
                    continue
                idx = l * E + e
                writes.append((idx, writer.submit(write, idx, slot[0])))
                bar.update(bb)
                while len(writes) > WRITES_IN_FLIGHT or (writes and writes[0][1].done()):
                    i, fut = writes.popleft()
                    fut.result()
                    written[i], since = checksums[i], since + 1
                if since >= PROGRESS_EVERY:
                    checkpoint()
                    since = 0
            while writes:
                i, fut = writes.popleft()
                fut.result()
                written[i] = checksums[i]
        assert not pending, "every expert tensor was checked present"
        os.fsync(fd)
    except BaseException:
        if written:  # what reached the disk stays usable for the next run
            checkpoint()
        raise
    finally:
        os.close(fd)
    return checksums, scalars[0], scalars[1]


def _check_scales(ws2: torch.Tensor, plan: Plan, l: int, e: int) -> None:
    name = f"{plan.family.prefix}layers.{l}.mlp.experts.{e}"
    if not bool(torch.isfinite(ws2).all() and (ws2 > 0).all()):
        raise SetupError(f"{plan.snap.path}: {name} has weight_scale_2 {ws2.tolist()}, not positive finite")
    # the kernels fuse gate and up under one global scale, as the export promises
    if ws2[0].item() != ws2[1].item():
        raise SetupError(
            f"{plan.snap.path}: {name} has gate weight_scale_2 {ws2[0].item()!r} != up {ws2[1].item()!r}; "
            "the engine needs them identical"
        )


def _write_resident(plan: Plan, path: Path, progress: bool) -> tuple[list[str], int]:
    """Stream resident tensors into one safetensors file one by one; returns (the FP8 row-scaled names, the
    file's CRC32C, taken as it is written)."""
    entries, fp8 = [], []
    for info in plan.resident:
        name = plan.family.rname(info.name)
        if plan.fp8_dense and _fp8_dense(plan.family, name):
            entries += [(name, "F8_E4M3", info.shape), (f"{name}_scale", "F32", (info.shape[0],))]
            fp8.append(name)
        else:
            entries.append((name, info.dtype, info.shape))
    head = header_bytes(entries)
    fp8_set = set(fp8)
    bar = tqdm(total=plan.resident_bytes, unit="B", unit_scale=True, desc="resident", disable=not progress)
    with open(path, "wb") as f, bar:
        f.write(head)
        crc = checksum(head)
        for info, data in iter_tensor_bytes(plan.resident):
            if plan.family.rname(info.name) in fp8_set:
                q, scale = quantize_fp8_rows(bytes_to_tensor(info, data))
                chunks = [q.view(torch.uint8).numpy(), scale.numpy()]
            else:
                chunks = [data]
            for c in chunks:
                f.write(c)
                crc = checksum(c, crc)
                bar.update(memoryview(c).nbytes)
        f.flush()
        os.fsync(f.fileno())
    assert path.stat().st_size == len(head) + plan.resident_bytes, "resident size matches the plan"
    return fp8, crc


def _copy_ple(plan: Plan, workdir: Path, progress: bool) -> tuple[dict, int]:
    """Concatenate the PLE shards (row order) into ple/ngram_embedding.bin; returns (the manifest's `ple`
    block pointing there, the file's CRC32C)."""
    out = workdir / PLE_COPY
    out.parent.mkdir(exist_ok=True)
    total = sum(i.nbytes for i in plan.ple_infos)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="PLE copy", disable=not progress)
    crc = 0
    with open(out, "wb") as f, bar:
        for info in plan.ple_infos:
            for _, data in iter_tensor_bytes([info]):
                f.write(data)
                crc = checksum(data, crc)
                bar.update(info.nbytes)
        f.flush()
        os.fsync(f.fileno())
    ple = {**plan.ple, "shards": [{"path": PLE_COPY, "offset": 0, "rows": plan.ple["rows"]}]}
    return ple, crc


def _entry(path: Path, crc: int | None = None) -> dict:
    size, crc = (path.stat().st_size, crc) if crc is not None else file_checksum(path)
    return {"bytes": size, ALGORITHM: crc}


def budget(plan: Plan) -> dict:
    # PLE: one FP8 row (width bytes) per n-gram head per token
    ple = ple_heads(plan.snap.text_config) * plan.ple["width"] if plan.ple else 0
    return {
        "expert_bytes_per_token": plan.top_k * plan.num_layers * plan.layout.block_bytes,
        "resident_bytes": plan.resident_bytes,
        "ple_bytes_per_token": ple,
    }


def _size(n: int) -> str:
    return f"{n:,} B ({n / 1e9:.2f} GB)"


def budget_report(plan: Plan) -> str:
    b, blocks = budget(plan), plan.num_layers * plan.num_experts
    return "\n".join([
        f"experts.bin: {plan.num_layers} layers x {plan.num_experts} experts x {plan.layout.block_bytes:,} B "
        f"= {_size(blocks * plan.layout.block_bytes)}",
        f"expert bytes per token: {_size(b['expert_bytes_per_token'])} "
        f"= {plan.top_k} experts x {plan.num_layers} layers x {plan.layout.block_bytes:,} B",
        f"resident bytes: {_size(plan.resident_bytes_bf16)} as in the snapshot, "
        f"{_size(plan.resident_bytes_fp8)} with --fp8-dense; this setup stores {_size(b['resident_bytes'])}",
        f"PLE bytes per token: {b['ple_bytes_per_token']:,} B",
    ])  # fmt: skip


def setup_workdir(
    snapshot: str | os.PathLike,
    workdir: str | os.PathLike,
    *,
    fp8_dense: bool = False,
    copy_ple: bool = False,
    progress: bool = True,
    restart: bool = False,
) -> Path:
    """Turn a HF snapshot into a working directory (docs/workdir.md).

    Args:
        snapshot: directory of the NVFP4 ModelOpt export (config.json, index, shards).
        workdir: target directory; a rerun replaces what an earlier run wrote.
        fp8_dense: store the big GDN matrices as FP8 row-scaled instead of BF16.
        copy_ple: copy the PLE table into the workdir instead of reading it from the snapshot in place.
        progress: show tqdm progress bars.
        restart: ignore what an interrupted setup of the same snapshot left (by default its expert blocks
            are kept and only the missing ones are read and written).

    Returns:
        The working directory's absolute path.

    Raises:
        SetupError, SnapshotError: unsupported, incomplete or truncated snapshot, or too little disk.
    """
    plan = plan_setup(snapshot, fp8_dense)
    workdir = Path(workdir).resolve()
    check_disk(plan, workdir, copy_ple)
    log.info("setup %s -> %s\n%s", plan.snap.path, workdir, budget_report(plan))
    created = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MANIFEST).unlink(missing_ok=True)  # from here on the directory is unfinished
    done = {} if restart else _resumable(plan, workdir)
    if done:
        log.info(
            "resuming an interrupted setup: %d of %d expert blocks already written (--restart redoes all)",
            len(done),
            plan.num_layers * plan.num_experts,
        )
    try:
        checksums, ws2, input_scale = _write_experts(plan, workdir / "experts.bin", progress, done)
        save_file({"weight_scale_2": ws2, "input_scale": input_scale}, workdir / EXPERT_SCALES)
        fp8, resident_crc = _write_resident(plan, workdir / "resident.safetensors", progress)
        # every file but experts.bin (checked block by block) and the manifest: relative path -> size, CRC32C
        files = {"resident.safetensors": _entry(workdir / "resident.safetensors", resident_crc)}
        if copy_ple and plan.ple:
            ple, ple_crc = _copy_ple(plan, workdir, progress)
            files[PLE_COPY] = _entry(workdir / PLE_COPY, ple_crc)
        else:
            shutil.rmtree(workdir / "ple", ignore_errors=True)
            ple = plan.ple
        for name in COPY_FILES:
            if (plan.snap.path / name).is_file():
                shutil.copyfile(plan.snap.path / name, workdir / name)
        for name in (EXPERT_SCALES, *COPY_FILES):
            if (workdir / name).is_file():
                files[name] = _entry(workdir / name)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "model_type": plan.snap.config["model_type"],
            "source": {"snapshot": str(plan.snap.path), "config_sha256": plan.snap.config_sha256},
            "experts": {
                "file": "experts.bin",
                "num_layers": plan.num_layers,
                "num_experts": plan.num_experts,
                "layout": plan.layout.to_json(),
                "checksum": ALGORITHM,
                "checksums": checksums,
            },
            "files": dict(sorted(files.items())),
            "resident": {"file": "resident.safetensors", "fp8_row_scaled": fp8, "bytes": plan.resident_bytes},
            "ple": ple,
            "budget": budget(plan),
        }
        write_manifest(workdir, manifest)
        (workdir / PROGRESS).unlink(missing_ok=True)
    except BaseException as e:
        if isinstance(e, (SetupError, SnapshotError)):  # a refused snapshot: nothing to resume from
            (workdir / PROGRESS).unlink(missing_ok=True)
        if created and not (workdir / PROGRESS).is_file():  # a directory we made, with nothing to resume
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    return workdir


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "snapshot", help="Hugging Face snapshot directory (nvidia/Qwen3.8-Flash-Next-NVFP4 layout)"
    )
    p.add_argument("workdir", help="working directory to write (about 78 GB for the real model)")
    p.add_argument("--fp8-dense", action="store_true", help="store the big GDN matrices as FP8 row-scaled")
    p.add_argument(
        "--copy-ple", action="store_true", help="copy the PLE table instead of reading it in place"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--restart",
        action="store_true",
        help="redo everything instead of resuming an interrupted setup of the same snapshot",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check from the safetensors headers alone (no tensor data read), print the inventory, the disk "
        "needed and the VRAM plan, and write nothing",
    )
    p.add_argument(
        "--gpu-memory-gb", type=float, help="--dry-run: the VRAM budget to plan for (default: free)"
    )
    p.add_argument(
        "--max-model-len", type=int, default=32768, help="--dry-run: context to plan for (default: 32768)"
    )
    p.add_argument("--force", action="store_true", help="rewrite a finished working directory")


def check_target(workdir: Path, force: bool) -> None:
    """Refuse to overwrite a finished working directory without --force, or write into a directory that
    holds anything setup does not write (an interrupted setup's files are resumed)."""
    if not workdir.is_dir():
        return
    ours = {*COPY_FILES, *REPLACED, MANIFEST, MANIFEST + ".tmp", PROGRESS, "ple", "demo.sha256"}
    foreign = sorted(p.name for p in workdir.iterdir() if p.name not in ours)
    if foreign:
        raise SetupError(
            f"{workdir} holds files setup does not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}): give a new or empty directory"
        )
    if (workdir / MANIFEST).is_file() and not force:
        raise SetupError(
            f"{workdir} is a finished working directory: `expertstream verify {workdir}` checks it, "
            "--force rewrites it"
        )


def main(args: argparse.Namespace) -> int:
    if args.dry_run:
        from expertstream.workdir.dry_run import dry_run

        ok, report = dry_run(
            args.snapshot,
            args.workdir,
            fp8_dense=args.fp8_dense,
            copy_ple=args.copy_ple,
            gpu_memory_gb=args.gpu_memory_gb,
            max_model_len=args.max_model_len,
        )
        print(report, flush=True)
        return 0 if ok else 1
    try:
        check_target(Path(args.workdir), args.force)
        wd = setup_workdir(
            args.snapshot,
            args.workdir,
            fp8_dense=args.fp8_dense,
            copy_ple=args.copy_ple,
            progress=not args.no_progress,
            restart=args.restart,
        )
    except (SetupError, SnapshotError, OSError) as e:
        print(f"expertstream setup: error: {e}", flush=True)
        return 1
    print(f"wrote {wd}; check it with `expertstream verify {wd}`")
    return 0
