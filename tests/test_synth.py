"""expertstream synth: NVIDIA's NVFP4 export layout, dtypes and shapes, config traps, determinism, the exact
BF16 twin, and transformers loading that twin directly."""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from expertstream.cli import main as cli_main
from expertstream.formats import nvfp4
from expertstream.formats.fp8 import e4m3_to_float
from expertstream.synth.synth import write_synthetic

P = "model.language_model."


def _read_all(snap: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(snap.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _weight_map(snap: Path) -> dict[str, str]:
    return json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"]


def _text_config(snap: Path) -> dict:
    return json.loads((snap / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    return write_synthetic(
        tmp_path_factory.mktemp("synth") / "tiny-bf16", preset="tiny", seed=0, dtype="bf16"
    )


@pytest.fixture(scope="module")
def tf_model(tiny_bf16):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Qwen4ExpForCausalLM.from_pretrained(
        tiny_bf16, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def test_tiny_is_fast_and_index_complete(tmp_path):
    t0 = time.perf_counter()
    snap = write_synthetic(tmp_path / "tiny", preset="tiny", seed=3)
    assert time.perf_counter() - t0 < 5.0
    wm = _weight_map(snap)
    on_disk = {}
    for f in snap.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            on_disk.update(dict.fromkeys(st.keys(), f.name))
    assert wm == on_disk
    shards = sorted({v for v in wm.values() if v.startswith("model-0")})
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert len(shards) > 1
    assert {v for k, v in wm.items() if "ngram_embedding" in k} == {"model-fp8-mtp-ple.safetensors"}
    for name in ("config.json", "generation_config.json", "hf_quant_config.json", "tokenizer.json"):
        assert (snap / name).is_file(), name
    assert (snap / "chat_template.jinja").read_text().startswith("{%")


def test_tiny_inventory_matches_transformers_and_doc(tiny_snapshot, tf_model):
    """Every checkpoint tensor maps onto a transformers parameter, with the doc's NVFP4/FP8 dtypes/shapes."""
    model, _ = tf_model
    tc = _text_config(tiny_snapshot)
    tensors = _read_all(tiny_snapshot)
    parts = tc["split_ngram_parts"]
    seen = set()
    for name, t in tensors.items():
        if name.startswith("model.visual."):
            continue
        assert name.startswith((P, "lm_head.")), name
        key = name.replace(P, "model.", 1)
        if ".mlp.experts." in name:
            layer, _, _, expert, proj, kind = key.split(".")[2:8]
            fused = model.state_dict()[
                f"model.layers.{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
            ]
            out_f, in_f = fused.shape[1] // (1 if proj == "down_proj" else 2), fused.shape[2]
            expect = {
                "weight": (torch.uint8, (out_f, in_f // 2)),
                "weight_scale": (torch.float8_e4m3fn, (out_f, in_f // 16)),
                "weight_scale_2": (torch.float32, ()),
                "input_scale": (torch.float32, ()),
            }[kind]
            seen.add(f"model.layers.{layer}.mlp.experts.{expert}")
        elif ".ngram_embedding." in name:
            table = model.state_dict()[key.split(".ngram_embedding.")[0] + ".ngram_embedding.weight"]
            if name.endswith("weight_scale"):
                expect = (torch.bfloat16, (1,))  # the published export's shape (docs/synth.md)
            else:
                expect = (torch.float8_e4m3fn, (table.shape[0] // parts, table.shape[1]))
                seen.add(key)
        else:
            ref = model.state_dict()[key]
            expect = (torch.int64 if ref.dtype == torch.int64 else torch.bfloat16, tuple(ref.shape))
            seen.add(key)
        assert (t.dtype, tuple(t.shape)) == expect, name
    n_layers, n_experts = tc["num_hidden_layers"], tc["num_experts"]
    assert len([s for s in seen if ".mlp.experts." in s]) == n_layers * n_experts
    assert len([s for s in seen if ".shard_" in s]) == parts
    # every transformers parameter except the fused experts and the concatenated table comes from the file
    plain = {k for k in model.state_dict() if ".mlp.experts." not in k and "ngram_embedding" not in k}
    assert plain <= seen


def test_tiny_config_traps(tiny_snapshot):
    cfg = json.loads((tiny_snapshot / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["model_type"] == "qwen4_exp" and cfg["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    assert "vision_config" in cfg
    assert "full_attention" in tc["layer_types"] and "linear_attention" in tc["layer_types"]
    assert tc["ple_layer_ids"] == [2] and tc["output_gate_type"] == "sigmoid"
    assert "norm_topk_prob" not in tc and "seed" not in tc
    tok = json.loads((tiny_snapshot / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert tc["eos_token_id"] == tc["bos_token_id"] == ids["<|endoftext|>"] != ids["<|im_end|>"]
    assert tc["vocab_size"] % 64 == 0 and tc["vocab_size"] > max(ids.values())
    assert tc["split_ngram_parts"] != 512
    rope = tc["rope_parameters"]
    assert (
        rope["partial_rotary_factor"] == 0.25
        and rope["mrope_interleaved"]
        and len(rope["mrope_section"]) == 3
    )
    assert tc["linear_num_value_heads"] > tc["linear_num_key_heads"] > 1
    qc = cfg["quantization_config"]
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["quant_method"] == "modelopt"
    ql = qc["quantized_layers"]
    for layer in range(tc["num_hidden_layers"]):
        assert ql[f"{P}layers.{layer}.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert ql[f"{P}layers.1.ple.ple_embedding.ngram_embedding"] == {"quant_algo": "FP8"}
    hq = json.loads((tiny_snapshot / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quantized_layers"] == ql


def test_tiny_nvfp4_edge_cases_and_shared_scalars(tiny_snapshot):
    tc = _text_config(tiny_snapshot)
    t = _read_all(tiny_snapshot)
    for layer in range(tc["num_hidden_layers"]):
        for e in range(tc["num_experts"]):
            b = f"{P}layers.{layer}.mlp.experts.{e}"
            for s in ("weight_scale_2", "input_scale"):
                gate, up = t[f"{b}.gate_proj.{s}"], t[f"{b}.up_proj.{s}"]
                assert gate.view(torch.int32) == up.view(torch.int32), (b, s)
    scales = torch.cat(
        [
            v.view(torch.uint8).flatten()
            for k, v in t.items()
            if k.endswith(".weight_scale") and ".experts." in k
        ]
    )
    exp_bits, man_bits = (scales >> 3) & 0xF, scales & 7
    assert ((exp_bits == 0) & (man_bits != 0)).any(), "no subnormal E4M3 block scale"
    codes = nvfp4.unpack_codes(t[f"{P}layers.0.mlp.experts.0.gate_proj.weight"])
    assert (codes[0, :16] & 7 == 0).all() and t[f"{P}layers.0.mlp.experts.0.gate_proj.weight_scale"][
        0, 0
    ].item() == 1.0
    all_codes = torch.cat(
        [
            nvfp4.unpack_codes(v).flatten()
            for k, v in t.items()
            if k.endswith("_proj.weight") and ".experts." in k
        ]
    )
    assert (all_codes == 7).any() and (all_codes == 15).any()


def test_bf16_twin_is_exact_dequantization(tiny_snapshot, tiny_bf16):
    q, d = _read_all(tiny_snapshot), _read_all(tiny_bf16)
    tc = _text_config(tiny_snapshot)
    for layer in range(tc["num_hidden_layers"]):
        for e in range(tc["num_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                b = f"{P}layers.{layer}.mlp.experts.{e}.{proj}"
                w = nvfp4.dequantize(q[f"{b}.weight"], q[f"{b}.weight_scale"], q[f"{b}.weight_scale_2"])
                assert torch.equal(w.to(torch.bfloat16), d[f"{b}.weight"]), b
    emb = f"{P}layers.1.ple.ple_embedding.ngram_embedding"
    scale = q[f"{emb}.weight_scale"].float()
    for i in range(tc["split_ngram_parts"]):
        want = (e4m3_to_float(q[f"{emb}.shard_{i}.weight"]) * scale).to(torch.bfloat16)
        assert torch.equal(want, d[f"{emb}.shard_{i}.weight"])
    # every other tensor is the same model
    for k, v in d.items():
        if ".experts." not in k and "ngram_embedding" not in k:
            assert torch.equal(v, q[k]), k
    assert "quantization_config" not in json.loads((tiny_bf16 / "config.json").read_text())


def test_deterministic(tmp_path, tiny_snapshot):
    again = write_synthetic(tmp_path / "again", preset="tiny", seed=0)
    other = write_synthetic(tmp_path / "other", preset="tiny", seed=1)
    files = sorted(p.name for p in tiny_snapshot.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (tiny_snapshot / name).read_bytes() == (again / name).read_bytes(), name
    assert (tiny_snapshot / "model-00001-of-00004.safetensors").read_bytes() != (
        other / "model-00001-of-00004.safetensors"
    ).read_bytes()


def test_transformers_loads_bf16_twin_and_runs(tiny_bf16, tf_model):
    from transformers.models.qwen4_exp import modeling_qwen4_exp as tfm

    model, info = tf_model
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert not info["unexpected_keys"]
    # the only file tensors transformers drops are the vision ones
    file_names = set(_weight_map(tiny_bf16))
    assert (
        {k for k in file_names if not k.startswith((P, "lm_head."))}
        == {k for k in file_names if k.startswith("model.visual.")}
        != set()
    )
    tc = model.config
    assert tc.layer_types[3] == "indexed_attention" and tc.output_gate_type == "sigmoid"
    # PLE buffers as transformers computes them
    ple = model.model.layers[1].ple.ple_embedding
    assert torch.equal(
        ple.layer_multipliers, tfm._build_layer_multipliers(tc.vocab_size, tc.ngram_size, 0, tc.seed)
    )
    assert ple.ngram_heads_vocab_sizes.tolist() == ple.head_vocab_sizes
    assert ple.ngram_heads_offsets.tolist() == ple.head_offsets
    ids = torch.randint(0, tc.vocab_size, (1, 100), generator=torch.Generator().manual_seed(0))
    masks = []
    indexer = model.model.layers[tc.layer_types.index("indexed_attention")].self_attn.indexer
    hook = indexer.register_forward_hook(lambda mod, args, out: masks.append(out))
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    hook.remove()
    logits = out.logits[0]
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.float().std().item() < 5
    assert (logits.argmax(-1).unique().numel()) > 5  # not one token everywhere
    for router_logits in out.router_logits:
        picked = router_logits.topk(tc.num_experts_per_tok, dim=-1).indices.unique().numel()
        assert picked >= tc.num_experts * 3 // 4
    # the indexer budget is small enough that a 100-token prompt really selects blocks: late queries see
    # fewer keys than the causal mask allows
    visible = masks[0][0, 0].sum(-1)  # [T] keys kept per query
    assert visible[-1] == tc.indexer_budget + (ids.shape[1] % tc.indexer_compress_ratio) < ids.shape[1]


def test_full_shape_smoke(tmp_path):
    snap = write_synthetic(tmp_path / "full", preset="full-shape", seed=0, layers=2, experts=8)
    tc = _text_config(snap)
    assert (tc["hidden_size"], tc["num_experts"], tc["num_hidden_layers"]) == (2560, 8, 2)
    wm = _weight_map(snap)
    assert len([k for k in wm if ".mlp.experts." in k]) == 2 * 8 * 3 * 4
    with safe_open(snap / wm[f"{P}layers.1.mlp.experts.7.down_proj.weight"], "pt") as st:
        b = f"{P}layers.1.mlp.experts.7"
        assert st.get_slice(f"{b}.down_proj.weight").get_shape() == [2560, 320]
        assert st.get_slice(f"{b}.down_proj.weight_scale").get_shape() == [2560, 40]
        assert st.get_slice(f"{b}.gate_proj.weight").get_shape() == [640, 1280]
        assert st.get_slice(f"{b}.gate_proj.weight_scale").get_dtype() == "F8_E4M3"
        assert st.get_tensor(f"{b}.gate_proj.weight_scale_2").view(torch.int32) == st.get_tensor(
            f"{b}.up_proj.weight_scale_2"
        ).view(torch.int32)
    with safe_open(snap / "model-fp8-mtp-ple.safetensors", "pt") as st:
        shard = st.get_slice(f"{P}layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight")
        assert shard.get_dtype() == "F8_E4M3" and shard.get_shape()[1] == 160
        assert len([k for k in st.keys() if ".shard_" in k]) == tc["split_ngram_parts"] == 128
    with safe_open(snap / wm[f"{P}layers.0.linear_attn.in_proj_qkv.weight"], "pt") as st:
        assert st.get_slice(f"{P}layers.0.linear_attn.in_proj_qkv.weight").get_shape() == [10240, 2560]


def test_mtp_needs_128_multiples_and_writes_block_fp8(tmp_path, full_shape_mtp_snapshot):
    with pytest.raises(ValueError, match="128"):
        write_synthetic(tmp_path / "tiny-mtp", preset="tiny", mtp=True)
    snap = full_shape_mtp_snapshot
    wm = _weight_map(snap)
    with safe_open(snap / "model-fp8-mtp-ple.safetensors", "pt") as st:
        b = "mtp.layers.0.mlp.experts.3"
        assert st.get_slice(f"{b}.gate_proj.weight").get_dtype() == "F8_E4M3"
        assert st.get_slice(f"{b}.gate_proj.weight_scale_inv").get_shape() == [5, 20]
        assert st.get_slice(f"{b}.down_proj.weight_scale_inv").get_shape() == [20, 5]
    assert all(v == "model-fp8-mtp-ple.safetensors" for k, v in wm.items() if k.startswith("mtp."))
    ql = json.loads((snap / "config.json").read_text())["quantization_config"]["quantized_layers"]
    assert ql["mtp.layers.0.mlp.experts"] == {"quant_algo": "FP8_PB_WO", "group_size": 128}


def test_cli_refuses_non_empty_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli_main(["synth", str(out)]) == 1
    assert cli_main(["synth", str(out), "--force", "--seed", "2", "--dtype", "bf16"]) == 0
    assert (out / "keep.txt").exists() and (out / "config.json").is_file()


@pytest.mark.parametrize("reserve", [0, 16, 4096], ids=["no slot", "slot too small", "slot"])
def test_stream_writer_header_in_its_slot_or_before_a_copy(tmp_path, reserve):
    # the header goes into the slot left before the data (padded with spaces), or, when it does not fit,
    # in front of a copy of the data: either way safetensors reads the same tensors
    from expertstream.synth.checkpoint_writer import SafetensorsStreamWriter

    tensors = {f"t{i}": torch.randn(3, i + 1).to(torch.bfloat16) for i in range(5)}
    w = SafetensorsStreamWriter(tmp_path / "a.safetensors", reserve)
    for name, t in tensors.items():
        w.add(name, t)
    assert w.close() == list(tensors) and w.close() == list(tensors)  # closing twice changes nothing
    raw = (tmp_path / "a.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and json.loads(raw[8 : 8 + n])["t4"]["shape"] == [3, 5]
    assert n == (reserve if w.header_bytes <= reserve else -(-w.header_bytes // 8) * 8)
    assert len(raw) == 8 + n + w.nbytes and not list(tmp_path.glob("*.data"))
    with safe_open(tmp_path / "a.safetensors", "pt") as st:
        assert all(torch.equal(st.get_tensor(k), t) for k, t in tensors.items())


def test_layer_shards_after_the_first_write_their_data_once(tmp_path):
    # a layer's shard is finished when the next layer starts, and the next gets a header slot from it
    from expertstream.synth.checkpoint_writer import PREFIX, _Sharder

    sharder = _Sharder(tmp_path, separate_fp8=False)
    for layer in range(3):
        for j in range(4):
            sharder.add(f"{PREFIX}layers.{layer}.w{j}.weight", torch.ones(2, 2, dtype=torch.bfloat16))
    first, second, third = sharder.shards
    assert first.closed and second.closed and not third.closed
    weight_map, total = sharder.close()
    assert total == 3 * 4 * 8 and len(set(weight_map.values())) == 3
    assert _read_all(tmp_path)[f"{PREFIX}layers.2.w3.weight"].sum() == 4
    # the first shard's header fits its file exactly (a copy); the later ones sit in slots 1 KB larger
    slots = [int.from_bytes(f.read_bytes()[:8], "little") for f in sorted(tmp_path.glob("model-*"))]
    heads = [-(-w.header_bytes // 8) * 8 for w in (first, second, third)]
    assert slots[0] == heads[0] and all(s >= h + 1024 for s, h in zip(slots[1:], heads[1:]))
