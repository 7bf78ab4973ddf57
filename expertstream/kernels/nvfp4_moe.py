"""Routed-expert SwiGLU straight from repacked NVFP4 blocks in GPU slot memory (W4A16, FP32 accumulation).

Shapes: T tokens, H hidden, I expert width, K experts per token, S slots, B = layout.block_bytes.
Each slot row is one `ExpertLayout` block; ws2 [S, 3] holds its FP32 weight_scale_2 (gate, up, down).
y[t] = sum_k w[t, k] * down_k(silu(gate_k x[t]) * up_k x[t]).
- decode (one token): two launches per layer, FP32 FMAs on codes read as int64 words (one 16-code group
  each): gate+up over (expert, row block), then down over row blocks, one reduction over the K experts'
  concatenated columns (deterministic, no atomics).
- prefill (many tokens): (token, k) pairs sorted by slot and padded to BLOCK_M tiles; each tile dequantises
  weight tiles to the activation dtype in registers (exactly, weight * 2^-7) and runs tl.dot; per-pair
  outputs [T*K, H] are summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels.codec import (
    cdiv,
    dot_precision,
    e2m1_pair,
    e2m1_unit,
    e2m1x8,
    e4m3_f32,
    exact_cast,
    jit,
    launch_e2m1,
    nvfp4_tile_scale,
    require_triton,
    tl,
    tuned_config,
)


def _offsets(layout: ExpertLayout) -> dict[str, int]:
    names = {"gw": "gate_proj.weight", "uw": "up_proj.weight", "dw": "down_proj.weight"}
    names |= {"gs": "gate_proj.weight_scale", "us": "up_proj.weight_scale", "ds": "down_proj.weight_scale"}
    return {f"{k}_off": layout.part(v).offset for k, v in names.items()}


def _check_common(x, slots, ws2, layout: ExpertLayout) -> None:
    require_triton(x, slots, ws2)
    assert x.shape[-1] == layout.hidden_size and x.is_contiguous(), f"x {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert slots.dtype == torch.uint8 and slots.dim() == 2, f"slots {slots.dtype} {tuple(slots.shape)}"
    assert slots.shape[1] == layout.block_bytes and slots.is_contiguous(), f"slots {tuple(slots.shape)}"
    assert ws2.dtype == torch.float32 and ws2.shape == (slots.shape[0], 3) and ws2.is_contiguous()


# ---------------------------------------------------------------- decode


# launch shape until a device sweep records one as data (bench_kernels.DECODE_SWEEP): gate+up 8 rows x 32
# groups on 2 warps (5 steps over H = 2560), down 8 rows x 128 groups on 8 warps (2560 / 8 programs would
# give too few threads with narrower steps), loads pipelined 2 deep
DECODE_DEFAULT = dict(block_n_gu=8, block_g_gu=32, num_warps_gu=2, block_n_down=8, block_g_down=128,
                      num_warps_down=8, num_stages=2)  # fmt: skip
# x and h are pre-scaled by 2^64 so that code (value * 2^-126 in software) * x products are normal floats
X_UNIT = 2.0**64


def nvfp4_moe_decode_ref(x, slots, slot_ids, ws2, weights, layout: ExpertLayout) -> torch.Tensor:
    """Plain-torch twin of `nvfp4_moe_decode` (FP32 maths, output in x.dtype)."""
    xf = x.reshape(-1).float()  # [H]
    out = torch.zeros_like(xf)
    for k, s in enumerate(slot_ids.tolist()):
        gate, up, down = layout.dequantize(slots[s], ws2[s])  # [I, H], [I, H], [H, I] fp32
        out += weights[k].float() * (down @ (F.silu(gate @ xf) * (up @ xf)))
    return out.to(x.dtype).reshape(x.shape)


def nvfp4_moe_decode(
    x: torch.Tensor,
    slots: torch.Tensor,
    slot_ids: torch.Tensor,
    ws2: torch.Tensor,
    weights: torch.Tensor,
    layout: ExpertLayout,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Routed expert sum for one token, read straight from slot memory.

    Args:
        x: [H] or [1, H] activations (fp32 / fp16 / bf16).
        slots: [S, block_bytes] uint8 expert blocks.
        slot_ids: [K] int32 slot of each routed expert (duplicates allowed).
        ws2: [S, 3] float32 weight_scale_2 (gate, up, down) of each slot.
        weights: [K] float32 router weights.
        layout: the block layout.
        config: block_n, block_g and num_warps (rows per program, 16-column groups per row and step, warps)
            of the gate+up (`_gu`) and the down (`_down`) launch, num_stages: the loops' load
            pipelining depth (1: none). block_g < 32 num_warps keeps the x vectors out of shared memory.
            Default: tuned_configs.json for this device and shape, else DECODE_DEFAULT.

    Returns:
        Tensor shaped like x, in x.dtype.
    """
    _check_common(x, slots, ws2, layout)
    assert x.numel() == layout.hidden_size, f"decode takes one token, got x {tuple(x.shape)}"
    assert slot_ids.dtype == torch.int32 and slot_ids.dim() == 1, (
        f"slot_ids {slot_ids.dtype} {slot_ids.shape}"
    )
    k, h_size, i_size = slot_ids.numel(), layout.hidden_size, layout.intermediate_size
    assert weights.dtype == torch.float32 and weights.shape == (k,), (
        f"weights {weights.dtype} {weights.shape}"
    )
    # codes are read as int64 words (one 16-code group each) from 16-byte aligned blocks (vector-load hints)
    assert layout.block_bytes % 16 == 0 and slots.data_ptr() % 16 == 0, "slots must be 16-byte aligned"
    cfg = config or tuned_config("nvfp4_decode", x.device, f"{h_size}x{i_size}") or DECODE_DEFAULT
    off = _offsets(layout)
    # xp [16, H/16], xp[p, j] = x[16j + p] 2^64: one contiguous vector per nibble position of a group word,
    # in one kernel (fp16 x is widened first: x 2^64 would overflow it)
    xv = x.reshape(h_size // 16, 16).T
    xp = torch.empty(16, h_size // 16, dtype=torch.float32, device=x.device)
    torch.mul(xv.float() if x.dtype == torch.float16 else xv, X_UNIT, out=xp)
    # hp [16, K I/16], hp[p, k I/16 + j] = h_k[16j + p] w_k ws2_k(down) 2^64 with h = silu(g) u, written
    # by gate+up: the same layout over the K experts' concatenated columns, so down is one reduction of K I
    hp = torch.empty(16, k * i_size // 16, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    groups = slots.view(torch.int64)  # [S, block_bytes / 8]
    common = dict(block_groups=layout.block_bytes // 8, block_bytes=layout.block_bytes, K=k, H=h_size,
                  I=i_size, X_UNIT=X_UNIT, NUM_STAGES=cfg["num_stages"])  # fmt: skip
    launch_e2m1(
        _decode_gate_up_kernel, (k, cdiv(i_size, cfg["block_n_gu"])), x.device,
        xp, groups, slots, slot_ids, ws2, weights, hp, gw_off=off["gw_off"] // 8, uw_off=off["uw_off"] // 8,
        gs_off=off["gs_off"], us_off=off["us_off"], BLOCK_N=cfg["block_n_gu"], BLOCK_G=cfg["block_g_gu"],
        num_warps=cfg["num_warps_gu"], **common,
    )  # fmt: skip
    launch_e2m1(
        _decode_down_kernel, (cdiv(h_size, cfg["block_n_down"]),), x.device,
        hp, groups, slots, slot_ids, out, dw_off=off["dw_off"] // 8, ds_off=off["ds_off"],
        BLOCK_N=cfg["block_n_down"], BLOCK_G=cfg["block_g_down"], num_warps=cfg["num_warps_down"], **common,
    )  # fmt: skip
    return out


@jit
def _group_dots(gp, gcol, gmask, sp, scol, nmask, xp_ptr, XG: tl.constexpr, USE_PTX: tl.constexpr):
    # rows [BN] x BG groups of 16 codes -> sum over the group of code * x, times its E4M3 scale: [BN, BG].
    # Group j of row r is the int64 word at gp[r] + gcol[j] (column p at bits 4p..4p+3), its scale the byte
    # at sp[r] + scol[j]; x of column p of group j is xp[p, j] (xp [16, XG] fp32 times 2^64, [BG] vectors).
    # Codes and scales share one shape and contiguity, so one register layout; Triton loads the x vectors
    # straight in its column layout when BG < the program's threads (a small load), else converts them.
    m2 = nmask[:, None] & gmask[None, :]
    g = tl.load(gp + gcol[None, :], mask=m2, other=0)
    codes = e2m1x8(g.to(tl.uint32), USE_PTX) + e2m1x8((g >> 32).to(tl.uint32), USE_PTX)  # 16 x [BN, BG]
    xo = tl.arange(0, gcol.shape[0])
    part = tl.zeros(g.shape, tl.float32)
    for p in tl.static_range(16):
        part += codes[p] * tl.load(xp_ptr + p * XG + xo, mask=gmask, other=0.0)[None, :]
    return part * e4m3_f32(tl.load(sp + scol[None, :], mask=m2, other=0))


@jit
def _decode_gate_up_kernel(
    xp_ptr, groups_ptr, slots_ptr, slot_ids_ptr, ws2_ptr, rw_ptr, hp_ptr, block_groups, block_bytes, gw_off,
    uw_off, gs_off, us_off, K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, X_UNIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (k, n block): h[k, n] = silu(gate[n] . x) * (up[n] . x) for BLOCK_N rows of expert k, stored
    # times w_k ws2_k(down) 2^64 in the permuted hp layout. The loop stays rolled (unrolled, every step's
    # loads stay live and spill registers on sm_90); NUM_STAGES > 1 prefetches the next steps' loads.
    k = tl.program_id(0)
    slot = tl.load(slot_ids_ptr + k).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    grow = groups_ptr + slot * block_groups + n[:, None] * (H // 16)  # [BN, 1] int64 words
    srow = slots_ptr + slot * block_bytes + n[:, None] * (H // 16)  # [BN, 1] scale bytes
    acc_g = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for g0 in tl.range(0, H // 16, BLOCK_G, num_stages=NUM_STAGES):
        # offsets from the induction variable (a multiple of BLOCK_G) keep 16-byte vector loads
        gi = g0 + tl.arange(0, BLOCK_G)
        gmask = gi < H // 16
        xs = xp_ptr + g0
        acc_g += _group_dots(grow + gw_off, gi, gmask, srow + gs_off, gi, nmask, xs, H // 16, USE_PTX)
        acc_u += _group_dots(grow + uw_off, gi, gmask, srow + us_off, gi, nmask, xs, H // 16, USE_PTX)
    unit = e2m1_unit(USE_PTX) / X_UNIT
    g = tl.sum(acc_g, axis=1) * (tl.load(ws2_ptr + slot * 3) * unit)
    u = tl.sum(acc_u, axis=1) * (tl.load(ws2_ptr + slot * 3 + 1) * unit)
    fold = tl.load(rw_ptr + k) * tl.load(ws2_ptr + slot * 3 + 2) * X_UNIT
    # column n of expert k -> hp[n % 16, k I/16 + n / 16]
    hcol = (n % 16) * (K * I // 16) + k * (I // 16) + n // 16
    tl.store(hp_ptr + hcol, g * tl.sigmoid(g) * u * fold, mask=nmask)


@jit
def _decode_down_kernel(
    hp_ptr, groups_ptr, slots_ptr, slot_ids_ptr, out_ptr, block_groups, block_bytes, dw_off, ds_off,
    K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, X_UNIT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (n block): out[n] = sum over the K experts' concatenated groups c = k I/16 + j of
    # down_k[n] group j . hp[:, c] (w_k, ws2 already in hp): one row reduction of length K I in a fixed order
    # (deterministic, no atomics) with as many threads per row as a gate+up row, where a (row block, expert)
    # grid would need FP32 partials and a third launch to sum them.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    grow = groups_ptr + n[:, None] * (I // 16)  # [BN, 1]; the expert's slot and dw_off go into the columns
    srow = slots_ptr + n[:, None] * (I // 16)
    # an expert's groups come in runs of I/16: 16-byte (2-group) loads when that is even
    VEC: tl.constexpr = 2 if (I // 16) % 2 == 0 else 1
    acc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for c0 in tl.range(0, K * I // 16, BLOCK_G, num_stages=NUM_STAGES):
        ci = c0 + tl.arange(0, BLOCK_G)
        cmask = ci < K * I // 16
        kc = ci // (I // 16)  # expert of each group
        slot = tl.load(slot_ids_ptr + kc, mask=cmask, other=0).to(tl.int64)
        j = ci - kc * (I // 16)
        gcol = tl.max_contiguous(tl.multiple_of(slot * block_groups + dw_off + j, VEC), VEC)
        acc += _group_dots(grow, gcol, cmask, srow, slot * block_bytes + ds_off + j, nmask, hp_ptr + c0,
                           K * I // 16, USE_PTX)  # fmt: skip
    y = tl.sum(acc, axis=1) * (e2m1_unit(USE_PTX) / X_UNIT)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


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


def prefill_bucket(num_pairs: int, num_slots: int) -> str:
    """Tuning key: mean pairs per touched slot, bucketed (decides how full BLOCK_M tiles are)."""
    per_slot = num_pairs / max(1, min(num_slots, num_pairs))
    return "ps16" if per_slot <= 16 else "ps64" if per_slot <= 64 else "psbig"


def _prefill_config(num_pairs: int, num_slots: int, layout: ExpertLayout, device: torch.device) -> dict:
    key = f"{layout.hidden_size}x{layout.intermediate_size}x{prefill_bucket(num_pairs, num_slots)}"
    tuned = tuned_config("nvfp4_prefill", device, key)
    if tuned:
        return tuned
    # rows per tile follow the mean pairs per touched slot (padding rows cost tensor-core work);
    # picked by the H200 sweep of docs/kernels.md
    per_slot = num_pairs / max(1, min(num_slots, num_pairs))
    if per_slot <= 16:
        return dict(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=4)
    return dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


def sort_pairs(slot_of_pair: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group (token, k) pairs by slot into BLOCK_M tiles without a host sync; pairs of slot -1 are left out.

    Args:
        slot_of_pair: [P] int64 slot of each flattened pair p = t * K + k, or -1 (not in this pass).
        num_slots: S.
        block_m: rows per tile.

    Returns:
        (pair_ids [NT * block_m] int32, padding = P; tile_slot [NT] int32, -1 past the last tile) where
        NT = cdiv(P, block_m) + min(S, P) bounds the tiles needed.
    """
    p = slot_of_pair.numel()
    dev = slot_of_pair.device
    skipped = slot_of_pair < 0
    bucket = torch.where(
        skipped, num_slots, slot_of_pair
    )  # skipped pairs sort last, in a bucket of their own
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # [S + 1]
    counts[num_slots] = 0  # no tiles for them
    order = torch.argsort(bucket, stable=True)  # [P]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    seg_begin = torch.cumsum(counts, 0) - counts
    sorted_slot = bucket[order]
    rank = torch.arange(p, device=dev) - seg_begin[sorted_slot]
    nt = -(-p // block_m) + min(num_slots, p)
    # skipped pairs are written to one scratch entry past the end (no boolean indexing: that would sync)
    dest = torch.where(
        sorted_slot < num_slots, (tile_end - tiles)[sorted_slot] * block_m + rank, nt * block_m
    )
    pair_ids = torch.full((nt * block_m + 1,), p, dtype=torch.int32, device=dev)
    pair_ids[dest] = order.to(torch.int32)
    tile_idx = torch.searchsorted(tile_end[:num_slots], torch.arange(nt, device=dev), right=True)  # [NT]
    tile_slot = torch.where(tile_idx < num_slots, tile_idx, -1).to(torch.int32)
    return pair_ids[:-1], tile_slot


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
) -> None:
    """Per-pair weighted outputs, out[t K + k] = weights[t, k] expert_{t,k}(x[t]), for the pairs whose expert
    has a slot; rows of pairs whose expert maps to -1 are left as they are (a bank that fits a prompt's
    experts in several passes remaps and calls once per pass, then sums the rows over k).

    Args: as `nvfp4_moe_prefill`, plus out [T*K, H] in x.dtype, and distinct: the prompt's distinct routed
    experts (default min(S, T K)), which sets the mean pairs per slot that picks the tile size.
    """
    _check_common(x, slots, ws2, layout)
    assert x.dim() == 2 and expert_ids.dim() == 2 and expert_ids.shape[0] == x.shape[0], "x / expert_ids"
    assert expert_ids.dtype in (torch.int32, torch.int64), f"expert_ids dtype {expert_ids.dtype}"
    assert expert_to_slot.dtype in (torch.int32, torch.int64) and expert_to_slot.dim() == 1
    assert weights.dtype == torch.float32 and weights.shape == expert_ids.shape, f"weights {weights.shape}"
    t, k = expert_ids.shape
    h_size, i_size, s = layout.hidden_size, layout.intermediate_size, slots.shape[0]
    p = t * k
    assert out.shape == (p, h_size) and out.dtype == x.dtype and out.is_contiguous(), (
        f"out {tuple(out.shape)}"
    )
    require_triton(x, expert_ids, expert_to_slot, weights, out)
    cfg = config or _prefill_config(p, min(s, distinct or s), layout, x.device)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    pair_ids, tile_slot = sort_pairs(expert_to_slot[expert_ids.reshape(-1).long()].long(), s, bm)
    nt = tile_slot.numel()
    off = _offsets(layout)
    h = torch.empty(nt * bm, i_size, dtype=x.dtype, device=x.device)  # silu(g) * u by padded sorted row
    common = dict(
        block_bytes=layout.block_bytes, H=h_size, I=i_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    launch_e2m1(
        _prefill_gate_up_kernel, (nt, cdiv(i_size, bn)), x.device,
        x, pair_ids, tile_slot, slots, ws2, h, p, k, gw_off=off["gw_off"], uw_off=off["uw_off"],
        gs_off=off["gs_off"], us_off=off["us_off"], **common,
    )  # fmt: skip
    launch_e2m1(
        _prefill_down_kernel, (nt, cdiv(h_size, bn)), x.device,
        h, pair_ids, tile_slot, slots, ws2, weights.reshape(-1), out, p, dw_off=off["dw_off"],
        ds_off=off["ds_off"], **common,
    )  # fmt: skip


@jit
def _dequant_tile(blk, w_off, s_off, kk, n, row_bytes, row_groups, mask, USE_PTX: tl.constexpr,
                  dtype: tl.constexpr):  # fmt: skip
    # W^T tile of rows n [BN] over packed bytes kk [BK]: (even-column, odd-column) halves [BK, BN] in dtype,
    # holding weight / TILE_UNIT exactly (no conversion instruction in software for bf16 and fp32 tiles)
    b = tl.load(blk + w_off + n[None, :] * row_bytes + kk[:, None], mask=mask, other=0)
    sb = tl.load(blk + s_off + n[None, :] * row_groups + kk[:, None] // 8, mask=mask, other=0)
    s = nvfp4_tile_scale(sb, USE_PTX)
    lo, hi = e2m1_pair(b, USE_PTX)
    return exact_cast(lo * s, dtype), exact_cast(hi * s, dtype)


@jit(do_not_specialize=("P", "K"))  # pair counts vary per call: one compiled variant
def _prefill_gate_up_kernel(
    x_ptr, pair_ptr, tile_slot_ptr, slots_ptr, ws2_ptr, h_ptr, P, K, block_bytes, H, I,
    gw_off, uw_off, gs_off, us_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (tile, n block): h[rows, n] = silu(x[tok] gate^T) * (x[tok] up^T), rows of one slot
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    if slot < 0:
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
    g = acc_g * (tl.load(ws2_ptr + slot * 3) * 128.0)  # TILE_UNIT: tiles hold weight * 2^-7
    u = acc_u * (tl.load(ws2_ptr + slot * 3 + 1) * 128.0)
    hv = g * tl.sigmoid(g) * u
    hm = valid[:, None] & nmask[None, :]
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], hv.to(h_ptr.dtype.element_ty), mask=hm)


@jit(do_not_specialize=("P",))
def _prefill_down_kernel(
    h_ptr, pair_ptr, tile_slot_ptr, slots_ptr, ws2_ptr, w_ptr, y_ptr, P, block_bytes, H, I, dw_off, ds_off,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PTX: tl.constexpr,
):  # fmt: skip
    # program (tile, n block): y[pair, n] = w[pair] * h[rows] down^T for the rows of one slot
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    if slot < 0:
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
    acc = acc * (tl.load(ws2_ptr + slot * 3 + 2) * 128.0) * rw[:, None]  # TILE_UNIT
    ym = valid[:, None] & nmask[None, :]
    tl.store(y_ptr + pair[:, None].to(tl.int64) * H + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)
