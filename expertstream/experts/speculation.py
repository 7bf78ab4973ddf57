"""Next-layer expert guesses: layer L+1's router applied to layer L's MoE input, and their bookkeeping.

The residual stream changes little from one layer to the next, so W_router[L+1] x_L picks most of the
experts layer L+1 will really route to. The banks use the guess to start disk reads early; it
never changes a result, only where blocks are when the next layer asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertstream.models.base import top_ids


@dataclass(slots=True)
class SpecStats:
    issued: int = 0  # next-layer experts guessed
    used: int = 0  # guesses the next layer really routed to
    prefetches: int = 0  # guessed blocks queued for a low-priority disk read

    @property
    def hit_rate(self) -> float:
        return self.used / self.issued if self.issued else 0.0


class Speculator:
    """Holds the routers and the guess in flight; a bank calls guess() before its host sync, then issue()
    with what it started, and score() when the next layer's real experts are known. `kernel`: the top-k
    through its Triton kernel on CUDA tensors."""

    def __init__(self, block_bytes: int, width: float = 1.0, kernel: bool = False):
        self.block_bytes, self.kernel = block_bytes, kernel
        self.width = width  # guesses per layer as a multiple of K (wider: more found, more wasted reads)
        self.routers: dict[int, torch.Tensor] = {}
        self.stats = SpecStats()
        self._pending: tuple[int, set[int]] | None = None  # (layer, guessed)

    def set_router_weights(self, routers: dict[int, torch.Tensor]) -> None:
        # W [E, H] per layer, on the compute device in the activation dtype (shared with the model)
        self.routers = dict(routers)

    def guess(self, layer: int, x: torch.Tensor, k: int) -> torch.Tensor | None:
        """int64 [round(width * k)] device tensor: layer+1's top experts for x [1, H], best first, or None
        without its router."""
        w = self.routers.get(layer + 1)
        if w is None:
            return None
        n = min(w.shape[0], round(self.width * k))
        # top-k of the logits is top-k of the softmax (monotone): no softmax, no renormalisation needed
        return top_ids(torch.nn.functional.linear(x, w), n, kernel=self.kernel)[0]

    def issue(self, layer: int, guessed: list[int], prefetched: int) -> None:
        self.stats.issued += len(guessed)
        self.stats.prefetches += prefetched
        self._pending = (layer, set(guessed))

    def score(self, layer: int, experts: list[int]) -> None:
        """Count the guess made for `layer` against the experts it really routed to."""
        if self._pending is None:
            return
        glayer, guessed = self._pending
        self._pending = None
        used = set(experts) if glayer == layer else set()
        self.stats.used += len(guessed & used)
