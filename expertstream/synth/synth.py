"""`expertstream synth`: random qwen4_exp checkpoints in the exact layout of nvidia/Qwen3.8-Flash-Next-NVFP4.

Presets: `tiny` (every feature, hidden 64, a second on CPU; experts quantized from dense weights so the BF16
twin is their exact dequantization) and `full-shape` (real per-layer dimensions, fewer layers; expert codes
and scales drawn directly in NVFP4 and streamed to disk layer by layer). See docs/synth.md.
"""

from __future__ import annotations

import argparse
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from expertstream.formats import nvfp4
from expertstream.formats.expert_block import PROJ
from expertstream.formats.fp8 import dequantize_fp8_blocks, e4m3_to_float, quantize_fp8_blocks
from expertstream.log import get_logger
from expertstream.synth import checkpoint_writer
from expertstream.synth.tokenizer import tokenizer_files

log = get_logger(__name__)

P = checkpoint_writer.PREFIX
PRESETS = ("tiny", "demo", "full-shape")
VOCAB_MULTIPLE = 64  # config vocab_size = tokenizer vocab padded up, as the real 248,320 rows are

# text_config values that differ between presets; the rest is shared and follows the shipped file
_TEXT = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, hc_lowrank=16, ple_embed_dim=64,
        ngram_vocab_size_base=997, split_ngram_parts=4,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=32, indexer_compress_ratio=4,  # a 100-token prompt already selects blocks
        mrope_section=[2, 1, 1], max_position_embeddings=4096,
    ),
    # the bundled demo model's shape (scripts/train_demo.py trains it): every feature, < 30 MB as NVFP4
    "demo": dict(
        hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=64, num_experts_per_tok=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=16, hc_lowrank=32, ple_embed_dim=256,
        ngram_vocab_size_base=4001, split_ngram_parts=4,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32,
        indexer_budget=128, indexer_compress_ratio=4,
        mrope_section=[3, 3, 2], max_position_embeddings=4096,
    ),
    "full-shape": dict(
        hidden_size=2560, num_hidden_layers=4, num_attention_heads=24, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640,
        shared_expert_intermediate_size=640, hc_lowrank=320, ple_embed_dim=2560,
        ngram_vocab_size_base=20011, split_ngram_parts=128,  # small base: 320k table rows, not 320M
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128,
        indexer_budget=2048, indexer_compress_ratio=4,
        mrope_section=[11, 11, 10], max_position_embeddings=262144,
    ),
}  # fmt: skip
_VISION = {
    "tiny": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=16),
    "demo": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=16),
    "full-shape": dict(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, num_position_embeddings=2304
    ),
}


def preset_dims(preset: str) -> dict:
    """A preset's text_config values that differ between presets (a copy)."""
    return dict(_TEXT[preset])


