"""NVFP4 as NVIDIA ModelOpt exports it (weight-only use: W4A16).

w[r, c] = e2m1(code[r, c]) * e4m3(weight_scale[r, c // 16]) * weight_scale_2
- codes: 4-bit E2M1 (sign in bit 3; code 8 is -0), two per byte along K, element 2j in the LOW nibble.
- weight_scale: E4M3 [N, K/16], row-major, subnormals allowed (clamped to [2^-9, 448] at export).
- weight_scale_2: one FP32 scalar per projection = amax(W) / (6 * 448).
"""

from __future__ import annotations

import torch

from expertstream.formats.fp8 import E4M3_MAX, E4M3_MIN_SUBNORMAL, e4m3_to_float, float_to_e4m3

GROUP = 16
E2M1_MAX = 6.0
# code -> value; codes 8..15 mirror 0..7 with the sign bit set (8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# rounding thresholds between magnitude codes i and i+1; at an exact tie the even code wins
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 codes (low nibble = even element)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed NVFP4 must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes (K even) -> [..., K/2] uint8."""
    if codes.shape[-1] % 2:
        raise ValueError(f"NVFP4 packing needs an even last dim, got {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode an NVFP4 matrix.

    Args:
        weight: [N, K/2] uint8 packed codes.
        weight_scale: [N, K/16] float8_e4m3fn, or its raw uint8 bytes.
        weight_scale_2: FP32 scalar (0-d tensor or float).
        dtype: output dtype; the product is formed in FP32 and cast once.

    Returns:
        [N, K] tensor.
    """
    n, half_k = weight.shape
    k = half_k * 2
    if weight_scale.shape != (n, k // GROUP):
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} does not match weight [{n}, {k}]")
    vals = e2m1_table(weight.device)[unpack_codes(weight).long()]  # [N, K]
    scales = e4m3_to_float(weight_scale).repeat_interleave(GROUP, dim=1)  # [N, K]
    ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
    return (vals * scales * ws2).to(dtype)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code for float32 values already divided by their scale (ties to even, saturating)."""
    mag = x.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for i, t in enumerate(_THRESHOLDS):
        up = (mag > t) | ((mag == t) & (i % 2 == 1))
        code += up.to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def quantize(
    w: torch.Tensor, weight_scale_2: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize as ModelOpt does.

    Args:
        w: [N, K] float weight, K a multiple of 16.
        weight_scale_2: override of the global scale (gate and up share one in the export).

    Returns:
        (weight [N, K/2] uint8, weight_scale [N, K/16] float8_e4m3fn, weight_scale_2 0-d float32).
    """
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"NVFP4 needs the input dim to be a multiple of {GROUP}, got {k}")
    wf = w.float()
    if weight_scale_2 is None:
        amax = wf.abs().max()
        weight_scale_2 = float(amax / (E2M1_MAX * E4M3_MAX)) if amax > 0 else 1.0
    ws2 = torch.tensor(weight_scale_2, dtype=torch.float32)
    blocks = wf.reshape(n, k // GROUP, GROUP)
    bamax = blocks.abs().amax(dim=-1)
    scale = bamax / (E2M1_MAX * ws2)
    scale = torch.where(bamax == 0, torch.ones_like(scale), scale).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    scale_q = float_to_e4m3(scale)
    denom = (e4m3_to_float(scale_q) * ws2)[..., None]
    codes = round_to_e2m1(blocks / denom).reshape(n, k)
    return pack_codes(codes), scale_q, ws2
