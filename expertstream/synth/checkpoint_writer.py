"""Write dense qwen4_exp text weights (HF names) as a checkpoint in NVIDIA's NVFP4 export layout, streaming.

Input names are the checkpoint's own: `model.language_model.*`, `lm_head.weight`, `mtp.*`, `model.visual.*`,
per-expert `...mlp.experts.E.{gate,up,down}_proj.weight`, and the whole PLE table as
`...ple_embedding.ngram_embedding.weight` [padded_rows, width] (transformers' runtime name).
With quantize="nvfp4" (ModelOpt MIXED_PRECISION, as the NVIDIA export):
  - routed experts -> NVFP4 (gate and up share one weight_scale_2 from their joint amax),
  - the PLE table -> FP8 E4M3 shards plus one BF16 scale of shape [1], MTP experts -> FP8 128x128
    block-scaled with BF16 `weight_scale_inv`,
  - already-quantized tensors (uint8 expert codes, e4m3 scales, F32 scalars) pass through unchanged,
  - everything else -> BF16 (integer buffers keep their dtype).
With quantize="bf16" the same names are written unquantized (PLE split into BF16 shards), no quant config.
Only one tensor (plus one expert's gate waiting for its up) is held at a time; shards are written per layer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from expertstream.formats import nvfp4
from expertstream.formats.fp8 import E4M3_MAX, float_to_e4m3, quantize_fp8_blocks
from expertstream.log import get_logger

log = get_logger(__name__)

PREFIX = "model.language_model."
FP8_FILE = "model-fp8-mtp-ple.safetensors"
MODELOPT_VERSION = "0.47.0"
# as the published export stores them (docs/synth.md lists the sources)
PLE_SCALE_SHAPE = (1,)
MTP_SCALE_DTYPE = torch.bfloat16
_ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
_EXPERT_RE = re.compile(
    r"^(?P<module>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_PLE_RE = re.compile(r"^(?P<module>.*\.ple_embedding\.ngram_embedding)\.weight$")
_LAYER_RE = re.compile(r"^" + re.escape(PREFIX) + r"layers\.(\d+)\.")


class CheckpointWriteError(ValueError):
    pass


class SafetensorsStreamWriter:
    """One .safetensors file written tensor by tensor: the data go after a header slot of `reserve` bytes and
    the header is written into it last, padded with spaces as safetensors allows. A header that outgrows its
    slot is written in front of a copy of the data (the whole file once more)."""

    def __init__(self, path: Path, reserve: int = 0):
        self.path = path
        self._reserve = -(-reserve // 8) * 8  # the data start 8-byte aligned
        self._file = open(path, "wb")
        self._file.seek(8 + self._reserve)
        self._header: dict[str, dict] = {}
        self._offset = 0
        self.header_bytes = 0  # the header's own length, once closed

    @property
    def nbytes(self) -> int:
        return self._offset

    @property
    def closed(self) -> bool:
        return self._file.closed

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._header:
            raise CheckpointWriteError(f"tensor {name!r} written twice to {self.path.name}")
        if tensor.dtype not in _ST_DTYPES:
            raise CheckpointWriteError(
                f"tensor {name!r} has dtype {tensor.dtype}, not storable in safetensors"
            )
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(raw))
        end = self._offset + raw.nbytes
        self._header[name] = {
            "dtype": _ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, end],
        }
        self._offset = end

    def close(self) -> list[str]:
        if self.closed:
            return list(self._header)
        header = {"__metadata__": {"format": "pt"}, **self._header}
        blob = json.dumps(header, separators=(",", ":")).encode()
        self.header_bytes = len(blob)
        if len(blob) <= self._reserve:
            self._file.seek(0)
            self._file.write(self._reserve.to_bytes(8, "little") + blob + b" " * (self._reserve - len(blob)))
            self._file.close()
            return list(self._header)
        self._file.close()
        blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
        data = self.path.with_name(self.path.name + ".data")
        os.replace(self.path, data)
        with open(self.path, "wb") as f, open(data, "rb") as src:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            src.seek(8 + self._reserve)
            shutil.copyfileobj(src, f, 16 << 20)
        data.unlink()
        return list(self._header)


def quantize_nvfp4_expert(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, input_scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 for one routed expert; gate and up share one global scale from their joint amax.

    Args:
        gate, up: [I, H] float weights; down: [H, I].
        input_scale: the FP32 activation scalar to store (unused by weight-only engines).

    Returns:
        {"gate_proj.weight": u8 [I, H/2], "gate_proj.weight_scale": e4m3 [I, H/16],
        "gate_proj.weight_scale_2": f32 0-d, "gate_proj.input_scale": f32 0-d, ... up_proj, down_proj}.
    """
    amax = torch.maximum(gate.float().abs().max(), up.float().abs().max())
    ws2 = float(amax / (nvfp4.E2M1_MAX * E4M3_MAX)) if amax > 0 else 1.0
    out = {}
    for proj, w, scale_2 in (("gate_proj", gate, ws2), ("up_proj", up, ws2), ("down_proj", down, None)):
        q, s, s2 = nvfp4.quantize(w, scale_2)
        out[f"{proj}.weight"] = q
        out[f"{proj}.weight_scale"] = s
        out[f"{proj}.weight_scale_2"] = s2
        out[f"{proj}.input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    return out


def quantize_fp8_table(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 for the PLE table: ([rows, width] float8_e4m3fn, BF16 0-d scale) with row = fp8 * scale.

    The scale is rounded to BF16 first so that the stored scalar is exactly the one the codes were made with.
    """
    amax = table.float().abs().max()
    scale = (amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)).to(torch.bfloat16)
    return float_to_e4m3(table.float() / scale.float()), scale


def _quantization_config(quantized_layers: dict[str, dict], expert_modules: list[str]) -> dict:
    group = {"num_bits": 4, "type": "float", "group_size": nvfp4.GROUP, "dynamic": False}
    return {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "config_groups": {
            "group_0": {"weights": dict(group), "input_activations": dict(group), "targets": expert_modules}
        },
        "ignore": ["lm_head", f"{PREFIX}embed_tokens", f"{PREFIX}hyper_connection_mixer*"],
        "quantized_layers": quantized_layers,
    }


def _hf_quant_config(qc: dict) -> dict:
    return {
        "producer": qc["producer"],
        "quantization": {
            "quant_algo": qc["quant_algo"],
            "kv_cache_quant_algo": None,
            "quantized_layers": qc["quantized_layers"],
            "exclude_modules": qc["ignore"],
        },
    }


class _Sharder:
    """Routes tensors to files: a new `model-*` shard per decoder layer; FP8 PLE and MTP go to FP8_FILE."""

    def __init__(self, out_dir: Path, separate_fp8: bool):
        self.out_dir = out_dir
        self.separate_fp8 = separate_fp8
        self.shards: list[SafetensorsStreamWriter] = []
        self.shard_layer: int | None = None
        self.fp8: SafetensorsStreamWriter | None = None
        self.names: dict[str, SafetensorsStreamWriter] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.separate_fp8 and (name.startswith("mtp.") or ".ple_embedding.ngram_embedding." in name):
            if self.fp8 is None:
                self.fp8 = SafetensorsStreamWriter(self.out_dir / FP8_FILE)
            writer = self.fp8
        else:
            m = _LAYER_RE.match(name)
            layer = int(m.group(1)) if m else None
            if not self.shards or (
                layer is not None and self.shard_layer is not None and layer != self.shard_layer
            ):
                # a layer's shard is done when the next starts; the next (the same tensors, other numbers)
                # gets a header slot a little larger than its header, so its data are written once
                reserve = 0
                if self.shards:
                    self.shards[-1].close()
                    reserve = self.shards[-1].header_bytes * 5 // 4 + 1024
                self.shards.append(
                    SafetensorsStreamWriter(self.out_dir / f"shard-{len(self.shards):05d}.tmp", reserve)
                )
                self.shard_layer = None
            if layer is not None:
                self.shard_layer = layer
            writer = self.shards[-1]
        if name in self.names:
            raise CheckpointWriteError(f"tensor {name!r} given twice")
        writer.add(name, tensor)
        self.names[name] = writer

    def close(self) -> tuple[dict[str, str], int]:
        weight_map: dict[str, str] = {}
        total = 0
        n = len(self.shards)
        for i, shard in enumerate(self.shards):
            final = self.out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            total += shard.nbytes
            names = shard.close()
            os.replace(shard.path, final)
            weight_map.update(dict.fromkeys(names, final.name))
        if self.fp8 is not None:
            total += self.fp8.nbytes
            weight_map.update(dict.fromkeys(self.fp8.close(), FP8_FILE))
        return dict(sorted(weight_map.items())), total


def write_checkpoint(
    out_dir: str | Path,
    config: dict,
    tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    tokenizer: str | Path | Mapping[str, str],
    quantize: str = "nvfp4",
    generation_config: dict | None = None,
    input_scale: float = 1.0,
) -> Path:
    """Write a checkpoint directory in the layout of `nvidia/Qwen3.8-Flash-Next-NVFP4`.

    Args:
        out_dir: target directory (created; existing files of the same names are replaced).
        config: the composite `config.json` dict (`text_config`, `vision_config`, ...) without
            `quantization_config`; the writer adds it for quantize="nvfp4".
        tensors: (name, tensor) pairs or a state dict: dense text weights, checkpoint names (see module doc).
            Order decides sharding: keep each decoder layer's tensors together. An expert's gate and up may
            arrive in either order; the pair is quantized once both are seen.
        tokenizer: a directory whose files are copied, or a {file name: text} mapping.
        quantize: "nvfp4" (ModelOpt MIXED_PRECISION layout) or "bf16" (unquantized twin).
        generation_config: written as generation_config.json when given.
        input_scale: FP32 activation scalar for experts quantized here (uncalibrated; W4A16 ignores it).

    Returns:
        The output directory.
    """
    if quantize not in ("nvfp4", "bf16"):
        raise CheckpointWriteError(f"quantize must be 'nvfp4' or 'bf16', got {quantize!r}")
    if "quantization_config" in config:
        raise CheckpointWriteError("config already has a quantization_config; pass the unquantized config")
    text_config = config.get("text_config")
    if not isinstance(text_config, dict):
        raise CheckpointWriteError("config has no text_config dict")
    parts = int(text_config["split_ngram_parts"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    sharder = _Sharder(out, separate_fp8=quantize == "nvfp4")
    quantized_layers: dict[str, dict] = {}
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (module, expert) -> {proj: dense weight}

    def emit_ple(module: str, table: torch.Tensor) -> None:
        # table [padded_rows, width] -> split_ngram_parts shards of rows/parts
        if table.shape[0] % parts:
            raise CheckpointWriteError(
                f"{module}.weight has {table.shape[0]} rows, not divisible by split_ngram_parts={parts}"
            )
        if quantize == "nvfp4":
            table, scale = quantize_fp8_table(table)
            quantized_layers[module] = {"quant_algo": "FP8"}
        else:
            table = table.to(torch.bfloat16)
        for i, shard in enumerate(table.chunk(parts, dim=0)):
            sharder.add(f"{module}.shard_{i}.weight", shard)
        if quantize == "nvfp4":
            sharder.add(f"{module}.weight_scale", scale.reshape(PLE_SCALE_SHAPE))

    def emit_expert(module: str, expert: str, proj: str, w: torch.Tensor) -> None:
        key = (module, expert)
        if quantize == "bf16":
            sharder.add(f"{module}.{expert}.{proj}.weight", w.to(torch.bfloat16))
        elif module.startswith("mtp."):
            q, scale_inv = quantize_fp8_blocks(w, scale_dtype=MTP_SCALE_DTYPE)
            sharder.add(f"{module}.{expert}.{proj}.weight", q)
            sharder.add(f"{module}.{expert}.{proj}.weight_scale_inv", scale_inv)
            quantized_layers[module] = {"quant_algo": "FP8_PB_WO", "group_size": 128}
        else:
            got = pending.setdefault(key, {})
            got[proj] = w
            if len(got) < 3:
                return
            q = quantize_nvfp4_expert(got["gate_proj"], got["up_proj"], got["down_proj"], input_scale)
            for sub, t in q.items():
                sharder.add(f"{module}.{expert}.{sub}", t)
            quantized_layers[module] = {"quant_algo": "NVFP4", "group_size": nvfp4.GROUP}
        pending.pop(key, None)

    for name, tensor in items:
        m_expert = _EXPERT_RE.match(name)
        m_ple = _PLE_RE.match(name)
        if m_expert and tensor.is_floating_point() and tensor.dtype != torch.float8_e4m3fn:
            emit_expert(m_expert["module"], m_expert["expert"], m_expert["proj"], tensor)
        elif m_ple and tensor.is_floating_point():
            emit_ple(m_ple["module"], tensor)
        elif tensor.dtype in (torch.uint8, torch.float8_e4m3fn) or (tensor.numel() == 1 and "_scale" in name):
            # already quantized (codes, block scales, FP32/BF16 scalars): keep bytes as they are
            if quantize == "bf16":
                raise CheckpointWriteError(
                    f"{name} is quantized ({tensor.dtype}); a bf16 checkpoint needs dense weights"
                )
            if m_expert:
                quantized_layers[m_expert["module"]] = {"quant_algo": "NVFP4", "group_size": nvfp4.GROUP}
            sharder.add(name, tensor)
        elif tensor.is_floating_point():
            sharder.add(name, tensor.to(torch.bfloat16))
        else:
            sharder.add(name, tensor)
    if pending:
        (module, expert), got = next(iter(pending.items()))
        raise CheckpointWriteError(
            f"{module}.{expert} is missing {sorted({'gate_proj', 'up_proj', 'down_proj'} - set(got))}"
        )

    weight_map, total = sharder.close()
    config = dict(config)
    if quantize == "nvfp4":
        # the 4-bit group targets the routed experts only: the FP8 PLE table is in quantized_layers alone
        experts = sorted((k for k, v in quantized_layers.items() if v["quant_algo"] == "NVFP4"), key=_natural)
        quantized_layers = {k: quantized_layers[k] for k in sorted(quantized_layers, key=_natural)}
        config["quantization_config"] = _quantization_config(quantized_layers, experts)
        _write_json(out / "hf_quant_config.json", _hf_quant_config(config["quantization_config"]))
    _write_json(out / "config.json", config)
    if generation_config is not None:
        _write_json(out / "generation_config.json", generation_config)
    _write_json(
        out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    _write_tokenizer(out, tokenizer)
    log.info("wrote %s: %d tensors, %.1f MB", out, len(weight_map), total / 1e6)
    return out


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _write_tokenizer(out: Path, tokenizer: str | Path | Mapping[str, str]) -> None:
    if isinstance(tokenizer, Mapping):
        for fname, text in tokenizer.items():
            (out / fname).write_text(text)
        return
    src = Path(tokenizer)
    if not src.is_dir():
        raise CheckpointWriteError(f"tokenizer directory {src} does not exist")
    for f in sorted(src.iterdir()):
        if f.is_file() and (
            f.name.startswith("tokenizer")
            or f.name in ("chat_template.jinja", "vocab.json", "merges.txt", "special_tokens_map.json")
        ):
            shutil.copyfile(f, out / f.name)
