"""The reference of `expertstream check`: transformers' qwen4_exp on the snapshot's weights, read directly.

The snapshot's safetensors are opened with safe_open; NVFP4 experts and the FP8 PLE table are dequantized with
our codecs and loaded into `Qwen4ExpForCausalLM`. None of the engine's readers (Workdir, ExpertStore, PLE
reader) are involved, so a reader or repack bug shows up as a logit difference. Rationale: docs/check.md.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from expertstream.formats import nvfp4
from expertstream.formats.expert_block import PROJ
from expertstream.formats.fp8 import e4m3_to_float
from expertstream.formats.snapshot import Snapshot
from expertstream.models import deepseek_v4, deepseek_v4_reference

PREFIX = "model.language_model."
EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
PLE_SHARD_RE = re.compile(r"^(layers\.\d+\.ple\.ple_embedding\.ngram_embedding)\.shard_(\d+)\.weight$")
LAYER_RE = re.compile(r"^layers\.(\d+)\.")
# the final mixer is built without injection in transformers; an exported `block_inject_weight` is unused
UNUSED_RE = re.compile(r"^hyper_connection_mixer\.block_inject_weight\.weight$")
# tensors the text model does not have: MTP head and vision tower
SKIP_RE = re.compile(r"^(mtp\.|model\.visual\.)")
EXPERT_PARTS = ("weight", "weight_scale", "weight_scale_2")
# model_type -> (snapshot, dtype) -> transformers' model of a family whose model file builds its own truth
OWN_REFERENCES = {deepseek_v4.MODEL_TYPE: deepseek_v4_reference.transformers_reference}


def text_config_of(snapshot: Path) -> dict:
    with open(snapshot / "config.json") as f:
        config = json.load(f)
    text = dict(config.get("text_config", config))
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return text


def _snapshot_files(snapshot: Path) -> list[Path]:
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [snapshot / n for n in names]
    files = sorted(snapshot.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files (and no model.safetensors.index.json) in {snapshot}")
    return files


class RawExperts:
    """The snapshot's NVFP4 expert tensors of every layer, kept packed on `device`; `layer(l)` dequantizes
    one layer to FP32 (gate_up [E, 2I, H] with gate rows first, down [E, H, I]), so a reference deeper than
    the device holds in FP32 (10 GB a full-shape layer) runs with one layer of experts dense at a time."""

    def __init__(self, parts: dict[tuple[int, int, str, str], torch.Tensor], layers: int, experts: int):
        self.parts, self.num_layers, self.num_experts = parts, layers, experts

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, down = [], []
        for e in range(self.num_experts):
            w = {proj: nvfp4.dequantize(*self.expert(layer, e, proj), dtype=torch.float32) for proj in PROJ}
            gate_up.append(torch.cat([w["gate_proj"], w["up_proj"]], dim=0))
            down.append(w["down_proj"])
        return torch.stack(gate_up), torch.stack(down)

    def expert(self, layer: int, e: int, proj: str) -> list[torch.Tensor]:
        parts = [self.parts.get((layer, e, proj, k)) for k in EXPERT_PARTS]
        if any(p is None for p in parts):
            raise ValueError(f"expert tensors of layer {layer} expert {e} {proj} are missing")
        return parts


def read_snapshot(snapshot: Path, text: dict, device: str = "cpu") -> tuple[dict, RawExperts]:
    """(the text weights but the routed experts under `Qwen4ExpForCausalLM` names, PLE dequantized, all in
    FP32 on `device`; the routed experts packed on `device`). Tensors of layers at or past the config's
    num_hidden_layers are skipped: a snapshot whose config is cut to fewer layers is that shallower model."""
    num_layers, num_experts = text["num_hidden_layers"], text["num_experts"]
    experts: dict[tuple[int, int, str, str], torch.Tensor] = {}
    ple_shards: dict[str, dict[int, torch.Tensor]] = {}
    ple_scales: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for path in _snapshot_files(snapshot):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if SKIP_RE.match(name):
                    continue
                if not name.startswith(PREFIX):
                    if name != "lm_head.weight":
                        raise ValueError(f"{path.name}: unexpected tensor {name} outside {PREFIX}")
                    out[name] = f.get_tensor(name)
                    continue
                short = name[len(PREFIX) :]
                if (m := LAYER_RE.match(short)) and int(m[1]) >= num_layers:
                    continue
                if m := EXPERT_RE.match(short):
                    if m[4] in EXPERT_PARTS:
                        experts[(int(m[1]), int(m[2]), m[3], m[4])] = f.get_tensor(name).to(device)
                elif m := PLE_SHARD_RE.match(short):
                    ple_shards.setdefault(m[1], {})[int(m[2])] = f.get_tensor(name)
                elif short.endswith("ngram_embedding.weight_scale"):
                    ple_scales[short.rsplit(".", 1)[0]] = f.get_tensor(name)
                elif not UNUSED_RE.match(short):
                    out["model." + short] = f.get_tensor(name)

    for name, t in out.items():
        out[name] = t.to(device).float() if t.is_floating_point() else t.to(device)
    raw = RawExperts(experts, num_layers, num_experts)
    for layer in range(num_layers):  # every expert's tensors are there before any forward needs them
        for e in range(num_experts):
            for proj in PROJ:
                try:
                    raw.expert(layer, e, proj)
                except ValueError as err:
                    raise ValueError(f"{snapshot}: {err}") from None
    # PLE: row = fp8 * one bf16 scale; shards concatenated in shard order
    for module, shards in ple_shards.items():
        if module not in ple_scales:
            raise ValueError(f"{snapshot}: {PREFIX}{module}.weight_scale is missing")
        if sorted(shards) != list(range(len(shards))):
            raise ValueError(
                f"{snapshot}: {PREFIX}{module} shards are not 0..{len(shards) - 1}: {sorted(shards)}"
            )
        table = torch.cat([shards[i] for i in range(len(shards))]).to(device)
        out[f"model.{module}.weight"] = e4m3_to_float(table) * ple_scales[module].to(device).float()
    return out, raw


def reference_state_dict(snapshot: Path, text: dict, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The text weights under `Qwen4ExpForCausalLM` names, experts and PLE dequantized to FP32 on `device`."""
    out, raw = read_snapshot(snapshot, text, device)
    for layer in range(raw.num_layers):
        gate_up, down = raw.layer(layer)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = down
    return out


