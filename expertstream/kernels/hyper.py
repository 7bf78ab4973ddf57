"""Hyper-connection maths of a decode layer in one launch each (the torch forms are four and three small
kernels, twice a layer):

- `hc_mix`: the block input u = mean over the N streams of sigmoid(mix) * xn, and the injection gates
  sigmoid(inj);
- `moe_combine`: the MoE output y = routed + shared_gate * shared, injected into the streams x + 2 c y.

Shapes: T tokens, N streams, H hidden; streams [T, N*H], gates [T, N], all in the activation dtype except the
routed sum (FP32 or the activation dtype). Every rounding through the activation dtype follows the torch form.
"""

from __future__ import annotations

import torch

from expertstream.kernels.codec import (
    cdiv,
    dependent_launch,
    device_capability,
    gdc_launch_dependents,
    jit,
    next_pow2,
    require_triton,
    tl,
)

BLOCK_H = 1024


def hc_mix_ref(mix: torch.Tensor, xn: torch.Tensor, inj: torch.Tensor | None, n: int):
    """Plain-torch twin of `hc_mix`."""
    h = xn.shape[-1] // n
    u = (torch.sigmoid(mix).unflatten(-1, (n, h)) * xn.unflatten(-1, (n, h))).mean(-2)
    return u, torch.sigmoid(inj) if inj is not None else None


def hc_mix(mix: torch.Tensor, xn: torch.Tensor, inj: torch.Tensor | None, n: int):
    """(u [T, H], sigmoid(inj) [T, N] or None) from the mixing logits mix [T, N*H], the normalised streams
    xn [T, N*H] and the injection logits inj [T, N] (rows may be strided)."""
    t, nh = xn.shape
    h = nh // n
    assert mix.shape == xn.shape and nh == n * h and mix.dtype == xn.dtype, f"{mix.shape} {xn.shape}"
    assert mix.is_contiguous() and xn.is_contiguous()
    assert inj is None or (inj.shape == (t, n) and inj.stride(1) == 1 and inj.dtype == xn.dtype)
    require_triton(mix, xn)
    u = xn.new_empty(t, h)
    c = xn.new_empty(t, n) if inj is not None else u  # u: an unused pointer without injection
    src = inj if inj is not None else u
    _hc_mix_kernel[(t, cdiv(h, BLOCK_H))](
        mix, xn, u, src, c, src.stride(0), h, N=n, NP=next_pow2(n), INJ=inj is not None, BLOCK=BLOCK_H,
        PDL=dependent_launch(device_capability(u.device)), num_warps=4,
    )  # fmt: skip
    return u, c if inj is not None else None


@jit
def _hc_mix_kernel(
    mix_ptr, xn_ptr, u_ptr, inj_ptr, c_ptr, inj_stride, H, N: tl.constexpr, NP: tl.constexpr,
    INJ: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the block's input projection (an FP8 GEMV, a dependent launch) may start reading its weights
        gdc_launch_dependents()
    t = tl.program_id(0)
    hb = tl.program_id(1)
    act = u_ptr.dtype.element_ty
    offs = hb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(N):  # torch's mean: the dtype's products summed in FP32, times 1/N
        at = t * N * H + s * H + offs
        m = tl.sigmoid(tl.load(mix_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(act)
        acc += (m.to(tl.float32) * tl.load(xn_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(act)
    tl.store(u_ptr + t * H + offs, (acc * (1.0 / N)).to(act), mask=mask)
    if INJ:
        if hb == 0:
            j = tl.arange(0, NP)
            g = tl.load(inj_ptr + t * inj_stride + j, mask=j < N, other=0.0).to(tl.float32)
            tl.store(c_ptr + t * N + j, tl.sigmoid(g).to(act), mask=j < N)


def inject(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """x [T, N*H] + 2 c [T, N] (x) y [T, H], stream by stream, in one torch kernel (in_place: into x, the same
    bits): the attention output's injection, and the MoE output's in `moe_combine_ref`."""
    xs = x.unflatten(-1, (c.shape[1], -1))
    if in_place:
        xs.addcmul_(c[:, :, None], y[:, None, :], value=2)
        return x
    return torch.addcmul(xs, c[:, :, None], y[:, None, :], value=2).flatten(-2)


def moe_combine_ref(x, c, routed, shared_gate, shared, in_place: bool = False) -> torch.Tensor:
    """Plain-torch twin of `moe_combine`."""
    return inject(x, torch.addcmul(routed.to(shared.dtype), shared_gate, shared), c, in_place)


def moe_combine(x, c, routed, shared_gate, shared, in_place: bool = False) -> torch.Tensor:
    """x [T, N*H] + 2 c [T, N] (x) y [T, H] with y = routed [T, H] + shared_gate [T, 1] * shared [T, H], y
    rounded through x's dtype first; into x when `in_place` (the same bits), else a new tensor."""
    t, nh = x.shape
    n = c.shape[1]
    h = nh // n
    assert x.is_contiguous() and c.shape == (t, n) and c.is_contiguous() and nh == n * h, (
        f"{x.shape} {c.shape}"
    )
    assert routed.shape == shared.shape == (t, h) and routed.is_contiguous() and shared.is_contiguous()
    assert shared_gate.shape == (t, 1) and shared.dtype == c.dtype == shared_gate.dtype == x.dtype
    require_triton(x, c, routed, shared_gate, shared)
    out = x if in_place else torch.empty_like(x)
    _moe_combine_kernel[(t, cdiv(h, BLOCK_H))](
        x, c, routed, shared_gate, shared, out, h, shared_gate.stride(0), N=n, BLOCK=BLOCK_H, num_warps=4
    )
    return out


@jit
def _moe_combine_kernel(
    x_ptr, c_ptr, r_ptr, g_ptr, s_ptr, out_ptr, H, g_stride, N: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    act = out_ptr.dtype.element_ty
    offs = hb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    r = tl.load(r_ptr + t * H + offs, mask=mask, other=0.0).to(act).to(tl.float32)
    g = tl.load(g_ptr + t * g_stride).to(tl.float32)
    y = (r + g * tl.load(s_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)).to(act).to(tl.float32)
    for s in tl.static_range(N):
        at = t * N * H + s * H + offs
        cs = tl.load(c_ptr + t * N + s).to(tl.float32)
        xs = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (xs + 2.0 * cs * y).to(act), mask=mask)
