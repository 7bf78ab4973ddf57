"""`setup --dry-run` on a header-exact replica of the full 48-layer NVIDIA checkpoint, made of sparse files.

The replica's names, dtypes and shapes are written here from the checkpoint doc's tables (section 4), not from
the engine's inventory, so the two are independent. Every file is its safetensors header followed by a hole
of the data's length: names, shapes and offsets at real scale, a few tens of MB of real disk.
"""

import json
import os
import shutil

import pytest
import tokenizers

from expertstream.cli import main as cli_main
from expertstream.formats.snapshot import header_bytes
from expertstream.workdir.dry_run import dry_run

P = "model.language_model."
L, E, V, H, HC = 48, 512, 248320, 2560, 10240
PLE_ROWS, PLE_PARTS = 2_500_012, 128  # 128 shards of 2,500,012 rows = 320,001,536 (doc section 6)
MODEL_SHARDS = 13  # the published count is unknown (doc section 15.1); 25 files - 11 others - the FP8 file
FP8_FILE = "model-fp8-mtp-ple.safetensors"
SNAPSHOT_BYTES = 132_766_433_236  # SEED's count of the real snapshot (doc section 3.1)


def _hyper(prefix: str, inject: bool) -> list:
    t = [
        (f"{prefix}.hc_norm.weight", "BF16", [HC]),
        (f"{prefix}.input_mix_weight_down.weight", "BF16", [320, HC]),
        (f"{prefix}.input_mix_weight_up.weight", "BF16", [HC, 320]),
    ]
    return t + ([(f"{prefix}.block_inject_weight.weight", "BF16", [4, HC])] if inject else [])


def _attention(a: str) -> list:
    return [
        (f"{a}.q_proj.weight", "BF16", [12288, H]),
        (f"{a}.k_proj.weight", "BF16", [512, H]),
        (f"{a}.v_proj.weight", "BF16", [512, H]),
        (f"{a}.o_proj.weight", "BF16", [H, 6144]),
        (f"{a}.q_norm.weight", "BF16", [256]),
        (f"{a}.k_norm.weight", "BF16", [256]),
        (f"{a}.indexer.index_qk_proj.weight", "BF16", [640, H]),
        (f"{a}.indexer.q_layernorm.weight", "BF16", [128]),
        (f"{a}.indexer.k_layernorm.weight", "BF16", [128]),
    ]


def _moe_dense(m: str) -> list:
    return [
        (f"{m}.gate.weight", "BF16", [E, H]),
        (f"{m}.shared_expert.gate_proj.weight", "BF16", [640, H]),
        (f"{m}.shared_expert.up_proj.weight", "BF16", [640, H]),
        (f"{m}.shared_expert.down_proj.weight", "BF16", [H, 640]),
        (f"{m}.shared_expert_gate.weight", "BF16", [1, H]),
    ]


