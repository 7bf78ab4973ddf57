"""`expertstream verify WORKDIR [--snapshot SNAPSHOT] [--all]`: check a working directory; exit 1 on mismatch.

Always: manifest, every file's presence and size and the small files' CRC32C, resident tensor
names/dtypes/shapes against config.json, expert scalars, and a sample of expert blocks (the four corners plus
random ones) byte-compared with the snapshot and checked against their CRC32C. With --all: every file's and
every block's CRC32C, so a changed byte anywhere is named (the file, or the block's layer and expert).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import torch
from tqdm import tqdm

from expertstream.formats.expert_block import PROJ
from expertstream.formats.snapshot import Snapshot, SnapshotError, read_tensor
from expertstream.log import get_logger
from expertstream.workdir.checksum import ALGORITHM, checksum
from expertstream.workdir.families import family_of
from expertstream.workdir.inventory import plan_ple
from expertstream.workdir.workdir import Workdir, WorkdirError

log = get_logger(__name__)

CHUNK = 64 << 20  # --all reads experts.bin in pieces of about this many bytes


def _check_scales(wd: Workdir, snap: Snapshot | None, blocks: list[tuple[int, int]]) -> list[str]:
    ws2, inp = wd.expert_scales()
    want = (wd.num_layers, wd.num_experts, len(PROJ))
    if tuple(ws2.shape) != want or tuple(inp.shape) != want:
        return [
            f"expert_scales.safetensors: shapes {list(ws2.shape)}, {list(inp.shape)}; expected {list(want)}"
        ]
    bad = (~torch.isfinite(ws2) | (ws2 <= 0)).nonzero().tolist()
    problems = [
        f"weight_scale_2 of (layer {l}, expert {e}) projection {PROJ[j]} is {ws2[l, e, j].item()}"
        for l, e, j in bad
    ]
    family = family_of(wd.config)
    for l, e in blocks if snap else ():
        for j, proj in enumerate(PROJ):
            for s, got in zip(family.scalars, (ws2, inp)):
                name = f"{family.prefix}layers.{l}.mlp.experts.{e}.{proj}.{s}"
                ref = read_tensor(snap.info(name)).item()
                if got[l, e, j].item() != ref:
                    problems.append(
                        f"{s} of (layer {l}, expert {e}) {proj}: {got[l, e, j].item()} != snapshot {ref}"
                    )
    return problems


def _compare_block(wd: Workdir, snap: Snapshot, l: int, e: int, block: bytes) -> list[str]:
    problems = []
    names = {part: name for name, part in family_of(wd.config).expert_name(l, e).items()}
    for part in wd.layout.parts:
        info = snap.info(names[part.name])
        ref = read_tensor(info).view(torch.uint8).numpy().tobytes()
        if block[part.offset : part.offset + part.nbytes] != ref:
            problems.append(
                f"experts.bin block (layer {l}, expert {e}): {part.name} differs from {info.path.name}"
            )
    if any(block[wd.layout.payload_bytes :]):
        problems.append(f"experts.bin block (layer {l}, expert {e}): padding is not zero")
    return problems


def _check_all_checksums(wd: Workdir, progress: bool) -> list[str]:
    bb, checksums = wd.layout.block_bytes, wd.manifest["experts"]["checksums"]
    per_read = max(1, CHUNK // bb)
    problems, n = [], len(checksums)
    fd = os.open(wd.experts_path, os.O_RDONLY)
    try:
        with tqdm(total=n * bb, unit="B", unit_scale=True, desc="checksums", disable=not progress) as bar:
            for first in range(0, n, per_read):
                count = min(per_read, n - first)
                data = memoryview(os.pread(fd, count * bb, first * bb))
                for k in range(count):
                    idx = first + k
                    got = checksum(data[k * bb : (k + 1) * bb])
                    if len(data) < (k + 1) * bb or got != checksums[idx]:
                        l, e = divmod(idx, wd.num_experts)
                        problems.append(
                            f"experts.bin block (layer {l}, expert {e}) at byte {idx * bb}: "
                            f"{ALGORITHM} {got} != manifest {checksums[idx]}"
                        )
                bar.update(count * bb)
    finally:
        os.close(fd)
    return problems


def _check_ple(wd: Workdir, snap: Snapshot | None) -> list[str]:
    ple = wd.ple
    if ple is None:
        return []
    problems, width = [], ple["width"]
    if sum(s["rows"] for s in ple["shards"]) != ple["rows"]:
        problems.append(f"manifest: PLE shard rows do not add up to {ple['rows']}")
    for s in ple["shards"]:
        path = Path(s["path"])
        end = s["offset"] + s["rows"] * width
        if not path.is_file() or path.stat().st_size < end:
            problems.append(f"PLE shard {path} is missing or shorter than {end} bytes")
    if problems or snap is None:
        return problems
    # rows read through the manifest must equal the snapshot's (catches wrong offsets and bad copies)
    ref, _ = plan_ple(snap, snap.text_config)
    if any(ple[k] != ref[k] for k in ("layer", "dtype", "width", "scale", "rows")):
        return [
            f"manifest PLE entry differs from the snapshot's table ({ref['rows']} rows, scale {ref['scale']})"
        ]
    for r in (0, ple["rows"] // 2, ple["rows"] - 1):
        if _row(ple["shards"], width, r) != _row(ref["shards"], width, r):
            problems.append(f"PLE row {r} differs from the snapshot")
    return problems


def _row(shards: list[dict], width: int, r: int) -> bytes:
    for s in shards:
        if r < s["rows"]:
            with open(s["path"], "rb") as f:
                f.seek(s["offset"] + r * width)
                return f.read(width)
        r -= s["rows"]
    raise IndexError(r)


def verify_workdir(
    workdir: str | os.PathLike,
    snapshot: str | os.PathLike | None = None,
    check_all: bool = False,
    samples: int = 16,
    seed: int = 0,
    progress: bool = False,
) -> list[str]:
    """Check a working directory; returns the problems found (empty: all good).

    Args:
        workdir: the directory `expertstream setup` wrote.
        snapshot: snapshot to byte-compare against (default: the one the manifest names, if it still exists).
        check_all: verify every file's and every expert block's CRC32C, not just the sample.
        samples: random blocks to byte-compare besides the four corners.
        seed: seed of the random sample.
        progress: show a progress bar for --all.
    """
    try:
        wd = Workdir(workdir, check=False)  # every problem is reported below, not just the first
    except WorkdirError as e:
        return [str(e)]
    problems = wd.file_problems(full=check_all) + wd.resident_problems()
    snap = None
    source = Path(snapshot) if snapshot else Path(wd.manifest["source"]["snapshot"])
    try:
        snap = Snapshot(source)
    except SnapshotError as e:
        if snapshot is not None:
            return [*problems, str(e)]
        log.warning("snapshot %s unavailable (%s): expert blocks checked by checksum only", source, e)
    if snap is not None and snap.config_sha256 != wd.manifest["source"]["config_sha256"]:
        problems.append(
            f"{source / 'config.json'} is not the config this workdir was made from (sha256 differs)"
        )
        snap = None
    L, E = wd.num_layers, wd.num_experts
    rng = random.Random(seed)
    blocks = sorted(
        {(0, 0), (0, E - 1), (L - 1, 0), (L - 1, E - 1)}
        | {divmod(rng.randrange(L * E), E) for _ in range(samples)}
    )
    problems += _check_scales(wd, snap, blocks)
    checksums = wd.manifest["experts"]["checksums"]
    with open(wd.experts_path, "rb") as f:
        for l, e in blocks:
            f.seek(wd.block_offset(l, e))
            block = f.read(wd.layout.block_bytes)
            if checksum(block) != checksums[l * E + e] and not check_all:
                problems.append(
                    f"experts.bin block (layer {l}, expert {e}): {ALGORITHM} differs from the manifest"
                )
            if snap is not None:
                problems += _compare_block(wd, snap, l, e, block)
    if check_all:
        problems += _check_all_checksums(wd, progress)
    problems += _check_ple(wd, snap)
    return problems


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("workdir", help="working directory made by `expertstream setup`")
    p.add_argument("--snapshot", help="snapshot to compare with (default: the one recorded in the manifest)")
    p.add_argument("--all", action="store_true", help="check the CRC32C of every file and every expert block")
    p.add_argument(
        "--samples", type=int, default=16, help="random expert blocks to byte-compare (default: 16)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample (default: 0)")


def main(args: argparse.Namespace) -> int:
    problems = verify_workdir(args.workdir, args.snapshot, args.all, args.samples, args.seed, progress=True)
    for p in problems:
        print(f"MISMATCH: {p}")
    if problems:
        print(f"verify: {len(problems)} problem(s) in {args.workdir}")
        return 1
    print(f"verify: {args.workdir} OK")
    return 0