def build_config(
    preset: str, layers: int | None, experts: int | None, vocab_size: int, ids: dict[str, int]
) -> dict:
    """The composite config.json (no quantization_config) with the shipped field set and its traps."""
    d = preset_dims(preset)
    n_layers = layers or d.pop("num_hidden_layers")
    d.pop("num_hidden_layers", None)
    n_experts = experts or d.pop("num_experts")
    d.pop("num_experts", None)
    if n_experts < 1:
        raise ValueError(f"--experts must be at least 1, got {n_experts}")
    if n_experts < d["num_experts_per_tok"]:
        log.info("--experts %d: num_experts_per_tok lowered to %d", n_experts, n_experts)
        d["num_experts_per_tok"] = n_experts
    if n_layers < 1:
        raise ValueError(f"--layers must be at least 1, got {n_layers}")
    interval = 4
    eos = ids["<|endoftext|>"]
    text = {
        "model_type": "qwen4_exp_text",
        "architectures": ["Qwen4ExpForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": d["hidden_size"],
        "num_hidden_layers": n_layers,
        # trap kept: the file says full_attention; transformers rewrites it to indexed_attention
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
        ],
        "full_attention_interval": interval,
        **{k: d[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")},
        **{k: d[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")},
        "linear_value_head_dim": d["linear_value_head_dim"],
        "linear_conv_kernel_dim": 4,
        "output_gate_type": "sigmoid",  # trap: transformers falls back to hidden_act (silu) when absent
        "hidden_act": "silu",
        "mamba_ssm_dtype": "float32",
        "num_experts": n_experts,
        **{
            k: d[k]
            for k in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        },
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hc_count": 4,
        "hc_lowrank": d["hc_lowrank"],
        # trap: one-indexed, i.e. zero-based decoder layer 1 (a 1-layer model has no PLE)
        "ple_layer_ids": [2] if n_layers >= 2 else [],
        "ple_embed_dim": d["ple_embed_dim"],
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": d["ngram_vocab_size_base"],
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": d["split_ngram_parts"],  # trap: transformers' default is 512
        "ple_embedding_dtype": "float8_e4m3fn",
        **{k: d[k] for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget")},
        "indexer_compress_ratio": d["indexer_compress_ratio"],
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": d["mrope_section"],
            "mrope_interleaved": True,
        },
        "rms_norm_eps": 1e-6,
        "bos_token_id": eos,
        "eos_token_id": eos,  # trap: one int, <|endoftext|>, not the <|im_end|> that ends chat turns
        "pad_token_id": None,
        "max_position_embeddings": d["max_position_embeddings"],
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "mtp": {"hybrid": True, "num_hidden_layers": 1, "rope_theta": 10000000.0},
        "dtype": "bfloat16",
        "use_cache": True,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "qwen4_exp_vision",
        **_VISION[preset],
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": d["hidden_size"],
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "dtype": "bfloat16",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "language_model_only": False,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
    }


# ---- the PLE hash buffers (doc section 6), computed as transformers computes them ----

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def ple_buffers(tc: dict, ple_index: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One PLE layer's (layer_multipliers [ngram_size], head vocab sizes [H], offsets [H], padded rows)."""
    heads = (tc["ngram_size"] - 1) * tc["heads_per_ngram"]
    seed = tc.get("seed", 1234)  # absent in the shipped file: transformers' default applies
    half = max(1, ((2**63 - 1) // max(tc["vocab_size"], 1)) // 2)
    mult = [
        2 * (_splitmix64((seed + 10007 * ple_index + _GAMMA * (i + 1)) & _MASK64) % half) + 1
        for i in range(tc["ngram_size"])
    ]
    sizes, prime = [], tc["ngram_vocab_size_base"] - 1
    for _ in range(ple_index * heads):
        prime = _next_prime(prime)
    for _ in range(heads):
        prime = _next_prime(prime)
        sizes.append(prime)
    offsets = [sum(sizes[:h]) for h in range(heads)]
    div = tc["make_ngram_vocab_size_divisible_by"]
    padded = math.ceil(sum(sizes) / div) * div
    as_i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return as_i64(mult), as_i64(sizes), as_i64(offsets), padded


def _next_prime(n: int) -> int:
    n += 1
    while n < 2 or any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


# ---- random weights ----


class _Rng:
    """Per-tensor generators keyed by (seed, name): every tensor is independent of generation order."""

    def __init__(self, seed: int):
        self.seed = seed

    def gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))

    def normal(self, name: str, shape, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen(name)).mul_(std).add_(mean)

    def uniform(self, name: str, shape, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen(name)) * (hi - lo) + lo


def _linear(rng: _Rng, name: str, out_f: int, in_f: int, gain: float = 1.0) -> tuple[str, torch.Tensor]:
    # std 1/sqrt(fan_in) keeps activations O(1) through every projection
    return name, rng.normal(name, (out_f, in_f), gain / math.sqrt(in_f))


def _norm(rng: _Rng, name: str, dim: int) -> tuple[str, torch.Tensor]:
    # zero-centred RMSNorm weights (the layer uses 1 + w): small random offsets
    return name, rng.normal(name, (dim,), 0.1)


def _hyper_connection(
    rng: _Rng, base: str, tc: dict, inject: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    wide = tc["hc_count"] * tc["hidden_size"]
    yield _norm(rng, f"{base}.hc_norm.weight", wide)
    yield _linear(rng, f"{base}.input_mix_weight_down.weight", tc["hc_lowrank"], wide, 2.0)
    yield _linear(rng, f"{base}.input_mix_weight_up.weight", wide, tc["hc_lowrank"], 2.0)
    if inject:
        yield _linear(rng, f"{base}.block_inject_weight.weight", tc["hc_count"], wide, 2.0)


def _gdn(rng: _Rng, base: str, tc: dict) -> Iterator[tuple[str, torch.Tensor]]:
    h, nv = tc["hidden_size"], tc["linear_num_value_heads"]
    kd = tc["linear_num_key_heads"] * tc["linear_key_head_dim"]
    vd = nv * tc["linear_value_head_dim"]
    yield _linear(rng, f"{base}.in_proj_qkv.weight", 2 * kd + vd, h)
    yield _linear(rng, f"{base}.in_proj_z.weight", vd, h)
    yield _linear(rng, f"{base}.in_proj_b.weight", nv, h)
    yield _linear(rng, f"{base}.in_proj_a.weight", nv, h)
    yield (
        f"{base}.conv1d.weight",
        rng.normal(f"{base}.conv1d.weight", (2 * kd + vd, 1, tc["linear_conv_kernel_dim"]), 0.5),
    )
    yield f"{base}.dt_bias", rng.normal(f"{base}.dt_bias", (nv,), 0.1, 1.0)
    # A = exp(A_log) in [1, 16): state decays fast enough to stay bounded, as transformers' init
    yield f"{base}.A_log", rng.uniform(f"{base}.A_log", (nv,), 0.0, math.log(16.0))
    yield f"{base}.norm.weight", rng.normal(f"{base}.norm.weight", (tc["linear_value_head_dim"],), 0.1, 1.0)
    yield _linear(rng, f"{base}.out_proj.weight", h, vd)


def _attention(rng: _Rng, base: str, tc: dict) -> Iterator[tuple[str, torch.Tensor]]:
    h, nh, kv, hd = tc["hidden_size"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    yield _linear(rng, f"{base}.q_proj.weight", 2 * nh * hd, h)  # per head: query then output gate
    yield _linear(rng, f"{base}.k_proj.weight", kv * hd, h)
    yield _linear(rng, f"{base}.v_proj.weight", kv * hd, h)
    yield _linear(rng, f"{base}.o_proj.weight", h, nh * hd)
    yield _norm(rng, f"{base}.q_norm.weight", hd)
    yield _norm(rng, f"{base}.k_norm.weight", hd)
    ihd = tc["indexer_head_dim"]
    yield _linear(
        rng, f"{base}.indexer.index_qk_proj.weight", (tc["indexer_n_heads"] + tc["indexer_kv_heads"]) * ihd, h
    )
    yield _norm(rng, f"{base}.indexer.q_layernorm.weight", ihd)
    yield _norm(rng, f"{base}.indexer.k_layernorm.weight", ihd)


def _ple(rng: _Rng, base: str, tc: dict) -> Iterator[tuple[str, torch.Tensor]]:
    h, d, wide = tc["hidden_size"], tc["ple_embed_dim"], tc["hc_count"] * tc["hidden_size"]
    yield _linear(rng, f"{base}.key_proj.weight", wide, d)
    yield _linear(rng, f"{base}.value_proj.weight", h, d)
    for n in ("norm_key", "norm_query", "norm_conv"):
        yield _norm(rng, f"{base}.{n}.weight", wide)
    yield (
        f"{base}.conv1d.weight",
        rng.normal(f"{base}.conv1d.weight", (wide, 1, tc["ple_conv_kernel_size"]), 0.3),
    )
    mult, sizes, offsets, rows = ple_buffers(tc)
    emb = f"{base}.ple_embedding"
    yield f"{emb}.layer_multipliers", mult
    yield f"{emb}.ngram_heads_vocab_sizes", sizes
    yield f"{emb}.ngram_heads_offsets", offsets
    width = d // ((tc["ngram_size"] - 1) * tc["heads_per_ngram"])
    yield f"{emb}.ngram_embedding.weight", rng.normal(f"{emb}.ngram_embedding.weight", (rows, width), 1.0)


def _dense_expert(rng: _Rng, base: str, tc: dict, expert: int) -> dict[str, torch.Tensor]:
    h, i = tc["hidden_size"], tc["moe_intermediate_size"]
    w = {
        "gate_proj": rng.normal(f"{base}.gate_proj", (i, h), 1 / math.sqrt(h)),
        "up_proj": rng.normal(f"{base}.up_proj", (i, h), 1 / math.sqrt(h)),
        "down_proj": rng.normal(f"{base}.down_proj", (h, i), 1 / math.sqrt(i)),
    }
    if expert == 0:
        # edge cases every NVFP4 decoder must get right: an all-zero block (scale 1.0) and a tiny block whose
        # E4M3 scale is subnormal (block amax / global amax ~ 2e-5 -> scale ~ 0.006 < 2^-6)
        for t in w.values():
            t[0, :16] = 0.0
            t[1, :16] *= 2e-5
    return w


def _nvfp4_expert(rng: _Rng, base: str, tc: dict, expert: int) -> dict[str, torch.Tensor]:
    """Codes, E4M3 block scales and global scales drawn directly (fast for full-shape experts)."""
    h, i = tc["hidden_size"], tc["moe_intermediate_size"]
    g = rng.gen(base)
    # random codes: rms |e2m1| = sqrt(68.5 / 8) ~ 2.93; block scales in [0.5, 2) (E4M3 exponent 6 or 7)
    std_gate = 1 / math.sqrt(h) / (2.93 * 1.15)
    gate_up_ws2 = torch.tensor(std_gate * float(torch.empty(()).uniform_(0.8, 1.25, generator=g)))
    down_ws2 = torch.tensor(
        1 / math.sqrt(i) / (2.93 * 1.15) * float(torch.empty(()).uniform_(0.8, 1.25, generator=g))
    )
    in_gate_up = torch.tensor(float(torch.empty(()).uniform_(0.002, 0.02, generator=g)))
    in_down = torch.tensor(float(torch.empty(()).uniform_(0.002, 0.02, generator=g)))
    out = {}
    for proj, (n, k), ws2, ins in (
        ("gate_proj", (i, h), gate_up_ws2, in_gate_up),
        ("up_proj", (i, h), gate_up_ws2, in_gate_up),
        ("down_proj", (h, i), down_ws2, in_down),
    ):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(48, 64, (n, k // nvfp4.GROUP), dtype=torch.uint8, generator=g)
        if expert == 0:
            codes[0, :8] = 0  # all-zero block, stored with scale 1.0 as ModelOpt does
            scales[0, 0] = 0x38
            scales[1, 0] = 0x03  # subnormal E4M3: 3 * 2^-9
            codes[2, :8] = 0x7F  # +6 / -6 (codes 7 and 15)
        out[f"{proj}.weight"] = codes
        out[f"{proj}.weight_scale"] = scales.view(torch.float8_e4m3fn)
        out[f"{proj}.weight_scale_2"] = ws2.to(torch.float32)
        out[f"{proj}.input_scale"] = ins.to(torch.float32)
    return out


def _experts(
    rng: _Rng, module: str, tc: dict, twin: bool, direct: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    for e in range(tc["num_experts"]):
        base = f"{module}.{e}"
        if direct:
            q = _nvfp4_expert(rng, base, tc, e)
        else:
            dense = _dense_expert(rng, base, tc, e)
            if not twin:  # the writer quantizes
                yield from ((f"{base}.{p}.weight", w) for p, w in dense.items())
                continue
            q = checkpoint_writer.quantize_nvfp4_expert(
                dense["gate_proj"], dense["up_proj"], dense["down_proj"]
            )
        if not twin:
            yield from ((f"{base}.{k}", v) for k, v in q.items())
            continue
        # the BF16 twin: the exact NVFP4 dequantization, rounded once to BF16
        for p in PROJ:
            w = nvfp4.dequantize(q[f"{p}.weight"], q[f"{p}.weight_scale"], q[f"{p}.weight_scale_2"])
            yield f"{base}.{p}.weight", w.to(torch.bfloat16)


def _moe_dense(rng: _Rng, base: str, tc: dict) -> Iterator[tuple[str, torch.Tensor]]:
    h, s = tc["hidden_size"], tc["shared_expert_intermediate_size"]
    # router gain 3: logits std ~1-2 so the top-k varies from token to token
    yield _linear(rng, f"{base}.gate.weight", tc["num_experts"], h, 3.0)
    yield _linear(rng, f"{base}.shared_expert.gate_proj.weight", s, h)
    yield _linear(rng, f"{base}.shared_expert.up_proj.weight", s, h)
    yield _linear(rng, f"{base}.shared_expert.down_proj.weight", h, s)
    yield _linear(rng, f"{base}.shared_expert_gate.weight", 1, h)


def _mtp(rng: _Rng, tc: dict, twin: bool) -> Iterator[tuple[str, torch.Tensor]]:
    h, wide = tc["hidden_size"], tc["hc_count"] * tc["hidden_size"]
    yield _linear(rng, "mtp.fc_embedding.weight", h, h)
    yield _linear(rng, "mtp.fc_hidden.weight", h, h)
    yield _norm(rng, "mtp.pre_fc_norm_embedding.weight", h)
    yield _norm(rng, "mtp.pre_fc_norm_hidden.weight", wide)
    yield from _hyper_connection(rng, "mtp.hyper_connection_mixer", tc, inject=False)
    yield from _hyper_connection(rng, "mtp.layers.0.attn_hyper_connection", tc)
    yield from _attention(rng, "mtp.layers.0.self_attn", tc)
    yield from _hyper_connection(rng, "mtp.layers.0.mlp_hyper_connection", tc)
    yield from _moe_dense(rng, "mtp.layers.0.mlp", tc)
    for e in range(tc["num_experts"]):
        for p, w in _dense_expert(rng, f"mtp.layers.0.mlp.experts.{e}", tc, e).items():
            if twin:  # BF16 twin of the FP8 128x128 block export
                w = dequantize_fp8_blocks(
                    *quantize_fp8_blocks(w, scale_dtype=checkpoint_writer.MTP_SCALE_DTYPE)
                )
                w = w.to(torch.bfloat16)
            yield f"mtp.layers.0.mlp.experts.{e}.{p}.weight", w


def _visual(rng: _Rng, vc: dict) -> Iterator[tuple[str, torch.Tensor]]:
    # a handful of vision tensors: text-only loaders must skip model.visual.*
    vh, p, t = vc["hidden_size"], vc["patch_size"], vc["temporal_patch_size"]
    merged = vh * vc["spatial_merge_size"] ** 2
    yield _linear(rng, "model.visual.patch_embed.proj.weight", vh, 3 * t * p * p)
    yield (
        "model.visual.pos_embed.weight",
        rng.normal("model.visual.pos_embed.weight", (vc["num_position_embeddings"], vh), 0.02),
    )
    yield "model.visual.blocks.0.norm1.weight", torch.ones(vh)
    yield _linear(rng, "model.visual.blocks.0.attn.qkv.weight", 3 * vh, vh)
    yield _linear(rng, "model.visual.merger.linear_fc2.weight", vc["out_hidden_size"], merged)


def synthetic_tensors(
    config: dict, seed: int, dtype: str, mtp: bool, direct: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint in file order, dense (float) where the writer quantizes."""
    tc = config["text_config"]
    rng = _Rng(seed)
    h, v = tc["hidden_size"], tc["vocab_size"]
    yield f"{P}embed_tokens.weight", rng.normal(f"{P}embed_tokens.weight", (v, h), 1.0)
    yield from _visual(rng, config["vision_config"])
    ple_layers = {i - 1 for i in tc["ple_layer_ids"]}  # one-indexed in the config
    for layer, kind in enumerate(tc["layer_types"]):
        base = f"{P}layers.{layer}"
        if layer in ple_layers:
            yield from _ple_with_twin(rng, f"{base}.ple", tc, dtype)
        yield from _hyper_connection(rng, f"{base}.attn_hyper_connection", tc)
        if kind == "linear_attention":
            yield from _gdn(rng, f"{base}.linear_attn", tc)
        else:
            yield from _attention(rng, f"{base}.self_attn", tc)
        yield from _hyper_connection(rng, f"{base}.mlp_hyper_connection", tc)
        yield from _moe_dense(rng, f"{base}.mlp", tc)
        yield from _experts(rng, f"{base}.mlp.experts", tc, twin=dtype == "bf16", direct=direct)
    yield from _hyper_connection(rng, f"{P}hyper_connection_mixer", tc, inject=False)
    yield _linear(rng, "lm_head.weight", v, h, 3.0)  # logits std ~1.5
    if mtp:
        yield from _mtp(rng, tc, twin=dtype == "bf16")


def _ple_with_twin(rng: _Rng, base: str, tc: dict, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in _ple(rng, base, tc):
        if dtype == "bf16" and name.endswith("ngram_embedding.weight"):
            # the BF16 twin: fp8 * scale of the NVFP4 export, rounded once to BF16
            q, scale = checkpoint_writer.quantize_fp8_table(t)
            t = (e4m3_to_float(q) * scale.float()).to(torch.bfloat16)
        yield name, t


def write_synthetic(
    out: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "nvfp4",
    layers: int | None = None,
    experts: int | None = None,
    mtp: bool = False,
    progress: bool = False,
) -> Path:
    """Write a synthetic checkpoint directory.

    Args:
        out: output directory (created).
        preset: "tiny", "demo" (the bundled model's shape, random weights) or "full-shape".
        seed: same seed -> byte-identical files; the bf16 and nvfp4 twins of one seed hold the same model.
        dtype: "nvfp4" (NVIDIA's MIXED_PRECISION layout) or "bf16" (the unquantized twin).
        layers, experts: override num_hidden_layers / num_experts.
        mtp: add the `mtp.*` block (FP8 128x128 experts; needs hidden and expert widths divisible by 128).
        progress: show a tqdm bar over tensors.

    Returns:
        The output directory.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
    if dtype not in ("nvfp4", "bf16"):
        raise ValueError(f"dtype must be 'nvfp4' or 'bf16', got {dtype!r}")
    tok_files, ids = tokenizer_files(_TEXT[preset]["max_position_embeddings"])
    vocab = math.ceil((max(ids.values()) + 1) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = build_config(preset, layers, experts, vocab, ids)
    tc = config["text_config"]
    if mtp and (tc["hidden_size"] % 128 or tc["moe_intermediate_size"] % 128):
        raise ValueError(
            f"--mtp needs hidden_size and moe_intermediate_size divisible by 128 (128x128 FP8 blocks); "
            f"preset {preset!r} has {tc['hidden_size']} and {tc['moe_intermediate_size']}"
            " (use --preset full-shape)"
        )
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }
    tensors = synthetic_tensors(config, seed, dtype, mtp, direct=preset == "full-shape")
    if progress:
        tensors = tqdm(tensors, desc=f"synth {preset}", unit=" tensors")
    return checkpoint_writer.write_checkpoint(
        out, config, tensors, tok_files, quantize=dtype, generation_config=generation
    )


def configure_parser(p: argparse.ArgumentParser) -> None:
    from expertstream.synth import deepseek_v4  # imports this module

    p.add_argument("out", type=Path, help="output directory")
    p.add_argument(
        "--preset", choices=PRESETS + deepseek_v4.PRESETS, default="tiny",
        help="qwen4_exp: tiny, demo, full-shape; DeepSeek-V4-Flash: ds4-tiny, ds4-full-shape",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="number of decoder layers (full-shape default 4)")
    p.add_argument(
        "--experts", type=int, default=None, help="routed experts per layer (default: the preset's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=("nvfp4", "fp8", "bf16"), default=None,
        help="the published layout (default: nvfp4 for qwen4_exp, fp8 + MXFP4 experts for ds4-*) or bf16",
    )  # fmt: skip
    p.add_argument(
        "--mtp", action="store_true", help="add the MTP block with FP8 128x128 experts (full-shape)"
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT")


def main(args: argparse.Namespace) -> int:
    from expertstream.synth import deepseek_v4

    if args.out.exists() and any(args.out.iterdir()) and not args.force:
        log.error("%s is not empty; pass --force to write into it", args.out)
        return 1
    if args.preset in deepseek_v4.PRESETS:
        if args.dtype == "nvfp4" or args.mtp:
            log.error("--preset %s writes fp8 (the published layout) or bf16, without --mtp", args.preset)
            return 1
        try:
            deepseek_v4.write_synthetic_ds4(
                args.out, args.preset, args.seed, args.dtype or "fp8", args.layers, args.experts,
                progress=args.preset == "ds4-full-shape",
            )  # fmt: skip
        except ValueError as e:
            log.error("%s", e)
            return 1
        return 0
    if args.dtype == "fp8":
        log.error("--dtype fp8 is the DeepSeek-V4 layout; qwen4_exp presets write nvfp4 or bf16")
        return 1
    write_synthetic(
        args.out, args.preset, args.seed, args.dtype or "nvfp4", args.layers, args.experts, args.mtp,
        progress=args.preset == "full-shape",
    )  # fmt: skip
    return 0
