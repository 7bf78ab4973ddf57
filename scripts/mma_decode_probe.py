"""Probe (device): the one-token routed experts on tensor cores, against the engine's FMA decode kernels.

Why it was tried: docs/kernels.md had the FMA decode kernels (`nvfp4_moe_decode`) bound by instruction issue
on sm_90 (~6 instructions a code: bit decode, two conversions, an FMA). Here a code costs its share of the bit
decode, a packed multiply by its block scale and 1/256 of an mma.sync (3.5 a code in sm_90 SASS, Triton 3.9).

How a warp maps onto mma.sync.m16n8k16 (bf16 in, fp32 accumulate), through inline PTX (one element per thread:
every tensor is [32 num_warps], which Triton lays out element i on thread i). Lane l = 4 g + t. Gate+up: the
eight quads read four rows' 128-byte chunks (quads g and g + 4 one row's two halves, so one warp load is four
whole lines); A row g is row g % 4 of the warp's eight, A row g + 8 the row four further, over K half g // 4.
Word q's 8 codes give four bf16x2 patterns, pattern j holding columns j and j + 4 (the codes' bits placed in
bf16, value x 2^-126), times the block scale as s 2^118 (cvt e4m3x2, then fp32), exactly c s 2^-8. Since the
dot product does not care in which order k runs, B takes x in the same order, loaded by the same lane: every
column of B is x over one K half, so D[g, 2t] is A row g's product where t // 2 == g // 4. Down (rows 320
bytes, not whole lines) keeps rows g and g + 8 and 64-byte chunks, and takes h as bf16 hi and lo halves
(h = hi + lo to 16 bits, two mmas a word), which gate+up writes in the B order. Needs sm_89+ and bf16 x.

Measured 2026-12-02 (docs/benchmarks.md, twenty-first session), graph-timed as `bench kernels` times decode, k
= 10, blocks in HBM: 21.2-22.5 us a call against 22.9-23.5 for the FMA kernels in the same runs (8 runs);
error against the fp32 twin like the FMA kernels' (bf16 output rounding). The time is not in the maths: with
gate+up's maths removed (its reads kept, READ_ONLY) a call still took 18.2-20.4 us and gate+up 10.1-10.7 us
for its 18.4 MB, whether each warp load read half lines or whole lines, with any cache hint (HINT: .nc,
L1::no_allocate, L2::256B) and in either grid order (a form since removed); with K also split over 2-10
programs (GSPLIT) gate+up took 8.5-10.3 us. The same gate and up codes read as contiguous 4 KiB pieces
(`stream_codes`) took 6.2 us. L2 prefetches of a warp's slice (an earlier mapping) made it slower (28.6 us).
From pinned host RAM it was slower than the FMA kernels (633-737 against 564-569 us). Not built into the
engine: ~8 % of a kernel that is ~1.5 ms of a 48-layer `vram` token, for a second decode kernel family with no
interpreter twin. The twenty-second session found the access pattern not to be the limit either: read-only
kernels in the FMA kernels' own pattern read gate+up's codes in 6.5 us (`scripts/read_probe.py`); this
probe's READ_ONLY form still loads x, the scales and h.
Usage: python3 scripts/mma_decode_probe.py"""

import torch

from expertstream.bench.kernels import EXPERTS, decode_calls, graph_ms, launch_us, random_bank, route
from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels import nvfp4_moe
from expertstream.kernels.codec import (
    cdiv,
    dependent_launch,
    device_capability,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    prefetch_lines,
    tl,
)
from expertstream.kernels.nvfp4_moe import _expert_block, _prefetch_down_rows


def mma_decode_ok(x: torch.Tensor) -> bool:
    """The tensor-core decode runs on sm_89+ (cvt e4m3x2, mma bf16) for bf16 activations."""
    cap = device_capability(x.device)
    return cap is not None and tuple(cap) >= (8, 9) and x.dtype == torch.bfloat16


