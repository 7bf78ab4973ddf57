"""A synthetic model cut to its first layers, in place: one deep full-shape model serves shallower checks.

Making a full-shape model takes ~15 s and 3.1 GB of disk a layer (snapshot and working directory), so the
device runs make the deepest model once and cut it: the snapshot's config.json (and the workdir's copy) names
fewer layers, the workdir's experts.bin is truncated to them (blocks are layer-major) and its resident file
rewritten without the layers past the cut (the VRAM plan counts what that file holds), with its manifest.
The snapshot's tensors of those layers stay in its files unread (the check's reference skips them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from safetensors.torch import load_file, save_file

from expertstream.workdir.checksum import ALGORITHM, file_checksum
from expertstream.workdir.workdir import Workdir, write_manifest

LAYER_RE = re.compile(r"^layers\.(\d+)\.")


def cut_config(config: dict, layers: int) -> dict:
    """config.json (composite or text-only) naming the first `layers` decoder layers."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    have = text["num_hidden_layers"]
    if not 1 <= layers <= have:
        raise ValueError(f"cannot cut a {have}-layer model to {layers} layers")
    text["num_hidden_layers"] = layers
    if text.get("layer_types"):
        text["layer_types"] = text["layer_types"][:layers]
    text["ple_layer_ids"] = [i for i in text.get("ple_layer_ids") or [] if i <= layers]
    return config


def cut_model(snapshot: str | os.PathLike, workdir: str | os.PathLike, layers: int) -> None:
    """Cut a snapshot and the working directory made from it to their first `layers` layers, in place."""
    snapshot, wd = Path(snapshot), Workdir(workdir)
    config = cut_config(json.loads((snapshot / "config.json").read_text()), layers)
    data = (json.dumps(config, indent=2) + "\n").encode()
    (snapshot / "config.json").write_bytes(data)
    (wd.path / "config.json").write_bytes(data)
    manifest = wd.manifest
    experts = manifest["experts"]
    old = experts["num_layers"]
    blocks = layers * experts["num_experts"]
    os.truncate(wd.experts_path, blocks * wd.layout.block_bytes)
    experts["num_layers"], experts["checksums"] = layers, experts["checksums"][:blocks]
    manifest["budget"]["expert_bytes_per_token"] = (
        manifest["budget"]["expert_bytes_per_token"] * layers // old
    )
    kept = {
        n: t
        for n, t in load_file(wd.resident_path).items()
        if not (m := LAYER_RE.match(n)) or int(m[1]) < layers
    }
    tmp = wd.resident_path.with_suffix(".tmp")
    save_file(kept, tmp)
    os.replace(tmp, wd.resident_path)
    resident = manifest["resident"]
    resident["fp8_row_scaled"] = [n for n in resident["fp8_row_scaled"] if n in kept]
    resident["bytes"] = manifest["budget"]["resident_bytes"] = sum(t.nbytes for t in kept.values())
    manifest["source"]["config_sha256"] = hashlib.sha256(data).hexdigest()
    for name in ("config.json", wd.resident_path.name):  # the rewritten files' sizes and checksums
        size, crc = file_checksum(wd.path / name)
        manifest["files"][name] = {"bytes": size, ALGORITHM: crc}
    write_manifest(wd.path, manifest)
