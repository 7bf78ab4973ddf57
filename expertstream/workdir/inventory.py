"""What a qwen4_exp NVFP4 snapshot must hold, derived from its config.json (names, dtypes, shapes).

Shared by `setup` (checks before writing anything) and `verify` (checks the written workdir). Tensor names are
the checkpoint's (docs: qwen4-exp-checkpoint.md section 4); widths and counts always come from text_config.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re

from expertstream.errors import UserError
from expertstream.formats import nvfp4
from expertstream.formats.expert_block import PROJ
from expertstream.formats.snapshot import DTYPES, Snapshot, TensorInfo, read_tensor

PREFIX = "model.language_model."
ATTENTION_TYPES = ("full_attention", "indexed_attention", "qwen_sparse_attention")  # all mean gated GQA + QSA
PLE_TABLE = "ple_embedding.ngram_embedding"
SCALARS = ("weight_scale_2", "input_scale")
# the big GDN matrices that --fp8-dense stores as E4M3 with one FP32 scale per output row
FP8_DENSE = re.compile(r"layers\.\d+\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\.weight")
EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")


class SetupError(UserError, ValueError):
    """The snapshot or the target cannot make a working directory; the message names the file or tensor."""


def config_value(tc: dict, key: str):
    if key not in tc:
        raise SetupError(f"config.json text_config lacks {key!r}")
    return tc[key]


def layer_types(tc: dict) -> list[str]:
    n = config_value(tc, "num_hidden_layers")
    types = tc.get("layer_types") or [
        "full_attention" if (i + 1) % config_value(tc, "full_attention_interval") == 0 else "linear_attention"
        for i in range(n)
    ]
    if len(types) != n:
        raise SetupError(f"config.json: {len(types)} layer_types for {n} layers")
    bad = sorted(set(types) - {"linear_attention", *ATTENTION_TYPES})
    if bad:
        raise SetupError(f"config.json: unsupported layer types {bad}")
    return types


def ple_layer(tc: dict) -> int | None:
    """Zero-based decoder layer carrying the PLE (`ple_layer_ids` is one-indexed), or None."""
    ids = tc.get("ple_layer_ids") or []
    if len(ids) > 1:
        raise SetupError(f"config.json: ple_layer_ids {ids}: the workdir format holds one PLE table")
    return ids[0] - 1 if ids else None


def resident_spec(tc: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every resident (non-expert, non-PLE-table) text tensor the model needs: name -> (dtype code, shape).

    Names are the workdir's (the `model.language_model.` prefix removed); shapes come from config.json.
    """
    H, V, E = config_value(tc, "hidden_size"), config_value(tc, "vocab_size"), config_value(tc, "num_experts")
    HC, R, S = (
        config_value(tc, "hc_count") * H,
        config_value(tc, "hc_lowrank"),
        config_value(tc, "shared_expert_intermediate_size"),
    )
    bf = "BF16"
    spec = {"embed_tokens.weight": (bf, (V, H)), "lm_head.weight": (bf, (V, H))}

    def hyper(prefix: str, inject: bool) -> None:
        spec[f"{prefix}.hc_norm.weight"] = (bf, (HC,))
        spec[f"{prefix}.input_mix_weight_down.weight"] = (bf, (R, HC))
        spec[f"{prefix}.input_mix_weight_up.weight"] = (bf, (HC, R))
        if inject:
            spec[f"{prefix}.block_inject_weight.weight"] = (bf, (config_value(tc, "hc_count"), HC))

    # the final mixer has no inject (an unused one may be stored; it is then kept but not required)
    hyper("hyper_connection_mixer", inject=False)
    ple = ple_layer(tc)
    for i, kind in enumerate(layer_types(tc)):
        p = f"layers.{i}"
        hyper(f"{p}.attn_hyper_connection", True)
        hyper(f"{p}.mlp_hyper_connection", True)
        spec[f"{p}.mlp.gate.weight"] = (bf, (E, H))
        spec[f"{p}.mlp.shared_expert.gate_proj.weight"] = (bf, (S, H))
        spec[f"{p}.mlp.shared_expert.up_proj.weight"] = (bf, (S, H))
        spec[f"{p}.mlp.shared_expert.down_proj.weight"] = (bf, (H, S))
        spec[f"{p}.mlp.shared_expert_gate.weight"] = (bf, (1, H))
        if kind == "linear_attention":
            nk, nv = config_value(tc, "linear_num_key_heads"), config_value(tc, "linear_num_value_heads")
            dk, dv = config_value(tc, "linear_key_head_dim"), config_value(tc, "linear_value_head_dim")
            conv = 2 * nk * dk + nv * dv
            a = f"{p}.linear_attn"
            spec[f"{a}.in_proj_qkv.weight"] = (bf, (conv, H))
            spec[f"{a}.in_proj_z.weight"] = (bf, (nv * dv, H))
            spec[f"{a}.in_proj_b.weight"] = (bf, (nv, H))
            spec[f"{a}.in_proj_a.weight"] = (bf, (nv, H))
            spec[f"{a}.conv1d.weight"] = (bf, (conv, 1, config_value(tc, "linear_conv_kernel_dim")))
            spec[f"{a}.dt_bias"] = (bf, (nv,))
            spec[f"{a}.A_log"] = (bf, (nv,))
            spec[f"{a}.norm.weight"] = (bf, (dv,))
            spec[f"{a}.out_proj.weight"] = (bf, (H, nv * dv))
        else:
            nh, nkv, hd = (
                config_value(tc, "num_attention_heads"),
                config_value(tc, "num_key_value_heads"),
                config_value(tc, "head_dim"),
            )
            ih, ikv, ihd = (
                config_value(tc, "indexer_n_heads"),
                config_value(tc, "indexer_kv_heads"),
                config_value(tc, "indexer_head_dim"),
            )
            a = f"{p}.self_attn"
            spec[f"{a}.q_proj.weight"] = (bf, (2 * nh * hd, H))  # query and output gate per head
            spec[f"{a}.k_proj.weight"] = (bf, (nkv * hd, H))
            spec[f"{a}.v_proj.weight"] = (bf, (nkv * hd, H))
            spec[f"{a}.o_proj.weight"] = (bf, (H, nh * hd))
            spec[f"{a}.q_norm.weight"] = (bf, (hd,))
            spec[f"{a}.k_norm.weight"] = (bf, (hd,))
            spec[f"{a}.indexer.index_qk_proj.weight"] = (bf, ((ih + ikv) * ihd, H))
            spec[f"{a}.indexer.q_layernorm.weight"] = (bf, (ihd,))
            spec[f"{a}.indexer.k_layernorm.weight"] = (bf, (ihd,))
        if i == ple:
            D, heads = tc.get("ple_embed_dim") or H, ple_heads(tc)
            k = config_value(tc, "ple_conv_kernel_size")
            spec[f"{p}.ple.key_proj.weight"] = (bf, (HC, D))
            spec[f"{p}.ple.value_proj.weight"] = (bf, (H, D))
            for norm in ("norm_key", "norm_query", "norm_conv"):
                spec[f"{p}.ple.{norm}.weight"] = (bf, (HC,))
            spec[f"{p}.ple.conv1d.weight"] = (bf, (HC, 1, k))
            spec[f"{p}.ple.ple_embedding.layer_multipliers"] = ("I64", (config_value(tc, "ngram_size"),))
            spec[f"{p}.ple.ple_embedding.ngram_heads_vocab_sizes"] = ("I64", (heads,))
            spec[f"{p}.ple.ple_embedding.ngram_heads_offsets"] = ("I64", (heads,))
    return spec


