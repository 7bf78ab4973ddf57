"""Routed-expert SwiGLU straight from repacked NVFP4 blocks (W4A16, FP32 accumulation).

Shapes: T tokens, H hidden, I expert width, K experts per token, S slots, B = layout.block_bytes.
Each slot row is one `ExpertLayout` block; its FP32 weight_scale_2 (gate, up, down) come beside it.
y[t] = sum_k w[t, k] * down_k(silu(gate_k x[t]) * up_k x[t]).
- decode (one token): two launches per layer, gate+up over (expert, row block), then down over (row block,
  split of the K experts): each program writes its experts' partial rows, and the last program of a row
  block to finish (an atomic count) sums the partials in expert order, so the result is deterministic.
  Each expert's block is found through a location table: a VRAM slot, or a row of pinned host RAM that
  the kernel reads over the bus without a copy.
- prefill (many tokens): (token, k) pairs sorted by expert and padded to BLOCK_M tiles (once per chunk of
  tokens, shared by a bank's passes); each tile finds its expert's slot, dequantises weight tiles to the
  activation dtype in registers and runs tl.dot; per-pair outputs [T*K, H] are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels.codec import (
    cdiv,
    dot_precision,
    e2m1_pair,
    e4m3_f16,
    jit,
    launch_e2m1,
    nvfp4_unit,
    require_triton,
    tl,
    tuned_config,
)


def _offsets(layout: ExpertLayout) -> dict[str, int]:
    names = {"gw": "gate_proj.weight", "uw": "up_proj.weight", "dw": "down_proj.weight"}
    names |= {"gs": "gate_proj.weight_scale", "us": "up_proj.weight_scale", "ds": "down_proj.weight_scale"}
    return {f"{k}_off": layout.part(v).offset for k, v in names.items()}


def _check_common(x, slots, layout: ExpertLayout) -> None:
    require_triton(x, slots)
    assert x.shape[-1] == layout.hidden_size and x.is_contiguous(), f"x {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert slots.dtype == torch.uint8 and slots.dim() == 2, f"slots {slots.dtype} {tuple(slots.shape)}"
    assert slots.shape[1] == layout.block_bytes and slots.is_contiguous(), f"slots {tuple(slots.shape)}"


# ---------------------------------------------------------------- decode


# the launch shape measured on the H200 (docs/kernels.md) until a sweep records a better one as data
DECODE_DEFAULT = dict(block_n_gu=4, block_g_gu=32, block_n_down=16, block_g_down=8, num_warps=2)


_PINNED: set[int] = set()  # host block memory already checked (the check queries the driver)


def _pinned(host: torch.Tensor) -> bool:
    if host.data_ptr() not in _PINNED and host.is_pinned():
        _PINNED.add(host.data_ptr())
    return host.data_ptr() in _PINNED


def _block_of(slots, host, loc: int) -> torch.Tensor:
    return slots[loc] if loc >= 0 else host[-1 - loc]


def nvfp4_moe_decode_ref(x, expert_ids, loc, scales, weights, layout: ExpertLayout, slots, host=None):
    """Plain-torch twin of `nvfp4_moe_decode` (FP32 maths, output in x.dtype)."""
    xf = x.reshape(-1).float()  # [H]
    out = torch.zeros_like(xf)
    for k, e in enumerate(expert_ids.tolist()):
        block = _block_of(slots, host, int(loc[e])).to(xf.device)
        gate, up, down = layout.dequantize(block, scales[e])  # [I, H], [I, H], [H, I] fp32
        out += weights[k].float() * (down @ (F.silu(gate @ xf) * (up @ xf)))
    return out.to(x.dtype).reshape(x.shape)


def nvfp4_moe_decode(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    loc: torch.Tensor,
    scales: torch.Tensor,
    weights: torch.Tensor,
    layout: ExpertLayout,
    slots: torch.Tensor,
    host: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Routed expert sum for one token, read straight from the blocks wherever they are: VRAM slots, or
    pinned host RAM read over the bus (no copy; the H200 probe read it at 93 % of the copy engine's rate).

    Args:
        x: [H] or [1, H] activations (fp32 / fp16 / bf16).
        expert_ids: [K] int32 / int64 routed experts (duplicates allowed).
        loc: [E] int32 block of each expert: row c >= 0 of `slots`, or row -1 - c of `host` (only the
            routed experts' entries are read).
        scales: [E, 3] float32 weight_scale_2 (gate, up, down) of each expert.
        weights: [K] float32 router weights.
        layout: the block layout.
        slots: [S, block_bytes] uint8 blocks in device memory.
        host: [C, block_bytes] uint8 blocks in pinned host memory (the RAM cache), or None.
        config: block_n and block_g (rows per program and 16-element groups per step) of the gate+up and
            the down launch, split_down (down programs per row block over the K experts, default K),
            num_warps; default: tuned_configs.json for this device and shape, else
            DECODE_DEFAULT.

    Returns:
        Tensor shaped like x, in x.dtype.
    """
    host = slots if host is None else host  # never read when no loc is negative
    _check_common(x, slots, layout)
    assert host.dtype == torch.uint8 and host.dim() == 2 and host.shape[1] == layout.block_bytes
    assert host.is_contiguous() and (host.device == x.device or _pinned(host)), (
        f"host blocks on {host.device} must be pinned to be read by the kernel"
    )
    assert x.numel() == layout.hidden_size, f"decode takes one token, got x {tuple(x.shape)}"
    assert expert_ids.dtype in (torch.int32, torch.int64) and expert_ids.dim() == 1, (
        f"expert_ids {expert_ids.dtype} {expert_ids.shape}"
    )
    assert loc.dtype == torch.int32 and loc.dim() == 1, f"loc {loc.dtype} {loc.shape}"
    assert scales.dtype == torch.float32 and scales.shape == (loc.numel(), 3) and scales.is_contiguous()
    k, h_size, i_size = expert_ids.numel(), layout.hidden_size, layout.intermediate_size
    assert weights.dtype == torch.float32 and weights.shape == (k,), (
        f"weights {weights.dtype} {weights.shape}"
    )
    require_triton(x, expert_ids, loc, scales, weights)
    # blocks read over the bus want more bytes in flight than blocks in HBM: tuned apart ("-host")
    key = f"{h_size}x{i_size}" + ("-host" if host.device != x.device else "")
    cfg = config or tuned_config("nvfp4_decode", x.device, key) or DECODE_DEFAULT
    block_n, block_g = (cfg["block_n_gu"], cfg["block_n_down"]), (cfg["block_g_gu"], cfg["block_g_down"])
    off = _offsets(layout)
    h = torch.empty(k, i_size, dtype=torch.float32, device=x.device)  # silu(g) * u, [K, I]
    out = torch.empty_like(x)
    common = dict(H=h_size, I=i_size, block_bytes=layout.block_bytes, num_warps=cfg["num_warps"])
    launch_e2m1(
        _decode_gate_up_kernel, (k, cdiv(i_size, block_n[0])), x.device,
        x, expert_ids, loc, scales, slots, host, h, gw_off=off["gw_off"], uw_off=off["uw_off"],
        gs_off=off["gs_off"], us_off=off["us_off"], BLOCK_N=block_n[0], BLOCK_G=block_g[0], **common,
    )  # fmt: skip
    n_blocks = cdiv(h_size, block_n[1])
    per = cdiv(k, cfg.get("split_down", k))  # experts per down program; the split is cdiv(k, per) programs
    part = torch.empty(cdiv(k, per), h_size, dtype=torch.float32, device=x.device)  # each split's rows
    done = torch.zeros(n_blocks, dtype=torch.int32, device=x.device)  # programs finished per row block
    launch_e2m1(
        _decode_down_kernel, (n_blocks, cdiv(k, per)), x.device,
        h, expert_ids, loc, scales, slots, host, weights, part, done, out, K=k, PER=per,
        dw_off=off["dw_off"], ds_off=off["ds_off"], BLOCK_N=block_n[1], BLOCK_G=block_g[1], **common,
    )  # fmt: skip
    return out


