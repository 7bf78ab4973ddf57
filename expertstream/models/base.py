"""Shared model pieces: `ModelArgs` parsed from config.json, zero-centred RMSNorm, RoPE, FP8-aware Linear."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from expertstream.formats import text_config
from expertstream.formats.fp8 import e4m3_to_float
from expertstream.kernels import HAVE_TRITON, conv_update, fp8_gemv, gdn_decode, hyper, rms_norm, router
from expertstream.kernels.codec import interpreting
from expertstream.kernels.dispatch import Fused

INDEXED_ALIASES = text_config.INDEXED_ALIASES
LAYER_KINDS = ("linear_attention", "indexed_attention")
ACT = {"silu": F.silu, "sigmoid": torch.sigmoid}  # hidden_act -> activation


@dataclass(slots=True)
class ModelArgs:
    """The `text_config` of a qwen4_exp config.json; key names are the config's own."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    eos_token_id: int | list[int]
    layer_types: list[str] | None = None  # None: transformers' full_attention_interval pattern
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False  # refused when true (formats/text_config.py)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list[int] = field(default_factory=list)
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        """Build from a text_config dict as transformers resolves it (formats/text_config.py: RoPE keys
        merged, layer types derived when absent); keys the network does not read are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["rope_parameters"] = text_config.rope_parameters(d)
        kw["layer_types"] = text_config.layer_types(d)
        missing = [
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in kw
        ]
        if missing:
            raise ValueError(f"text_config lacks required keys {missing}")
        args = cls(**kw)
        args._normalise()
        return args

    def _normalise(self) -> None:
        kinds = []
        for i, t in enumerate(self.layer_types):
            kind = "indexed_attention" if t in INDEXED_ALIASES else t
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer_types[{i}] = {t!r} is not one of {LAYER_KINDS + INDEXED_ALIASES}")
            kinds.append(kind)
        if len(kinds) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(kinds)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        self.layer_types = kinds
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        # the GDN output gate falls back to hidden_act only when the key is absent or null
        if self.output_gate_type is None:
            self.output_gate_type = self.hidden_act
        problem = text_config.config_problem(dataclasses.asdict(self))
        if problem is not None:
            raise ValueError(problem)
        if self.hidden_act == "swish":
            self.hidden_act = "silu"
        for lid in self.ple_layer_ids:
            if not 1 <= lid <= self.num_hidden_layers or kinds[lid - 1] != "linear_attention":
                raise ValueError(
                    f"ple_layer_ids entry {lid} must name a linear_attention layer (one-indexed)"
                )

    @property
    def eos_id(self) -> int:
        return self.eos_token_id[0] if isinstance(self.eos_token_id, list) else self.eos_token_id

    @property
    def ple_layers(self) -> list[int]:
        # ple_layer_ids is one-indexed; zero-based layer i carries the PLE when i + 1 is listed
        return [lid - 1 for lid in self.ple_layer_ids]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))

    @property
    def ple_conv_state_len(self) -> int:
        # the PLE conv is dilated by ngram_size
        return (self.ple_conv_kernel_size - 1) * self.ngram_size


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm in FP32: x / rms(x) * (1 + w); `group` normalises each group-wide slice alone.
    `kernel`: the Triton kernel where it can run, else the torch twin (kernels/dispatch.py)."""

    def __init__(self, weight: torch.Tensor, eps: float, group: int | None = None, kernel: bool = False):
        super().__init__()
        self.scale = nn.Buffer(1.0 + weight.float())  # (1 + w) in FP32 once, not per call
        self.eps, self.group, self.kernel = eps, group, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x.contiguous(), self.scale, self.eps, self.group, kernel=self.kernel)


