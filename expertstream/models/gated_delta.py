"""The gated delta rule in its prompt form (chunked, FP32) and the one-row causal conv of a decode step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