@jit
def _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes):
    # (block pointer, expert id) of the k-th routed expert: a VRAM slot row, or a pinned host RAM row
    e = tl.load(ids_ptr + k).to(tl.int64)
    c = tl.load(loc_ptr + e).to(tl.int64)
    blk = tl.where(c >= 0, slots_ptr + c * block_bytes, host_ptr + (-1 - c) * block_bytes)
    return blk, e


@jit
def _group_partial(
    blk, w_off, s_off, n, gg, j, row_bytes, row_groups, nmask, gmask, xe, xo, USE_PTX: tl.constexpr
):
    # rows n [BN] x groups gg [BG] of 16 elements: codes [BN, BG, 8] bytes, scales [BN, BG];
    # xe / xo [BG, 8] are the even / odd input columns. Returns [BN, BG] in units of 1 / nvfp4_unit.
    m2 = nmask[:, None] & gmask[None, :]
    b = tl.load(
        blk + w_off + n[:, None, None] * row_bytes + gg[None, :, None] * 8 + j[None, None, :],
        mask=m2[:, :, None], other=0,
    )  # fmt: skip
    lo, hi = e2m1_pair(b, USE_PTX)
    part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)
    s = e4m3_f16(tl.load(blk + s_off + n[:, None] * row_groups + gg[None, :], mask=m2, other=0))
    return part * s.to(tl.float32)


