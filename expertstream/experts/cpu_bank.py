"""The expert banks on the CPU (the contract: experts/bank.py).

Only the routed sum lives here (the router and shared expert stay in the model). Each expert is SwiGLU:
down(silu(gate x) * up x), scaled by its routing weight. `DenseExperts` holds dense weights (tests,
reference); `StreamedExperts` fetches the layer's distinct experts from the `ExpertStore` once per call
and, for a few tokens on the CPU, runs the C kernel on the blocks in place (kernels/cpu_moe.py), else
decodes them; in decode it also queues the next layer's guessed experts to the store's low-priority
disk reader (expertstream/experts/speculation.py).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from expertstream.experts.bank import ExpertBank
from expertstream.experts.speculation import Speculator
from expertstream.kernels import cpu_moe
from expertstream.kernels.nvfp4_moe import swiglu_ref
from expertstream.log import get_logger

log = get_logger(__name__)


def routed_sum(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[int],
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    segments: list[tuple[int, int]] | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Sum over each token's routed experts; `expert_weights(e)` -> (gate [I, H], up [I, H], down [H, I]).
    `swiglu_limit` clamps gate x above and up x on both sides first (DeepSeek-V4).

    With `segments` (row ranges [a, b) of several sequences) each expert's weights are got once and its
    products run per segment, on the rows one call over that segment alone would give them, so a row's
    sum does not depend on the rows of the other segments."""
    out = torch.zeros_like(x)
    bounds = None if segments is None else torch.tensor([a for a, _ in segments[1:]], dtype=torch.long)
    for e in experts:
        tok, slot = torch.where(expert_ids == e)
        gate, up, down = expert_weights(e)
        parts = [(tok, slot)]
        if bounds is not None:  # tok is ascending: cut it at the segments' first rows
            cuts = torch.searchsorted(tok.cpu(), bounds).tolist()
            parts = [(tok[i:j], slot[i:j]) for i, j in zip([0, *cuts], [*cuts, tok.numel()]) if j > i]
        for tok_s, slot_s in parts:
            xe = x[tok_s]
            h = swiglu_ref(F.linear(xe, gate), F.linear(xe, up), swiglu_limit)  # [n, I]
            y = F.linear(h, down) * weights[tok_s, slot_s, None].to(x.dtype)
            out.index_add_(0, tok_s, y)
    return out


class DenseExperts(ExpertBank):
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
        return routed_sum(x, expert_ids, weights, experts, expert_weights, swiglu_limit=self.swiglu_limit)


