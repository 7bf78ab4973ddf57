"""MXFP4 experts and UE8M0-scaled FP8 blocks as DeepSeek-V4-Flash ships them (plain-torch decode).

MXFP4 (OCP MX, group 32): w[r, c] = e2m1(code[r, c]) * 2^(scale[r, c // 32] - 127).
- codes: 4-bit E2M1 (the NVFP4 code table), two per byte along K, element 2j in the LOW nibble; the
  checkpoint stores the bytes as I8 [N, K/2].
- scale: UE8M0 (float8_e8m0fnu) [N, K/32], a pure power of two; byte 255 is NaN.
FP8 dense weights: E4M3 [N, K] with one UE8M0 scale per 128x128 block, [ceil(N/128), ceil(K/128)].
See docs/deepseek-v4.md for what each fact rests on. The Triton expert kernels decode the same blocks in
registers (kernels/nvfp4_moe.py, `codec.block_scale`).
"""

from __future__ import annotations

import math

import torch

from expertstream.formats.fp8 import E4M3_MAX, e4m3_to_float, float_to_e4m3
from expertstream.formats.nvfp4 import E2M1_MAX, e2m1_table, pack_codes, round_to_e2m1, unpack_codes

GROUP = 32
FP8_BLOCK = 128
E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_to_float(x: torch.Tensor) -> torch.Tensor:
    """UE8M0 (float8_e8m0fnu or its raw uint8 bytes) -> float32 2^(byte - 127); byte 255 -> NaN."""
    b = x.view(torch.uint8) if x.dtype == torch.float8_e8m0fnu else x
    if b.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_float expects float8_e8m0fnu or uint8 bytes, got {x.dtype}")
    b = b.to(torch.int32)
    val = torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive scales UP to a power of two (so no value overflows its grid) -> float8_e8m0fnu."""
    exp = torch.ceil(torch.log2(scale.float().clamp_min(2.0**-127))).clamp(-127, 127)
    return (exp.to(torch.int32) + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float (K a multiple of 32) -> (codes I8 [N, K/2], scale float8_e8m0fnu [N, K/32])."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs K divisible by {GROUP}, got {tuple(w.shape)}")
    groups = w.float().reshape(n, k // GROUP, GROUP)
    scale = float_to_e8m0(groups.abs().amax(-1) / E2M1_MAX)
    codes = round_to_e2m1(groups / e8m0_to_float(scale)[..., None]).reshape(n, k)
    return pack_codes(codes).view(torch.int8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode MXFP4: weight I8/U8 [N, K/2], scale e8m0 (or raw uint8) [N, K/32] -> [N, K] (FP32 product)."""
    n, half_k = weight.shape
    k = half_k * 2
    if tuple(scale.shape) != (n, k // GROUP):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match weight [{n}, {k}]")
    vals = e2m1_table(weight.device)[unpack_codes(weight.view(torch.uint8)).long()]
    return (vals * e8m0_to_float(scale).repeat_interleave(GROUP, dim=1)).to(dtype)


def quantize_fp8_blocks_e8m0(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (E4M3 [N, K], UE8M0 [ceil(N/block), ceil(K/block)]); edge blocks may be partial."""
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(nb, block, kb, block)
    scale = float_to_e8m0(tiles.abs().amax(dim=(1, 3)) / E4M3_MAX)
    q = float_to_e4m3(tiles / e8m0_to_float(scale)[:, None, :, None]).reshape(nb * block, kb * block)
    return q[:n, :k].contiguous(), scale


def dequantize_fp8_blocks_e8m0(
    q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8_blocks_e8m0`: E4M3 [N, K], UE8M0 [ceil(N/b), ceil(K/b)] -> [N, K] dtype."""
    n, k = q.shape
    if tuple(scale.shape) != (math.ceil(n / block), math.ceil(k / block)):
        raise ValueError(f"FP8 block scale shape {tuple(scale.shape)} does not match weight [{n}, {k}]")
    full = e8m0_to_float(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (e4m3_to_float(q) * full).to(dtype)
