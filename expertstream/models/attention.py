"""Attention helpers of the QSA layers: the decode KV window and the block indexer's key mask."""

from __future__ import annotations

import math

import torch


def kv_bucket(s: int, max_len: int) -> int:
    """KV rows a one-token step attends over when s tokens are in context: the next power of two >= s (at
    least 256), capped at max_len. Few distinct values, so CUDA graphs are captured per bucket."""
    return min(max_len, max(256, 1 << (s - 1).bit_length()))


def index_mask(qi: torch.Tensor, qpos: torch.Tensor, bk: torch.Tensor, s: int, c: int, block_topk: int):
    """QSA key mask [Q, S] for indexer queries qi [Q, Hi, Di] at positions qpos [Q], block keys bk [S//c, Di].

    A query at p sees V = p + 1 tokens: its V // c complete blocks compete (top block_topk by the summed ReLU
    score), the V mod c tail tokens are always kept. Scores and masks are computed for all queries at once.
    """
    keys = torch.arange(s, device=qi.device)
    causal = keys[None, :] <= qpos[:, None]
    nvis = (qpos + 1) // c  # [Q] complete visible blocks
    nb = bk.shape[0]
    if nb == 0 or int(nvis.max()) <= block_topk:
        return causal  # every complete block fits the budget: plain causal attention
    scores = torch.relu(torch.einsum("qhd,bd->qhb", qi.float(), bk.float())).sum(1) / math.sqrt(qi.shape[-1])
    visible = torch.arange(nb, device=qi.device)[None, :] < nvis[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    # everything at or above the k-th best visible score; rows with nvis <= k get kth = -inf: all visible
    kth = scores.topk(min(block_topk, nb), dim=-1).values[:, -1:]
    chosen = (scores > kth) | ((scores == kth) & visible)  # [Q, nb]
    # a tie at the k-th score (ReLU makes zeros common) is broken as transformers does: topk over exactly the
    # visible row, batched per visible-block count (only such rows, usually none)
    tied = chosen.sum(-1) > block_topk
    for n in torch.unique(nvis[tied]).tolist():
        rows = tied & (nvis == n)
        top = scores[rows, :n].topk(block_topk, dim=-1).indices
        chosen[rows] = torch.zeros_like(chosen[rows]).scatter_(1, top, True)
    blk = keys // c
    in_blocks = blk[None, :] < nvis[:, None]
    chosen_tok = chosen.gather(1, blk.clamp_max(nb - 1)[None, :].expand(qi.shape[0], -1))
    return causal & (~in_blocks | chosen_tok)
