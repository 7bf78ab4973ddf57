"""Several sequences' rows in one call of the CUDA expert bank (`GpuExperts`, `segments`): their prompts share
one sweep of the layer's experts, their one-token rows the fetch of their experts' union, and every row's sum
is the one its sequence alone gets."""

from __future__ import annotations

import time

import torch


def run_segments(bank, layer: int, x, expert_ids, weights, segments: list[tuple[int, int]]) -> torch.Tensor:
    """x [T, H], expert_ids [T, K], weights [T, K] of the sequences' row ranges [a, b): the prompts' rows go
    through one prompt sweep (`GpuExperts.prompts`: each block fetched once for all of them, each prompt's
    sums those of its own call), one-token rows through `decode_rows`. FP32 when a prompt is among them (a
    prompt call's sums), else x's dtype (one-token sums)."""
    ones = [a for a, b in segments if b - a == 1]
    prompts = [(a, b) for a, b in segments if b - a > 1]
    out = torch.empty(x.shape, dtype=torch.float32 if prompts else x.dtype, device=x.device)
    if prompts:
        bank.prompts(layer, x, expert_ids, weights, prompts, out)
    if ones:
        # exact either way: a one-token sum in x's dtype, widened when the prompts' FP32 sums share `out`
        out[ones] = decode_rows(bank, layer, x[ones], expert_ids[ones], weights[ones]).to(out.dtype)
    return out


def decode_rows(bank, layer: int, x, expert_ids, weights) -> torch.Tensor:
    """One-token rows x [S, H] of S sequences: their experts' union fetched once (`decode_prepare` of all
    their ids, in groups whose union fits half the slots, since the previous group's stay protected), then
    each row's sum by the one-token kernel (`decode_compute`), as alone; no next-layer guesses (they follow
    one token's input). -> [S, H]."""
    bank._cache_reads = True  # decode misses are cached in RAM
    half = max(bank.k, bank.cache.n_slots // 2)
    groups: list[tuple[list[int], set[int]]] = []
    for i, row in enumerate(expert_ids.tolist()):  # one read-back for the grouping, besides the prepares'
        if groups and len(groups[-1][1] | set(row)) <= half:
            groups[-1][0].append(i)
            groups[-1][1].update(row)
        else:
            groups.append(([i], set(row)))
    bank.host_syncs += 1
    out = torch.empty_like(x)
    for rows, _ in groups:
        want = expert_ids[rows].reshape(-1)
        bank.decode_prepare(layer, want, want.numel())
        t0 = time.perf_counter()
        for i in rows:
            out[i : i + 1] = bank.decode_compute(
                layer, x[i : i + 1], expert_ids[i : i + 1], weights[i : i + 1]
            )
        bank.decode_seconds += time.perf_counter() - t0
        bank.decode_launched()
    return out