def _expert_modules(model) -> list:
    return [layer.mlp.experts for layer in model.model.layers]


def attach_experts(model, raw: RawExperts, dtype: torch.dtype, device: str) -> None:
    """Give each layer's experts module its dense weights only while it runs: dequantized (FP32, then cast
    to dtype, as the eager reference casts them) in a pre-hook, dropped again in a hook after."""
    empty = torch.empty(0, dtype=dtype, device=device)

    def put(module, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        module.down_proj = torch.nn.Parameter(down, requires_grad=False)

    for layer, module in enumerate(_expert_modules(model)):
        put(module, empty, empty)  # the 10 GB a full-shape layer that construction reserved are let go

        def before(module, args, layer=layer):
            gate_up, down = raw.layer(layer)
            put(module, gate_up.to(dtype), down.to(dtype))

        module.register_forward_pre_hook(before)
        module.register_forward_hook(lambda module, args, out: put(module, empty, empty))


def build_reference(
    snapshot: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    lazy_experts: bool = False,
    raw: tuple[dict, RawExperts] | None = None,
):
    """transformers' `Qwen4ExpForCausalLM` holding the snapshot's weights (experts and PLE dequantized).

    Args:
        snapshot: directory of a Hugging Face snapshot in NVIDIA's NVFP4 export layout.
        dtype: dtype of the reference weights and activations. Parameters are cast to it as
            `from_pretrained(dtype=...)` loads them; RoPE's inverse frequencies stay FP32 as there.
        device: where the reference runs.
        lazy_experts: dequantize each layer's experts when the layer runs (`attach_experts`), instead of
            holding every layer's dense experts.
        raw: `read_snapshot`'s result to reuse (two references share one read); lazy only.

    Returns:
        The model in eval mode.
    """
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    snapshot = Path(snapshot)
    text = text_config_of(snapshot)
    # transformers accepts full_attention / indexed_attention; qwen_sparse_attention is the pre-5.18 name
    text["layer_types"] = [
        "full_attention" if t == "qwen_sparse_attention" else t for t in text.get("layer_types") or []
    ][: text["num_hidden_layers"]] or None
    config = Qwen4ExpTextConfig(**text)
    config._attn_implementation = "eager"
    if lazy_experts:
        state, experts = raw or read_snapshot(snapshot, text, device)
        state = dict(state)
    else:
        state, experts = reference_state_dict(snapshot, text, device), None
    try:  # every weight is loaded next: skip the random initialisation (minutes for a full-shape model)
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = Qwen4ExpForCausalLM(config)
    # assign: the model takes the dequantized tensors as they are, no second copy of every weight
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if experts is not None:
        missing = [
            n for n in missing if not n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        ]
    if missing or unexpected:
        raise ValueError(
            f"{snapshot}: reference weights do not match; missing {missing}, unexpected {unexpected}"
        )
    if experts is not None:  # before the cast: the empty experts construction made would go to the device
        attach_experts(model, experts, dtype, device)
    for p in model.parameters():  # buffers (RoPE) keep the FP32 transformers made them in
        p.data = p.data.to(device, dtype)
    model.to(device)
    return model.eval()


def build_references(snapshot: str | Path, dtypes: list[torch.dtype], device: str = "cpu") -> list:
    """transformers' model of the snapshot in each dtype (the first is the truth), experts dequantized;
    qwen4_exp's share one read of the snapshot and dequantize each layer's experts as it runs."""
    snapshot = Path(snapshot)
    own = OWN_REFERENCES.get(text_config_of(snapshot).get("model_type"))
    if own is not None:
        snap = Snapshot(snapshot)
        return [own(snap, dtype).to(device) for dtype in dtypes]
    raw = read_snapshot(snapshot, text_config_of(snapshot), device)
    return [build_reference(snapshot, dtype, device, lazy_experts=True, raw=raw) for dtype in dtypes]


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] float32 of a full no-cache forward."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    return model(input_ids=x, use_cache=False).logits[0].float().cpu()
