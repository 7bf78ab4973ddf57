"""Hyper-connections: N residual streams mixed into one block input, the block output injected back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expertstream.models.base import ModelArgs, RMSNorm, hc_mix
from expertstream.models.weights import Weights


class GatedResidual(nn.Module):
    """Hyper-connection: N streams [T, N*H] -> block input u [T, H] and injection gates c [T, N] (c / 2)."""

    def __init__(self, w: Weights, p: str, a: ModelArgs, inject: bool = True):
        super().__init__()
        self.n, self.h = a.hc_count, a.hidden_size
        nh = self.n * self.h
        self.norm = RMSNorm(w.get(f"{p}.hc_norm.weight", (nh,)), a.rms_norm_eps, self.h, w.kernels)
        self.kernel = w.kernels
        # the low-rank down projection and the injection logits both read xn and are divided by N: one
        # matmul, the division folded into the rows (exact for a power-of-two N such as the shipped 4)
        specs = [(f"{p}.input_mix_weight_down.weight", a.hc_lowrank)]
        specs += [(f"{p}.block_inject_weight.weight", self.n)] if inject else []
        self.proj = w.fused(specs, nh, factor=1.0 / self.n)
        self.up = w.linear(f"{p}.input_mix_weight_up.weight", nh, a.hc_lowrank)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        xn = self.norm(x)
        down, *inj = self.proj(xn)
        # u = mean over the streams of sigmoid(mix) * xn; the injection weight is 2 * sigmoid(inj), and
        # `inject` applies the exact factor 2
        return hc_mix(self.up(F.silu(down)), xn, inj[0] if inj else None, self.n, kernel=self.kernel)