def _layer(i: int) -> list:
    p = f"{P}layers.{i}"
    t = _hyper(f"{p}.attn_hyper_connection", True) + _hyper(f"{p}.mlp_hyper_connection", True)
    t += _moe_dense(f"{p}.mlp")
    if i % 4 == 3:  # QSA every fourth layer
        t += _attention(f"{p}.self_attn")
    else:
        a = f"{p}.linear_attn"
        t += [
            (f"{a}.in_proj_qkv.weight", "BF16", [HC, H]),
            (f"{a}.in_proj_z.weight", "BF16", [6144, H]),
            (f"{a}.in_proj_b.weight", "BF16", [48, H]),
            (f"{a}.in_proj_a.weight", "BF16", [48, H]),
            (f"{a}.conv1d.weight", "BF16", [HC, 1, 4]),
            (f"{a}.dt_bias", "BF16", [48]),
            (f"{a}.A_log", "BF16", [48]),
            (f"{a}.norm.weight", "BF16", [128]),
            (f"{a}.out_proj.weight", "BF16", [H, 6144]),
        ]
    if i == 1:  # the PLE's dense part; its table lives in the FP8 file
        q = f"{p}.ple"
        t += [
            (f"{q}.key_proj.weight", "BF16", [HC, H]),
            (f"{q}.value_proj.weight", "BF16", [H, H]),
            (f"{q}.norm_key.weight", "BF16", [HC]),
            (f"{q}.norm_query.weight", "BF16", [HC]),
            (f"{q}.norm_conv.weight", "BF16", [HC]),
            (f"{q}.conv1d.weight", "BF16", [HC, 1, 4]),
            (f"{q}.ple_embedding.layer_multipliers", "I64", [3]),
            (f"{q}.ple_embedding.ngram_heads_vocab_sizes", "I64", [16]),
            (f"{q}.ple_embedding.ngram_heads_offsets", "I64", [16]),
        ]
    for e in range(E):
        for proj, (o, k) in (("gate_proj", (640, H)), ("up_proj", (640, H)), ("down_proj", (H, 640))):
            x = f"{p}.mlp.experts.{e}.{proj}"
            t += [
                (f"{x}.weight", "U8", [o, k // 2]),
                (f"{x}.weight_scale", "F8_E4M3", [o, k // 16]),
                (f"{x}.weight_scale_2", "F32", []),
                (f"{x}.input_scale", "F32", []),
            ]
    return t


def _fp8_file() -> list:
    t = [
        (f"{P}layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight", "F8_E4M3", [PLE_ROWS, 160])
        for i in range(PLE_PARTS)
    ]
    t.append((f"{P}layers.1.ple.ple_embedding.ngram_embedding.weight_scale", "BF16", [1]))
    t += [
        ("mtp.fc_embedding.weight", "BF16", [H, H]),
        ("mtp.fc_hidden.weight", "BF16", [H, H]),
        ("mtp.pre_fc_norm_embedding.weight", "BF16", [H]),
        ("mtp.pre_fc_norm_hidden.weight", "BF16", [HC]),
    ]
    t += _hyper("mtp.hyper_connection_mixer", False)
    t += _hyper("mtp.layers.0.attn_hyper_connection", True) + _hyper(
        "mtp.layers.0.mlp_hyper_connection", True
    )
    t += _attention("mtp.layers.0.self_attn") + _moe_dense("mtp.layers.0.mlp")
    for e in range(E):
        for proj, shape, grid in (
            ("gate_proj", [640, H], [5, 20]),
            ("up_proj", [640, H], [5, 20]),
            ("down_proj", [H, 640], [20, 5]),
        ):
            x = f"mtp.layers.0.mlp.experts.{e}.{proj}"
            t += [(f"{x}.weight", "F8_E4M3", shape), (f"{x}.weight_scale_inv", "BF16", grid)]
    return t


def _config() -> dict:
    tc = {
        "model_type": "qwen4_exp_text",
        "vocab_size": V,
        "hidden_size": H,
        "num_hidden_layers": L,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)],
        "full_attention_interval": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "output_gate_type": "sigmoid",
        "hidden_act": "silu",
        "num_experts": E,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 640,
        "shared_expert_intermediate_size": 640,
        "hc_count": 4,
        "hc_lowrank": 320,
        "ple_layer_ids": [2],
        "ple_embed_dim": H,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": 20_000_000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": PLE_PARTS,
        "ple_embedding_dtype": "float8_e4m3fn",
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 128,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "bos_token_id": 248044,
        "eos_token_id": 248044,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    experts = [f"{P}layers.{i}.mlp.experts" for i in range(L)]
    group = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    layers = {m: {"quant_algo": "NVFP4", "group_size": 16} for m in experts}
    layers[f"{P}layers.1.ple.ple_embedding.ngram_embedding"] = {"quant_algo": "FP8"}
    layers["mtp.layers.0.mlp.experts"] = {"quant_algo": "FP8_PB_WO", "group_size": 128}
    qc = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "producer": {"name": "modelopt"},
        "config_groups": {"group_0": {"weights": group, "input_activations": group, "targets": experts}},
        "ignore": ["lm_head", f"{P}embed_tokens", f"{P}hyper_connection_mixer*"],
        "quantized_layers": layers,
    }
    return {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "text_config": tc,
        "vision_config": {"depth": 27, "hidden_size": 1152},
        "quantization_config": qc,
    }


def _write_sparse(path, entries) -> int:
    head = header_bytes([(n, d, tuple(s)) for n, d, s in entries])
    data = json.loads(head[8:])
    end = max(v["data_offsets"][1] for v in data.values())
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + end)  # a hole: no data blocks are allocated
    return len(head) + end


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    out = tmp_path_factory.mktemp("replica")
    shards: list[list] = [[] for _ in range(MODEL_SHARDS)]
    shards[0] += [(f"{P}embed_tokens.weight", "BF16", [V, H])]
    shards[0] += [
        ("model.visual.patch_embed.proj.weight", "BF16", [1152, 3, 2, 16, 16]),
        ("model.visual.pos_embed.weight", "BF16", [2304, 1152]),
    ]
    for i in range(L):
        shards[i * MODEL_SHARDS // L] += _layer(i)
    shards[-1] += _hyper(f"{P}hyper_connection_mixer", False) + [("lm_head.weight", "BF16", [V, H])]
    weight_map, total = {}, 0
    for i, entries in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{MODEL_SHARDS:05d}.safetensors"
        total += _write_sparse(out / name, entries)
        weight_map.update(dict.fromkeys((n for n, _, _ in entries), name))
    fp8 = _fp8_file()
    total += _write_sparse(out / FP8_FILE, fp8)
    weight_map.update(dict.fromkeys((n for n, _, _ in fp8), FP8_FILE))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(_config()))
    (out / "tokenizer.json").write_text(tokenizers.Tokenizer(tokenizers.models.BPE()).to_str())
    return out, total


@pytest.fixture(scope="module")
def dry_run_output(replica, tmp_path_factory):
    """One dry run of the replica (a few seconds on an idle core: ~300k headers), with reads of tensor
    data made impossible and 200 GB of free disk."""

    def no_data(*a, **k):
        raise AssertionError("the dry run read tensor data")

    real = shutil.disk_usage
    wd = tmp_path_factory.mktemp("dry") / "wd"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "pread", no_data)
        mp.setattr(os, "preadv", no_data)
        mp.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=200 * 10**9))
        ok, report = dry_run(replica[0], wd, gpu_memory_gb=8)
    return ok, report, wd


