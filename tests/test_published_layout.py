"""The published nvidia/Qwen3.8-Flash-Next-NVFP4 layout: synth writes it, setup accepts it (docs/synth.md)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from expertstream.default_model import DEMO_SNAPSHOT
from expertstream.formats.snapshot import Snapshot
from expertstream.workdir.inventory import PREFIX, SetupError
from expertstream.workdir.repack import plan_setup

PLE_SCALE = PREFIX + "layers.1.ple.ple_embedding.ngram_embedding.weight_scale"
FP8_FILE = "model-fp8-mtp-ple.safetensors"


def test_synth_writes_the_published_ple_scale_and_quant_groups(tiny_snapshot):
    with safe_open(tiny_snapshot / FP8_FILE, "pt") as st:
        scale = st.get_slice(PLE_SCALE)
        assert (scale.get_dtype(), scale.get_shape()) == ("BF16", [1])
    qc = json.loads((tiny_snapshot / "config.json").read_text())["quantization_config"]
    experts = [f"{PREFIX}layers.{L}.mlp.experts" for L in range(4)]
    # the 4-bit group lists the routed experts only; the FP8 PLE module is in quantized_layers alone
    assert qc["config_groups"]["group_0"]["targets"] == experts
    assert qc["quantized_layers"][PREFIX + "layers.1.ple.ple_embedding.ngram_embedding"] == {
        "quant_algo": "FP8"
    }
    hf = json.loads((tiny_snapshot / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quantized_layers"] == qc["quantized_layers"]


def test_synth_mtp_block_scales_are_bf16(full_shape_mtp_snapshot):
    snap = full_shape_mtp_snapshot
    with safe_open(snap / FP8_FILE, "pt") as st:
        for proj, grid in (("gate_proj", [5, 20]), ("up_proj", [5, 20]), ("down_proj", [20, 5])):
            s = st.get_slice(f"mtp.layers.0.mlp.experts.1.{proj}.weight_scale_inv")
            assert (s.get_dtype(), s.get_shape()) == ("BF16", grid)
    qc = json.loads((snap / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == [f"{PREFIX}layers.0.mlp.experts"]
    assert qc["quantized_layers"]["mtp.layers.0.mlp.experts"] == {
        "quant_algo": "FP8_PB_WO",
        "group_size": 128,
    }
    # setup takes the snapshot with its BF16 MTP grids (MTP is not part of the workdir)
    assert plan_setup(snap, fp8_dense=False).num_layers == 1


def _with_ple_scale(src, dst, fn):
    shutil.copytree(src, dst)
    tensors = load_file(dst / FP8_FILE)
    tensors[PLE_SCALE] = fn(tensors[PLE_SCALE])
    save_file(tensors, dst / FP8_FILE)
    return dst


@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-d", "[1]"])
def test_setup_accepts_ple_scale_of_shape_empty_and_one(tiny_snapshot, tmp_path, shape):
    snap = _with_ple_scale(tiny_snapshot, tmp_path / "snap", lambda t: t.reshape(shape).clone())
    want = float(Snapshot(tiny_snapshot).read(PLE_SCALE).float().reshape(()))
    assert plan_setup(snap, fp8_dense=False).ple["scale"] == want


def test_setup_refuses_ple_scale_of_other_shapes(tiny_snapshot, tmp_path):
    snap = _with_ple_scale(tiny_snapshot, tmp_path / "snap", lambda t: t.reshape(1).repeat(2).clone())
    with pytest.raises(SetupError, match=r"weight_scale is BF16 \[2\], expected one floating value"):
        plan_setup(snap, fp8_dense=False)


def test_bundled_demo_snapshot_still_sets_up():
    # written by an earlier writer (0-d PLE scale, F32-free experts layout): it must keep loading
    with safe_open(DEMO_SNAPSHOT / FP8_FILE, "pt") as st:
        assert st.get_slice(PLE_SCALE).get_shape() in ([], [1])
    plan = plan_setup(DEMO_SNAPSHOT, fp8_dense=False)
    assert plan.ple["scale"] > 0 and torch.isfinite(torch.tensor(plan.ple["scale"]))