def upload(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Host rows -> device without waiting for the GPU: a pageable copy waits for the stream to drain, so
    CUDA uploads go through pinned memory (torch's caching host allocator keeps it until the copy ran)."""
    t = t.to(dtype)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


class Rope(NamedTuple):
    """One call's positions [T] (on the device), their cos / signed sin [T, rotary_dim], and inv_freq."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    inv_freq: torch.Tensor


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.rotary_dim
    return 1.0 / (args.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """cos and signed sin [T, rotary_dim] for `apply_rope`: (cos, cos) and (-sin, sin) halves.

    Text tokens carry equal M-RoPE positions on all three axes, so the interleaved section split is a no-op.
    """
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, : freqs.shape[1]].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In-place rotate-half RoPE on the first rotary_dim features: x [T, heads, D], cos/sin [T, rot_dim]."""
    r = cos.shape[-1]
    xr = x[..., :r]
    # rotate_half(x) * sin == roll(x, r/2) * (-sin, sin), bit for bit, without two concatenations
    rotated = xr.roll(r // 2, -1) * sin[:, None, :]
    xr.mul_(cos[:, None, :]).add_(rotated)
    return x


# the decode path's small-op kernels (each its own launch where torch takes several), beside their twins
gdn_step = Fused(gdn_decode.gdn_step, gdn_decode.gdn_step_ref, "GatedDeltaNet decode")
rmsnorm = Fused(rms_norm.rms_norm, rms_norm.rms_norm_ref, "RMSNorm")
hc_mix = Fused(hyper.hc_mix, hyper.hc_mix_ref, "hyper-connection mix")
moe_combine = Fused(hyper.moe_combine, hyper.moe_combine_ref, "MoE combine")
gdn_conv = Fused(conv_update.conv_update, conv_update.conv_update_ref, "GatedDeltaNet conv")
route_topk = Fused(router.route_topk, router.route_topk_ref, "router top-k")
top_ids = Fused(router.top_ids, router.top_ids_ref, "top-k ids")
FUSED = (gdn_step, rmsnorm, hc_mix, moe_combine, gdn_conv, route_topk, top_ids)


def fp8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, kernel: bool
) -> torch.Tensor:
    """x [M, K] @ w.T for FP8 q [N, K] e4m3 with one scale per row (block None: scale [N] FP32) or per
    (SN x SK) block (scale [ceil(N/SN), ceil(K/SK)], FP32 or UE8M0): with `kernel` the Triton kernels on CUDA
    (or under the interpreter, as `Fused`), else dequantised on the fly."""
    if kernel and HAVE_TRITON and (x.is_cuda or interpreting()):
        if block is None:
            return fp8_gemv.fp8_rows_matmul(x, q, scale)
        return fp8_gemv.fp8_block_matmul(x, q, scale, block)
    if block is None:
        w = e4m3_to_float(q).mul_(scale.float()[:, None])
    else:
        w = fp8_gemv.dequantize_fp8_scaled(q, scale, block)
    return F.linear(x, w.to(x.dtype))


class Linear(nn.Module):
    """Linear holding a dense weight [out, in] or FP8 (q [out, in] e4m3 with scale [out] FP32 a row, or with
    `block` (SN, SK) one scale per block, [ceil(out/SN), ceil(in/SK)] FP32 or UE8M0 bytes), and an optional
    bias [out] (`attention_bias`); `kernel`: FP8 through the Triton kernels on CUDA."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        bias=None,
        kernel: bool = False,
        block: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.weight = nn.Buffer(weight)
        self.scale = nn.Buffer(scale) if scale is not None else None
        self.bias = nn.Buffer(bias) if bias is not None else None
        self.kernel, self.block = kernel, block

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def rows(self, start: int, stop: int) -> Linear:
        """The Linear of output rows [start, stop) (bias-free), sharing this one's weight. Block scales whose
        row blocks the range cuts become one scale a (1 x SK) block for those rows."""
        assert self.bias is None, "rows of a biased Linear"
        w = self.weight[start:stop]
        if self.scale is None or self.block is None:
            return Linear(w, None if self.scale is None else self.scale[start:stop], kernel=self.kernel)
        sn, sk = self.block
        if start % sn == 0 and (stop % sn == 0 or stop == self.out_features):
            return Linear(w, self.scale[start // sn : -(-stop // sn)], kernel=self.kernel, block=self.block)
        scale = self.scale.view(torch.uint8) if self.scale.dtype != torch.float32 else self.scale
        return Linear(w, scale.repeat_interleave(sn, 0)[start:stop], kernel=self.kernel, block=(1, sk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        y = fp8_matmul(
            x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.scale, self.block, self.kernel
        )
        y = y.unflatten(0, x.shape[:-1])
        return y if self.bias is None else y + self.bias


class FusedLinear(nn.Module):
    """Bias-free linears sharing one input, rows concatenated: one matmul per run of equally stored parts.

    `runs` [(Linear, [out_i, ...])]; forward returns every part's output [..., out_i] in the given order.
    """

    def __init__(self, runs: list[tuple[Linear, list[int]]]):
        super().__init__()
        self.linears = nn.ModuleList(lin for lin, _ in runs)
        self.sizes = [sizes for _, sizes in runs]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for lin, sizes in zip(self.linears, self.sizes):
            out += lin(x).split(sizes, dim=-1)
        return out
