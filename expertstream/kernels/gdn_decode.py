"""One GatedDeltaNet decode step after the conv, in one launch: gates, L2 norms, the delta-rule state update,
the per-head RMSNorm and the output gate (the torch form is ~35 small kernels per layer and token).

Shapes: Hk key heads, Hv value heads (a multiple of Hk), Dk, Dv head dims. qkv [2 Hk Dk + Hv Dv] FP32 after
the conv's activation; b, a [Hv], z [Hv Dv] and the weights in the activation dtype; state [Hv, Dk, Dv]
FP32, updated in place. Roundings through the activation dtype follow the torch form exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertstream.kernels.codec import (
    dependent_launch,
    device_capability,
    gdc_launch_dependents,
    jit,
    require_triton,
    tl,
)

GATES = ("silu", "sigmoid")


def gdn_gates(b: torch.Tensor, a: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor):
    """b, a [..., Hv] (activation dtype) -> FP32 (beta, g): the delta rule's write strength and log decay."""
    return torch.sigmoid(b).float(), neg_a * F.softplus(a.float() + dt_bias)


def gdn_heads(qkv: torch.Tensor, hk: int, hv: int, dk: int, dv: int):
    """qkv [T, 2 Hk Dk + Hv Dv] FP32 -> q, k [T, Hv, Dk] (L2-normed, q scaled by Dk^-1/2), v [T, Hv, Dv]."""
    t = qkv.shape[0]
    # q and k are adjacent: one L2 norm and one head repeat for both; qk [T, 2, Hk, Dk]
    qk = qkv[:, : 2 * hk * dk].view(t, 2, hk, dk)
    qk = (qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(hv // hk, dim=2)
    return qk[:, 0] * dk**-0.5, qk[:, 1], qkv[:, 2 * hk * dk :].view(t, hv, dv)


def gdn_out(o: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float, gate: str) -> torch.Tensor:
    """o [T, Hv, Dv] FP32, z [T, Hv Dv] -> per-head plain RMSNorm (weight not zero-centred) times the output
    gate, [T, Hv Dv] in z.dtype."""
    o = F.rms_norm(o.to(z.dtype).float(), (o.shape[-1],), None, eps).to(z.dtype)
    gz = z.view(o.shape).float()
    gz = F.silu(gz) if gate == "silu" else torch.sigmoid(gz)
    return ((norm_w * o) * gz).to(z.dtype).reshape(z.shape)


def gdn_step_ref(qkv, b, a, z, state, neg_a, dt_bias, norm_w, *, num_k_heads: int, eps: float, gate: str):
    """Plain-torch twin of `gdn_step` (the model's one-token path without Triton)."""
    hv, dk, dv = state.shape
    beta, g = gdn_gates(b, a, neg_a, dt_bias)
    q, k, v = (x[0] for x in gdn_heads(qkv[None], num_k_heads, hv, dk, dv))
    state.mul_(g.exp()[:, None, None])
    delta = (v - torch.bmm(k[:, None, :], state)[:, 0]) * beta[:, None]  # [Hv, Dv]
    state.baddbmm_(k[:, :, None], delta[:, None, :])
    o = torch.bmm(q[:, None, :], state)[:, 0]
    return gdn_out(o[None], z[None], norm_w, eps, gate)[0]


def gdn_step(qkv, b, a, z, state, neg_a, dt_bias, norm_w, *, num_k_heads: int, eps: float, gate: str):
    """One token of a GatedDeltaNet layer from its conv output to the input of out_proj.

    Args:
        qkv: [2 Hk Dk + Hv Dv] float32, after the conv and its activation (q, k, v heads in that order).
        b, a: [Hv] the beta and decay projections, activation dtype.
        z: [Hv Dv] the output-gate projection, activation dtype.
        state: [Hv, Dk, Dv] float32 recurrent state, updated in place.
        neg_a: [Hv] float32, -exp(A_log). dt_bias: [Hv]. norm_w: [Dv] (activation dtype).
        num_k_heads: Hk. eps: the RMSNorm epsilon. gate: "silu" or "sigmoid" (output_gate_type).

    Returns:
        [Hv Dv] in z.dtype.
    """
    hv, dk, dv = state.shape
    hk = num_k_heads
    assert gate in GATES, f"gate {gate!r}"
    assert hv % hk == 0 and qkv.shape == (2 * hk * dk + hv * dv,) and qkv.dtype == torch.float32
    assert state.dtype == torch.float32 and state.is_contiguous(), f"state {state.dtype}"
    assert b.shape == a.shape == (hv,) and z.shape == (hv * dv,) and norm_w.shape == (dv,)
    assert neg_a.shape == dt_bias.shape == (hv,) and neg_a.dtype == torch.float32
    assert dk & (dk - 1) == 0 and dv & (dv - 1) == 0, f"head dims {dk}, {dv} must be powers of two"
    tensors = (qkv, b, a, z, neg_a, dt_bias, norm_w)
    assert all(t.is_contiguous() for t in tensors)
    require_triton(qkv, b, a, z, state, neg_a, dt_bias, norm_w)
    out = torch.empty_like(z)
    # one program per value head holds its [Dk, Dv] state in registers (128 x 128 FP32 for the real model)
    _gdn_step_kernel[(hv,)](
        qkv, b, a, z, state, neg_a, dt_bias, norm_w, out, eps, dk**-0.5, HK=hk, HV=hv, DK=dk, DV=dv,
        SILU=gate == "silu", PDL=dependent_launch(device_capability(out.device)),
        num_warps=8 if dk * dv >= 8192 else 2,
    )  # fmt: skip
    return out


@jit
def _gdn_step_kernel(
    qkv_ptr, b_ptr, a_ptr, z_ptr, s_ptr, nega_ptr, dtb_ptr, nw_ptr, out_ptr, eps, q_scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SILU: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Hv programs leave most SMs idle: out_proj (a dependent launch) may start now and read its weights
    if PDL:
        gdc_launch_dependents()
    h = tl.program_id(0)
    kh = h // (HV // HK)  # the key head this value head repeats
    act = out_ptr.dtype.element_ty
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q = tl.load(qkv_ptr + kh * DK + dk)
    k = tl.load(qkv_ptr + HK * DK + kh * DK + dk)
    v = tl.load(qkv_ptr + 2 * HK * DK + h * DV + dv)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + 1e-6)) * q_scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-6))
    beta = tl.sigmoid(tl.load(b_ptr + h).to(tl.float32)).to(act).to(tl.float32)  # sigmoid in act dtype
    x = tl.load(a_ptr + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
    g = tl.load(nega_ptr + h) * softplus
    offs = h * DK * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(s_ptr + offs) * tl.exp(g)  # [DK, DV]
    delta = (v - tl.sum(k[:, None] * s, 0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptr + offs, s)
    o = tl.sum(q[:, None] * s, 0).to(act).to(tl.float32)  # [DV]
    o = (o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / DV + eps))).to(act)
    o = (tl.load(nw_ptr + dv) * o).to(tl.float32)
    zz = tl.load(z_ptr + h * DV + dv).to(tl.float32)
    if SILU:
        gz = zz * tl.sigmoid(zz)
    else:
        gz = tl.sigmoid(zz)
    tl.store(out_ptr + h * DV + dv, (o * gz).to(act))
