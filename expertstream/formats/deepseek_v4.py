"""DeepSeek-V4-Flash's checkpoint layout from its config.json: every tensor's name, dtype and shape, the
routed experts' names, and the quantization the engine reads (docs/deepseek-v4.md gives each fact's source).

Shared by `setup` (what a snapshot must hold), the workdir check and `plan` (the resident inventory before
the download). Names are the checkpoint's (no `model.` prefix); the workdir keeps them.
"""

from __future__ import annotations

MODEL_TYPE = "deepseek_v4"
# routed expert projection -> the expert block's part (w1 gate, w3 up, w2 down)
PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
FP8_BLOCK = 128
COMPRESS_RATIOS = (0, 4, 128)  # sliding window only, CSA, HCA


class LayoutError(ValueError):
    """The config lacks a field the layout needs, or holds a value the engine does not implement."""


def _need(c: dict, key: str):
    if key not in c:
        raise LayoutError(f"lacks {key!r}")
    return c[key]


def config_problem(c: dict) -> str | None:
    """None when the engine implements every value of the config that shapes the network, else why not."""
    try:
        ratios = _need(c, "compress_ratios")[: _need(c, "num_hidden_layers")]
    except LayoutError as e:
        return str(e)
    bad = sorted({r for r in ratios if r not in COMPRESS_RATIOS})
    if bad:
        return f"has compress_ratios {bad} (the engine implements {list(COMPRESS_RATIOS)})"
    if c.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        return f"has scoring_func {c['scoring_func']!r} (the engine implements 'sqrtsoftplus')"
    return None


def expert_names(layer: int, expert: int) -> dict[str, str]:
    """Checkpoint name -> expert block part of one routed expert's six tensors."""
    x = f"layers.{layer}.ffn.experts.{expert}"
    out = {}
    for proj, part in PROJ.items():
        out[f"{x}.{proj}.weight"] = f"{part}.weight"
        out[f"{x}.{proj}.scale"] = f"{part}.weight_scale"
    return out


def quant_problem(config: dict) -> str | None:
    """None when the snapshot is FP8 128x128 UE8M0 dense blocks with MXFP4 experts, else why not."""
    qc = config.get("quantization_config")
    if not qc:
        return "has no quantization_config: not the published FP8 + MXFP4 checkpoint"
    got = {k: qc.get(k) for k in QUANT}
    if got != QUANT:
        return f"quantization_config {got} is not {QUANT}"
    if config.get("expert_dtype", "fp4") != "fp4":
        return f"expert_dtype {config.get('expert_dtype')!r} is not supported (the engine reads MXFP4: 'fp4')"
    return None


def resident_spec(c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every non-expert tensor the model reads: checkpoint name -> (safetensors dtype, shape); FP8 matrices
    bring their UE8M0 block scale `<stem>.scale` [ceil(N/128), ceil(K/128)]."""
    h, v, hc = _need(c, "hidden_size"), _need(c, "vocab_size"), _need(c, "hc_mult")
    nh, d, q = _need(c, "num_attention_heads"), _need(c, "head_dim"), _need(c, "q_lora_rank")
    g, r, e = _need(c, "o_groups"), _need(c, "o_lora_rank"), _need(c, "n_routed_experts")
    inter, ih, ihd = _need(c, "moe_intermediate_size"), _need(c, "index_n_heads"), _need(c, "index_head_dim")
    layers, k = _need(c, "num_hidden_layers"), _need(c, "num_experts_per_tok")
    spec: dict[str, tuple[str, tuple[int, ...]]] = {}

    def fp8(name: str, n: int, kk: int) -> None:
        spec[f"{name}.weight"] = ("F8_E4M3", (n, kk))
        spec[f"{name}.scale"] = ("F8_E8M0", (-(-n // FP8_BLOCK), -(-kk // FP8_BLOCK)))

    def hyper(base: str, rows: int, scales: int) -> None:
        spec[f"{base}_fn"] = ("F32", (rows, hc * h))
        spec[f"{base}_base"] = ("F32", (rows,))
        spec[f"{base}_scale"] = ("F32", (scales,))

    def compressor(base: str, width: int, ratio: int) -> None:
        cw = width * (2 if ratio == 4 else 1)  # CSA mixes two overlapping windows
        spec[f"{base}.ape"] = ("F32", (ratio, cw))
        spec[f"{base}.wkv.weight"] = ("BF16", (cw, h))
        spec[f"{base}.wgate.weight"] = ("BF16", (cw, h))
        spec[f"{base}.norm.weight"] = ("BF16", (width,))

    spec["embed.weight"] = ("BF16", (v, h))
    for layer, ratio in enumerate(_need(c, "compress_ratios")[:layers]):
        b = f"layers.{layer}"
        spec[f"{b}.attn_norm.weight"] = spec[f"{b}.ffn_norm.weight"] = ("BF16", (h,))
        hyper(f"{b}.hc_attn", (2 + hc) * hc, 3)
        hyper(f"{b}.hc_ffn", (2 + hc) * hc, 3)
        spec[f"{b}.attn.attn_sink"] = ("F32", (nh,))
        fp8(f"{b}.attn.wq_a", q, h)
        spec[f"{b}.attn.q_norm.weight"] = ("BF16", (q,))
        fp8(f"{b}.attn.wq_b", nh * d, q)
        fp8(f"{b}.attn.wkv", d, h)
        spec[f"{b}.attn.kv_norm.weight"] = ("BF16", (d,))
        fp8(f"{b}.attn.wo_a", g * r, nh * d // g)
        fp8(f"{b}.attn.wo_b", h, g * r)
        if ratio:
            compressor(f"{b}.attn.compressor", d, ratio)
        if ratio == 4:
            compressor(f"{b}.attn.indexer.compressor", ihd, ratio)
            fp8(f"{b}.attn.indexer.wq_b", ih * ihd, q)
            spec[f"{b}.attn.indexer.weights_proj.weight"] = ("BF16", (ih, h))
        spec[f"{b}.ffn.gate.weight"] = ("BF16", (e, h))
        if layer < _need(c, "num_hash_layers"):
            spec[f"{b}.ffn.gate.tid2eid"] = ("I64", (v, k))
        else:
            spec[f"{b}.ffn.gate.bias"] = ("F32", (e,))
        fp8(f"{b}.ffn.shared_experts.w1", inter, h)
        fp8(f"{b}.ffn.shared_experts.w2", h, inter)
        fp8(f"{b}.ffn.shared_experts.w3", inter, h)
    spec["norm.weight"] = ("BF16", (h,))
    hyper("hc_head", hc, 1)
    spec["head.weight"] = ("BF16", (v, h))
    return spec
