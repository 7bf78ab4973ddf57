"""transformers' DeepseekV4ForCausalLM holding a DeepSeek-V4 snapshot's dequantized weights: the reference
`check` compares the engine against (commands/check_reference.py), with the checkpoint's names mapped to
transformers' (docs/deepseek-v4.md's table)."""

from __future__ import annotations

import torch

from expertstream.formats.snapshot import Snapshot as Checkpoint
from expertstream.models.deepseek_v4 import DeepseekV4Args, dense_experts, load_weights

# checkpoint name -> transformers' DeepseekV4ForCausalLM name (docs/deepseek-v4.md's table), layer suffixes
_HF_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_HF_COMPRESSOR = {"ape": "position_bias", "wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight"}
_HF_COMPRESSOR["norm.weight"] = "kv_norm.weight"
_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{b}_{k}": f"{b}_hc.{k}" for b in ("attn", "ffn") for k in ("fn", "base", "scale")},
    "attn.attn_sink": "self_attn.sinks",
    **{f"attn.{c}.weight": f"self_attn.{h}.weight" for c, h in (
        ("wq_a", "q_a_proj"), ("q_norm", "q_a_norm"), ("wq_b", "q_b_proj"), ("wkv", "kv_proj"),
        ("kv_norm", "kv_norm"), ("wo_a", "o_a_proj"), ("wo_b", "o_b_proj"))},
    **{f"attn.compressor.{c}": f"self_attn.compressor.{h}" for c, h in _HF_COMPRESSOR.items()},
    **{f"attn.indexer.compressor.{c}": f"self_attn.compressor.indexer.{h}" for c, h in _HF_COMPRESSOR.items()
       },
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    **{f"ffn.shared_experts.{c}.weight": f"mlp.shared_experts.{h}.weight" for c, h in (
        ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
}  # fmt: skip


def hf_state_dict(weights: dict, gate_up: list, down: list) -> dict[str, torch.Tensor]:
    """`load_weights` + `dense_experts` under transformers' names (experts stacked: gate_up [E, 2I, H])."""
    out = {}
    for name, t in weights.items():
        if name in _HF_TOP:
            out[_HF_TOP[name]] = t
            continue
        layer, rest = name.removeprefix("layers.").split(".", 1)
        out[f"model.layers.{layer}.{_HF_LAYER[rest]}"] = t
    for layer, (gu, dn) in enumerate(zip(gate_up, down)):
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gu
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = dn
    return out


def transformers_reference(snap: Checkpoint, dtype: torch.dtype = torch.float32):
    """transformers' DeepseekV4ForCausalLM (eager attention) holding the snapshot's dequantized weights."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cfg = {k: v for k, v in snap.config.items() if k != "quantization_config"}
    config = DeepseekV4Config(**cfg)
    config._attn_implementation = "eager"
    args = DeepseekV4Args.from_dict(snap.config)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    sd = hf_state_dict(load_weights(snap, dtype), *dense_experts(snap, args, dtype))
    model.load_state_dict(sd, strict=True, assign=True)
    # the rotary tables are computed buffers, not weights: fill them off the meta device
    for mod in model.modules():
        if isinstance(mod, DeepseekV4RotaryEmbedding):
            for name, buf in DeepseekV4RotaryEmbedding(config).named_buffers():
                setattr(mod, name, buf)
    return model.eval()
