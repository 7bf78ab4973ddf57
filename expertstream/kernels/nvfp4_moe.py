"""Routed-expert SwiGLU straight from repacked NVFP4 or MXFP4 blocks (W4A16, FP32 accumulation).

Shapes: T tokens, H hidden, I expert width, K experts per token, S slots, B = layout.block_bytes.
Each slot row is one `ExpertLayout` block; its FP32 weight_scale_2 (gate, up, down) come beside it (NVFP4:
E4M3 scale per 16 codes; MXFP4: UE8M0 scale per 32, no weight_scale_2). One kernel body per launch reads
both: the layout's format is a constexpr switch in the scale and group decoding.
y[t] = sum_k w[t, k] * down_k(silu(gate_k x[t]) * up_k x[t]); with a SwiGLU limit (DeepSeek-V4) gate x is
clamped above and up x on both sides first.
- decode (one token): two launches per layer, gate+up over (expert, row block), then down over (row block,
  split of the K experts): each program writes its experts' partial rows, and the last program of a row
  block to finish (an atomic count) sums the partials in expert order, so the result is deterministic.
  Each expert's block is found through a location table: a VRAM slot, or a row of pinned host RAM that
  the kernel reads over the bus without a copy.
- prefill (many tokens): (token, k) pairs sorted by expert and padded to BLOCK_M tiles (once per prompt
  call, shared by a bank's passes); a pass launches over its experts' tiles only, each tile finds its
  expert's slot, dequantises weight tiles to the activation dtype in registers and runs tl.dot, writing
  weighted rows by tile row; `combine_rows` adds each token's rows in expert order into an FP32 sum, one
  addition after another, so the sums do not depend on how a bank groups the experts into passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels.codec import (
    block_scale,
    cdiv,
    dependent_launch,
    device_capability,
    dot_precision,
    e2m1_cols_unit,
    e2m1_word_cols,
    e2m1_words,
    f16x2_halves,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    l2_prefetch_rows,
    launch_e2m1,
    nvfp4_unit,
    prefetch_lines,
    require_triton,
    tl,
    tuned_config,
)


def _offsets(layout: ExpertLayout) -> dict[str, int]:
    names = {"gw": "gate_proj.weight", "uw": "up_proj.weight", "dw": "down_proj.weight"}
    names |= {"gs": "gate_proj.weight_scale", "us": "up_proj.weight_scale", "ds": "down_proj.weight_scale"}
    return {f"{k}_off": layout.part(v).offset for k, v in names.items()}


def _format(layout: ExpertLayout) -> bool:
    """The kernels' MXFP4 switch: True for MXFP4 blocks (UE8M0 scale per 32), False for NVFP4 (E4M3, 16)."""
    assert layout.fmt in ("nvfp4", "mxfp4"), f"no expert kernel reads {layout.fmt!r} blocks"
    return layout.fmt == "mxfp4"


def _clamp(swiglu_limit: float | None) -> dict:
    # the SwiGLU clamp's kernel arguments: a runtime limit (no variant per value) and the constexpr switch
    assert swiglu_limit is None or swiglu_limit > 0, f"swiglu_limit {swiglu_limit}"
    return dict(limit=float(swiglu_limit or 0.0), CLAMP=swiglu_limit is not None)


def _check_common(x, slots, layout: ExpertLayout) -> None:
    # slots in pinned host RAM are read over the bus in place (`bench kernels` times a prompt so)
    require_triton(x, *(() if slots.device != x.device and _pinned(slots) else (slots,)))
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


