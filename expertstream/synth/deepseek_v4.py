"""`expertstream synth --preset ds4-*`: random DeepSeek-V4-Flash checkpoints in the published layout.

The layout (names, dtypes, shapes, FP8 128x128 UE8M0 dense blocks, MXFP4 experts) is listed with its sources
in docs/deepseek-v4.md. `ds4-tiny` draws dense weights and quantizes them, so its `--dtype bf16` twin (same
names, no `.scale` tensors, no quantization_config) is their exact dequantization; `ds4-full-shape` has the
published per-layer dimensions, fewer layers, and expert codes and scales drawn directly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from expertstream.formats import mxfp4
from expertstream.log import get_logger
from expertstream.synth import checkpoint_writer
from expertstream.synth.synth import _Rng
from expertstream.synth.tokenizer import tokenizer_files

log = get_logger(__name__)

PRESETS = ("ds4-tiny", "ds4-full-shape")
VOCAB_MULTIPLE = 64
MODEL_MAX_LENGTH = 1048576

# the published config.json of deepseek-ai/DeepSeek-V4-Flash, less the fields the presets change
_SHARED = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", attention_bias=False,
    attention_dropout=0.0, expert_dtype="fp4", hc_eps=1e-6, hidden_act="silu", initializer_range=0.02,
    max_position_embeddings=MODEL_MAX_LENGTH, n_shared_experts=1, norm_topk_prob=True,
    num_key_value_heads=1, rms_norm_eps=1e-6,
    rope_scaling=dict(
        beta_fast=32, beta_slow=1, factor=16, original_max_position_embeddings=65536, type="yarn"
    ),
    rope_theta=10000, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0,
    tie_word_embeddings=False, topk_method="noaux_tc", torch_dtype="bfloat16", use_cache=True,
    compress_rope_theta=160000,
)  # fmt: skip
_QUANT = dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", scale_fmt="ue8m0",
              weight_block_size=[128, 128])  # fmt: skip
# ds4-tiny has 8 indexer heads: with 2, many entries score exactly 0 (every head's ReLU at 0) and the
# indexer's top-k among those ties is arbitrary, so two correct forwards could keep different entries
_DIMS = {
    "ds4-tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
        q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4,
        sliding_window=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        num_hash_layers=2, hc_mult=4, hc_sinkhorn_iters=20, num_nextn_predict_layers=0,
    ),
    "ds4-full-shape": dict(
        hidden_size=4096, num_hidden_layers=4, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
        index_topk=512, sliding_window=128, n_routed_experts=256, num_experts_per_tok=6,
        moe_intermediate_size=2048, num_hash_layers=3, hc_mult=4, hc_sinkhorn_iters=20,
        num_nextn_predict_layers=0,
    ),
}  # fmt: skip


def preset_dims(preset: str) -> dict:
    """A preset's config fields other than the layer schedule, vocabulary and token ids (dims, routing,
    swiglu_limit): what the kernel checks take the expert shapes from."""
    return {**_SHARED, **_DIMS[preset]}


def compress_ratios(layers: int) -> list[int]:
    """The published schedule: two sliding-window layers, then CSA (4) and HCA (128) alternating."""
    return ([0, 0] + [4, 128] * layers)[:layers]


def build_config(preset: str, layers: int | None, experts: int | None, vocab: int, ids: dict) -> dict:
    d = dict(_DIMS[preset])
    if layers is not None:
        d["num_hidden_layers"] = layers
    if experts is not None:
        d["n_routed_experts"] = experts
    if d["n_routed_experts"] < d["num_experts_per_tok"]:
        raise ValueError(
            f"--experts {d['n_routed_experts']} is fewer than the {d['num_experts_per_tok']} each token "
            "routes to"
        )
    d["num_hash_layers"] = min(d["num_hash_layers"], d["num_hidden_layers"])
    n = d["num_hidden_layers"]
    ratios = compress_ratios(n) if preset != "ds4-tiny" else [0, 4, 128, 4] * (n // 4) + [0, 4, 128][: n % 4]
    return {
        **_SHARED, **d, "vocab_size": vocab, "compress_ratios": ratios,
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
    }  # fmt: skip


def dense_tensors(c: dict, seed: int, expert_shapes: bool = False) -> Iterator[tuple[str, str, object]]:
    """(name, kind, FP32 tensor) in checkpoint order; kind: "fp8" (128x128 blocks), "fp4" (a routed expert's
    projection; only its shape when `expert_shapes`), "bf16", "f32" or "i64"."""
    rng = _Rng(seed)
    h, v, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    heads, hd, ql = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    og, ol, inter = c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"]
    ih, ihd = c["index_n_heads"], c["index_head_dim"]

    def lin(name, out_f, in_f, kind="fp8", gain=1.0):
        return name, kind, rng.normal(name, (out_f, in_f), gain / math.sqrt(in_f))

    def norm(name, dim):
        return name, "bf16", rng.normal(name, (dim,), 0.1, 1.0)  # V4's RMSNorm multiplies by w, not 1 + w

    def hyper(base, rows):
        # mHC: fn [rows, hc*h] (pre, post and the hc x hc residual logits), base [rows], scale [3 or 1]
        yield f"{base}_fn", "f32", rng.normal(f"{base}_fn", (rows, hc * h), 0.5 / math.sqrt(hc * h))
        yield f"{base}_base", "f32", rng.normal(f"{base}_base", (rows,), 0.1)
        yield f"{base}_scale", "f32", rng.normal(f"{base}_scale", (3 if rows > hc else 1,), 0.1, 1.0)

    def compressor(base, width, ratio):
        # CSA's compressor keeps two overlapping windows (2 * width), HCA's one
        cw = width * (2 if ratio == 4 else 1)
        yield f"{base}.ape", "f32", rng.normal(f"{base}.ape", (ratio, cw), 0.1)
        yield lin(f"{base}.wkv.weight", cw, h, "bf16")
        yield lin(f"{base}.wgate.weight", cw, h, "bf16")
        yield norm(f"{base}.norm.weight", width)

    yield "embed.weight", "bf16", rng.normal("embed.weight", (v, h), 1.0)
    for layer, ratio in enumerate(c["compress_ratios"]):
        b = f"layers.{layer}"
        yield norm(f"{b}.attn_norm.weight", h)
        yield norm(f"{b}.ffn_norm.weight", h)
        yield from hyper(f"{b}.hc_attn", (2 + hc) * hc)
        yield from hyper(f"{b}.hc_ffn", (2 + hc) * hc)
        yield f"{b}.attn.attn_sink", "f32", rng.normal(f"{b}.attn.attn_sink", (heads,), 0.5)
        yield lin(f"{b}.attn.wq_a.weight", ql, h)
        yield norm(f"{b}.attn.q_norm.weight", ql)
        yield lin(f"{b}.attn.wq_b.weight", heads * hd, ql)
        yield lin(f"{b}.attn.wkv.weight", hd, h)
        yield norm(f"{b}.attn.kv_norm.weight", hd)
        yield lin(f"{b}.attn.wo_a.weight", og * ol, heads * hd // og)
        yield lin(f"{b}.attn.wo_b.weight", h, og * ol)
        if ratio:
            yield from compressor(f"{b}.attn.compressor", hd, ratio)
        if ratio == 4:
            yield from compressor(f"{b}.attn.indexer.compressor", ihd, ratio)
            yield lin(f"{b}.attn.indexer.wq_b.weight", ih * ihd, ql)
            yield lin(f"{b}.attn.indexer.weights_proj.weight", ih, h, "bf16")
        e = c["n_routed_experts"]
        yield lin(f"{b}.ffn.gate.weight", e, h, "bf16")
        if layer < c["num_hash_layers"]:
            # token id -> its top-k distinct experts [V, top_k]
            g = rng.gen(f"{b}.ffn.gate.tid2eid")
            table = torch.rand(v, e, generator=g).argsort(dim=1)[:, : c["num_experts_per_tok"]]
            yield f"{b}.ffn.gate.tid2eid", "i64", table
        else:
            yield f"{b}.ffn.gate.bias", "f32", rng.normal(f"{b}.ffn.gate.bias", (e,), 0.1)
        for expert in range(e):
            x = f"{b}.ffn.experts.{expert}"
            for proj, shape in (("w1", (inter, h)), ("w2", (h, inter)), ("w3", (inter, h))):
                name = f"{x}.{proj}.weight"
                yield (name, "fp4", shape) if expert_shapes else lin(name, *shape, "fp4")
        yield lin(f"{b}.ffn.shared_experts.w1.weight", inter, h)
        yield lin(f"{b}.ffn.shared_experts.w2.weight", h, inter)
        yield lin(f"{b}.ffn.shared_experts.w3.weight", inter, h)
    yield norm("norm.weight", h)
    yield from hyper("hc_head", hc)
    yield lin("head.weight", v, h, "bf16", 3.0)


def _direct_fp4(rng: _Rng, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    # random codes and scales around 2^-(log2 sqrt(K)) so a full-shape expert is O(1) without quantizing
    n, k = shape
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=rng.gen(name)).view(torch.int8)
    exp = mxfp4.E8M0_BIAS - 2 - round(math.log2(math.sqrt(k)))
    scale = torch.full((n, k // mxfp4.GROUP), exp, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return codes, scale


def checkpoint_tensors(c: dict, seed: int, dtype: str, direct: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The stored tensors: quantized (dtype "fp8", the published layout) or the exact BF16 twin."""
    rng = _Rng(seed)
    for name, kind, t in dense_tensors(c, seed, expert_shapes=direct):
        stem = name.removesuffix(".weight")
        if kind == "fp4":
            codes, scale = _direct_fp4(rng, name, t) if direct else mxfp4.quantize(t)
            if dtype == "bf16":
                yield name, mxfp4.dequantize(codes, scale, torch.bfloat16)
            else:
                yield name, codes
                yield f"{stem}.scale", scale
        elif kind == "fp8":
            q, scale = mxfp4.quantize_fp8_blocks_e8m0(t)
            if dtype == "bf16":
                yield name, mxfp4.dequantize_fp8_blocks_e8m0(q, scale, dtype=torch.bfloat16)
            else:
                yield name, q
                yield f"{stem}.scale", scale
        elif kind == "bf16":
            yield name, t.to(torch.bfloat16)
        elif kind == "f32":
            yield name, t.float()
        else:
            yield name, t.to(torch.int64)


