"""FP8 row-scaled matrix-vector / small-M matmul for the resident matrices: y = x (q * scale[:, None])^T.

q [N, K] float8_e4m3fn (read as raw bytes), scale [N] float32, x [M, K]. Bytes decode to fp16 holding
value * 2^-8 (exact, subnormals included), then to the activation dtype (exact for bf16 too: 4 significant
bits); 2^8 and the row scale are applied on the FP32 accumulator.
"""

from __future__ import annotations

import torch

from expertstream.formats.fp8 import dequantize_fp8_rows
from expertstream.kernels.codec import E4M3_UNIT, cdiv, dot_precision, e4m3_f16, jit, require_triton, tl


def fp8_rows_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of `fp8_rows_matmul` (FP32 maths, output in x.dtype)."""
    return (x.float() @ dequantize_fp8_rows(q, scale).T).to(x.dtype)


def _config(m: int, n: int) -> dict:
    # narrow column blocks keep every SM streaming; M rounds up to the 16-row dot minimum (H200 sweep)
    if n <= 4096:
        return dict(block_m=16 if m <= 16 else 64, block_n=16, block_k=128, num_warps=2, num_stages=4)
    return dict(block_m=16 if m <= 16 else 64, block_n=32, block_k=256, num_warps=4, num_stages=4)


def fp8_rows_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, config: dict | None = None
) -> torch.Tensor:
    """x [M, K] @ (q * scale[:, None])^T for an FP8 row-scaled matrix.

    Args:
        x: [M, K] activations (fp32 / fp16 / bf16), contiguous.
        q: [N, K] float8_e4m3fn, or its raw uint8 bytes, contiguous.
        scale: [N] float32 row scales.
        config: block_m, block_n, block_k, num_warps, num_stages (default from the shape).

    Returns:
        [M, N] in x.dtype.
    """
    require_triton(x, q, scale)
    assert x.dim() == 2 and x.is_contiguous(), f"x {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert q.dtype in (torch.float8_e4m3fn, torch.uint8) and q.dim() == 2 and q.is_contiguous(), (
        f"q {q.dtype}"
    )
    m, k = x.shape
    n = q.shape[0]
    assert q.shape[1] == k, f"q {tuple(q.shape)} does not match x {tuple(x.shape)}"
    assert scale.dtype == torch.float32 and scale.shape == (n,), f"scale {scale.dtype} {tuple(scale.shape)}"
    cfg = config or _config(m, n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (cdiv(n, cfg["block_n"]), cdiv(m, cfg["block_m"]))
    _fp8_rows_kernel[grid](
        x, q.view(torch.uint8), scale, out, m, n, k, UNIT=E4M3_UNIT, BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], DOT_PRECISION=dot_precision(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


@jit
def _fp8_rows_kernel(
    x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, UNIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # program (n block, m block): out[m, n] = scale[n] * UNIT * sum_k x[m, k] * (q[n, k] / UNIT)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        xt = tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(
            q_ptr + n[None, :].to(tl.int64) * K + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0
        )
        acc = tl.dot(xt, e4m3_f16(b).to(xt.dtype), acc, input_precision=DOT_PRECISION)  # [BM, BN]
    s = tl.load(scale_ptr + n, mask=nmask, other=0.0) * UNIT
    out = (acc * s[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[:, None] * N + n[None, :], out, mask=mmask[:, None] & nmask[None, :])