def _pattern(d: str, u: str, j: int) -> str:
    # bf16x2 pattern j of word u (columns j, j + 4): sign bit 4j + 3 -> 15, magnitude bits 4j.. -> 6 .. 8
    sign = f"shl.b32 s0, {u}, {12 - 4 * j};" if j < 3 else f"mov.b32 s0, {u};"
    sh = 6 - 4 * j
    mag = f"shl.b32 s1, {u}, {sh};" if sh >= 0 else f"shr.b32 s1, {u}, {-sh};"
    return f"{sign}\nand.b32 s0, s0, 0x80008000;\n{mag}\nand.b32 s1, s1, 0x01C001C0;\nor.b32 {d}, s0, s1;"


MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def mma_word_asm(b_sets: int) -> str:
    """$0..$3 = $4..$7 + the products of one word of rows g ($8) and g + 8 ($9), scaled by the bf16x2 block
    scales $10, $11, with each of `b_sets` B operands ($12 + 4 i .. $15 + 4 i: the word's x pairs)."""
    lines = ["{", ".reg .b32 a<8>, s0, s1, z;", "mov.b32 z, 0x80008000;"]
    for r, (u, sc) in enumerate((("$8", "$10"), ("$9", "$11"))):
        for j in range(4):
            lines.append(_pattern(f"a{4 * r + j}", u, j))
            lines.append(f"fma.rn.bf16x2 a{4 * r + j}, a{4 * r + j}, {sc}, z;")
    c = "{$4, $5, $6, $7}"
    for i in range(b_sets):
        b = 12 + 4 * i
        lines.append(f"{MMA} {{$0, $1, $2, $3}}, {{a0, a4, a1, a5}}, {{${b}, ${b + 1}}}, {c};")
        c = "{$0, $1, $2, $3}"
        lines.append(f"{MMA} {{$0, $1, $2, $3}}, {{a2, a6, a3, a7}}, {{${b + 2}, ${b + 3}}}, {c};")
    return "\n".join(lines + ["}"])


# two e4m3 block scales ($2, low byte first) -> each as s 2^118 in bf16, broadcast to both halves
SCALE_ASM = """{
.reg .b32 h2, b;
.reg .b16 l0, l1;
.reg .f32 f0, f1;
cvt.rn.f16x2.e4m3x2 h2, $2;
mov.b32 {l0, l1}, h2;
cvt.f32.f16 f0, l0;
cvt.f32.f16 f1, l1;
mul.f32 f0, f0, 0f7A800000;
mul.f32 f1, f1, 0f7A800000;
cvt.rn.bf16x2.f32 b, f1, f0;
prmt.b32 $0, b, b, 0x1010;
prmt.b32 $1, b, b, 0x3232;
}"""

LOAD4_ASM = "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];"
LOAD4_HINTS = ("ld.global.nc.L1::no_allocate.v4.u32", "ld.global.L2::256B.v4.u32",
               "ld.global.nc.L1::no_allocate.L2::256B.v4.u32")  # fmt: skip

# 8 bf16 of x in column order -> the pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7)
X_PAIRS_ASM = """{
.reg .b32 r0, r1, r2, r3;
ld.global.v4.u32 {r0, r1, r2, r3}, [$4];
prmt.b32 $0, r0, r2, 0x5410;
prmt.b32 $1, r0, r2, 0x7632;
prmt.b32 $2, r1, r3, 0x5410;
prmt.b32 $3, r1, r3, 0x7632;
}"""

if tl is not None:
    MMA1_ASM = tl.constexpr(mma_word_asm(1))
    MMA2_ASM = tl.constexpr(mma_word_asm(2))
    SCALE_ASM_C = tl.constexpr(SCALE_ASM)
    LOAD4_ASM_C = tl.constexpr(LOAD4_ASM)
    LOAD4_H1 = tl.constexpr(LOAD4_HINTS[0] + " {$0, $1, $2, $3}, [$4];")
    LOAD4_H2 = tl.constexpr(LOAD4_HINTS[1] + " {$0, $1, $2, $3}, [$4];")
    LOAD4_H3 = tl.constexpr(LOAD4_HINTS[2] + " {$0, $1, $2, $3}, [$4];")
    X_PAIRS_ASM_C = tl.constexpr(X_PAIRS_ASM)