_LAYER = re.compile(r"^layers\.(\d+)\.")


def write_synthetic_ds4(
    out: str | Path,
    preset: str = "ds4-tiny",
    seed: int = 0,
    dtype: str = "fp8",
    layers: int | None = None,
    experts: int | None = None,
    progress: bool = False,
) -> Path:
    """Write a synthetic DeepSeek-V4-Flash checkpoint directory (one shard per decoder layer).

    Args:
        out: output directory (created).
        preset: "ds4-tiny" or "ds4-full-shape".
        seed: same seed -> byte-identical files; the bf16 and fp8 twins of one seed hold the same model
            (exactly for ds4-tiny, whose experts are quantized from dense weights).
        dtype: "fp8" (the published FP8 + MXFP4 layout) or "bf16" (the dequantized twin, no `.scale`).
        layers, experts: override num_hidden_layers / n_routed_experts.
        progress: show a tqdm bar over tensors.

    Returns:
        The output directory.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"a DeepSeek-V4 checkpoint's dtype is 'fp8' or 'bf16', got {dtype!r}")
    tok_files, ids = tokenizer_files(MODEL_MAX_LENGTH)
    vocab = math.ceil((max(ids.values()) + 1) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = build_config(preset, layers, experts, vocab, ids)
    if dtype == "fp8":
        config["quantization_config"] = dict(_QUANT)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(config, seed, dtype, direct=preset == "ds4-full-shape")
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc=f"synth {preset}", unit=" tensors")
    shards: list[checkpoint_writer.SafetensorsStreamWriter] = []
    shard_layer = -1
    for name, t in tensors:
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else shard_layer  # embed joins layer 0's shard, the head the last
        if not shards or layer != shard_layer:
            reserve = 0
            if shards:
                shards[-1].close()
                reserve = shards[-1].header_bytes * 5 // 4 + 1024
            shards.append(
                checkpoint_writer.SafetensorsStreamWriter(out / f"shard-{len(shards):05d}.tmp", reserve)
            )
            shard_layer = layer if m else shard_layer
        shards[-1].add(name, t)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        final = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += shard.nbytes
        names = shard.close()
        shard.path.replace(final)
        weight_map.update(dict.fromkeys(names, final.name))
    _json(out / "config.json", config)
    _json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                           "eos_token_id": config["eos_token_id"], "do_sample": True,
                                           "temperature": 1.0, "top_p": 1.0})  # fmt: skip
    _json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    for fname, text in tok_files.items():
        (out / fname).write_text(text)
    log.info("wrote %s: %d tensors, %.1f MB", out, len(weight_map), total / 1e6)
    return out


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
