"""The router's tail in one launch: softmax over the experts, top-k, renormalisation and the rounding through
the activation dtype (the torch form is seven small kernels per layer and token, ~20 us on an H200); and the
plain top-k ids of logits that speculation's next-layer guess uses.

Shapes: T tokens, E experts, K picked. logits [T, E] in the activation dtype; ids int64 [T, K] best first,
weights FP32 [T, K]. Ties pick the lower expert id.
"""

from __future__ import annotations

import torch

from expertstream.kernels.codec import jit, next_pow2, require_triton, tl


def route_topk_ref(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of `route_topk` (transformers' router maths)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    if renormalise:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    # rounded through the activation dtype as transformers does, passed on as FP32
    return top_i, top_w.to(logits.dtype).float()


def route_topk(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, K], weights FP32 [T, K]) of logits [T, E]: softmax in FP32, the K largest, divided by
    their sum when `renormalise`, rounded through logits.dtype."""
    return _launch(logits, k, renormalise, softmax=True)


def top_ids_ref(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-torch twin of `top_ids`."""
    return torch.topk(logits, k, dim=-1).indices


def top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [T, K]: the K largest logits of [T, E] (the top-k of the softmax too: it is monotone)."""
    return _launch(logits, k, False, softmax=False)[0]


def _launch(logits: torch.Tensor, k: int, renormalise: bool, softmax: bool):
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits {tuple(logits.shape)} {logits.stride()}"
    t, e = logits.shape
    assert 0 < k <= e and e <= 8192, f"k {k} of {e} experts"
    require_triton(logits)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    _route_kernel[(t,)](
        logits, ids, w, logits.stride(0), e, K=k, KP=next_pow2(k), BLOCK=next_pow2(e),
        SOFTMAX=softmax, RENORM=renormalise, num_warps=4,
    )  # fmt: skip
    return ids, w


@jit
def _route_kernel(
    x_ptr, ids_ptr, w_ptr, stride, E, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
    SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        e = tl.exp(x - tl.max(x, 0))
        x = e / tl.sum(e, 0)
    slot = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    vals = tl.zeros([KP], dtype=tl.float32)
    for j in tl.static_range(K):  # K rounds of max: the picks come out best first
        best = tl.max(x, 0)
        # the lowest id of the tie; a NaN row matches nothing, and gets the last id, not one past the experts
        i = tl.minimum(tl.min(tl.where(x == best, offs, BLOCK), 0), E - 1)
        ids = tl.where(slot == j, i, ids)
        vals = tl.where(slot == j, best, vals)
        x = tl.where(offs == i, float("-inf"), x)
    if RENORM:
        vals = vals / tl.sum(vals, 0)
    out = row * K + slot
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < K)
    tl.store(w_ptr + out, vals.to(x_ptr.dtype.element_ty).to(tl.float32), mask=slot < K)