@jit
def _load4(ptrs, HINT: tl.constexpr = 0):
    # not pure: the compiler would sink a pure load to its use, leaving one chunk's reads in flight at a time
    if HINT == 1:
        r = tl.inline_asm_elementwise(
            LOAD4_H1, "=r,=r,=r,=r,l", [ptrs], (tl.uint32,) * 4, is_pure=False, pack=1
        )
    elif HINT == 2:
        r = tl.inline_asm_elementwise(
            LOAD4_H2, "=r,=r,=r,=r,l", [ptrs], (tl.uint32,) * 4, is_pure=False, pack=1
        )
    elif HINT == 3:
        r = tl.inline_asm_elementwise(
            LOAD4_H3, "=r,=r,=r,=r,l", [ptrs], (tl.uint32,) * 4, is_pure=False, pack=1
        )
    else:
        r = tl.inline_asm_elementwise(
            LOAD4_ASM_C, "=r,=r,=r,=r,l", [ptrs], (tl.uint32,) * 4, is_pure=False, pack=1
        )
    return r


@jit
def _load2(ptrs):
    return tl.inline_asm_elementwise(
        "ld.global.u16 $0, [$1];", "=h,l", [ptrs], tl.int16, is_pure=False, pack=1
    )


@jit
def _x_pairs(ptrs):
    return tl.inline_asm_elementwise(
        X_PAIRS_ASM_C,
        "=r,=r,=r,=r,l",
        [ptrs],
        (tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=True,
        pack=1,
    )


@jit
def _scales(b):
    # the two block scales (int16: e4m3 bytes of groups 2t, 2t + 1 of the chunk) as bf16x2 multipliers
    return tl.inline_asm_elementwise(
        SCALE_ASM_C, "=r,=r,h", [b], (tl.uint32, tl.uint32), is_pure=True, pack=1
    )


@jit
def _mma1(acc, w0, w1, s0, s1, b):
    return tl.inline_asm_elementwise(
        MMA1_ASM, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r,r,r",
        [acc[0], acc[1], acc[2], acc[3], w0, w1, s0, s1, b[0], b[1], b[2], b[3]],
        (tl.float32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


@jit
def _mma2(acc, w0, w1, s0, s1, b, c):
    return tl.inline_asm_elementwise(
        MMA2_ASM, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r,r,r,r,r,r,r",
        [acc[0], acc[1], acc[2], acc[3], w0, w1, s0, s1, b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
        (tl.float32,) * 4, is_pure=True, pack=1,
    )  # fmt: skip


@jit
def _chunk_reads(
    blk, w_off, s_off, r0, r1, wpos, spos, RB: tl.constexpr, RS: tl.constexpr, HINT: tl.constexpr
):
    # the lane's reads for the two A rows: 16 code bytes at wpos of rows r0 and r1 (RB bytes a row) and the
    # two scale bytes at spos (RS a row); issued for a warp's whole K slice before any is used
    w = blk + w_off + wpos
    sc = blk + s_off + spos
    return _load4(w + r0 * RB, HINT), _load4(w + r1 * RB, HINT), _load2(sc + r0 * RS), _load2(sc + r1 * RS)


@jit
def _chunk_mma(acc, reads, xb, xb2, TWO: tl.constexpr):
    w, w8, s, s8 = reads
    sa, sb = _scales(s)
    sa8, sb8 = _scales(s8)
    if TWO:
        acc = _mma2(acc, w[0], w8[0], sa, sa8, xb[0], xb2[0])
        acc = _mma2(acc, w[1], w8[1], sa, sa8, xb[1], xb2[1])
        acc = _mma2(acc, w[2], w8[2], sb, sb8, xb[2], xb2[2])
        acc = _mma2(acc, w[3], w8[3], sb, sb8, xb[3], xb2[3])
    else:
        acc = _mma1(acc, w[0], w8[0], sa, sa8, xb[0])
        acc = _mma1(acc, w[1], w8[1], sa, sa8, xb[1])
        acc = _mma1(acc, w[2], w8[2], sb, sb8, xb[2])
        acc = _mma1(acc, w[3], w8[3], sb, sb8, xb[3])
    return acc


@jit
def _perm(j):
    # position of h element j in the B order: octet columns (0, 4, 1, 5, 2, 6, 3, 7)
    return (j & ~7) | ((j & 3) << 1) | ((j >> 2) & 1)


@jit
def _mma_gate_up_kernel(
    x_ptr, ids_ptr, loc_ptr, scales_ptr, slots_ptr, host_ptr, hh_ptr, lo_off, block_bytes, gw_off, uw_off,
    gs_off, us_off, H: tl.constexpr, I: tl.constexpr, ROWG: tl.constexpr, KSPLIT: tl.constexpr,
    GSPLIT: tl.constexpr,
    PDL: tl.constexpr, READ_ONLY: tl.constexpr, HINT: tl.constexpr,
):  # fmt: skip
    # program (k, row block): h[k, rows] = silu(gate . x) * (up . x) for ROWG groups of 16 rows of expert k,
    # each group's K split over KSPLIT warps; h stored as bf16 hi (hh) and lo (hh + lo_off) in the B order
    if PDL:
        gdc_launch_dependents()
    k, rb = tl.program_id(0), tl.program_id(1)
    blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes)
    NT: tl.constexpr = 32 * ROWG * KSPLIT
    i = tl.arange(0, NT)
    lane, warp = i % 32, i // 32
    g, t = lane // 4, lane % 4
    hf = g // 4  # quads 0-3 read the first 64 bytes of a row's 128-byte chunk, quads 4-7 the rest
    row = (rb * ROWG + warp // KSPLIT) * 8 + g % 4  # A row g; A row g + 8 is row + 4
    # GSPLIT (READ_ONLY only): K also split over programs (grid axis 2), so each program reads a short span
    CPS: tl.constexpr = H // 256 // KSPLIT // GSPLIT
    c0 = (tl.program_id(2) * KSPLIT + warp % KSPLIT) * CPS
    z = tl.zeros([NT], tl.float32)
    ag = (z, z, z, z)
    au = (z, z, z, z)
    rg = ()
    ru = ()
    for cc in tl.static_range(CPS):
        wpos = (c0 + cc) * 128 + hf * 64 + t * 16
        spos = (c0 + cc) * 16 + hf * 8 + t * 2
        rg = rg + (_chunk_reads(blk, gw_off, gs_off, row, row + 4, wpos, spos, H // 2, H // 16, HINT),)
        ru = ru + (_chunk_reads(blk, uw_off, us_off, row, row + 4, wpos, spos, H // 2, H // 16, HINT),)
    if READ_ONLY:  # the same reads, no maths: what the access pattern alone costs
        bits = tl.zeros([NT], tl.uint32)
        for cc in tl.static_range(CPS):
            for m in tl.static_range(2):
                rr = rg[cc] if m == 0 else ru[cc]
                bits ^= rr[0][0] ^ rr[0][1] ^ rr[0][2] ^ rr[0][3] ^ rr[1][0] ^ rr[1][1] ^ rr[1][2] ^ rr[1][3]
                bits ^= rr[2].to(tl.uint32) ^ rr[3].to(tl.uint32)
        f = (bits & 0x3FFFFF).to(tl.float32)
        ag = (f, f, f, f)
        au = (f, f, f, f)
    else:
        for cc in tl.static_range(CPS):
            xk = x_ptr + (c0 + cc) * 256 + hf * 128 + t * 32
            xb = (_x_pairs(xk), _x_pairs(xk + 8), _x_pairs(xk + 16), _x_pairs(xk + 24))
            ag = _chunk_mma(ag, rg[cc], xb, xb, False)
            au = _chunk_mma(au, ru[cc], xb, xb, False)
    ws = scales_ptr + e * 3
    wg, wu = tl.load(ws) * 256.0, tl.load(ws + 1) * 256.0
    # D column j holds x's half j // 4, so D[g, 2t] is row g's product over its own half where
    # t // 2 == g // 4: lane t = 2 (g // 4) keeps it, and a row's two halves (A rows g, g + 4) are summed
    keep = t == 2 * hf
    j = tl.arange(0, 4)[None, :]
    for half in tl.static_range(2):  # c0: rows row (A row g), c2: rows row + 4 (A row g + 8)
        gg = tl.reshape(tl.where(keep, ag[2 * half], 0.0), [ROWG, KSPLIT * 2, 4, 4])
        uu = tl.reshape(tl.where(keep, au[2 * half], 0.0), [ROWG, KSPLIT * 2, 4, 4])
        gv = tl.sum(tl.sum(gg, axis=3), axis=1) * wg  # [ROWG, 4]
        uv = tl.sum(tl.sum(uu, axis=3), axis=1) * wu
        h = gv * tl.sigmoid(gv) * uv
        r = (rb * ROWG + tl.arange(0, ROWG)[:, None]) * 8 + j + 4 * half
        hi = h.to(tl.bfloat16)
        lo = (h - hi.to(tl.float32)).to(tl.bfloat16)
        dst = hh_ptr + k * I + _perm(r)
        tl.store(dst, hi)
        tl.store(dst + lo_off, lo)


@jit
def _mma_down_kernel(
    hh_ptr, lo_off, ids_ptr, loc_ptr, scales_ptr, slots_ptr, host_ptr, w_ptr, part_ptr, done_ptr, out_ptr,
    block_bytes, dw_off, ds_off, K: tl.constexpr, PER: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
    ROWG: tl.constexpr, PDL: tl.constexpr, HINT: tl.constexpr, LINES_W: tl.constexpr, LINES_S: tl.constexpr,
):  # fmt: skip
    # program (row block, split s): part[s, rows] = sum over experts k = s PER .. s PER + PER - 1, in order,
    # of w[k] down_k[rows] . h[k]; the last program of a row block sums the splits in order
    nb, s = tl.program_id(0), tl.program_id(1)
    NT: tl.constexpr = 32 * ROWG
    i = tl.arange(0, NT)
    lane, warp = i % 32, i // 32
    row = (nb * ROWG + warp) * 16 + lane // 4
    t = lane % 4
    if PDL:  # launched while gate+up runs: the rows into L2 first, then wait for h
        _prefetch_down_rows(ids_ptr, loc_ptr, slots_ptr, block_bytes, dw_off, ds_off, s,
                            nb * NT // 2 + tl.arange(0, NT // 2), K, PER, I, LINES_W, LINES_S)  # fmt: skip
        gdc_wait()
    tot0 = tl.zeros([NT], tl.float32)
    tot8 = tl.zeros([NT], tl.float32)
    for kk in tl.static_range(PER):
        k = s * PER + kk
        if k < K:
            blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes)
            z = tl.zeros([NT], tl.float32)
            acc = (z, z, z, z)
            reads = ()
            for c in tl.static_range(I // 128):
                wpos, spos = c * 64 + t * 16, c * 8 + t * 2
                reads = reads + (
                    _chunk_reads(blk, dw_off, ds_off, row, row + 8, wpos, spos, I // 2, I // 16, HINT),
                )
            for c in tl.static_range(I // 128):
                hk = hh_ptr + k * I + c * 128 + t * 32  # pairs stored in the B order: plain loads
                hb = (_load4(hk), _load4(hk + 8), _load4(hk + 16), _load4(hk + 24))
                lb = (_load4(hk + lo_off), _load4(hk + lo_off + 8), _load4(hk + lo_off + 16),
                      _load4(hk + lo_off + 24))  # fmt: skip
                acc = _chunk_mma(acc, reads[c], hb, lb, True)
            f = tl.load(scales_ptr + e * 3 + 2) * tl.load(w_ptr + k)
            tot0 += acc[0] * f
            tot8 += acc[2] * f
    keep = (lane % 4) == 0
    tl.store(part_ptr + s * H + row, tot0, mask=keep)
    tl.store(part_ptr + s * H + row + 8, tot8, mask=keep)
    tl.debug_barrier()  # as in the FMA kernel: the last split to finish sums the row block in order
    splits = tl.num_programs(1)
    if tl.atomic_add(done_ptr + nb, 1, sem="acq_rel") == splits - 1:
        n = nb * ROWG * 16 + tl.arange(0, ROWG * 16)
        total = tl.zeros([ROWG * 16], tl.float32)
        for j in range(splits):
            total += tl.load(part_ptr + j * H + n, cache_modifier=".cg")
        tl.store(out_ptr + n, (total * 256.0).to(out_ptr.dtype.element_ty))


MMA_DEFAULT = dict(rowg_gu=1, ksplit_gu=2, rowg_down=4, split_down=10)


def nvfp4_moe_decode_mma(
    x, expert_ids, loc, scales, weights, layout: ExpertLayout, slots, host=None, *, config: dict | None = None
) -> torch.Tensor:
    """`nvfp4_moe_decode` on tensor cores (same arguments and result; `mma_decode_ok(x)` must hold)."""
    host = slots if host is None else host
    assert mma_decode_ok(x), f"tensor-core decode needs sm_89+ and bf16 x, got {x.dtype} on {x.device}"
    cfg = config or MMA_DEFAULT
    k, h_size, i_size = expert_ids.numel(), layout.hidden_size, layout.intermediate_size
    rg, ks, rd = cfg["rowg_gu"], cfg["ksplit_gu"], cfg["rowg_down"]
    gsplit = cfg.get("gsplit", 1)
    assert gsplit == 1 or cfg.get("read_only"), "a K split over programs has no sum: reads only"
    assert h_size % (256 * ks * gsplit) == 0 and i_size % (8 * rg) == 0 and i_size % 128 == 0, (
        h_size,
        i_size,
        cfg,
    )
    assert h_size % (16 * rd) == 0 and x.data_ptr() % 16 == 0 and layout.block_bytes % 16 == 0
    hh = torch.empty(2, k, i_size, dtype=torch.bfloat16, device=x.device)  # h's hi and lo halves, B order
    per = cdiv(k, cfg["split_down"])
    part = torch.empty(cdiv(k, per), h_size, dtype=torch.float32, device=x.device)
    n_blocks = h_size // (16 * rd)
    done = torch.zeros(n_blocks, dtype=torch.int32, device=x.device)
    out = torch.empty_like(x)
    pdl = dependent_launch(device_capability(x.device))
    off = {p.name: p.offset for p in layout.parts}
    _mma_gate_up_kernel[(k, i_size // (8 * rg), gsplit)](
        x, expert_ids, loc, scales, slots, host, hh, k * i_size, layout.block_bytes,
        off["gate_proj.weight"], off["up_proj.weight"], off["gate_proj.weight_scale"],
        off["up_proj.weight_scale"], H=h_size, I=i_size, ROWG=rg, KSPLIT=ks, GSPLIT=gsplit, PDL=pdl,
        READ_ONLY=cfg.get("read_only", False), HINT=cfg.get("hint", 0),
        num_warps=rg * ks,
    )  # fmt: skip
    _mma_down_kernel[(n_blocks, cdiv(k, per))](
        hh, k * i_size, expert_ids, loc, scales, slots, host, weights, part, done, out, layout.block_bytes,
        off["down_proj.weight"], off["down_proj.weight_scale"], K=k, PER=per, H=h_size, I=i_size, ROWG=rd,
        PDL=pdl, HINT=cfg.get("hint", 0), LINES_W=prefetch_lines(i_size // 2),
        LINES_S=prefetch_lines(i_size // 16), num_warps=rd, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


@jit
def _stream_kernel(ids_ptr, loc_ptr, slots_ptr, host_ptr, out_ptr, block_bytes, start, BLOCK: tl.constexpr):
    # program (k, piece): xor of BLOCK contiguous bytes of expert k's block from `start` (gate then up codes)
    k, piece = tl.program_id(0), tl.program_id(1)
    blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, host_ptr, k, block_bytes)
    words = (blk + start + piece * BLOCK).to(tl.pointer_type(tl.int32))
    v = tl.load(words + tl.arange(0, BLOCK // 4))
    tl.store(out_ptr + k * tl.num_programs(1) + piece, tl.reduce(v, 0, _xor))


@jit
def _xor(a, b):
    return a ^ b


def stream_codes(x, expert_ids, loc, scales, weights, layout, slots, host=None, *, config=None):
    """Read the routed experts' gate and up codes (16.4 MB at k = 10) as contiguous 4 KiB pieces: what the
    same bytes cost with the simplest access pattern, in the same harness."""
    nbytes, block = 2 * layout.part("gate_proj.weight").nbytes, 4096
    out = torch.empty(expert_ids.numel(), nbytes // block, dtype=torch.int32, device=x.device)
    _stream_kernel[(expert_ids.numel(), nbytes // block)](
        expert_ids, loc, slots, slots if host is None else host, out, layout.block_bytes,
        layout.part("gate_proj.weight").offset, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- the comparison


layout, slots, ws2 = random_bank(EXPERTS)
ids, w = route(4)
x = torch.randn(layout.hidden_size, dtype=torch.bfloat16, device="cuda")
loc = torch.arange(EXPERTS, dtype=torch.int32, device="cuda")
for r in range(4):
    ref = nvfp4_moe.nvfp4_moe_decode_ref(x, ids[r], loc, ws2, w[r], layout, slots).float()
    fma = nvfp4_moe.nvfp4_moe_decode(x, ids[r], loc, ws2, w[r], layout, slots).float()
    mma = nvfp4_moe_decode_mma(x, ids[r], loc, ws2, w[r], layout, slots).float()
    scale = ref.abs().max().item()
    print(
        f"route {r}: max|ref| {scale:.3g}  fma err {(fma - ref).abs().max().item() / scale:.2e}"
        f"  mma err {(mma - ref).abs().max().item() / scale:.2e}"
        f"  mma-fma {(mma - fma).abs().max().item() / scale:.2e}"
    )

D = MMA_DEFAULT
SHAPES = [D, {**D, "rowg_gu": 2}, {**D, "ksplit_gu": 1}, {**D, "read_only": True}]
SHAPES += [{**D, "hint": h} for h in (1, 2, 3)]
SHAPES += [
    {**D, "read_only": True, "ksplit_gu": ks, "gsplit": gs} for ks, gs in ((1, 10), (2, 5), (1, 5), (1, 2))
]
for place in ("vram", "host"):
    print(f"{place}: fma kernels {1e3 * graph_ms(decode_calls(layout, slots, ws2, place)):.1f} us per call")
    for cfg in SHAPES if place == "vram" else SHAPES[:1]:
        calls = decode_calls(layout, slots, ws2, place, cfg, nvfp4_moe_decode_mma)
        print(f"  {place} mma {cfg}: {1e3 * graph_ms(calls):.1f} us per call")
    calls = decode_calls(layout, slots, ws2, place, None, stream_codes)
    print(f"  {place} gate and up codes streamed in 4 KiB pieces: {1e3 * graph_ms(calls):.1f} us per call")

# each launch's share in one replay (torch.profiler), FMA kernels and the first shape
for name, fn, cfg in (
    ("fma", None, None),
    ("mma", nvfp4_moe_decode_mma, D),
    ("read", nvfp4_moe_decode_mma, SHAPES[3]),
    ("read, K over 10 programs", nvfp4_moe_decode_mma, SHAPES[-4]),
    ("read, K over 2 programs", nvfp4_moe_decode_mma, SHAPES[-1]),
):
    shares = launch_us(decode_calls(layout, slots, ws2, "vram", cfg, fn))
    print(name, {k[:50]: round(v, 1) for k, v in shares.items()})
