"""What setup, the workdir check and verify need to know of a model family, one description each.

A family says how its snapshot names routed experts and resident tensors, in which format its experts are,
how its quantization is declared and which resident tensors its config asks for. Everything else in
`workdir/` is the same for every family: one page-aligned expert block per routed expert, the resident
tensors in one safetensors file, checksums in the manifest.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from expertstream.formats import deepseek_v4 as ds4
from expertstream.formats.expert_block import PROJ, ExpertLayout
from expertstream.formats.snapshot import Snapshot
from expertstream.formats.text_config import check_config
from expertstream.workdir import inventory as qwen
from expertstream.workdir.inventory import SetupError, check_tensor, config_value

_CODES = {"uint8": ("U8",), "float8_e4m3fn": ("F8_E4M3",), "float8_e8m0fnu": ("F8_E8M0",)}


@dataclass(frozen=True, slots=True)
class Family:
    model_type: str
    expert_format: str  # ExpertLayout.for_format's name
    experts_key: str  # config key of the routed expert count
    prefix: str  # removed from snapshot names in the workdir
    scalars: tuple[str, ...]  # per-projection FP32 scalars beside the blocks (NVFP4's global scales)
    code_dtypes: tuple[str, ...]  # safetensors dtypes the packed E2M1 codes may have
    expert_name: Callable[[int, int], dict[str, str]]  # (layer, expert) -> {snapshot name: block part}
    resident_spec: Callable[[dict], dict[str, tuple[str, tuple[int, ...]]]]  # workdir name -> dtype, shape
    is_text: Callable[[str], bool]  # a snapshot tensor the text model may read (not vision, not MTP)
    check_quant: Callable[[Snapshot, int], str]  # raises SetupError; returns the line of the check passed
    check_config: Callable[
        [dict, object], None
    ]  # raises SetupError for a value the engine does not implement
    fp8_dense: re.Pattern | None  # BF16 matrices `--fp8-dense` stores as FP8 rows
    data_checks: tuple[str, ...]  # what setup checks once it reads tensor data (the dry run cannot)

    def dims(self, tc: dict) -> tuple[int, int, int]:
        """(layers, routed experts, experts a token)."""
        return (
            config_value(tc, "num_hidden_layers"),
            config_value(tc, self.experts_key),
            config_value(tc, "num_experts_per_tok"),
        )

    def layout(self, tc: dict) -> ExpertLayout:
        h, i = config_value(tc, "hidden_size"), config_value(tc, "moe_intermediate_size")
        return ExpertLayout.for_format(self.expert_format, h, i)

    def rname(self, name: str) -> str:
        """Snapshot name -> workdir name."""
        return name.removeprefix(self.prefix)

    def snapshot_name(self, rname: str) -> str:
        return rname if rname == "lm_head.weight" else self.prefix + rname

    def expert_tensors(self, snap: Snapshot, layout: ExpertLayout) -> dict[str, tuple[int, int, str]]:
        """Check every routed-expert tensor; snapshot name -> (layer, expert, block part or "proj.scalar")."""
        L, E, _ = self.dims(snap.text_config)
        experts = {}
        for l in range(L):
            for e in range(E):
                for name, part in self.expert_name(l, e).items():
                    p, info = layout.part(part), snap.tensors.get(name)
                    codes = self.code_dtypes if p.dtype == "uint8" else _CODES[p.dtype]
                    dtype = info.dtype if info is not None and info.dtype in codes else codes[0]
                    check_tensor(info, name, dtype, p.shape, snap)
                    experts[name] = (l, e, part)
                for proj in PROJ if self.scalars else ():
                    for s in self.scalars:
                        name = f"{self.prefix}layers.{l}.mlp.experts.{e}.{proj}.{s}"
                        check_tensor(snap.tensors.get(name), name, "F32", (), snap)
                        experts[name] = (l, e, f"{proj}.{s}")
        return experts


def _qwen_expert_name(layer: int, expert: int) -> dict[str, str]:
    x = f"{qwen.PREFIX}layers.{layer}.mlp.experts.{expert}"
    return {f"{x}.{p}.{k}": f"{p}.{k}" for k in ("weight", "weight_scale") for p in PROJ}


def _qwen_quant(snap: Snapshot, num_layers: int) -> str:
    qwen.check_quant_config(snap, num_layers)
    return f"experts of all {num_layers} layers NVFP4, group 16"


def _ds4_spec(tc: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    try:
        return ds4.resident_spec(tc)
    except ds4.LayoutError as e:
        raise SetupError(f"config.json {e}") from e


def _ds4_config(config: dict, where: object) -> None:
    problem = ds4.config_problem(config)
    if problem:
        raise SetupError(f"{where}: {problem}")


def _qwen_config(config: dict, where: object) -> None:
    check_config(config, where, SetupError)


def _ds4_quant(snap: Snapshot, num_layers: int) -> str:
    problem = ds4.quant_problem(snap.config)
    if problem:
        raise SetupError(f"{snap.path / 'config.json'}: {problem}")
    return f"dense FP8 128x128 blocks (UE8M0 scales); experts of all {num_layers} layers MXFP4, group 32"


FAMILIES = {
    "qwen4_exp": Family(
        model_type="qwen4_exp",
        expert_format="nvfp4",
        experts_key="num_experts",
        prefix=qwen.PREFIX,
        scalars=qwen.SCALARS,
        code_dtypes=("U8",),
        expert_name=_qwen_expert_name,
        resident_spec=qwen.resident_spec,
        is_text=lambda n: (
            (n.startswith(qwen.PREFIX) and f".{qwen.PLE_TABLE}." not in n) or n == "lm_head.weight"
        ),
        check_quant=_qwen_quant,
        check_config=_qwen_config,
        fp8_dense=qwen.FP8_DENSE,
        data_checks=(
            "the PLE scale's value (positive, finite) and the rows the n-gram head buffers address",
            "every expert's gate and up weight_scale_2 bit-identical and positive",
        ),
    ),
    ds4.MODEL_TYPE: Family(
        model_type=ds4.MODEL_TYPE,
        expert_format="mxfp4",
        experts_key="n_routed_experts",
        prefix="",
        scalars=(),
        code_dtypes=("I8", "U8"),
        expert_name=ds4.expert_names,
        resident_spec=_ds4_spec,
        is_text=lambda n: not n.startswith("mtp."),
        check_quant=_ds4_quant,
        check_config=_ds4_config,
        fp8_dense=None,
        data_checks=(),
    ),
}


def family_of(config: dict, where: object = "config.json") -> Family:
    """The family of a config.json (raises SetupError naming the supported ones)."""
    mt = config.get("model_type")
    if mt not in FAMILIES:
        raise SetupError(f"{where}: model_type {mt!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[mt]
