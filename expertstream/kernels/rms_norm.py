"""Zero-centred RMSNorm in one launch: x / rms(x) * (1 + w) in FP32, back to x's dtype (the torch form is a
cast, the norm, the scale and a cast back: four kernels, each normalisation of a decode layer).

Shapes: x [..., D] contiguous, normalised in groups of G features (G = D: the whole row); scale [D] FP32 holds
1 + w.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertstream.kernels.codec import jit, next_pow2, require_triton, tl


def rms_norm_ref(x: torch.Tensor, scale: torch.Tensor, eps: float, group: int | None) -> torch.Tensor:
    """Plain-torch twin of `rms_norm`."""
    # normalised and scaled in FP32: F.rms_norm on a bf16 input would round before the scale
    xf = x.float()
    if group is None:
        return F.rms_norm(xf, (xf.shape[-1],), scale, eps).type_as(x)
    out = F.rms_norm(xf.unflatten(-1, (-1, group)), (group,), None, eps)
    return (out * scale.view(-1, group)).flatten(-2).type_as(x)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, group: int | None) -> torch.Tensor:
    """x [..., D] -> the same shape and dtype: each G-wide group (G = group or D) times rsqrt(mean of its
    squares + eps), times scale [D] (1 + w, FP32)."""
    d = x.shape[-1]
    g = group or d
    assert x.is_contiguous() and d % g == 0, f"x {tuple(x.shape)} groups of {g}"
    assert scale.shape == (d,) and scale.dtype == torch.float32 and scale.is_contiguous()
    require_triton(x, scale)
    out = torch.empty_like(x)
    rows = x.numel() // g
    block = next_pow2(g)
    _rms_norm_kernel[(rows,)](
        x, scale, out, d // g, eps, G=g, BLOCK=block, num_warps=8 if block >= 4096 else 4
    )
    return out


@jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_groups, eps, G: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one group of one token
    offs = tl.arange(0, BLOCK)
    mask = offs < G
    x = tl.load(x_ptr + row * G + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / G + eps)
    w = tl.load(w_ptr + (row % n_groups) * G + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * G + offs, (x * r * w).to(out_ptr.dtype.element_ty), mask=mask)
