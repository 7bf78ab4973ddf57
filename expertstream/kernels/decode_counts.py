"""A decode layer's routing counts, kept on the device in one launch (graphable, no host read).

A bank whose blocks all sit in the RAM cache counts, for each decode layer: each routed expert (the hot
set follows these counts), the routed blocks it read from the hot set in VRAM, and the routed blocks it
found among the guesses staged for the layer. As torch ops these were ~10 launches a layer, each a few
microseconds in a CUDA graph, in the decode's critical path; here they are one.

Shapes: K routed experts, E experts, G staged guesses. loc: [E] int32 the layer's location row before
staging (a slot >= 0: the block is in VRAM, the hot set; < 0: a RAM row).
"""

from __future__ import annotations

import torch

from expertstream.kernels.codec import jit, next_pow2, require_triton, tl


def decode_counts_ref(ids, loc, counts=None, hot=None, staged=None, stage_hits=None) -> None:
    """Plain-torch twin of `decode_counts` (same arguments)."""
    in_vram = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
    if counts is not None:
        in_vram = loc.index_select(0, ids) >= 0
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
        hot += in_vram.sum()
    if staged is not None:
        found = (ids[:, None] == staged[None, :]).any(1)
        stage_hits += (found & ~in_vram).sum()


def decode_counts(
    ids: torch.Tensor,
    loc: torch.Tensor,
    counts: torch.Tensor | None = None,
    hot: torch.Tensor | None = None,
    staged: torch.Tensor | None = None,
    stage_hits: torch.Tensor | None = None,
) -> None:
    """Adds a decode layer's routing to counts on the device, in place.

    Args:
        ids: [K] int32 / int64 routed experts.
        loc: [E] int32 the layer's location row (before staging points it at staging rows).
        counts: [E] int64 per-expert routing counts (+1 per routed expert), with `hot`; or None.
        hot: a one-element int64 count of the routed blocks in VRAM (loc >= 0); given with `counts`.
        staged: [G] int32 / int64 the guesses staged for this layer, with `stage_hits`; or None.
        stage_hits: a one-element int64 count of the routed blocks found among `staged` that were not in
            VRAM already (those stay where they are).
    """
    require_triton(ids, loc)
    assert ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64), f"ids {ids.dtype} {tuple(ids.shape)}"
    assert loc.dim() == 1 and loc.dtype == torch.int32, f"loc {loc.dtype} {tuple(loc.shape)}"
    assert (counts is None) == (hot is None) and (staged is None) == (stage_hits is None)
    if counts is not None:
        assert counts.shape == loc.shape and counts.dtype == torch.int64, f"counts {counts.dtype}"
        assert hot.dtype == torch.int64 and hot.numel() == 1, f"hot {hot.dtype} {tuple(hot.shape)}"
    if staged is not None:
        assert staged.dim() == 1 and staged.dtype in (torch.int32, torch.int64), f"staged {staged.dtype}"
        assert stage_hits.dtype == torch.int64 and stage_hits.numel() == 1, f"stage_hits {stage_hits.dtype}"
    if counts is None and staged is None:
        return
    k, g = ids.numel(), 0 if staged is None else staged.numel()
    _counts_kernel[(1,)](
        ids, loc, ids if counts is None else counts, ids if hot is None else hot,
        ids if staged is None else staged, ids if stage_hits is None else stage_hits, k, g,
        BK=next_pow2(k), BG=next_pow2(g), HOT=counts is not None, STAGED=staged is not None,
    )  # fmt: skip


@jit
def _counts_kernel(
    ids_ptr, loc_ptr, counts_ptr, hot_ptr, staged_ptr, hits_ptr, K, G, BK: tl.constexpr, BG: tl.constexpr,
    HOT: tl.constexpr, STAGED: tl.constexpr,
):  # fmt: skip
    # one program: the K routed ids in a [BK] vector
    i = tl.arange(0, BK)
    m = i < K
    e = tl.load(ids_ptr + i, mask=m, other=0).to(tl.int64)
    in_vram = m & False
    if HOT:
        in_vram = m & (tl.load(loc_ptr + e, mask=m, other=-1) >= 0)
        tl.atomic_add(counts_ptr + e, tl.full([BK], 1, tl.int64), mask=m)  # atomics: duplicates count twice
        tl.store(hot_ptr, tl.load(hot_ptr) + tl.sum(in_vram.to(tl.int64)))
    if STAGED:
        j = tl.arange(0, BG)
        s = tl.load(staged_ptr + j, mask=j < G, other=-1).to(tl.int64)
        found = tl.max((e[:, None] == s[None, :]).to(tl.int32), axis=1) > 0
        tl.store(hits_ptr, tl.load(hits_ptr) + tl.sum((found & m & ~in_vram).to(tl.int64)))
