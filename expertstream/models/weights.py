"""A checkpoint's resident weights as the network's modules take them: dense or FP8 row-scaled linears, fused
where several read one input."""

from __future__ import annotations

import itertools

import torch

from expertstream.models.base import FusedLinear, Linear


class Weights:
    """HF text names (prefix removed) -> tensors in the run dtype/device; FP8 row-scaled names stay FP8.
    `kernels`: the modules built from them run the Triton kernels where they can (kernels/dispatch.py)."""

    def __init__(self, tensors: dict, dtype: torch.dtype, device, fp8_row_scaled=(), kernels: bool = False):
        self.tensors, self.dtype, self.device, self.fp8 = tensors, dtype, device, set(fp8_row_scaled)
        self.kernels = kernels

    def _checked(self, name: str, shape: tuple | None = None) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"weight {name!r} is missing from the resident weights")
        t = self.tensors[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        return t

    def get(
        self, name: str, shape: tuple | None = None, float_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        t = self._checked(name, shape)
        dtype = (float_dtype or self.dtype) if t.is_floating_point() else t.dtype
        return t.to(self.device, dtype)

    def host(self, name: str, shape: tuple) -> torch.Tensor:
        """An integer buffer kept in host RAM as stored (PLE hashing runs on the host)."""
        return self._checked(name, shape).cpu()

    def _fp8_rows(self, name: str, out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = self._checked(name, (out_f, in_f))
        if q.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"{name!r} is listed as FP8 row-scaled but stored as {q.dtype}")
        return q.view(torch.float8_e4m3fn), self._checked(f"{name}_scale", (out_f,)).float()

    def linear(self, name: str, out_f: int, in_f: int, bias: bool = False) -> Linear:
        b = self._bias([(name, out_f)]) if bias else None
        if name in self.fp8:
            q, scale = self._fp8_rows(name, out_f, in_f)
            return Linear(q.to(self.device), scale.to(self.device), b, self.kernels)
        return Linear(self.get(name, (out_f, in_f)), bias=b)

    def _bias(self, specs: list[tuple[str, int]], biased=()) -> torch.Tensor:
        """The biases [sum of out_f] of `specs` named in `biased` (all when empty), zeros for the others."""
        parts = [
            self.get(n.removesuffix(".weight") + ".bias", (o,))
            if not biased or n in biased
            else torch.zeros(o, dtype=self.dtype, device=self.device)
            for n, o in specs
        ]
        return torch.cat(parts)

    def fused(self, specs: list[tuple[str, int]], in_f: int, factor: float = 1.0, biased=()) -> FusedLinear:
        """Linears on one input, `specs` [(name, out_features)], rows concatenated before the device copy;
        the names in `biased` add their `.bias` (`attention_bias`).

        `factor` multiplies every output, folded into the weights or row scales (exact for powers of two).
        """
        runs = []
        for fp8, group in itertools.groupby(specs, key=lambda spec: spec[0] in self.fp8):
            group = list(group)
            b = self._bias(group, biased) if any(n in biased for n, _ in group) else None
            b = b.mul_(factor) if b is not None else None
            if fp8:
                q, scale = zip(*(self._fp8_rows(n, o, in_f) for n, o in group))
                q, scale = torch.cat(q).to(self.device), torch.cat(scale).mul_(factor).to(self.device)
                lin = Linear(q, scale, b, self.kernels)
            else:
                ws = [self._checked(n, (o, in_f)) for n, o in group]
                w = torch.cat([w.to(ws[0].device, self.dtype) for w in ws]).mul_(factor)
                lin = Linear(w.to(self.device), bias=b)
            runs.append((lin, [o for _, o in group]))
        return FusedLinear(runs)