@pytest.mark.slow  # writes the headers of the full checkpoint's ~300k tensors: ~6 s on 2 cores
def test_replica_is_real_scale_and_sparse(replica):
    snap, total = replica
    assert abs(total - SNAPSHOT_BYTES) / SNAPSHOT_BYTES < 0.01  # the real download's size, within 1 %
    allocated = sum(f.stat().st_blocks * 512 for f in snap.iterdir())
    assert allocated < 300e6  # headers only


@pytest.mark.slow  # the replica, then a dry run reading its headers: ~11 s on 2 cores
def test_dry_run_checks_and_plans_the_full_checkpoint_from_headers(dry_run_output):
    ok, out, wd = dry_run_output
    assert ok and "FAIL" not in out, out
    assert "14 safetensors headers read: " in out
    assert "294,912 routed-expert tensors (48 layers x 512 experts)" in out
    assert "PLE table: 128 F8_E4M3 shards, 320,001,536 rows x 160" in out
    assert "experts.bin: 48 layers x 512 experts x 2,764,800 B = 67,947,724,800 B" in out
    assert "expert bytes per token: 1,327,104,000 B" in out and "PLE bytes per token: 2,560 B" in out
    families = {line[2:50].strip(): line[50:].split() for line in out.splitlines() if " -> " in line}
    assert families["routed experts -> experts.bin"][0] == "147,456"  # codes and block scales
    assert families["routed experts -> experts.bin"][-2] == "67.95"  # GB in the workdir
    mtp = next(line for line in out.splitlines() if "MTP (dropped)" in line)
    assert "3,101" in mtp  # 512 x 3 x 2 expert tensors + 29 others, as the FP8 release counts
    assert "VRAM plan for a 7.20 GiB budget" in out and "VRAM expert cache" in out
    assert not wd.exists()  # a dry run writes nothing


def test_dry_run_names_what_fails(tiny_snapshot, tmp_path, monkeypatch, capsys):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    assert cli_main(["setup", str(tiny_snapshot), str(tmp_path / "wd"), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  free disk for" in out and "ok    config.json: model_type qwen4_exp" in out
    monkeypatch.undo()
    snap = tmp_path / "snap"
    shutil.copytree(tiny_snapshot, snap)
    last = sorted(snap.glob("model-0*.safetensors"))[-1]
    size = last.stat().st_size
    os.truncate(last, size - 1)  # a download cut short by one byte
    assert cli_main(["setup", str(snap), str(tmp_path / "wd"), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  {last} is truncated: tensor" in out and f"but the file has {size - 1} bytes" in out
    assert not (tmp_path / "wd").exists()
