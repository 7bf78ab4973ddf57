"""The working directory of `expertstream setup`: manifest (schema v2, docs/workdir.md) and `Workdir`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from expertstream.errors import UserError
from expertstream.formats.expert_block import ExpertLayout
from expertstream.formats.snapshot import SnapshotError, read_header
from expertstream.memory_plan import MemoryPlan, plan_memory
from expertstream.workdir.checksum import ALGORITHM, file_checksum
from expertstream.workdir.families import family_of
from expertstream.workdir.inventory import SetupError

FORMAT = "expertstream-workdir"
VERSION = 2  # 2: CRC32C of every block and every file (1: crc32 of the blocks only)
MANIFEST = "manifest.json"
EXPERT_SCALES = "expert_scales.safetensors"
PLE_COPY = "ple/ngram_embedding.bin"
# files up to this size are checksummed each time a Workdir opens (config, tokenizer, template, scales);
# bigger ones (resident weights, a copied PLE table) by `verify --all`
CHECK_AT_OPEN = 64 << 20
AGAIN = "run `expertstream setup` again"
# section -> keys it must hold (a manifest missing any of them is partial or from another writer)
REQUIRED = {
    "source": ("snapshot", "config_sha256"),
    "experts": ("file", "num_layers", "num_experts", "layout", "checksum", "checksums"),
    "resident": ("file", "fp8_row_scaled", "bytes"),
    "budget": ("expert_bytes_per_token", "resident_bytes", "ple_bytes_per_token"),
}
PLE_KEYS = ("layer", "dtype", "width", "scale", "rows", "shards")


class WorkdirError(UserError, ValueError):
    """A working directory is missing, unfinished, or of a format version this engine does not read."""


def write_manifest(workdir: Path, manifest: dict) -> Path:
    """Write manifest.json atomically (tmp + fsync + rename + dir fsync): it is whole or absent."""
    validate_manifest(manifest, workdir / MANIFEST)
    path, tmp = workdir / MANIFEST, workdir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(workdir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def is_current(workdir: Path) -> bool:
    """A finished working directory of this format version (else a cached one is to be set up again)."""
    try:
        return json.loads((workdir / MANIFEST).read_text()).get("version") == VERSION
    except (OSError, ValueError):
        return False


def read_manifest(workdir: Path) -> dict:
    path = workdir / MANIFEST
    if not path.is_file():
        raise WorkdirError(
            f"{workdir} has no {MANIFEST}: not a finished working directory "
            "(run `expertstream setup` to make one)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WorkdirError(f"{path} is not valid JSON ({e}): rerun `expertstream setup`") from e
    validate_manifest(manifest, path)
    return manifest


def validate_manifest(m: dict, path: Path) -> None:
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise WorkdirError(f"{path} is not an expertstream workdir manifest (format {m.get('format')!r})")
    if m.get("version") != VERSION:
        raise WorkdirError(
            f"{path} has format version {m.get('version')!r}, this engine reads version {VERSION} (with a "
            f"checksum of every file): {AGAIN}"
        )
    for section, keys in REQUIRED.items():
        missing = [k for k in keys if k not in m.get(section, {})]
        if missing:
            raise WorkdirError(f"{path}: section {section!r} lacks {missing}: rerun `expertstream setup`")
    if "model_type" not in m or "ple" not in m:
        raise WorkdirError(f"{path} lacks 'model_type' or 'ple': rerun `expertstream setup`")
    if m["ple"] is not None and any(k not in m["ple"] for k in PLE_KEYS):
        raise WorkdirError(f"{path}: section 'ple' lacks one of {list(PLE_KEYS)}")
    files = m.get("files")
    if not isinstance(files, dict) or any(not isinstance(v, dict) or {"bytes", ALGORITHM} - set(v)
                                          for v in files.values()):  # fmt: skip
        raise WorkdirError(f"{path} lacks the size and {ALGORITHM} of its files: {AGAIN}")
    e = m["experts"]
    if e["checksum"] != ALGORITHM:
        raise WorkdirError(f"{path}: block checksums are {e['checksum']!r}, this engine checks {ALGORITHM}")
    if len(e["checksums"]) != e["num_layers"] * e["num_experts"]:
        raise WorkdirError(
            f"{path}: {len(e['checksums'])} block checksums for {e['num_layers']} x {e['num_experts']}"
        )


class Workdir:
    """A finished working directory (docs/workdir.md). Opening one checks that every file is there with its
    size, the small files' checksums and the resident tensors' names, dtypes and shapes (check=False skips
    these, for `verify`, which reports every problem instead of the first)."""

    def __init__(self, path: str | os.PathLike, check: bool = True):
        self.path = Path(path).resolve()
        self.manifest = read_manifest(self.path)
        experts = self.manifest["experts"]
        try:
            self.layout = ExpertLayout.from_json(experts["layout"])
        except (KeyError, ValueError) as e:
            raise WorkdirError(f"{self.path / MANIFEST}: unusable expert layout ({e})") from e
        self.num_layers = int(experts["num_layers"])
        self.num_experts = int(experts["num_experts"])
        self.experts_path = self.path / experts["file"]
        self.resident_path = self.path / self.manifest["resident"]["file"]
        for f in (
            self.experts_path,
            self.resident_path,
            self.path / "config.json",
            self.path / EXPERT_SCALES,
        ):
            if not f.is_file():
                raise WorkdirError(f"{f} is missing from the working directory: rerun `expertstream setup`")
        want = self.num_layers * self.num_experts * self.layout.block_bytes
        have = self.experts_path.stat().st_size
        if have != want:
            raise WorkdirError(f"{self.experts_path} has {have} bytes, the manifest says {want}: truncated?")
        self.fp8_row_scaled: set[str] = set(self.manifest["resident"]["fp8_row_scaled"])
        problems = self.file_problems(full=False) if check else []
        if problems:
            raise WorkdirError(f"{problems[0]}: {AGAIN}")
        try:
            self.config: dict = json.loads((self.path / "config.json").read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WorkdirError(f"{self.path / 'config.json'} is not valid JSON ({e}): {AGAIN}") from e
        self.text_config: dict = self.config.get("text_config", self.config)
        if check and (problems := self.resident_problems()):
            raise WorkdirError(f"{problems[0]}: {AGAIN}")

    def file_problems(self, full: bool) -> list[str]:
        """Files missing, of another size, or (small ones; all with full=True) whose CRC32C differs from the
        manifest's, one line each."""
        problems = []
        for name, want in self.manifest["files"].items():
            f = self.path / name
            if not f.is_file():
                problems.append(f"{f} is missing from the working directory")
            elif f.stat().st_size != want["bytes"]:
                problems.append(
                    f"{f} has {f.stat().st_size} bytes, setup wrote {want['bytes']}: it changed after setup"
                )
            elif (full or want["bytes"] <= CHECK_AT_OPEN) and file_checksum(f)[1] != want[ALGORITHM]:
                problems.append(f"{f} does not match the {ALGORITHM} setup recorded: it changed after setup")
        return problems

    def resident_problems(self) -> list[str]:
        """Resident tensors missing or of another dtype or shape than config.json asks, one line each."""
        try:
            stored = read_header(self.resident_path)
            spec = family_of(self.config, self.path / "config.json").resident_spec(self.text_config)
        except (SnapshotError, SetupError) as e:
            return [str(e)]
        name_of, problems = self.resident_path.name, []
        for name, (dtype, shape) in spec.items():
            info = stored.get(name)
            if name in self.fp8_row_scaled:
                dtype, scale = "F8_E4M3", stored.get(f"{name}_scale")
                if scale is None or scale.dtype != "F32" or scale.shape != shape[:1]:
                    problems.append(f"{name_of}: {name}_scale missing or not F32 [{shape[0]}]")
            if info is None:
                problems.append(f"{name_of}: tensor {name} is missing")
            elif info.dtype != dtype or info.shape != shape:
                got = f"{info.dtype} {list(info.shape)}"
                problems.append(f"{name_of}: tensor {name} is {got}, expected {dtype} {list(shape)}")
        return problems

    def block_offset(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(
                f"expert ({layer}, {expert}) outside {self.num_layers} layers x {self.num_experts}"
            )
        return (layer * self.num_experts + expert) * self.layout.block_bytes

    def expert_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight_scale_2 [L, E, 3] f32, input_scale [L, E, 3] f32); last axis gate, up, down."""
        t = load_file(self.path / EXPERT_SCALES)
        return t["weight_scale_2"], t["input_scale"]

    def memory_plan(
        self,
        budget_bytes: int,
        max_model_len: int,
        act_bytes: int = 2,
        max_num_seqs: int = 1,
        kv_pool_tokens: int | None = None,
    ) -> MemoryPlan:
        """The VRAM plan for this model under a budget (`plan_memory` on the resident file's header: nothing
        is loaded). Raises MemoryPlanError when the budget cannot hold the minimum."""
        inventory = {n: (i.shape, i.dtype) for n, i in read_header(self.resident_path).items()}
        return plan_memory(self.text_config, inventory, self.layout.block_bytes, budget_bytes, max_model_len,
                           act_bytes, max_num_seqs, kv_pool_tokens)  # fmt: skip

    def load_resident(self, names: list[str] | None = None, device: str | torch.device = "cpu") -> dict:
        """Resident tensors by HF text name (prefix removed); an FP8 row-scaled name brings `<name>_scale`."""
        with safe_open(self.resident_path, framework="pt", device=str(device)) as f:
            stored = set(f.keys())
            if names is None:
                wanted = sorted(stored)
            else:
                wanted = [*names, *(f"{n}_scale" for n in names if n in self.fp8_row_scaled)]
            missing = [n for n in wanted if n not in stored]
            if missing:
                raise WorkdirError(f"{self.resident_path} has no tensor {missing[0]}")
            return {n: f.get_tensor(n) for n in wanted}

    @property
    def ple(self) -> dict | None:
        ple = self.manifest["ple"]
        if ple is None:
            return None
        shards = [
            {**s, "path": str(self.path / s["path"])} for s in ple["shards"]
        ]  # absolute paths stay absolute
        return {**ple, "shards": shards}
