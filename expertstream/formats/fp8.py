"""FP8 E4M3 (float8_e4m3fn): exact decoding from raw bytes, row-scaled and 128x128 block-scaled codecs.

E4M3: sign | 4 exponent bits (bias 7) | 3 mantissa bits; max 448, no infinities, NaN at 0x7F/0xFF;
exponent 0 holds subnormals man * 2^-9, which NVFP4 block scales really use.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9


def e4m3_to_float(x: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 to float32 with integer bit operations (exact, works on any device and dtype backend).

    Args:
        x: float8_e4m3fn tensor, or uint8 tensor holding the raw bytes.

    Returns:
        float32 tensor of the same shape.
    """
    b = x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x
    if b.dtype != torch.uint8:
        raise TypeError(f"e4m3_to_float expects float8_e4m3fn or uint8 bytes, got {x.dtype}")
    b = b.to(torch.int32)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).to(torch.float32)
    # normal: (1 + man/8) * 2^(exp-7); subnormal (exp == 0): man/8 * 2^-6 = man * 2^-9
    mag = torch.where(exp == 0, man * E4M3_MIN_SUBNORMAL, torch.ldexp(1.0 + man / 8.0, exp - 7))
    mag = torch.where((b & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((b & 0x80) != 0, -mag, mag)


def float_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float values to E4M3 (round to nearest even, saturating at +-448) and return float8_e4m3fn."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-scaled FP8 for resident dense matrices: one FP32 scale per output row.

    Args:
        w: [N, K] weight (any float dtype).

    Returns:
        (q [N, K] float8_e4m3fn, scale [N] float32) with w ~= q * scale[:, None].
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_rows expects a 2-D matrix, got shape {tuple(w.shape)}")
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / E4M3_MAX).clamp_min(1e-12)
    return float_to_e4m3(wf / scale[:, None]), scale


def dequantize_fp8_rows(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8_rows`: q [N, K] e4m3 (or raw uint8), scale [N] float32 -> [N, K] dtype."""
    return (e4m3_to_float(q) * scale.float()[:, None]).to(dtype)


def quantize_fp8_blocks(
    w: torch.Tensor, block: int = 128, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block-scaled FP8 as in the MTP experts (`FP8_PB_WO`): w ~= q * scale_inv per block.

    Args:
        w: [N, K] with N and K multiples of `block`.
        scale_dtype: dtype of the stored scales (the NVIDIA export stores BF16); values are encoded with the
            rounded scale, so the stored one is exactly the one used.

    Returns:
        (q [N, K] float8_e4m3fn, weight_scale_inv [N/block, K/block] scale_dtype).
    """
    n, k = w.shape
    if n % block or k % block:
        raise ValueError(f"block FP8 needs dims divisible by {block}, got {tuple(w.shape)}")
    tiles = w.float().reshape(n // block, block, k // block, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-12).to(scale_dtype)
    q = float_to_e4m3(tiles / scale.float()[:, None, :, None]).reshape(n, k)
    return q, scale


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of `quantize_fp8_blocks`; scale_inv may be BF16 or F32. Returns float32 [N, K]."""
    n, k = q.shape
    tiles = e4m3_to_float(q).reshape(n // block, block, k // block, block)
    return (tiles * scale_inv.float()[:, None, :, None]).reshape(n, k)
