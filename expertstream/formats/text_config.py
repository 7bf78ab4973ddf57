"""Which config.json fields the engine follows: the text_config values transformers' qwen4_exp would
resolve (RoPE keys merged as transformers merges them, layer types from `full_attention_interval`), and the
refusal of every value the engine would otherwise ignore. Setup and the engine each call `check_config`.

docs/model.md "Config fields" lists every field transformers reads and what the engine does with it.
"""

from __future__ import annotations

from pathlib import Path

# hidden_act values every user implements (routed experts: torch and Triton, shared expert, GatedDeltaNet
# conv); transformers' ACT2FN["swish"] is SiLU too
ACTIVATIONS = ("silu", "swish")
# config.json spellings of the one softmax-attention layer kind (QSA: indexed sparse attention)
INDEXED_ALIASES = ("indexed_attention", "full_attention", "qwen_sparse_attention")
INDEXER_KEYS = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
GATE_ACTIVATIONS = ("silu", "sigmoid")  # output_gate_type: what transformers itself accepts
ROPE_TYPES = ("default",)
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # Qwen4ExpTextConfig.__post_init__


class ConfigError(ValueError):
    """A config.json field holds a value the engine does not implement; the message names the field."""


def text_section(config: dict) -> dict:
    return config.get("text_config", config)


def rope_parameters(tc: dict) -> dict:
    """The flat `rope_parameters` transformers resolves: `rope_scaling` wins over `rope_parameters`, then
    a top-level `rope_theta` / `partial_rotary_factor` fills keys the dict lacks, `type` names the type."""
    rp = dict(tc.get("rope_scaling") or tc.get("rope_parameters") or {})
    rp.setdefault("rope_theta", tc.get("rope_theta", DEFAULT_ROPE_THETA))
    if tc.get("partial_rotary_factor") is not None:
        rp.setdefault("partial_rotary_factor", tc["partial_rotary_factor"])
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def layer_types(tc: dict) -> list[str] | None:
    """`layer_types`, or transformers' pattern when absent: every `full_attention_interval`-th layer (4 by
    default) indexed, the others linear. None when the layer count is missing too."""
    if tc.get("layer_types") is not None:
        return list(tc["layer_types"])
    n = tc.get("num_hidden_layers")
    if n is None:
        return None
    every = tc.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    return ["indexed_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


def config_problem(config: dict) -> str | None:
    """The first field of config.json the engine would not follow, as one sentence; None when all are."""
    tc = text_section(config)
    act = tc.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"hidden_act {act!r} is not supported: the routed-expert kernels implement silu only"
    gate = tc.get("output_gate_type") or act
    if gate not in GATE_ACTIVATIONS:
        return f"output_gate_type {gate!r} is not supported (transformers accepts silu and sigmoid)"
    for where, c in (("config.json", config), ("text_config", tc)):
        if c.get("tie_word_embeddings"):
            return f"{where} sets tie_word_embeddings: true; the engine reads its own lm_head.weight"
    rp = rope_parameters(tc)
    kinds = layer_types(tc) or []
    for i, kind in enumerate(kinds):
        if kind != "linear_attention" and kind not in INDEXED_ALIASES:
            return f"layer_types[{i}] {kind!r} is not a linear_attention or indexed_attention layer"
    if tc.get("num_hidden_layers") is not None and len(kinds) != tc["num_hidden_layers"]:
        return f"layer_types has {len(kinds)} entries for num_hidden_layers {tc['num_hidden_layers']}"
    if any(isinstance(v, dict) for v in rp.values()):
        return "rope_parameters nested per layer type are not supported (qwen4_exp reads one flat dict)"
    if rp["rope_type"] not in ROPE_TYPES:
        return f"rope_type {rp['rope_type']!r} is not supported (text positions use default RoPE)"
    if tc.get("indexer_kv_heads") not in (None, 1):
        return f"indexer_kv_heads {tc['indexer_kv_heads']} is not supported (QSA has one indexer key head)"
    if len(tc.get("ple_layer_ids") or []) > 1:
        return f"ple_layer_ids {tc['ple_layer_ids']} lists several layers; the workdir holds one PLE table"
    if kinds and any(k != "linear_attention" for k in kinds):
        missing = [k for k in INDEXER_KEYS if tc.get(k) is None]
        if missing:
            return f"text_config lacks {missing[0]}, which its indexed attention layers need"
    return None


def check_config(config: dict, where: str | Path = "config.json", error: type = ConfigError) -> None:
    """Raise `error` ("<where>: <one sentence>") when config.json has a field the engine would not follow."""
    problem = config_problem(config)
    if problem is not None:
        raise error(f"{where}: {problem}")
