"""expertstream synth --preset ds4-*: DeepSeek-V4-Flash's published layout (docs/deepseek-v4.md), the MXFP4
and UE8M0 FP8 codecs, the exact BF16 twin, and transformers' deepseek_v4 loading that twin with every key."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from expertstream.cli import main as cli_main
from expertstream.formats import mxfp4
from expertstream.formats.snapshot import Snapshot
from expertstream.synth.deepseek_v4 import write_synthetic_ds4


def _read_all(snap: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in snap.glob("*.safetensors") for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic_ds4(tmp_path_factory.mktemp("ds4") / "tiny", "ds4-tiny", seed=0)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    return write_synthetic_ds4(tmp_path_factory.mktemp("ds4") / "tiny-bf16", "ds4-tiny", seed=0, dtype="bf16")


def test_e8m0_decodes_powers_of_two_and_nan():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = mxfp4.e8m0_to_float(b.view(torch.float8_e8m0fnu))
    assert got[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(got[6])
    # torch's own e8m0 cast agrees on the finite bytes
    assert torch.equal(got[:6], b[:6].view(torch.float8_e8m0fnu).float())


def test_mxfp4_low_nibble_is_the_even_element_and_scale_is_per_32():
    # byte 0x21: code 1 (0.5) then code 2 (1.0); 0xF9: code 9 (-0.5) then code 15 (-6)
    w = torch.tensor([[0x21, 0xF9] * 16 + [0x07] * 16], dtype=torch.uint8).view(torch.int8)  # [1, 48] -> K 96
    scale = torch.tensor([[127, 129, 126]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = mxfp4.dequantize(w, scale)
    assert got.shape == (1, 96)
    assert got[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]
    assert got[0, 32:36].tolist() == [2.0, 4.0, -2.0, -24.0]  # the second group scales by 2^2
    assert got[0, 64:66].tolist() == [3.0, 0.0]  # code 7 (6.0) * 0.5, code 0
    with pytest.raises(ValueError, match="scale shape"):
        mxfp4.dequantize(w, scale[:, :2])


def test_mxfp4_round_trip_is_exact_on_the_grid_and_close_off_it():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), generator=g)
    exps = torch.randint(-4, 4, (8, 2), generator=g).float()
    w = nvfp4_values(codes) * torch.exp2(exps).repeat_interleave(32, dim=1)
    q, s = mxfp4.quantize(w)
    assert (
        q.dtype == torch.int8 and q.shape == (8, 32) and s.dtype == torch.float8_e8m0fnu and s.shape == (8, 2)
    )
    assert torch.equal(mxfp4.dequantize(q, s), w.where(w != 0, torch.zeros_like(w)))
    r = torch.randn(16, 64, generator=g)
    err = (mxfp4.dequantize(*mxfp4.quantize(r)) - r).abs().amax(dim=1)
    assert (err <= r.abs().amax(dim=1) / 3).all()  # half the widest E2M1 step (2 of 6) at the group's scale


def nvfp4_values(codes: torch.Tensor) -> torch.Tensor:
    from expertstream.formats.nvfp4 import e2m1_table

    return e2m1_table()[codes]


def test_fp8_e8m0_blocks_round_trip_with_partial_edge_blocks():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 72, generator=g)
    q, s = mxfp4.quantize_fp8_blocks_e8m0(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 72)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 1)
    d = mxfp4.dequantize_fp8_blocks_e8m0(q, s)
    assert ((d - w).abs() <= w.abs() / 16 + 1e-3).all()  # E4M3: 3 mantissa bits
    assert torch.equal(mxfp4.dequantize_fp8_blocks_e8m0(*mxfp4.quantize_fp8_blocks_e8m0(d)), d)
    assert (d.abs().amax() <= 448 * mxfp4.e8m0_to_float(s).amax()).item()


def test_tiny_config_is_the_published_one_with_tiny_dimensions(tiny):
    c = json.loads((tiny / "config.json").read_text())
    assert c["model_type"] == "deepseek_v4" and c["architectures"] == ["DeepseekV4ForCausalLM"]
    assert c["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }  # fmt: skip
    assert (
        c["expert_dtype"] == "fp4" and c["scoring_func"] == "sqrtsoftplus" and c["topk_method"] == "noaux_tc"
    )
    assert c["compress_ratios"] == [0, 4, 128, 4] and c["num_hash_layers"] == 2
    transformers = pytest.importorskip("transformers")
    tc = transformers.AutoConfig.from_pretrained(tiny)
    assert tc.layer_types == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]  # fmt: skip
    assert tc.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert tc.qk_rope_head_dim == 8


def test_tiny_tensors_have_the_published_names_dtypes_and_shapes(tiny):
    snap = Snapshot(tiny)
    c = snap.config
    h, inter, e, v = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"], c["vocab_size"]
    t = snap.tensors
    assert not any(n.startswith("model.") for n in t)
    for layer in range(4):
        x = f"layers.{layer}.ffn.experts.{e - 1}"
        assert (t[f"{x}.w1.weight"].dtype, t[f"{x}.w1.weight"].shape) == ("I8", (inter, h // 2))
        assert (t[f"{x}.w1.scale"].dtype, t[f"{x}.w1.scale"].shape) == ("F8_E8M0", (inter, h // 32))
        assert (t[f"{x}.w2.weight"].shape, t[f"{x}.w2.scale"].shape) == ((h, inter // 2), (h, inter // 32))
        a = f"layers.{layer}.attn"
        assert t[f"{a}.wq_b.weight"].dtype == "F8_E4M3" and t[f"{a}.wq_b.scale"].dtype == "F8_E8M0"
        assert t[f"{a}.wq_b.weight"].shape == (4 * 32, 32) and t[f"{a}.wq_b.scale"].shape == (1, 1)
        assert t[f"{a}.attn_sink"].dtype == "F32" and t[f"layers.{layer}.hc_attn_fn"].shape == (24, 4 * h)
        hashed = layer < 2
        assert (f"layers.{layer}.ffn.gate.tid2eid" in t) == hashed
        assert (f"layers.{layer}.ffn.gate.bias" in t) == (not hashed)
        assert (f"{a}.compressor.wkv.weight" in t) == (layer != 0)
        assert (f"{a}.indexer.wq_b.weight" in t) == (layer in (1, 3))
    assert t["layers.0.ffn.gate.tid2eid"].dtype == "I64" and t["layers.0.ffn.gate.tid2eid"].shape == (v, 2)
    assert t["layers.1.attn.compressor.ape"].shape == (4, 64)  # CSA: two windows of head_dim
    assert t["layers.2.attn.compressor.ape"].shape == (128, 32)  # HCA: one
    assert t["layers.1.attn.indexer.compressor.ape"].shape == (4, 32)
    assert t["embed.weight"].dtype == "BF16" and t["head.weight"].shape == (v, h)
    assert t["hc_head_fn"].shape == (4, 4 * h) and t["hc_head_scale"].shape == (1,)
    table = snap.read("layers.0.ffn.gate.tid2eid")
    assert ((table >= 0) & (table < e)).all() and (table[:, 0] != table[:, 1]).all()


def test_bf16_twin_is_the_exact_dequantization(tiny, tiny_bf16):
    q, d = _read_all(tiny), _read_all(tiny_bf16)
    assert set(d) == {n for n in q if not n.endswith(".scale")}
    for name, twin in d.items():
        stem = name.removesuffix(".weight")
        quantized = q[name].dtype in (torch.int8, torch.float8_e4m3fn)
        if q[name].dtype == torch.int8:
            ref = mxfp4.dequantize(q[name], q[f"{stem}.scale"])
        elif q[name].dtype == torch.float8_e4m3fn:
            ref = mxfp4.dequantize_fp8_blocks_e8m0(q[name], q[f"{stem}.scale"])
        else:
            ref = q[name]
        assert twin.dtype == (torch.bfloat16 if quantized else q[name].dtype), name
        assert torch.equal(twin.to(ref.dtype), ref), name


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = write_synthetic_ds4(tmp_path / "again", "ds4-tiny", seed=0)
    for f in sorted(tiny.glob("*.safetensors")) + [tiny / "config.json"]:
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    other = write_synthetic_ds4(tmp_path / "other", "ds4-tiny", seed=1)
    a, b = Snapshot(tiny), Snapshot(other)
    assert not torch.equal(a.read("layers.1.attn.wq_a.weight"), b.read("layers.1.attn.wq_a.weight"))


def test_transformers_loads_the_twin_with_every_key_and_runs(tiny_bf16):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_bf16, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert not info["mismatched_keys"] and not info["error_msgs"]
    sd = model.state_dict()
    ours = _read_all(tiny_bf16)
    # the conversion mapping merges w1 and w3 into gate_up_proj [E, 2I, H], w1 first
    gate_up = sd["model.layers.3.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[5, :32], ours["layers.3.ffn.experts.5.w1.weight"].float())
    assert torch.equal(gate_up[5, 32:], ours["layers.3.ffn.experts.5.w3.weight"].float())
    assert torch.equal(sd["model.layers.2.mlp.gate.e_score_correction_bias"], ours["layers.2.ffn.gate.bias"])
    assert torch.equal(sd["model.layers.0.mlp.gate.tid2eid"], ours["layers.0.ffn.gate.tid2eid"])
    ids = (torch.arange(136) * 7 % model.config.vocab_size)[None]  # past 128 tokens: HCA has an entry
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and 0.3 < logits.std() < 30


def test_cli_writes_ds4_and_refuses_nvfp4(tmp_path):
    assert (
        cli_main(["synth", str(tmp_path / "a"), "--preset", "ds4-tiny", "--layers", "2", "--experts", "4"])
        == 0
    )
    c = json.loads((tmp_path / "a" / "config.json").read_text())
    assert c["num_hidden_layers"] == 2 and c["n_routed_experts"] == 4 and c["compress_ratios"] == [0, 4]
    assert cli_main(["synth", str(tmp_path / "b"), "--preset", "ds4-tiny", "--dtype", "nvfp4"]) == 1
    assert cli_main(["synth", str(tmp_path / "c"), "--dtype", "fp8"]) == 1
    assert cli_main(["synth", str(tmp_path / "d"), "--preset", "ds4-tiny", "--experts", "1"]) == 1
    with pytest.raises(ValueError, match="fewer than the 2 each token routes to"):
        write_synthetic_ds4(tmp_path / "d", "ds4-tiny", experts=1)


@pytest.mark.slow
def test_full_shape_has_the_published_dimensions(tmp_path):
    snap = Snapshot(write_synthetic_ds4(tmp_path / "full", "ds4-full-shape", layers=4, experts=6))
    c, t = snap.config, snap.tensors
    assert c["compress_ratios"] == [0, 0, 4, 128] and c["num_hash_layers"] == 3
    assert t["layers.3.ffn.experts.0.w1.weight"].shape == (2048, 2048)
    assert t["layers.3.ffn.experts.0.w1.scale"].shape == (2048, 128)
    assert t["layers.3.ffn.experts.0.w2.weight"].shape == (4096, 1024)
    assert t["layers.0.attn.wq_b.weight"].shape == (32768, 1024) and t["layers.0.attn.wq_b.scale"].shape == (
        256,
        8,
    )
    assert t["layers.0.attn.wo_a.weight"].shape == (8192, 4096)
    assert t["layers.2.attn.compressor.ape"].shape == (4, 1024) and t[
        "layers.3.attn.compressor.ape"
    ].shape == (128, 512)
    assert t["layers.2.attn.indexer.compressor.ape"].shape == (4, 256)
    assert t["layers.2.attn.indexer.wq_b.weight"].shape == (8192, 1024)
    assert t["layers.2.attn.indexer.weights_proj.weight"].shape == (64, 4096)
    w = mxfp4.dequantize(
        snap.read("layers.3.ffn.experts.0.w1.weight"), snap.read("layers.3.ffn.experts.0.w1.scale")
    )
    assert 0.2 / 64 < w.std() < 5 / 64  # ~1/sqrt(K): an O(1) projection
