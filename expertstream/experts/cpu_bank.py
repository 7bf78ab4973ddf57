"""The expert bank: `bank(layer, x [T, H], expert_ids [T, K] int64, weights [T, K] fp32) -> [T, H]`, in
x.dtype or FP32: a bank that sums in FP32 may return its sums as they are and callers cast (a layer-major
span then holds no second copy of them).

Only the routed sum lives here (the router and shared expert stay in the model). Each expert is SwiGLU:
down(silu(gate x) * up x), scaled by its routing weight. `DenseExperts` holds dense weights (tests,
reference); `StreamedExperts` fetches the layer's distinct experts from the `ExpertStore` once per call
and decodes them; in decode it also queues the next layer's guessed experts to the store's low-priority
disk reader (expertstream/experts/speculation.py).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from expertstream.experts.speculation import Speculator
from expertstream.formats.expert_block import PROJ
from expertstream.log import get_logger

log = get_logger(__name__)

CONTROLS = ("none", "swap-nibbles", "no-experts")


def routed_sum(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[int],
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Sum over each token's routed experts; `expert_weights(e)` -> (gate [I, H], up [I, H], down [H, I]).
    `swiglu_limit` clamps gate x above and up x on both sides first (DeepSeek-V4)."""
    out = torch.zeros_like(x)
    for e in experts:
        tok, slot = torch.where(expert_ids == e)
        gate, up, down = expert_weights(e)
        xe = x[tok]
        g, u = F.linear(xe, gate), F.linear(xe, up)  # [n, I]
        if swiglu_limit is not None:
            g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
        h = F.silu(g) * u
        y = F.linear(h, down) * weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


class DenseExperts:
    """In-memory bank in transformers' layout: per layer gate_up [E, 2I, H] (gate first), down [E, H, I]."""

    def __init__(
        self, gate_up: list[torch.Tensor], down: list[torch.Tensor], swiglu_limit: float | None = None
    ):
        self.gate_up, self.down, self.swiglu_limit = gate_up, down, swiglu_limit

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        gu, dn = self.gate_up[layer], self.down[layer]
        i = dn.shape[2]

        def expert_weights(e: int):
            w = gu[e].to(x.dtype)
            return w[:i], w[i:], dn[e].to(x.dtype)

        experts = torch.unique(expert_ids).tolist()
        return routed_sum(x, expert_ids, weights, experts, expert_weights, self.swiglu_limit)


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Exchange the two E2M1 codes of every byte (the must-break control)."""
    return (packed >> 4) | (packed << 4)


class StreamedExperts:
    """Bank backed by the expert store: each layer's distinct experts are fetched once per call.

    Args:
        workdir: the `Workdir` (layout, `expert_scales()`).
        store: the `ExpertStore` (`request(keys)` -> handles with `wait()` / `release()`).
        dtype: dtype of the decoded weights (the activation dtype).
        control: "none"; "swap-nibbles" decodes every packed weight byte with its nibbles exchanged;
            "no-experts" returns a zero routed sum. Both controls must visibly break the model.
        speculate: in decode, queue disk reads of the next layer's guessed experts (needs the routers from
            `set_router_weights` and a store with `prefetch`).
    """

    def __init__(
        self,
        workdir,
        store,
        dtype: torch.dtype,
        control: str = "none",
        speculate: bool = True,
        speculation_width: float = 1.0,
    ):
        if control not in CONTROLS:
            raise ValueError(f"expert control {control!r} is not one of {CONTROLS}")
        self.layout, self.store, self.dtype, self.control = workdir.layout, store, dtype, control
        self.weight_scale_2 = workdir.expert_scales()[0]  # [L, E, 3] FP32
        # prompt misses bypass the RAM cache so a long prompt cannot evict the decode working set
        self._bypass = "cache" in inspect.signature(store.request).parameters
        self._weight_parts = [self.layout.part(f"{p}.weight") for p in PROJ]
        self.stall_seconds = 0.0  # time spent waiting for blocks that had not landed yet
        spec = speculate and hasattr(store, "prefetch")
        self.spec = Speculator(self.layout.block_bytes, speculation_width) if spec else None
        self.host_syncs = 0  # `.tolist()` reads of the routing (device syncs when it runs on a GPU)

    def set_router_weights(self, routers: dict[int, torch.Tensor]) -> None:
        """Routers {layer: W [E, H]} on the compute device in the activation dtype, for speculation."""
        if self.spec is not None:
            self.spec.set_router_weights(routers)

    def _wait(self, handle) -> torch.Tensor:
        t0 = time.perf_counter()
        block = handle.wait()
        self.stall_seconds += time.perf_counter() - t0
        return block

    def _decode(self, layer: int, e: int, block: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
        if self.control == "swap-nibbles":
            block = block.clone()
            for p in self._weight_parts:
                block[p.offset : p.offset + p.nbytes] = swap_nibbles(block[p.offset : p.offset + p.nbytes])
        block = block.to(device, non_blocking=True)
        return self.layout.dequantize(block, self.weight_scale_2[layer, e].to(device), self.dtype)

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.control == "no-experts":
            return torch.zeros_like(x)
        guess = None
        if self.spec is not None and x.shape[0] == 1:
            guess = self.spec.guess(layer, x, expert_ids.shape[1])
        uniq = torch.unique(expert_ids)
        ids = (uniq if guess is None else torch.cat((uniq, guess))).tolist()  # one sync for both
        self.host_syncs += 1
        experts, guessed = ids[: uniq.numel()], ids[uniq.numel() :]
        keys = [(layer, e) for e in experts]
        if self.spec is not None:
            self.spec.score(layer, experts)
        if self._bypass:
            handles = self.store.request(keys, cache=x.shape[0] == 1)
        else:
            handles = self.store.request(keys)
        by_expert = dict(zip(experts, handles))
        if guess is not None:  # after the demand request: its reads are queued ahead of the guesses
            self.spec.issue(layer + 1, guessed, self.store.prefetch([(layer + 1, e) for e in guessed]))
        try:
            return routed_sum(
                x,
                expert_ids,
                weights,
                experts,
                lambda e: self._decode(layer, e, self._wait(by_expert[e]), x.device),
            )
        finally:
            for h in handles:
                h.release()