class StreamedExperts(ExpertBank):
    """Bank backed by the expert store: each layer's distinct experts are fetched once per call.

    Args:
        workdir: the `Workdir` (layout, `expert_scales()`).
        store: the `ExpertStore` (`request(keys)` -> handles with `wait()` / `release()`).
        dtype: dtype of the decoded weights (the activation dtype).
        speculate: in decode, queue disk reads of the next layer's guessed experts (needs the routers from
            `set_router_weights` and a store with `prefetch`).
        threads: callable -> the threads the CPU kernel may use now (`CpuThreads`); None: one.
        kernels: the guesses' top-k through its Triton kernel where it can run.
        swiglu_limit: clamp gate x above and up x on both sides first (DeepSeek-V4), None: no clamp.
    """

    def __init__(
        self,
        workdir,
        store,
        dtype: torch.dtype,
        speculate: bool = True,
        speculation_width: float = 1.0,
        threads: Callable[[], int] | None = None,
        kernels: bool = False,
        swiglu_limit: float | None = None,
    ):
        self.layout, self.store, self.dtype = workdir.layout, store, dtype
        self.weight_scale_2 = workdir.expert_scales()[0]  # [L, E, 3] FP32
        # prompt misses bypass the RAM cache so a long prompt cannot evict the decode working set
        self._bypass = "cache" in inspect.signature(store.request).parameters
        self.stall_seconds = 0.0  # time spent waiting for blocks that had not landed yet
        spec = speculate and hasattr(store, "prefetch")
        self.spec = Speculator(self.layout.block_bytes, speculation_width, kernels) if spec else None
        self.host_syncs = 0  # `.tolist()` reads of the routing (device syncs when it runs on a GPU)
        self.threads = threads or (lambda: 1)
        self.swiglu_limit = swiglu_limit
        self.kernel = cpu_moe.library() is not None  # the C kernel where it builds (NVFP4 and MXFP4)

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
        block = block.to(device, non_blocking=True)
        return self.layout.dequantize(block, self.weight_scale_2[layer, e].to(device), self.dtype)

    segmented = True  # takes `segments`: one fetch per block for several sequences' rows

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        segments: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        # one token per sequence is a decode step (batched): its blocks go through the RAM cache
        decode = x.shape[0] == 1 or segments is not None and all(b - a == 1 for a, b in segments)
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
            handles = self.store.request(keys, cache=decode)
        else:
            handles = self.store.request(keys)
        by_expert = dict(zip(experts, handles))
        if guess is not None:  # after the demand request: its reads are queued ahead of the guesses
            self.spec.issue(layer + 1, guessed, self.store.prefetch([(layer + 1, e) for e in guessed]))
        try:
            segs = segments or [(0, x.shape[0])]
            # a sequence of at most TMAX rows goes through the C kernel, as it would alone (its per-token
            # sums do not depend on the other rows of a call); longer ones through the torch sum
            small = (
                [(a, b) for a, b in segs if b - a <= cpu_moe.TMAX]
                if self.kernel and x.device.type == "cpu"
                else []
            )
            large = [seg for seg in segs if seg not in small]
            out = None
            if large:
                rows = torch.cat([torch.arange(a, b) for a, b in large]) if segments else None
                xs = x if rows is None else x[rows]
                cut = [0]
                for a, b in large:
                    cut.append(cut[-1] + b - a)
                part = routed_sum(
                    xs,
                    expert_ids if rows is None else expert_ids[rows],
                    weights if rows is None else weights[rows],
                    experts,
                    lambda e: self._decode(layer, e, self._wait(by_expert[e]), x.device),
                    None if rows is None else list(zip(cut[:-1], cut[1:])),
                    self.swiglu_limit,
                )
                if rows is None:
                    return part
                out = torch.zeros_like(x)
                out[rows] = part
            for group in _groups(small, cpu_moe.TMAX):
                rows = torch.cat([torch.arange(a, b) for a, b in group])
                part = self._kernel_sum(layer, x[rows], expert_ids[rows], weights[rows], by_expert)
                if out is None and rows.numel() == x.shape[0]:
                    return part
                out = torch.zeros_like(x) if out is None else out
                out[rows] = part
            return out
        finally:
            for h in handles:
                h.release()

    def _kernel_sum(self, layer, x, expert_ids, weights, by_expert) -> torch.Tensor:
        t = x.shape[0]
        uniq = torch.unique(expert_ids)
        experts = uniq.tolist()
        blocks = [self._wait(by_expert[e]) for e in experts]
        wt = torch.zeros(len(experts), t)  # [n, T] routing weight of expert row j for token t
        wt[torch.searchsorted(uniq, expert_ids), torch.arange(t)[:, None]] = weights.float()
        ws2 = self.weight_scale_2[layer, experts]  # [n, 3]
        threads = cpu_moe.useful_threads(self.layout, len(blocks), self.threads())
        return cpu_moe.moe(blocks, ws2, wt, x, self.layout, threads, self.swiglu_limit).to(x.dtype)


def _groups(segments: list[tuple[int, int]], rows: int) -> list[list[tuple[int, int]]]:
    """Whole segments packed in order into groups of at most `rows` rows (each segment has at most `rows`)."""
    groups, n = [], rows
    for a, b in segments:
        if n + b - a > rows:
            groups.append([])
            n = 0
        groups[-1].append((a, b))
        n += b - a
    return groups
