"""One token of GatedDeltaNet's depthwise causal conv in one launch: the new row against the last K-1, the
history shifted by one in place, the activation, FP32 out (the torch form is a concatenation, a copy, the
multiply-sum, two casts and the activation: eight kernels per layer and token).

Shapes: C channels, K taps. hist [K-1, C] and new [1, C] in the activation dtype, w_t [K, C] FP32 (the conv
weight transposed); out [1, C] FP32.
"""

from __future__ import annotations

import torch

from expertstream.kernels.codec import cdiv, jit, require_triton, tl

ACTS = ("silu", "sigmoid")
BLOCK_C = 1024


def conv_update_ref(hist: torch.Tensor, new: torch.Tensor, w_t: torch.Tensor, act: str) -> torch.Tensor:
    """Plain-torch twin of `conv_update` (the multiply and sum in FP32: F.conv1d for one position is over 10x
    slower on the CPU)."""
    rows = torch.cat((hist, new))
    hist.copy_(rows[-hist.shape[0] :])
    y = (rows.float() * w_t).sum(0, keepdim=True).to(new.dtype)
    return (torch.nn.functional.silu(y) if act == "silu" else torch.sigmoid(y)).float()


def conv_update(hist: torch.Tensor, new: torch.Tensor, w_t: torch.Tensor, act: str) -> torch.Tensor:
    """[1, C] FP32: act(sum over the K taps of [hist; new] * w_t, rounded through new's dtype); hist takes the
    last K-1 rows of [hist; new] in place."""
    k, c = w_t.shape
    assert act in ACTS and hist.shape == (k - 1, c) and new.shape == (1, c), f"{hist.shape} {new.shape}"
    assert hist.dtype == new.dtype and w_t.dtype == torch.float32
    assert hist.is_contiguous() and new.is_contiguous() and w_t.is_contiguous()
    require_triton(hist, new, w_t)
    out = torch.empty(1, c, dtype=torch.float32, device=new.device)
    _conv_update_kernel[(cdiv(c, BLOCK_C),)](hist, new, w_t, out, c, K=k, SILU=act == "silu", BLOCK=BLOCK_C)
    return out


@jit
def _conv_update_kernel(
    hist_ptr, new_ptr, w_ptr, out_ptr, C, K: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    act = new_ptr.dtype.element_ty
    new = tl.load(new_ptr + offs, mask=mask, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K - 1):  # each program owns its channels: read row k, then move it up
        row = tl.load(hist_ptr + k * C + offs, mask=mask, other=0.0)
        acc += row.to(tl.float32) * tl.load(w_ptr + k * C + offs, mask=mask, other=0.0)
        if k > 0:
            tl.store(hist_ptr + (k - 1) * C + offs, row, mask=mask)
    acc += new.to(tl.float32) * tl.load(w_ptr + (K - 1) * C + offs, mask=mask, other=0.0)
    if K > 1:
        tl.store(hist_ptr + (K - 2) * C + offs, new, mask=mask)
    y = acc.to(act).to(tl.float32)
    y = y * tl.sigmoid(y) if SILU else tl.sigmoid(y)
    tl.store(out_ptr + offs, y.to(act).to(tl.float32), mask=mask)