@jit
def _decode_gate_up_kernel(
    x_ptr, ids_ptr, loc_ptr, scales_ptr, slots_ptr, host_ptr, h_ptr, block_bytes, gw_off, uw_off, gs_off,
    us_off, H: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (k, n block): h[k, n] = silu(gate[n] . x) * (up[n] . x) for BLOCK_N rows of expert k;
    # H, I, K are constexpr so the loops unroll and every block load is in flight at once
    k = tl.program_id(0)
    blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    j = tl.arange(0, 8)
    acc_g = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for g0 in tl.static_range(0, H // 16, BLOCK_G):
        gg = g0 + tl.arange(0, BLOCK_G)
        gmask = gg < H // 16
        xi = gg[:, None] * 16 + 2 * j[None, :]  # [BG, 8] even input columns
        xe = tl.load(x_ptr + xi, mask=gmask[:, None], other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + xi + 1, mask=gmask[:, None], other=0.0).to(tl.float32)
        acc_g += _group_partial(blk, gw_off, gs_off, n, gg, j, H // 2, H // 16, nmask, gmask, xe, xo, USE_PTX)
        acc_u += _group_partial(blk, uw_off, us_off, n, gg, j, H // 2, H // 16, nmask, gmask, xe, xo, USE_PTX)
    unit = nvfp4_unit(USE_PTX)
    g = tl.sum(acc_g, axis=1) * (tl.load(scales_ptr + e * 3) * unit)
    u = tl.sum(acc_u, axis=1) * (tl.load(scales_ptr + e * 3 + 1) * unit)
    tl.store(h_ptr + k * I + n, g * tl.sigmoid(g) * u, mask=nmask)


@jit
def _decode_down_kernel(
    h_ptr, ids_ptr, loc_ptr, scales_ptr, slots_ptr, host_ptr, w_ptr, part_ptr, done_ptr, out_ptr, block_bytes,
    dw_off, ds_off, K: tl.constexpr, PER: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (n block, split s): part[s, n] = sum over experts k = s PER .. s PER + PER - 1, in order, of
    # w[k] * down_k[n] . h[k]; the splits of a row block run in parallel (more bytes in flight than one
    # program looping over all K)
    nb, s = tl.program_id(0), tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    j = tl.arange(0, 8)
    rows = tl.zeros([BLOCK_N], tl.float32)
    for kk in tl.static_range(PER):
        k = s * PER + kk
        if k < K:
            blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes)
            acc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
            for g0 in tl.static_range(0, I // 16, BLOCK_G):
                gg = g0 + tl.arange(0, BLOCK_G)
                gmask = gg < I // 16
                hoff = k * I + gg[:, None] * 16 + 2 * j[None, :]
                he = tl.load(h_ptr + hoff, mask=gmask[:, None], other=0.0)
                ho = tl.load(h_ptr + hoff + 1, mask=gmask[:, None], other=0.0)
                acc += _group_partial(
                    blk, dw_off, ds_off, n, gg, j, I // 2, I // 16, nmask, gmask, he, ho, USE_PTX
                )
            rows += tl.sum(acc, axis=1) * (tl.load(scales_ptr + e * 3 + 2) * tl.load(w_ptr + k))
    tl.store(part_ptr + s * H + n, rows, mask=nmask)
    # the last of the block's splits to finish sums the partials in order. One thread does the atomic: the
    # barrier orders every thread's partial stores before its release (the grid-sync idiom), and its
    # acquire, shared through the barrier that broadcasts its result, orders the loads below after the
    # other programs' stores
    tl.debug_barrier()
    splits = tl.num_programs(1)
    if tl.atomic_add(done_ptr + nb, 1, sem="acq_rel") == splits - 1:
        total = tl.zeros([BLOCK_N], tl.float32)
        for t in range(splits):
            total += tl.load(part_ptr + t * H + n, mask=nmask, other=0.0, cache_modifier=".cg")
        total = total * nvfp4_unit(USE_PTX)
        tl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=nmask)


# ---------------------------------------------------------------- prefill


def nvfp4_moe_prefill_ref(
    x, slots, expert_ids, expert_to_slot, ws2, weights, layout: ExpertLayout
) -> torch.Tensor:
    """Plain-torch twin of `nvfp4_moe_prefill` (FP32 maths, one dequantisation per routed expert)."""
    xf = x.float()
    out = torch.zeros_like(xf)  # [T, H]
    for e in torch.unique(expert_ids).tolist():
        s = int(expert_to_slot[e])
        if s < 0:
            raise ValueError(f"expert {e} is routed but has no slot (expert_to_slot[{e}] = {s})")
        tok, kk = (expert_ids == e).nonzero(as_tuple=True)  # duplicates give several (t, k) pairs
        gate, up, down = layout.dequantize(slots[s], ws2[s])
        xs = xf[tok]  # [n, H]
        y = (F.silu(xs @ gate.T) * (xs @ up.T)) @ down.T  # [n, H]
        out.index_add_(0, tok, y * weights[tok, kk, None].float())
    return out.to(x.dtype)


def prefill_bucket(num_pairs: int, num_experts: int) -> str:
    """Tuning key: mean pairs per touched expert, bucketed (decides how full BLOCK_M tiles are)."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return "ps16" if per_expert <= 16 else "ps64" if per_expert <= 64 else "psbig"


def _prefill_config(num_pairs: int, num_experts: int, layout: ExpertLayout, device: torch.device) -> dict:
    bucket = prefill_bucket(num_pairs, num_experts)
    tuned = tuned_config("nvfp4_prefill", device, f"{layout.hidden_size}x{layout.intermediate_size}x{bucket}")
    if tuned:
        return tuned
    # rows per tile follow the mean pairs per touched expert (padding rows cost tensor-core work);
    # picked by the H200 sweep of docs/kernels.md
    if bucket == "ps16":
        return dict(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=4)
    return dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


def sort_pairs(
    group_of_pair: torch.Tensor, num_groups: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, k) pairs by group id (an expert) into BLOCK_M tiles without a host sync; pairs of group
    -1 are left out.

    Args:
        group_of_pair: [P] int64 group of each flattened pair p = t * K + k, or -1 (left out).
        num_groups: G.
        block_m: rows per tile.

    Returns:
        (pair_ids [NT * block_m] int32, padding = P; tile_group [NT] int32, -1 past the last tile) where
        NT = cdiv(P, block_m) + min(G, P) bounds the tiles needed.
    """
    p = group_of_pair.numel()
    dev = group_of_pair.device
    skipped = group_of_pair < 0
    # skipped pairs sort last, in a bucket of their own
    bucket = torch.where(skipped, num_groups, group_of_pair)
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # [G + 1]
    counts[num_groups] = 0  # no tiles for them
    order = torch.argsort(bucket, stable=True)  # [P]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    seg_begin = torch.cumsum(counts, 0) - counts
    sorted_group = bucket[order]
    rank = torch.arange(p, device=dev) - seg_begin[sorted_group]
    nt = -(-p // block_m) + min(num_groups, p)
    # skipped pairs are written to one scratch entry past the end (no boolean indexing: that would sync)
    dest = torch.where(
        sorted_group < num_groups, (tile_end - tiles)[sorted_group] * block_m + rank, nt * block_m
    )
    pair_ids = torch.full((nt * block_m + 1,), p, dtype=torch.int32, device=dev)
    pair_ids[dest] = order.to(torch.int32)
    tile_idx = torch.searchsorted(tile_end[:num_groups], torch.arange(nt, device=dev), right=True)  # [NT]
    tile_group = torch.where(tile_idx < num_groups, tile_idx, -1).to(torch.int32)
    return pair_ids[:-1], tile_group


@dataclass
class PairOrder:
    """A prefill launch's (token, k) pairs sorted by expert into tiles, and the launch config it was made for.
    Made once per chunk of tokens (`order_pairs`); a bank that runs the chunk's experts in several passes
    reuses it for every pass: the kernels skip tiles whose expert has no slot in `expert_to_slot`."""

    pair_ids: torch.Tensor  # [NT * block_m] int32 pair per tile row, P for padding
    tile_expert: torch.Tensor  # [NT] int32 expert of each tile, -1 past the last
    config: dict


def order_pairs(
    expert_ids: torch.Tensor,
    num_experts: int,
    layout: ExpertLayout,
    distinct: int | None = None,
    config: dict | None = None,
) -> PairOrder:
    """Sort the pairs of expert_ids [T, K] by expert into the tiles of `config` (default: picked from the
    mean pairs per touched expert, with `distinct` touched experts, default min(E, T K))."""
    p = expert_ids.numel()
    cfg = config or _prefill_config(p, min(num_experts, distinct or num_experts), layout, expert_ids.device)
    pair_ids, tile_expert = sort_pairs(expert_ids.reshape(-1).long(), num_experts, cfg["block_m"])
    return PairOrder(pair_ids, tile_expert, cfg)


def nvfp4_moe_prefill(
    x: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_to_slot: torch.Tensor,
    ws2: torch.Tensor,
    weights: torch.Tensor,
    layout: ExpertLayout,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Routed expert sum for many tokens, grouped by expert, on tensor cores.

    Args:
        x: [T, H] activations (fp32 / fp16 / bf16).
        slots: [S, block_bytes] uint8 expert blocks.
        expert_ids: [T, K] int32/int64 routed experts (zero-token experts and duplicates allowed).
        expert_to_slot: [E] int32/int64 slot holding each expert; every routed expert must have one.
        ws2: [S, 3] float32 weight_scale_2 (gate, up, down) of each slot.
        weights: [T, K] float32 router weights.
        layout: the block layout.
        config: block_m, block_n, block_k (bytes), num_warps, num_stages; default from the routing size.

    Returns:
        [T, H] in x.dtype.
    """
    t, k = expert_ids.shape
    y = torch.empty(t * k, layout.hidden_size, dtype=x.dtype, device=x.device)  # weighted output per pair
    nvfp4_moe_prefill_pairs(x, slots, expert_ids, expert_to_slot, ws2, weights, layout, y, config=config)
    return y.view(t, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def nvfp4_moe_prefill_pairs(
    x: torch.Tensor,
    slots: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_to_slot: torch.Tensor,
    ws2: torch.Tensor,
    weights: torch.Tensor,
    layout: ExpertLayout,
    out: torch.Tensor,
    *,
    distinct: int | None = None,
    config: dict | None = None,
    order: PairOrder | None = None,
    work: torch.Tensor | None = None,
    launch: dict | None = None,
) -> None:
    """Per-pair weighted outputs, out[t K + k] = weights[t, k] expert_{t,k}(x[t]), for the pairs whose expert
    has a slot; rows of pairs whose expert maps to -1 are left as they are (a bank that fits a prompt's
    experts in several passes remaps and calls once per pass, then sums the rows over k).

    Args: as `nvfp4_moe_prefill`, plus out [T*K, H] in x.dtype; distinct: the prompt's distinct routed
    experts (default min(E, T K)), which sets the mean pairs per expert that picks the tile size; order: the
    pairs already sorted by `order_pairs` for these expert_ids (passes over one chunk share it); work: scratch
    for h, at least [NT * BLOCK_M, I] in x.dtype (default: allocated per call); launch: block_n, block_k,
    num_warps, num_stages for these launches in place of the order's (its block_m stays: the tiles are
    made), e.g. the shape tuned for a bank's passes that map a few experts each.
    """
    _check_common(x, slots, layout)
    assert ws2.dtype == torch.float32 and ws2.shape == (slots.shape[0], 3) and ws2.is_contiguous()
    assert x.dim() == 2 and expert_ids.dim() == 2 and expert_ids.shape[0] == x.shape[0], "x / expert_ids"
    assert expert_ids.dtype in (torch.int32, torch.int64), f"expert_ids dtype {expert_ids.dtype}"
    assert expert_to_slot.dtype in (torch.int32, torch.int64) and expert_to_slot.dim() == 1
    assert weights.dtype == torch.float32 and weights.shape == expert_ids.shape, f"weights {weights.shape}"
    t, k = expert_ids.shape
    h_size, i_size = layout.hidden_size, layout.intermediate_size
    p = t * k
    assert out.shape == (p, h_size) and out.dtype == x.dtype and out.is_contiguous(), (
        f"out {tuple(out.shape)}"
    )
    require_triton(x, ws2, expert_ids, expert_to_slot, weights, out)
    order = order or order_pairs(expert_ids, expert_to_slot.numel(), layout, distinct, config)
    cfg = {**order.config, **(launch or {}), "block_m": order.config["block_m"]}
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    assert order.pair_ids.numel() == order.tile_expert.numel() * bm, "order made for another config"
    nt = order.tile_expert.numel()
    off = _offsets(layout)
    if work is None:
        work = torch.empty(nt * bm, i_size, dtype=x.dtype, device=x.device)
    assert work.dtype == x.dtype and work.shape[0] >= nt * bm and work.shape[1:] == (i_size,), "work shape"
    assert work.is_contiguous(), "work must be contiguous"
    h = work[: nt * bm]  # silu(g) * u by padded sorted row
    common = dict(
        block_bytes=layout.block_bytes, H=h_size, I=i_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    tiles = (order.pair_ids, order.tile_expert, expert_to_slot)
    launch_e2m1(
        _prefill_gate_up_kernel, (nt, cdiv(i_size, bn)), x.device,
        x, *tiles, slots, ws2, h, p, k, gw_off=off["gw_off"], uw_off=off["uw_off"],
        gs_off=off["gs_off"], us_off=off["us_off"], **common,
    )  # fmt: skip
    launch_e2m1(
        _prefill_down_kernel, (nt, cdiv(h_size, bn)), x.device,
        h, *tiles, slots, ws2, weights.reshape(-1), out, p, dw_off=off["dw_off"],
        ds_off=off["ds_off"], **common,
    )  # fmt: skip


@jit
def _tile_slot(tile_expert_ptr, e2s_ptr, tile):
    # slot of the tile's expert (int64), or -1: no expert (past the last tile), or not in this pass
    e = tl.load(tile_expert_ptr + tile)
    return tl.where(e >= 0, tl.load(e2s_ptr + tl.maximum(e, 0)).to(tl.int64), -1)


@jit
def _dequant_tile(
    blk, w_off, s_off, kk, n, row_bytes, row_groups, mask, USE_PTX: tl.constexpr, dtype: tl.constexpr
):
    # W^T tile of rows n [BN] over packed bytes kk [BK]: (even-column, odd-column) halves [BK, BN] in dtype
    b = tl.load(blk + w_off + n[None, :] * row_bytes + kk[:, None], mask=mask, other=0)
    sb = tl.load(blk + s_off + n[None, :] * row_groups + kk[:, None] // 8, mask=mask, other=0)
    s = e4m3_f16(sb).to(tl.float32) * nvfp4_unit(USE_PTX)
    lo, hi = e2m1_pair(b, USE_PTX)
    return (lo * s).to(dtype), (hi * s).to(dtype)


@jit(do_not_specialize=("P", "K"))  # pair counts vary per call: one compiled variant
def _prefill_gate_up_kernel(
    x_ptr, pair_ptr, tile_expert_ptr, e2s_ptr, slots_ptr, ws2_ptr, h_ptr, P, K, block_bytes, H, I,
    gw_off, uw_off, gs_off, us_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (tile, n block): h[rows, n] = silu(x[tok] gate^T) * (x[tok] up^T), rows of one expert
    tile = tl.program_id(0)
    slot = _tile_slot(tile_expert_ptr, e2s_ptr, tile)
    if slot < 0:  # past the last tile, or its expert is not in this pass
        return
    blk = slots_ptr + slot * block_bytes
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    valid = pair < P
    tok = (pair // K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H // 2, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)  # packed bytes = column pairs (2kk, 2kk+1)
        kmask = kk < H // 2
        xm = valid[:, None] & kmask[None, :]
        xe = tl.load(x_ptr + tok[:, None] * H + 2 * kk[None, :], mask=xm, other=0.0)  # [BM, BK]
        xo = tl.load(x_ptr + tok[:, None] * H + 2 * kk[None, :] + 1, mask=xm, other=0.0)
        wm = kmask[:, None] & nmask[None, :]
        lo, hi = _dequant_tile(blk, gw_off, gs_off, kk, n, H // 2, H // 16, wm, USE_PTX, xe.dtype)
        acc_g = tl.dot(xe, lo, acc_g, input_precision=DOT_PRECISION)
        acc_g = tl.dot(xo, hi, acc_g, input_precision=DOT_PRECISION)
        lo, hi = _dequant_tile(blk, uw_off, us_off, kk, n, H // 2, H // 16, wm, USE_PTX, xe.dtype)
        acc_u = tl.dot(xe, lo, acc_u, input_precision=DOT_PRECISION)
        acc_u = tl.dot(xo, hi, acc_u, input_precision=DOT_PRECISION)
    g = acc_g * tl.load(ws2_ptr + slot * 3)
    u = acc_u * tl.load(ws2_ptr + slot * 3 + 1)
    hv = g * tl.sigmoid(g) * u
    hm = valid[:, None] & nmask[None, :]
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], hv.to(h_ptr.dtype.element_ty), mask=hm)


@jit(do_not_specialize=("P",))
def _prefill_down_kernel(
    h_ptr, pair_ptr, tile_expert_ptr, e2s_ptr, slots_ptr, ws2_ptr, w_ptr, y_ptr, P, block_bytes, H, I, dw_off,
    ds_off,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (tile, n block): y[pair, n] = w[pair] * h[rows] down^T for the rows of one expert
    tile = tl.program_id(0)
    slot = _tile_slot(tile_expert_ptr, e2s_ptr, tile)
    if slot < 0:  # past the last tile, or its expert is not in this pass
        return
    blk = slots_ptr + slot * block_bytes
    rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(pair_ptr + rows)
    valid = pair < P
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I // 2, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < I // 2
        hm = valid[:, None] & kmask[None, :]
        he = tl.load(h_ptr + rows[:, None] * I + 2 * kk[None, :], mask=hm, other=0.0)  # [BM, BK]
        ho = tl.load(h_ptr + rows[:, None] * I + 2 * kk[None, :] + 1, mask=hm, other=0.0)
        wm = kmask[:, None] & nmask[None, :]
        lo, hi = _dequant_tile(blk, dw_off, ds_off, kk, n, I // 2, I // 16, wm, USE_PTX, he.dtype)
        acc = tl.dot(he, lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(ho, hi, acc, input_precision=DOT_PRECISION)
    rw = tl.load(w_ptr + pair, mask=valid, other=0.0)
    acc = acc * tl.load(ws2_ptr + slot * 3 + 2) * rw[:, None]
    ym = valid[:, None] & nmask[None, :]
    tl.store(y_ptr + pair[:, None].to(tl.int64) * H + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)