def swiglu_ref(g: torch.Tensor, u: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """silu(g) * u; with `swiglu_limit` (DeepSeek-V4) g is clamped above and u on both sides first."""
    if swiglu_limit is not None:
        g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
    return F.silu(g) * u


def nvfp4_moe_decode_ref(
    x, expert_ids, loc, scales, weights, layout: ExpertLayout, slots, host=None, *, swiglu_limit=None
):
    """Plain-torch twin of `nvfp4_moe_decode` (FP32 maths, output in x.dtype)."""
    xf = x.reshape(-1).float()  # [H]
    out = torch.zeros_like(xf)
    for k, e in enumerate(expert_ids.tolist()):
        block = _block_of(slots, host, int(loc[e])).to(xf.device)
        gate, up, down = layout.dequantize(block, scales[e])  # [I, H], [I, H], [H, I] fp32
        out += weights[k].float() * (down @ swiglu_ref(gate @ xf, up @ xf, swiglu_limit))
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
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed expert sum for one token, read straight from the blocks wherever they are: VRAM slots, or
    pinned host RAM read over the bus (no copy; the H200 probe read it at 93 % of the copy engine's rate).

    Args:
        x: [H] or [1, H] activations (fp32 / fp16 / bf16).
        expert_ids: [K] int32 / int64 routed experts (duplicates allowed).
        loc: [E] int32 block of each expert: row c >= 0 of `slots`, or row -1 - c of `host` (only the
            routed experts' entries are read).
        scales: [E, 3] float32 weight_scale_2 (gate, up, down) of each expert (NVFP4; not read for MXFP4,
            which has none).
        weights: [K] float32 router weights.
        layout: the block layout, NVFP4 or MXFP4 (`layout.fmt`).
        slots: [S, block_bytes] uint8 blocks in device memory.
        host: [C, block_bytes] uint8 blocks in pinned host memory (the RAM cache), or None.
        config: block_n and block_g (rows per program and 16-element groups' worth of codes per step) of
            the gate+up and the down launch, split_down (down programs per row block over the K experts,
            default K), num_warps; default: tuned_configs.json for this device and shape, else
            DECODE_DEFAULT.
        swiglu_limit: clamp gate x above and up x on both sides at this value before the SwiGLU
            (DeepSeek-V4); None: no clamp.

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
    # one launch shape wherever the blocks are: the shape sets the order of each row's sums (groups per
    # step, the reduction across lanes), and a token must not depend on where its experts sit (the decode
    # regimes' greedy tokens are compared by `bench decode`); tuned for reads over the bus, the streaming case
    cfg = config or tuned_config("nvfp4_decode", x.device, f"{h_size}x{i_size}") or DECODE_DEFAULT
    off = _offsets(layout)
    mx = _format(layout)
    # block_g counts 16-element groups' worth of codes (2 words): an MXFP4 group is 32 elements
    per_group = 2 if mx else 1
    block_n = (cfg["block_n_gu"], cfg["block_n_down"])
    block_g = tuple(max(1, g // per_group) for g in (cfg["block_g_gu"], cfg["block_g_down"]))
    h = torch.empty(k, i_size, dtype=torch.float32, device=x.device)  # silu(g) * u, [K, I]
    out = torch.empty_like(x)
    n_blocks = cdiv(h_size, block_n[1])
    per = cdiv(k, cfg.get("split_down", k))  # experts per down program; the split is cdiv(k, per) programs
    part = torch.empty(cdiv(k, per), h_size, dtype=torch.float32, device=x.device)  # each split's rows
    # programs finished per row block; zeroed before gate+up, so that down follows gate+up directly
    done = torch.zeros(n_blocks, dtype=torch.int32, device=x.device)
    # sm_90+: down launches while gate+up runs and reads its VRAM blocks into L2 before it waits for h
    pdl = dependent_launch(device_capability(x.device))
    common = dict(
        H=h_size, I=i_size, block_bytes=layout.block_bytes, num_warps=cfg["num_warps"], PDL=pdl, MXFP4=mx
    )
    launch_e2m1(
        _decode_gate_up_kernel, (k, cdiv(i_size, block_n[0])), x.device,
        x, expert_ids, loc, scales, slots, host, h, gw_off=off["gw_off"], uw_off=off["uw_off"],
        gs_off=off["gs_off"], us_off=off["us_off"], BLOCK_N=block_n[0], BLOCK_G=block_g[0], **common,
        **_clamp(swiglu_limit),
    )  # fmt: skip
    launch_e2m1(
        _decode_down_kernel, (n_blocks, cdiv(k, per)), x.device,
        h, expert_ids, loc, scales, slots, host, weights, part, done, out, K=k, PER=per,
        dw_off=off["dw_off"], ds_off=off["ds_off"], BLOCK_N=block_n[1], BLOCK_G=block_g[1],
        LINES_W=prefetch_lines(i_size // 2), LINES_S=prefetch_lines(i_size // layout.group), **common,
        **({"launch_pdl": True} if pdl else {}),
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
def _x_octets(x_ptr, w0, NW: tl.constexpr, BW: tl.constexpr):
    # the 8 columns of words w0 .. w0 + BW - 1 of the fp32 / 16-bit vector x (zero past NW words) as eight
    # [BW] fp32, column c of each word in the c-th: loaded contiguously and split in registers
    kk = 8 * w0 + tl.arange(0, 8 * BW)
    xv = tl.load(x_ptr + kk, mask=kk < 8 * NW, other=0.0).to(tl.float32)
    return _octets(xv, BW)


@jit
def _octets(xv, BW: tl.constexpr):
    # a [8 BW] fp32 vector in registers -> eight [BW], column c of each 8-column word in the c-th
    ev, od = tl.split(tl.reshape(xv, [BW, 2, 2, 2]))  # by column bit 0, then bit 1, then bit 2
    e0, e1 = tl.split(ev)
    o0, o1 = tl.split(od)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@jit
def _group_partial(
    blk, w_off, s_off, n, g0, row_groups, nmask, xs, BLOCK_G: tl.constexpr, USE_PTX: tl.constexpr,
    MXFP4: tl.constexpr,
):  # fmt: skip
    # rows n [BN] x groups g0 .. g0 + BG - 1 of GROUP elements (16 NVFP4, 32 MXFP4): codes as int32 words
    # [BN, WPG BG] (8 columns each), scales [BN, BG]; xs: the step's x columns from _x_octets. Returns
    # [BN, BG] in units of 1 / nvfp4_unit
    WPG: tl.constexpr = 4 if MXFP4 else 2  # int32 code words per block scale
    wi = WPG * g0 + tl.arange(0, WPG * BLOCK_G)
    m = nmask[:, None] & (wi < WPG * row_groups)[None, :]
    words = (blk + w_off).to(tl.pointer_type(tl.int32))
    w = tl.load(words + n[:, None] * (WPG * row_groups) + wi[None, :], mask=m, other=0)
    p0, p1, p2, p3 = e2m1_words(w, USE_PTX)  # pattern j: columns j and j + 4
    a, b = f16x2_halves(p0)
    part = a * xs[0][None, :] + b * xs[4][None, :]
    a, b = f16x2_halves(p1)
    part += a * xs[1][None, :] + b * xs[5][None, :]
    a, b = f16x2_halves(p2)
    part += a * xs[2][None, :] + b * xs[6][None, :]
    a, b = f16x2_halves(p3)
    part += a * xs[3][None, :] + b * xs[7][None, :]
    part = tl.sum(tl.reshape(part, [part.shape[0], BLOCK_G, WPG]), axis=2)  # the words of a group
    gg = g0 + tl.arange(0, BLOCK_G)
    m2 = nmask[:, None] & (gg < row_groups)[None, :]
    s = block_scale(tl.load(blk + s_off + n[:, None] * row_groups + gg[None, :], mask=m2, other=0), MXFP4)
    return part * s


@jit
def _decode_gate_up_kernel(
    x_ptr, ids_ptr, loc_ptr, scales_ptr, slots_ptr, host_ptr, h_ptr, block_bytes, gw_off, uw_off, gs_off,
    us_off, limit, H: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    PDL: tl.constexpr, USE_PTX: tl.constexpr, MXFP4: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    # program (k, n block): h[k, n] = silu(gate[n] . x) * (up[n] . x) for BLOCK_N rows of expert k;
    # H, I, K are constexpr so the loops unroll and every block load is in flight at once
    if PDL:  # the down launch may start now (it waits for h itself)
        gdc_launch_dependents()
    k = tl.program_id(0)
    blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    ws2 = scales_ptr + e * 3
    h = _swiglu_rows(
        x_ptr, blk, ws2, gw_off, uw_off, gs_off, us_off, n, nmask, limit, H, BLOCK_G, USE_PTX, MXFP4, CLAMP
    )
    tl.store(h_ptr + k * I + n, h, mask=nmask)


@jit
def _swiglu_rows(
    x_ptr, blk, ws2_ptr, gw_off, uw_off, gs_off, us_off, n, nmask, limit, H: tl.constexpr,
    BLOCK_G: tl.constexpr, USE_PTX: tl.constexpr, MXFP4: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    # h[n] = silu(gate[n] . x) * (up[n] . x) in fp32 for the expert rows n [BN] of block blk, ws2_ptr its
    # (gate, up, down) global scales; rows masked off give 0
    WPG: tl.constexpr = 4 if MXFP4 else 2  # int32 code words per block scale
    G: tl.constexpr = H // (8 * WPG)  # block scales a row
    acc_g = tl.zeros([n.shape[0], BLOCK_G], tl.float32)
    acc_u = tl.zeros([n.shape[0], BLOCK_G], tl.float32)
    for g0 in tl.static_range(0, G, BLOCK_G):
        xs = _x_octets(x_ptr, WPG * g0, H // 8, WPG * BLOCK_G)
        acc_g += _group_partial(blk, gw_off, gs_off, n, g0, G, nmask, xs, BLOCK_G, USE_PTX, MXFP4)
        acc_u += _group_partial(blk, uw_off, us_off, n, g0, G, nmask, xs, BLOCK_G, USE_PTX, MXFP4)
    unit = nvfp4_unit(USE_PTX)
    g = tl.sum(acc_g, axis=1) * (_global_scale(ws2_ptr, MXFP4) * unit)
    u = tl.sum(acc_u, axis=1) * (_global_scale(ws2_ptr + 1, MXFP4) * unit)
    return _swiglu(g, u, limit, CLAMP)


@jit
def _global_scale(ptr, MXFP4: tl.constexpr):
    # an expert matrix's FP32 weight_scale_2 (NVFP4); MXFP4 has none (its blocks' table holds 1.0, unread)
    if MXFP4:
        s = 1.0
    else:
        s = tl.load(ptr)
    return s


@jit
def _swiglu(g, u, limit, CLAMP: tl.constexpr):
    # silu(g) * u in fp32; CLAMP (DeepSeek-V4's swiglu_limit): g clamped above and u on both sides at limit
    # first, as torch's clamp (a NaN stays NaN)
    if CLAMP:
        nan: tl.constexpr = tl.PropagateNan.ALL
        g = tl.minimum(g, limit, propagate_nan=nan)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=nan), limit, propagate_nan=nan)
    return g * tl.sigmoid(g) * u


@jit
def _prefetch_down_rows(
    ids_ptr, loc_ptr, slots_ptr, block_bytes, dw_off, ds_off, s, n, K: tl.constexpr, PER: tl.constexpr,
    I: tl.constexpr, LINES_W: tl.constexpr, LINES_S: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    # L2 prefetch of the down rows n (codes, scales) of the split's experts in VRAM slots: a block in host
    # RAM is left alone (read twice over the bus, it would cost the bus twice)
    for kk in tl.static_range(PER):
        k = s * PER + kk
        if k < K:
            c = tl.load(loc_ptr + tl.load(ids_ptr + k).to(tl.int64)).to(tl.int64)
            if c >= 0:
                blk = slots_ptr + c * block_bytes
                l2_prefetch_rows(blk + dw_off + n * (I // 2), I // 2, LINES_W)  # codes
                l2_prefetch_rows(blk + ds_off + n * G, G, LINES_S)  # scales, G a row


@jit
def _decode_down_kernel(
    h_ptr, ids_ptr, loc_ptr, scales_ptr, slots_ptr, host_ptr, w_ptr, part_ptr, done_ptr, out_ptr, block_bytes,
    dw_off, ds_off, K: tl.constexpr, PER: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr, USE_PTX: tl.constexpr,
    LINES_W: tl.constexpr, LINES_S: tl.constexpr, MXFP4: tl.constexpr,
):  # fmt: skip
    # program (n block, split s): part[s, n] = sum over experts k = s PER .. s PER + PER - 1, in order, of
    # w[k] * down_k[n] . h[k]; the splits of a row block run in parallel (more bytes in flight than one
    # program looping over all K)
    WPG: tl.constexpr = 4 if MXFP4 else 2  # int32 code words per block scale
    G: tl.constexpr = I // (8 * WPG)  # block scales a row
    nb, s = tl.program_id(0), tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    if PDL:  # launched while gate+up runs: start reading the rows into L2, then wait for h
        _prefetch_down_rows(
            ids_ptr, loc_ptr, slots_ptr, block_bytes, dw_off, ds_off, s, n, K, PER, I, LINES_W, LINES_S, G
        )
        gdc_wait()
    rows = tl.zeros([BLOCK_N], tl.float32)
    for kk in tl.static_range(PER):
        k = s * PER + kk
        if k < K:
            blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes)
            acc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
            for g0 in tl.static_range(0, G, BLOCK_G):
                hs = _x_octets(h_ptr + k * I, WPG * g0, I // 8, WPG * BLOCK_G)
                acc += _group_partial(blk, dw_off, ds_off, n, g0, G, nmask, hs, BLOCK_G, USE_PTX, MXFP4)
            rows += tl.sum(acc, axis=1) * (_global_scale(scales_ptr + e * 3 + 2, MXFP4) * tl.load(w_ptr + k))
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


# dequantised prefill tiles hold w 2^-8 (`_word_tile`), so that s times 2^(bias - 1), the unit of the codes'
# bits, stays inside fp16 for every scale s <= 448; the epilogues multiply it back
PREFILL_UNIT = tl.constexpr(256.0) if tl is not None else 256.0


def nvfp4_moe_prefill_ref(
    x, slots, expert_ids, expert_to_slot, ws2, weights, layout: ExpertLayout, *, swiglu_limit=None
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
        y = swiglu_ref(xs @ gate.T, xs @ up.T, swiglu_limit) @ down.T  # [n, H]
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group (token, k) pairs by group id (an expert) into BLOCK_M tiles without a host sync; pairs of group
    -1 are left out. Tiles run in group order, each group's pairs in pair order.

    Args:
        group_of_pair: [P] int64 group of each flattened pair p = t * K + k, or -1 (left out).
        num_groups: G.
        block_m: rows per tile.

    Returns:
        (pair_ids [NT * block_m] int32, padding = P; tile_group [NT] int32, -1 past the last tile;
        row_of_pair [P] int32, the row of pair_ids holding each pair, NT * block_m if left out) where
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
    row_of_pair = torch.empty(p, dtype=torch.int32, device=dev)
    row_of_pair[order] = dest.to(torch.int32)
    tile_idx = torch.searchsorted(tile_end[:num_groups], torch.arange(nt, device=dev), right=True)  # [NT]
    tile_group = torch.where(tile_idx < num_groups, tile_idx, -1).to(torch.int32)
    return pair_ids[:-1], tile_group, row_of_pair


def tile_starts(counts: list[int], block_m: int) -> list[int]:
    """First tile of each group in `sort_pairs`' order, from the pairs per group on the host: [G + 1], the
    last entry the tiles in use. Consecutive groups g..h own tiles [starts[g], starts[h + 1])."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + cdiv(c, block_m))
    return starts


@dataclass
class PairOrder:
    """A prefill launch's (token, k) pairs sorted by expert into tiles, and the launch config it was made for.
    Made once per prompt call (`order_pairs`); a bank that runs the experts in several passes launches each
    pass over its experts' tiles only (`tile_starts`)."""

    pair_ids: torch.Tensor  # [NT * block_m] int32 pair per tile row, P for padding
    tile_expert: torch.Tensor  # [NT] int32 expert of each tile, -1 past the last
    # [T, K] int32 each token's tile rows, ascending: rows run in expert order (a token's pairs of one expert
    # in k order), so this is the order `combine_rows` adds them in
    token_rows: torch.Tensor
    config: dict

    @property
    def tiles(self) -> int:
        return self.tile_expert.numel()


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
    flat = expert_ids.reshape(-1).long()
    pair_ids, tile_expert, row_of_pair = sort_pairs(flat, num_experts, cfg["block_m"])
    token_rows = row_of_pair.view(expert_ids.shape).sort(dim=1).values
    return PairOrder(pair_ids, tile_expert, token_rows, cfg)


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
    order: PairOrder | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed expert sum for many tokens, grouped by expert, on tensor cores.

    Args:
        x: [T, H] activations (fp32 / fp16 / bf16).
        slots: [S, block_bytes] uint8 expert blocks, on the device or in pinned host RAM (read over the bus).
        expert_ids: [T, K] int32/int64 routed experts (zero-token experts and duplicates allowed).
        expert_to_slot: [E] int32/int64 slot holding each expert; every routed expert must have one.
        ws2: [S, 3] float32 weight_scale_2 (gate, up, down) of each slot (not read for MXFP4).
        weights: [T, K] float32 router weights.
        layout: the block layout, NVFP4 or MXFP4.
        config: block_m, block_n, block_k (bytes), num_warps, num_stages, optionally maxnreg (a register
            cap per thread for gate+up, so that more programs share an SM), scale_words and tile_major (see
            `nvfp4_moe_prefill_rows`); default from the routing size.
        order: expert_ids' pairs already sorted by `order_pairs` (its config is used): the call then has no
            host-side step, so a CUDA graph can capture it.
        swiglu_limit: clamp gate x above and up x on both sides first (DeepSeek-V4); None: no clamp.

    Returns:
        [T, H] in x.dtype.
    """
    order = order or order_pairs(expert_ids, expert_to_slot.numel(), layout, config=config)
    tiles = (0, order.tiles)
    y, work = prefill_buffers(x, layout, order.tiles * order.config["block_m"])
    nvfp4_moe_prefill_rows(
        x, slots, expert_to_slot, ws2, weights, layout, order, tiles, y, work, swiglu_limit=swiglu_limit
    )
    total = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    combine_rows(y, order, expert_to_slot, tiles, total, accumulate=False)
    return total.to(x.dtype)


def prefill_buffers(x: torch.Tensor, layout: ExpertLayout, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [rows, H], work [rows, I]) in x.dtype: the scratch `nvfp4_moe_prefill_rows` fills."""
    y = torch.empty(rows, layout.hidden_size, dtype=x.dtype, device=x.device)
    return y, torch.empty(rows, layout.intermediate_size, dtype=x.dtype, device=x.device)


def nvfp4_moe_prefill_rows(
    x: torch.Tensor,
    slots: torch.Tensor,
    expert_to_slot: torch.Tensor,
    ws2: torch.Tensor,
    weights: torch.Tensor,
    layout: ExpertLayout,
    order: PairOrder,
    tiles: tuple[int, int],
    y: torch.Tensor,
    work: torch.Tensor,
    *,
    launch: dict | None = None,
    swiglu_limit: float | None = None,
) -> None:
    """Weighted expert outputs of the pairs in tiles [t0, t1) of `order`, by tile row: y[r - t0 BLOCK_M] =
    weights[p] expert_p(x[token of p]) for the pair p in row r. Tiles whose expert maps to -1 are skipped
    (their rows are left as they are). A bank that fits a prompt's experts in several passes launches each
    pass over its experts' tiles and adds the rows into the token sums with `combine_rows`.

    Args: as `nvfp4_moe_prefill`, plus order: the pairs of expert_ids [T, K] sorted by `order_pairs`; tiles:
    (t0, t1); y: [R, H] in x.dtype and work (h = silu(g) u): [R, I] in x.dtype, R >= (t1 - t0) BLOCK_M;
    launch: block_n, block_k, num_warps, num_stages (and maxnreg, scale_words, tile_major) in place of the
    order's (its block_m stays: the tiles are made), e.g. the shape tuned for a bank's passes of a few experts
    each. Either config may hold a "down" dict of those keys: the down launch's own shape (K = I is a quarter
    of gate+up's K = H). A maxnreg caps the launch of the shape that names it: gate+up's is not down's.
    scale_words reads a step's E4M3 scales as int32 words, which the compiler can stage ahead like the codes,
    where the rows allow it (block_k >= 32, K / 16 a multiple of 4); tile_major launches a tile's n blocks
    one after another (they share its input rows in L2) instead of one n block's tiles; down follows gate+up
    in both unless it names its own. swiglu_limit: as `nvfp4_moe_decode`'s.
    """
    _check_common(x, slots, layout)
    assert ws2.dtype == torch.float32 and ws2.shape == (slots.shape[0], 3) and ws2.is_contiguous()
    assert x.dim() == 2 and weights.shape[0] == x.shape[0], f"x {tuple(x.shape)} / weights {weights.shape}"
    assert expert_to_slot.dtype in (torch.int32, torch.int64) and expert_to_slot.dim() == 1
    assert weights.dtype == torch.float32 and weights.is_contiguous(), f"weights {weights.dtype}"
    t, k = weights.shape
    h_size, i_size = layout.hidden_size, layout.intermediate_size
    p = t * k
    # a launch shape replaces the order's whole (its cap and scale reads too; the order's down stays)
    replaced = ("maxnreg", "scale_words", "tile_major") if launch else ()
    own = {key: v for key, v in order.config.items() if key not in replaced}
    cfg = {**own, **(launch or {}), "block_m": order.config["block_m"]}
    down = {**{key: v for key, v in cfg.items() if key != "maxnreg"}, **cfg.get("down", {})}
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    group = layout.group
    for b in (bk, down["block_k"]):  # word tiles: whole int32 words and whole scale groups (8 or 16 bytes)
        assert b >= group // 2 and b & (b - 1) == 0, f"block_k {b}: a power of two >= {group // 2} bytes"
    assert order.pair_ids.numel() == order.tiles * bm and order.token_rows.numel() == p, "order"
    t0, t1 = tiles
    assert 0 <= t0 <= t1 <= order.tiles, f"tiles {tiles} of {order.tiles}"
    rows = (t1 - t0) * bm
    for buf, width in ((y, h_size), (work, i_size)):
        assert buf.dtype == x.dtype and buf.is_contiguous() and buf.dim() == 2, f"{buf.dtype} {buf.shape}"
        assert buf.shape[0] >= rows and buf.shape[1] == width, f"buffer {tuple(buf.shape)} for {rows} rows"
    require_triton(x, ws2, expert_to_slot, weights, y, work)
    if t1 == t0:
        return
    off = _offsets(layout)
    common = dict(
        block_bytes=layout.block_bytes, H=h_size, I=i_size, BLOCK_M=bm, DOT_PRECISION=dot_precision(x.dtype),
        MXFP4=_format(layout),
    )  # fmt: skip
    tile_args = (order.pair_ids, order.tile_expert, expert_to_slot)
    launch_e2m1(
        _prefill_gate_up_kernel, _tile_grid(t1 - t0, cdiv(i_size, bn), cfg), x.device,
        x, *tile_args, slots, ws2, work, p, k, t0, gw_off=off["gw_off"], uw_off=off["uw_off"],
        gs_off=off["gs_off"], us_off=off["us_off"], **common, **_launch_shape(cfg, h_size, group),
        **_clamp(swiglu_limit),
    )  # fmt: skip
    launch_e2m1(
        _prefill_down_kernel, _tile_grid(t1 - t0, cdiv(h_size, down["block_n"]), down), x.device,
        work, *tile_args, slots, ws2, weights, y, p, t0, dw_off=off["dw_off"], ds_off=off["ds_off"], **common,
        **_launch_shape(down, i_size, group),
    )  # fmt: skip


def _tile_grid(tiles: int, n_blocks: int, cfg: dict) -> tuple[int, ...]:
    # (tiles, n blocks), or tile-major in one dimension (`_program`)
    return (tiles * n_blocks,) if cfg.get("tile_major") else (tiles, n_blocks)


def _launch_shape(cfg: dict, k_in: int, group: int) -> dict:
    # maxnreg: ptxas' .maxnreg register cap (the interpreter ignores it). scale_words: a step's scale bytes
    # read as int32 words, where each row's step holds whole words (4 groups of `group` elements: block_k
    # >= 2 group bytes, and k_in / group groups a row, a multiple of 4). tile_major: the programs in
    # tile-major launch order (`_program`)
    cap = {"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}
    words = bool(cfg.get("scale_words")) and cfg["block_k"] >= 2 * group and (k_in // group) % 4 == 0
    return dict(
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        SCALE_WORDS=words,
        TILE_MAJOR=bool(cfg.get("tile_major")),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **cap,
    )


def _combine_args(y, order: PairOrder, expert_to_slot, tiles, total):
    t0, t1 = tiles
    bm = order.config["block_m"]
    assert total.dtype == torch.float32 and total.dim() == 2 and total.is_contiguous(), f"total {total.dtype}"
    assert y.dim() == 2 and y.shape[1] == total.shape[1] and y.shape[0] >= (t1 - t0) * bm, f"y {y.shape}"
    assert order.token_rows.shape[0] == total.shape[0], "order made for another token count"
    return t0 * bm, t1 * bm, order.token_rows.shape[1], bm


def combine_rows_ref(y, order: PairOrder, expert_to_slot, tiles, total, accumulate: bool) -> None:
    """Plain-torch twin of `combine_rows` (the same FP32 additions in the same order)."""
    r0, r1, k, bm = _combine_args(y, order, expert_to_slot, tiles, total)
    rows = order.token_rows.long()  # [T, K] ascending
    acc = torch.zeros_like(total)
    hit = torch.zeros(total.shape[0], dtype=torch.bool, device=total.device)
    for j in range(k):
        r = rows[:, j]
        inside = (r >= r0) & (r < r1)
        tile = torch.where(inside, r // bm, 0)
        e = order.tile_expert[tile].long()
        ok = inside & (e >= 0) & (expert_to_slot[e.clamp(min=0)] >= 0)
        if accumulate:  # a token's first row of the range adds onto its sum so far
            acc = torch.where((ok & ~hit)[:, None], total, acc)
        acc = torch.where(ok[:, None], acc + y[torch.where(ok, r - r0, 0)].float(), acc)
        hit |= ok
    if accumulate:
        total[hit] = acc[hit]
    else:
        total.copy_(acc)


def combine_rows(
    y: torch.Tensor,
    order: PairOrder,
    expert_to_slot: torch.Tensor,
    tiles: tuple[int, int],
    total: torch.Tensor,
    accumulate: bool,
) -> None:
    """Add each token's pair rows from tiles [t0, t1) of `order` (written by `nvfp4_moe_prefill_rows`) one
    after another in expert order (`PairOrder.token_rows`) onto 0, or with accumulate onto total's row, for
    the tokens that have such a pair, and write the result into total [T, H] FP32 (without accumulate every
    token's row, 0 where it has none). Rows of tiles whose expert maps to -1 are not read. Passes over
    consecutive experts in ascending order so give every token the same FP32 additions in the same order
    however the experts are grouped into passes. Deterministic: no atomics."""
    r0, r1, k, bm = _combine_args(y, order, expert_to_slot, tiles, total)
    require_triton(y, expert_to_slot, total)
    t, h = total.shape
    block_t, block_n = 16, 128
    _combine_rows_kernel[(cdiv(t, block_t), cdiv(h, block_n))](
        y, order.token_rows, order.tile_expert, expert_to_slot, total, t, k, r0, r1, h,
        ACCUMULATE=accumulate, BLOCK_M=bm, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip


@jit(do_not_specialize=("T", "K", "R0", "R1"))
def _combine_rows_kernel(
    y_ptr, row_ptr, tile_expert_ptr, e2s_ptr, total_ptr, T, K, R0, R1, H, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # program (token block, column block): total[t, n] = ((total[t, n] or 0) + y[r_1 - R0, n]) + ... over
    # token t's rows r_j (ascending, `token_rows`) in [R0, R1) whose tile's expert has a slot; with
    # ACCUMULATE a token's sum is read at its first such row (masked: only tokens the range touches)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    out = total_ptr + t.to(tl.int64)[:, None] * H + n[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    hit = tl.zeros([BLOCK_T], tl.int1)
    for j in range(K):
        r = tl.load(row_ptr + t.to(tl.int64) * K + j, mask=tmask, other=-1)
        inside = (r >= R0) & (r < R1)
        e = tl.load(tile_expert_ptr + r // BLOCK_M, mask=inside, other=-1)
        s = tl.load(e2s_ptr + tl.maximum(e, 0), mask=inside & (e >= 0), other=-1)
        ok = inside & (e >= 0) & (s >= 0)
        if ACCUMULATE:
            first = ok & ~hit
            base = tl.load(out, mask=first[:, None] & nmask[None, :], other=0.0)
            acc = tl.where(first[:, None], base, acc)
        yr = y_ptr + (r - R0).to(tl.int64)[:, None] * H + n[None, :]
        yv = tl.load(yr, mask=ok[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        acc = tl.where(ok[:, None], acc + yv, acc)
        hit = hit | ok
    if ACCUMULATE:
        tl.store(out, acc, mask=(tmask & hit)[:, None] & nmask[None, :])
    else:
        tl.store(out, acc, mask=tmask[:, None] & nmask[None, :])


@jit
def _tile_slot(tile_expert_ptr, e2s_ptr, tile):
    # slot of the tile's expert (int64), or -1: no expert (past the last tile), or not in this pass
    e = tl.load(tile_expert_ptr + tile)
    return tl.where(e >= 0, tl.load(e2s_ptr + tl.maximum(e, 0)).to(tl.int64), -1)


@jit
def _program(n_blocks, TILE_MAJOR: tl.constexpr):
    # (tile i of the range, n block) of this program. The hardware starts programs in launch order: a
    # (tiles, n blocks) grid runs every tile of one n block before the next, re-reading each tile's input
    # rows per n block; a tile-major 1-D grid runs a tile's n blocks together, so they share its rows in L2
    if TILE_MAJOR:
        return tl.program_id(0) // n_blocks, tl.program_id(0) % n_blocks
    return tl.program_id(0), tl.program_id(1)


@jit
def _tile(tile_expert_ptr, e2s_ptr, pair_ptr, slots_ptr, block_bytes, T0, i, P, BLOCK_M: tl.constexpr):
    # tile T0 + i: (its expert's slot or -1, the slot's block, its pairs [BM] (P: padding), their rows in the
    # range's buffers, which pairs are real)
    tile = T0 + i
    slot = _tile_slot(tile_expert_ptr, e2s_ptr, tile)
    pair = tl.load(pair_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    return slot, slots_ptr + tl.maximum(slot, 0) * block_bytes, pair, rows, pair < P


@jit
def _word_tile(
    blk, w_off, s_off, k0, n, nmask, row_bytes, row_groups, BLOCK_K: tl.constexpr, USE_PTX: tl.constexpr,
    dtype: tl.constexpr, SCALE_WORDS: tl.constexpr, MXFP4: tl.constexpr,
):  # fmt: skip
    # W^T tile [2 BK, BN] of rows n over packed bytes k0 .. k0 + BK - 1 in dtype, read as int32 words of 8
    # columns (e2m1_word_cols), each weight times 2^-8 (PREFILL_UNIT): an NVFP4 code c times its scale s is
    # exact in any of the three dtypes (6 significant bits; c s 2^-8 a multiple of 2^-18 and <= 10.5); an
    # MXFP4 one (s = 2^e) in fp32 and bf16 for e in -117..9, in fp16 for e in -15..9. One scale load and
    # decode per group (16 weights NVFP4, 32 MXFP4), broadcast over its WPG words
    BW: tl.constexpr = BLOCK_K // 4
    WPG: tl.constexpr = 4 if MXFP4 else 2  # int32 code words per block scale
    ww = k0 // 4 + tl.arange(0, BW)
    words = (blk + w_off).to(tl.pointer_type(tl.int32))
    m = (ww < row_bytes // 4)[:, None] & nmask[None, :]
    w = tl.load(words + n[None, :] * (row_bytes // 4) + ww[:, None], mask=m, other=0)  # [BW, BN]
    if SCALE_WORDS:  # int32 words of 4 scale bytes (the pipeliner stages them: cp.async moves >= 4 bytes)
        SW: tl.constexpr = BLOCK_K // (16 * WPG)
        sw = k0 // (16 * WPG) + tl.arange(0, SW)
        sm = (sw < row_groups // 4)[:, None] & nmask[None, :]
        swords = (blk + s_off).to(tl.pointer_type(tl.int32))
        sv = tl.load(swords + n[None, :] * (row_groups // 4) + sw[:, None], mask=sm, other=0)  # [SW, BN]
        byte = tl.arange(0, 4) * 8
        sb = ((sv[:, None, :] >> byte[None, :, None]) & 0xFF).to(tl.uint8)  # [SW, 4, BN]: group 4 sw + j
        sb = tl.reshape(sb, (BW // WPG, n.shape[0]))
    else:  # a byte per group
        g = k0 // (4 * WPG) + tl.arange(0, BW // WPG)
        sm = (g < row_groups)[:, None] & nmask[None, :]
        sb = tl.load(blk + s_off + n[None, :] * row_groups + g[:, None], mask=sm, other=0)  # [BW / WPG, BN]
    s = (block_scale(sb, MXFP4) * e2m1_cols_unit(dtype, USE_PTX)).to(dtype)
    s = tl.reshape(tl.broadcast_to(s[:, None, :], (BW // WPG, WPG, n.shape[0])), (BW, n.shape[0]))
    c0, c1, c2, c3, c4, c5, c6, c7 = e2m1_word_cols(w, dtype, USE_PTX)
    # [BW, BN, c >> 2, (c >> 1) & 1, c & 1]: a join's new dimension is its fastest in registers, so the two
    # columns of a byte (one packed multiply) lie next to each other and the registers run in K order
    t = tl.join(
        tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7))
    ) * s[:, :, None, None, None]  # fmt: skip
    return tl.reshape(tl.permute(t, (0, 2, 3, 4, 1)), (2 * BLOCK_K, n.shape[0]))


@jit
def _x_tile(xrow, xmask, k0, K_IN, BLOCK_K: tl.constexpr):
    # the step's input columns [BM, 2 BK] of rows xrow [BM, 1] (pointers) for packed bytes k0 .. k0 + BK - 1
    kk = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
    return tl.load(xrow + kk[None, :], mask=xmask & (kk < K_IN)[None, :], other=0.0)


@jit
def _dot_step(
    acc, xs, blk, w_off, s_off, k0, n, nmask, K_IN, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PTX: tl.constexpr, SCALE_WORDS: tl.constexpr, MXFP4: tl.constexpr,
):  # fmt: skip
    # acc [BM, BN] += the step's input columns xs [BM, 2 BK] (_x_tile) times W^T 2^-8 for rows n of an
    # [N, K_IN] matrix: one dot of K = 2 BK
    GROUP: tl.constexpr = 32 if MXFP4 else 16
    wt = _word_tile(
        blk, w_off, s_off, k0, n, nmask, K_IN // 2, K_IN // GROUP, BLOCK_K, USE_PTX, xs.dtype, SCALE_WORDS,
        MXFP4,
    )  # fmt: skip
    return tl.dot(xs, wt, acc, input_precision=DOT_PRECISION)


@jit(do_not_specialize=("P", "K", "T0"))  # pair counts and tile offsets vary per call: one variant
def _prefill_gate_up_kernel(
    x_ptr, pair_ptr, tile_expert_ptr, e2s_ptr, slots_ptr, ws2_ptr, h_ptr, P, K, T0, block_bytes, H, I,
    gw_off, uw_off, gs_off, us_off, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PTX: tl.constexpr, SCALE_WORDS: tl.constexpr,
    TILE_MAJOR: tl.constexpr, MXFP4: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    # program (tile T0 + i, n block): h[i BM + m, n] = silu(x[tok] gate^T) * (x[tok] up^T), rows of one expert
    i, nb = _program(tl.cdiv(I, BLOCK_N), TILE_MAJOR)
    slot, blk, pair, rows, valid = _tile(
        tile_expert_ptr, e2s_ptr, pair_ptr, slots_ptr, block_bytes, T0, i, P, BLOCK_M
    )
    if slot < 0:  # past the last tile, or its expert is not in this pass
        return
    tok = (pair // K).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H // 2, BLOCK_K):  # k0 in packed bytes: column pairs (2 k0, 2 k0 + 1) on
        xs = _x_tile(x_ptr + tok[:, None] * H, valid[:, None], k0, H, BLOCK_K)
        acc_g = _dot_step(
            acc_g, xs, blk, gw_off, gs_off, k0, n, nmask, H, BLOCK_K, DOT_PRECISION, USE_PTX, SCALE_WORDS,
            MXFP4,
        )  # fmt: skip
        acc_u = _dot_step(
            acc_u, xs, blk, uw_off, us_off, k0, n, nmask, H, BLOCK_K, DOT_PRECISION, USE_PTX, SCALE_WORDS,
            MXFP4,
        )  # fmt: skip
    g = acc_g * (_global_scale(ws2_ptr + slot * 3, MXFP4) * PREFILL_UNIT)
    u = acc_u * (_global_scale(ws2_ptr + slot * 3 + 1, MXFP4) * PREFILL_UNIT)
    hv = _swiglu(g, u, limit, CLAMP)
    hm = valid[:, None] & nmask[None, :]
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], hv.to(h_ptr.dtype.element_ty), mask=hm)


@jit(do_not_specialize=("P", "T0"))
def _prefill_down_kernel(
    h_ptr, pair_ptr, tile_expert_ptr, e2s_ptr, slots_ptr, ws2_ptr, w_ptr, y_ptr, P, T0, block_bytes, H, I,
    dw_off, ds_off,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PTX: tl.constexpr, SCALE_WORDS: tl.constexpr, TILE_MAJOR: tl.constexpr, MXFP4: tl.constexpr,
):  # fmt: skip
    # program (tile T0 + i, n block): y[i BM + m, n] = w[pair] * h[i BM + m] down^T, rows of one expert
    i, nb = _program(tl.cdiv(H, BLOCK_N), TILE_MAJOR)
    slot, blk, pair, rows, valid = _tile(
        tile_expert_ptr, e2s_ptr, pair_ptr, slots_ptr, block_bytes, T0, i, P, BLOCK_M
    )
    if slot < 0:  # past the last tile, or its expert is not in this pass
        return
    rows = rows.to(tl.int64)  # of h and y (int64 offsets: a long one-shot prompt passes 2^31 elements)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I // 2, BLOCK_K):
        hs = _x_tile(h_ptr + rows[:, None] * I, valid[:, None], k0, I, BLOCK_K)
        acc = _dot_step(
            acc, hs, blk, dw_off, ds_off, k0, n, nmask, I, BLOCK_K, DOT_PRECISION, USE_PTX, SCALE_WORDS,
            MXFP4,
        )  # fmt: skip
    rw = tl.load(w_ptr + pair, mask=valid, other=0.0)
    acc = acc * (_global_scale(ws2_ptr + slot * 3 + 2, MXFP4) * PREFILL_UNIT) * rw[:, None]
    ym = valid[:, None] & nmask[None, :]
    tl.store(y_ptr + rows[:, None] * H + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)