def ple_heads(tc: dict) -> int:
    return (config_value(tc, "ngram_size") - 1) * config_value(tc, "heads_per_ngram")


def snapshot_name(resident_name: str) -> str:
    return resident_name if resident_name == "lm_head.weight" else PREFIX + resident_name


def check_quant_config(snap: Snapshot, num_layers: int) -> None:
    """Accept ModelOpt MIXED_PRECISION with NVFP4 experts, and the older plain NVFP4 + ignore form."""
    qc = snap.config.get("quantization_config")
    hf_qc = snap.path / "hf_quant_config.json"
    if qc is None and hf_qc.is_file():
        qc = json.loads(hf_qc.read_text()).get("quantization")
    if not qc:
        raise SetupError(
            f"{snap.path / 'config.json'} has no quantization_config: not an NVFP4 ModelOpt export"
        )
    method, algo = qc.get("quant_method", "modelopt"), qc.get("quant_algo")
    if method != "modelopt":
        raise SetupError(
            f"{snap.path / 'config.json'}: quant_method {method!r} is not supported (need modelopt)"
        )
    for L in range(num_layers):
        module = f"{PREFIX}layers.{L}.mlp.experts"
        if algo == "MIXED_PRECISION":
            entry = qc.get("quantized_layers", {}).get(module, {})
            fmt, group = entry.get("quant_algo"), entry.get("group_size", nvfp4.GROUP)
        elif algo == "NVFP4":
            ignore = qc.get("ignore", qc.get("exclude_modules", []))
            fmt = (
                None if any(fnmatch.fnmatch(f"{module}.0.{p}", g) for p in PROJ for g in ignore) else "NVFP4"
            )
            groups = [g.get("weights", {}).get("group_size") for g in qc.get("config_groups", {}).values()]
            group = next((g for g in (qc.get("group_size"), *groups) if g is not None), nvfp4.GROUP)
        else:
            raise SetupError(f"{snap.path / 'config.json'}: quant_algo {algo!r} is not supported")
        if (fmt, group) != ("NVFP4", nvfp4.GROUP):
            raise SetupError(
                f"{snap.path / 'config.json'}: {module} is quantized as {fmt} with group size {group}, "
                f"the engine reads NVFP4 with group size {nvfp4.GROUP}"
            )


