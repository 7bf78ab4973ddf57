"""`expertstream setup` of a DeepSeek-V4-Flash snapshot (ds4-tiny): MXFP4 experts repacked one block each,
the dense part as shipped in resident.safetensors, checksums in the manifest; refusals name the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from expertstream.cli import main as cli_main
from expertstream.formats import deepseek_v4 as layout_ds4
from expertstream.formats.snapshot import Snapshot
from expertstream.workdir.checksum import checksum
from expertstream.workdir.inventory import SetupError
from expertstream.workdir.repack import setup_workdir
from expertstream.workdir.verify import verify_workdir
from expertstream.workdir.workdir import Workdir


@pytest.fixture(scope="module")
def ds4_pair(ds4_tiny):
    return ds4_tiny(1)


def test_blocks_resident_and_checksums_match_the_snapshot(ds4_pair):
    snap_dir, wd_dir = ds4_pair
    snap, wd = Snapshot(snap_dir), Workdir(wd_dir)
    c = snap.config
    L, E = c["num_hidden_layers"], c["n_routed_experts"]
    m = wd.manifest
    assert m["model_type"] == "deepseek_v4" and wd.layout.fmt == "mxfp4"
    assert (wd.num_layers, wd.num_experts) == (L, E)
    data = wd.experts_path.read_bytes()
    for l in range(L):
        for e in range(E):
            parts = {part: snap.read(n) for n, part in layout_ds4.expert_names(l, e).items()}
            block = data[wd.block_offset(l, e) : wd.block_offset(l, e) + wd.layout.block_bytes]
            assert block == wd.layout.pack(parts), (l, e)
            assert checksum(block) == m["experts"]["checksums"][l * E + e]
    # the dense part keeps its names, dtypes and bytes (FP8 blocks with their UE8M0 scales); MTP is dropped
    resident = load_file(wd.resident_path)
    want = {n for n in snap.tensors if ".ffn.experts." not in n}
    assert set(resident) == want
    for name in want:
        ref = snap.read(name)
        assert resident[name].dtype == ref.dtype and torch.equal(
            resident[name].view(torch.uint8), ref.view(torch.uint8)
        ), name
    ws2, _ = wd.expert_scales()
    assert torch.equal(ws2, torch.ones(L, E, 3))  # MXFP4 has no global scale: the identity
    assert m["budget"]["expert_bytes_per_token"] == c["num_experts_per_tok"] * L * wd.layout.block_bytes
    assert verify_workdir(wd_dir, snapshot=snap_dir, progress=False) == []


def test_the_layout_module_lists_what_synth_writes(ds4_pair):
    snap = Snapshot(ds4_pair[0])
    spec = layout_ds4.resident_spec(snap.config)
    dense = {n: (i.dtype, i.shape) for n, i in snap.tensors.items() if ".ffn.experts." not in n}
    assert spec == dense


def test_dry_run_passes_and_reports_mxfp4(ds4_pair, tmp_path, capsys):
    assert (
        cli_main(["setup", str(ds4_pair[0]), str(tmp_path / "x"), "--dry-run", "--gpu-memory-gb", "8"]) == 0
    )
    out = capsys.readouterr().out
    assert "experts of all 4 layers MXFP4, group 32" in out and "FAIL" not in out
    assert "VRAM plan for a 7.20 GiB budget" in out
    assert not (tmp_path / "x").exists()


def _edited(src, dst, fn):
    shutil.copytree(src, dst)
    fn(dst)
    return dst


def test_refusals_name_what_is_wrong(ds4_pair, tmp_path):
    snap = ds4_pair[0]

    def no_quant(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["scale_fmt"] = "fp32"
        (d / "config.json").write_text(json.dumps(cfg))

    def missing_scale(d):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        del index["weight_map"]["layers.1.ffn.experts.3.w2.scale"]
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    def ratio(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["compress_ratios"][1] = 16
        (d / "config.json").write_text(json.dumps(cfg))

    for fn, fragment in [
        (no_quant, "quantization_config"),
        (missing_scale, "layers.1.ffn.experts.3.w2.scale is missing"),
        (ratio, "compress_ratios [16]"),
    ]:
        bad = _edited(snap, tmp_path / fn.__name__, fn)
        with pytest.raises(SetupError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            setup_workdir(bad, tmp_path / f"wd-{fn.__name__}", progress=False)
        assert not (tmp_path / f"wd-{fn.__name__}").exists()
