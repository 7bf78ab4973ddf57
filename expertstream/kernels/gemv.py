"""One-token linear layers with 16-bit weights as a Triton GEMV, the input's activation fused in front: the
hyper-connections' up projection takes silu(down), the shared expert's down projection act(gate) * up. cuBLAS
runs these skinny shapes at ~1 TB/s on an H200 (5-7 us for 2.6-6.6 MB), some with a split-K reduction launch
after them, and each activation is a launch of its own.

Shapes: x [M, K] and w [N, K] in one dtype, mul [M, K] (the second factor of a gated input) -> [M, N]. The
kernel takes M = 1; more rows go to torch (cuBLAS's tiles are the better fit for prompts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertstream.kernels.codec import cdiv, jit, next_pow2, require_triton, tl

ACTS = {None: 0, "silu": 1, "sigmoid": 2}


def activate(x: torch.Tensor, act: str | None, mul: torch.Tensor | None) -> torch.Tensor:
    """The GEMV's input: act(x) (each step rounded to x's dtype, as torch's ops round), times mul if given."""
    if act == "silu":
        x = F.silu(x)
    elif act == "sigmoid":
        x = torch.sigmoid(x)
    return x if mul is None else x * mul


def linear_ref(x: torch.Tensor, w: torch.Tensor, act: str | None = None, mul: torch.Tensor | None = None):
    """Plain-torch twin of `linear`."""
    return F.linear(activate(x, act, mul), w)


def linear(x: torch.Tensor, w: torch.Tensor, act: str | None = None, mul: torch.Tensor | None = None):
    """activate(x, act, mul) @ w.T: the GEMV kernel for one row of x, torch for more."""
    if x.shape[0] != 1 or x.dim() != 2:
        return linear_ref(x, w, act, mul)
    k = x.shape[1]
    n = w.shape[0]
    assert act in ACTS and w.shape == (n, k) and w.dtype == x.dtype, (
        f"w {tuple(w.shape)} {w.dtype} x {x.dtype}"
    )
    assert (
        x.stride(1) == 1
        and w.is_contiguous()
        and (mul is None or (mul.shape == x.shape and mul.stride(1) == 1))
    )
    require_triton(x, w)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    # ~256+ programs keep every SM of a large GPU streaming: 1 row a program for few wide rows (the
    # hyper-connections' 10240-wide input), up to 16 for many short ones; the FP32 tile stays <= 4096
    block_n = max(1, min(16, 1 << max(0, (n // 256).bit_length() - 1)))
    block_k = min(next_pow2(k), max(64, 4096 // block_n))
    _gemv_kernel[(cdiv(n, block_n),)](
        x, mul if mul is not None else x, w, out, n, k, ACT=ACTS[act], MUL=mul is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return out


@jit
def _gemv_kernel(
    x_ptr, m_ptr, w_ptr, out_ptr, N, K, ACT: tl.constexpr, MUL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    dt = out_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        if ACT == 1:
            x = (x * tl.sigmoid(x)).to(dt).to(tl.float32)
        elif ACT == 2:
            x = tl.sigmoid(x).to(dt).to(tl.float32)
        if MUL:
            x = (x * tl.load(m_ptr + kk, mask=kmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        w = tl.load(
            w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0
        )
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + n, tl.sum(acc, 1).to(dt), mask=nmask)