def check_side_files(snap: Snapshot) -> list[str]:
    """The JSON files and the tokenizer setup copies must parse (a broken one would fail every load later);
    returns the names checked."""
    checked = []
    for name in ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
        path = snap.path / name
        if path.is_file():
            try:
                json.loads(path.read_bytes())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SetupError(f"{path} is not valid JSON ({e}): download it again") from e
            checked.append(name)
    path = snap.path / "tokenizer.json"
    if not path.is_file():
        raise SetupError(f"{path} not found: the engine needs the snapshot's tokenizer")
    import tokenizers

    try:
        tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception for a file it cannot read
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SetupError(
            f"{path} is not a tokenizer the `tokenizers` library reads ({first}): download it again"
        ) from e
    return [*checked, "tokenizer.json"]


def check_tensor(info: TensorInfo | None, name: str, dtype: str, shape: tuple, snap: Snapshot) -> TensorInfo:
    if info is None:
        raise SetupError(f"{snap.path}: tensor {name} is missing from the snapshot")
    if info.dtype != dtype or info.shape != tuple(shape):
        raise SetupError(
            f"{info.path.name}: tensor {name} is {info.dtype} {list(info.shape)}, "
            f"expected {dtype} {list(shape)}"
        )
    return info


def plan_ple(snap: Snapshot, tc: dict, read_data: bool = True) -> tuple[dict | None, list[TensorInfo]]:
    """Check the PLE table; returns (manifest `ple` block pointing into the snapshot, shards in row order).

    With read_data=False (setup --dry-run) only headers are checked: the scale value (`scale` None) and the
    row count the n-gram heads address are left to the real setup."""
    layer = ple_layer(tc)
    if layer is None:
        return None, []
    base = f"{PREFIX}layers.{layer}.ple.{PLE_TABLE}"
    width = (tc.get("ple_embed_dim") or config_value(tc, "hidden_size")) // ple_heads(tc)
    infos = []
    while f"{base}.shard_{len(infos)}.weight" in snap.tensors:
        infos.append(snap.tensors[f"{base}.shard_{len(infos)}.weight"])
    parts = tc.get("split_ngram_parts", len(infos))
    if not infos or len(infos) != parts:
        raise SetupError(
            f"{snap.path}: tensor {base}.shard_{len(infos)}.weight is missing ({parts} PLE shards expected)"
        )
    for info in infos:
        if info.dtype != "F8_E4M3" or len(info.shape) != 2 or info.shape[1] != width:
            raise SetupError(
                f"{info.path.name}: tensor {info.name} is {info.dtype} {list(info.shape)}, "
                f"expected F8_E4M3 [rows, {width}]"
            )
    rows = sum(i.shape[0] for i in infos)
    sizes_info = snap.info(f"{PREFIX}layers.{layer}.ple.ple_embedding.ngram_heads_vocab_sizes")
    sizes = read_tensor(sizes_info) if read_data else None
    if sizes is not None and rows < int(sizes.sum()):
        raise SetupError(
            f"{snap.path}: the PLE table {base} has {rows} rows, the n-gram heads address {int(sizes.sum())}"
        )
    scale_info = snap.info(f"{base}.weight_scale")
    # the published export stores BF16 [1]; our older writer stored a 0-d scalar: both are one value
    if scale_info.shape not in ((), (1,)) or not DTYPES[scale_info.dtype][0].is_floating_point:
        got = f"{scale_info.dtype} {list(scale_info.shape)}"
        raise SetupError(
            f"{scale_info.path.name}: tensor {scale_info.name} is {got}, "
            "expected one floating value of shape [] or [1]"
        )
    # the dtype comes from the header: the NVIDIA export stores a 2-byte BF16 here, not an F32
    scale = float(read_tensor(scale_info).float().reshape(())) if read_data else None
    if scale is not None and (not math.isfinite(scale) or scale <= 0):
        raise SetupError(
            f"{scale_info.path.name}: {scale_info.name} = {scale} is not a positive finite scale"
        )
    shards = [{"path": str(i.path), "offset": i.offset, "rows": i.shape[0]} for i in infos]
    ple = {
        "layer": layer,
        "dtype": "float8_e4m3fn",
        "width": width,
        "scale": scale,
        "rows": rows,
        "shards": shards,
    }
    return ple, infos
