"""The Gated DeltaNet layer: the gated delta rule in its prompt form (chunked, FP32), its one-token form (a
kernel or its twin), and the one-row causal conv of a decode step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expertstream.kernels.gdn_decode import GATES, gdn_gates, gdn_heads, gdn_out
from expertstream.models.base import ACT, ModelArgs, gdn_conv, gdn_step
from expertstream.models.state import State
from expertstream.models.weights import Weights

GDN_CHUNK = 64


def conv_step(hist: torch.Tensor, w_t: torch.Tensor, dilation: int = 1) -> torch.Tensor:
    """One new row of a depthwise causal conv in FP32: hist [(K-1)*dilation + 1, C], w_t [K, C] -> [1, C].

    A multiply and a sum: F.conv1d for one position takes over 10x longer on the CPU (46 vs 3.5 us, C = 1792).
    """
    return (hist[::dilation].float() * w_t).sum(0, keepdim=True).to(hist.dtype)


def gated_delta_chunked(q, k, v, g, beta, s, chunk: int = GDN_CHUNK):
    """Prompt form, FP32. q, k [Hv, T, Dk], v [Hv, T, Dv], g, beta [Hv, T]; s [Hv, Dk, Dv] updated in place.

    Per chunk the delta-rule updates are folded by a unit-lower-triangular solve (the UT transform), then one
    sequential scan over chunks carries the state. Padding tokens have k = v = beta = g = 0: no effect.
    """
    hv, t, dk = k.shape
    pad = (-t) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    nc = (t + pad) // chunk
    q, k, v = (x.view(hv, nc, chunk, -1) for x in (q, k, v))
    g, beta = g.view(hv, nc, chunk), beta.view(hv, nc, chunk)
    kb, vb = k * beta[..., None], v * beta[..., None]
    gc = g.cumsum(-1)  # [Hv, nc, C] log decay from chunk start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(future, float("-inf")).exp()  # [Hv, nc, C, C]
    ut = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * gc.exp()[..., None]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [Hv, nc, 1, 1]
    out = torch.empty_like(v)
    for i in range(nc):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ v_new
        s.mul_(chunk_decay[:, i]).add_(k_dec[:, i].transpose(-1, -2) @ v_new)
    return out.view(hv, nc * chunk, -1)[:, :t]


class GatedDeltaNet(nn.Module):
    def __init__(self, w: Weights, p: str, a: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.hk, self.hv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        key_dim, val_dim = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * key_dim + val_dim
        self.in_proj = w.fused(
            [
                (f"{p}.in_proj_qkv.weight", conv_dim),
                (f"{p}.in_proj_z.weight", val_dim),
                (f"{p}.in_proj_b.weight", self.hv),
                (f"{p}.in_proj_a.weight", self.hv),
            ],
            a.hidden_size,
        )
        self.conv_w = nn.Buffer(w.get(f"{p}.conv1d.weight", (conv_dim, 1, a.linear_conv_kernel_dim)))
        self.conv_wt = nn.Buffer(self.conv_w[:, 0].T.float().contiguous())  # [K, conv_dim] for one token
        self.dt_bias = nn.Buffer(w.get(f"{p}.dt_bias", (self.hv,)))
        self.neg_A = nn.Buffer(-w.get(f"{p}.A_log", (self.hv,)).float().exp())  # -exp(A_log) [Hv] FP32
        self.norm_w = nn.Buffer(w.get(f"{p}.norm.weight", (self.dv,)))
        self.out_proj = w.linear(f"{p}.out_proj.weight", a.hidden_size, val_dim)
        if a.output_gate_type not in GATES:
            raise ValueError(f"output_gate_type {a.output_gate_type!r} is not one of {GATES}")
        self.act, self.act_name = ACT[a.hidden_act], a.hidden_act
        self.gate, self.eps = a.output_gate_type, a.rms_norm_eps
        self.kernel = w.kernels

    def forward(self, x: torch.Tensor, st: State) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self.in_proj(x)  # [T, conv_dim], [T, Hv*Dv], [T, Hv], [T, Hv]
        # depthwise causal conv over [last K-1 rows | new rows]
        conv = st.conv[self.layer]
        if t == 1:
            qkv = gdn_conv(conv, qkv, self.conv_wt, self.act_name, kernel=self.kernel)
        else:
            hist = torch.cat((conv, qkv))
            conv.copy_(hist[-conv.shape[0] :])
            qkv = self.act(F.conv1d(hist.T[None], self.conv_w, groups=hist.shape[1])[0].T).float()
        s = st.rec[self.layer]
        if t == 1:  # one launch on CUDA (kernels/gdn_decode.py), its torch twin elsewhere
            o = gdn_step(qkv[0], b[0], a[0], z[0], s, self.neg_A, self.dt_bias, self.norm_w,
                         num_k_heads=self.hk, eps=self.eps, gate=self.gate,
                         kernel=self.kernel)[None]  # fmt: skip
            return self.out_proj(o)
        beta, g = gdn_gates(b, a, self.neg_A, self.dt_bias)
        q, k, v = gdn_heads(qkv, self.hk, self.hv, self.dk, self.dv)
        o = gated_delta_chunked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T, s)
        return self.out_proj(gdn_out(o.transpose(0, 1), z, self.norm_w, self.eps, self.gate))
