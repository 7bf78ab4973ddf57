"""Probe (device): how fast the decode kernels' bytes can be read, by access pattern alone (no maths).

The twenty-first session found the decode kernels bound by how they read HBM: gate+up's reads alone took
10.1-10.7 us a call where the same codes read as contiguous 4 KiB pieces took 6.2 us. This times read-only
kernels over the same blocks as `bench kernels` (k = 10 routed experts a call, 16 calls a graph, each on
another route), each program reading R rows of a region:
- rows: a step loads [R, W] words, W words of each of the R rows (the decode kernels' pattern: block_g
  groups of 16 codes are W = 2 block_g words);
- flat: a step loads W contiguous words of the program's R rows, whatever rows they belong to.
It xors what it reads into one word a program, so no load is dropped. Gate+up reads both regions (rows of
H/8 words), down one (rows of I/8 words). It also times the shipped kernels with one route for every call,
so that a call's blocks stay in L2, and gate+up at its tuned shape with its parts added back one at a time
and no maths (codes; + block scales; + x split into columns and broadcast over the rows, 85 barriers a
program as in the kernel): where the time above the reads goes.

Measured 2026-12-02 03:56-04:00 (docs/benchmarks.md, twenty-second session): gate+up's codes in the shipped
pattern 6.50 us, in flat pieces 6.34 us; down's 4.5-5.7 us; the shipped kernels 24.7 us from HBM and 21.9 us
with the blocks in L2. The access pattern is not what holds the decode kernels back. 2026-12-02 06:03
(twenty-third session): gate+up's codes 6.57 us, + scales 7.68, + x columns 9.47, the shipped gate+up 13.87.
Usage: python3 scripts/read_probe.py"""

import torch

from expertstream.bench.kernels import (
    DECODE_SWEEP,
    EXPERTS,
    ROTATE,
    decode_calls,
    graph_ms,
    launch_us,
    random_bank,
    route,
)
from expertstream.kernels import nvfp4_moe_decode
from expertstream.kernels.codec import cdiv, e4m3_f16, jit, tl
from expertstream.kernels.nvfp4_moe import _expert_block, _x_octets


@jit
def _xor(a, b):
    return a ^ b


@jit
def _read_kernel(
    ids_ptr, loc_ptr, slots_ptr, out_ptr, block_bytes, off0, off1, ROWS: tl.constexpr, ROW: tl.constexpr,
    R: tl.constexpr, W: tl.constexpr, NREG: tl.constexpr, FLAT: tl.constexpr,
):  # fmt: skip
    # program (k, row block): xor of rows rb R .. rb R + R - 1 (ROW int32 words each) of NREG regions
    k, rb = tl.program_id(0), tl.program_id(1)
    blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, slots_ptr, k, block_bytes)
    if FLAT:
        acc = tl.zeros([W], tl.int32)
    else:
        acc = tl.zeros([R, W], tl.int32)
    n = rb * R + tl.arange(0, R)
    for reg in tl.static_range(NREG):
        base = (blk + (off0 if reg == 0 else off1)).to(tl.pointer_type(tl.int32))
        if FLAT:
            span = tl.minimum(R, ROWS - rb * R) * ROW
            for s in tl.static_range(0, R * ROW, W):
                i = s + tl.arange(0, W)
                acc ^= tl.load(base + rb * R * ROW + i, mask=i < span, other=0)
        else:
            for s in tl.static_range(0, ROW, W):
                c = s + tl.arange(0, W)
                m = (n < ROWS)[:, None] & (c < ROW)[None, :]
                acc ^= tl.load(base + n[:, None] * ROW + c[None, :], mask=m, other=0)
    tl.store(out_ptr + k * tl.num_programs(1) + rb, tl.reduce(tl.reshape(acc, [acc.numel]), 0, _xor))


@jit
def _ablate_kernel(
    x_ptr, ids_ptr, loc_ptr, slots_ptr, out_ptr, block_bytes, gw_off, uw_off, gs_off, us_off, H: tl.constexpr,
    I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SCALES: tl.constexpr, X: tl.constexpr,
):  # fmt: skip
    # gate+up's program (k, n block) with its steps' parts added back one at a time and no maths: the
    # codes (xored), the block scales (decoded and added), x (split into its eight columns and each
    # broadcast over the rows, as the kernel's products take it)
    k, nb = tl.program_id(0), tl.program_id(1)
    blk, e = _expert_block(ids_ptr, loc_ptr, slots_ptr, slots_ptr, k, block_bytes)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    acc = tl.zeros([BLOCK_N, 2 * BLOCK_G], tl.int32)
    facc = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    xacc = tl.zeros([BLOCK_N, 2 * BLOCK_G], tl.float32)
    for g0 in tl.static_range(0, H // 16, BLOCK_G):
        a, s = _ablate_part(blk, gw_off, gs_off, n, g0, H // 16, nmask, BLOCK_G, SCALES)
        acc ^= a
        facc += s
        a, s = _ablate_part(blk, uw_off, us_off, n, g0, H // 16, nmask, BLOCK_G, SCALES)
        acc ^= a
        facc += s
        if X:
            xs = _x_octets(x_ptr, 2 * g0, H // 8, 2 * BLOCK_G)
            xacc += xs[0][None, :] + xs[1][None, :] + xs[2][None, :] + xs[3][None, :]
            xacc += xs[4][None, :] + xs[5][None, :] + xs[6][None, :] + xs[7][None, :]
    bits = tl.reduce(tl.reshape(acc, [acc.numel]), 0, _xor).to(tl.float32)
    tl.store(
        out_ptr + k * tl.num_programs(1) + nb, bits + tl.sum(tl.sum(facc, 1), 0) + tl.sum(tl.sum(xacc, 1), 0)
    )


@jit
def _ablate_part(blk, w_off, s_off, n, g0, row_groups, nmask, BLOCK_G: tl.constexpr, SCALES: tl.constexpr):
    # one step's code words [BN, 2 BG] (as the kernel loads them) and, with SCALES, its decoded scales
    wi = 2 * g0 + tl.arange(0, 2 * BLOCK_G)
    m = nmask[:, None] & (wi < 2 * row_groups)[None, :]
    words = (blk + w_off).to(tl.pointer_type(tl.int32))
    w = tl.load(words + n[:, None] * (2 * row_groups) + wi[None, :], mask=m, other=0)
    s = tl.zeros([n.shape[0], BLOCK_G], tl.float32)
    if SCALES:
        gg = g0 + tl.arange(0, BLOCK_G)
        m2 = nmask[:, None] & (gg < row_groups)[None, :]
        s = e4m3_f16(tl.load(blk + s_off + n[:, None] * row_groups + gg[None, :], mask=m2, other=0)).to(
            tl.float32
        )
    return w, s


def ablate_calls(layout, slots, scales: bool, xcols: bool, block_n: int = 4, block_g: int = 16) -> list:
    ids, _ = route(ROTATE)
    loc = torch.arange(EXPERTS, dtype=torch.int32, device=slots.device)
    x = torch.randn(layout.hidden_size, dtype=torch.bfloat16, device=slots.device)
    i_size = layout.intermediate_size
    out = torch.empty(ids.shape[1], cdiv(i_size, block_n), dtype=torch.float32, device=slots.device)
    offs = [layout.part(p).offset for p in ("gate_proj.weight", "up_proj.weight")]
    offs += [layout.part(p).offset for p in ("gate_proj.weight_scale", "up_proj.weight_scale")]

    def call(i):
        _ablate_kernel[(ids.shape[1], cdiv(i_size, block_n))](
            x, ids[i], loc, slots, out, layout.block_bytes, *offs, H=layout.hidden_size, I=i_size,
            BLOCK_N=block_n, BLOCK_G=block_g, SCALES=scales, X=xcols, num_warps=2,
        )  # fmt: skip

    return [lambda i=i: call(i) for i in range(ROTATE)]


def read_calls(layout, slots, region: str, r: int, w: int, flat: bool, warps: int) -> list:
    ids, _ = route(ROTATE)
    loc = torch.arange(EXPERTS, dtype=torch.int32, device="cuda")
    if region == "gate+up":
        rows, row = layout.intermediate_size, layout.hidden_size // 8
        offs, nreg = (layout.part("gate_proj.weight").offset, layout.part("up_proj.weight").offset), 2
    else:
        rows, row = layout.hidden_size, layout.intermediate_size // 8
        offs, nreg = (layout.part("down_proj.weight").offset,) * 2, 1
    out = torch.empty(ids.shape[1], cdiv(rows, r), dtype=torch.int32, device="cuda")

    def call(i):
        _read_kernel[(ids.shape[1], cdiv(rows, r))](
            ids[i], loc, slots, out, layout.block_bytes, *offs, ROWS=rows, ROW=row, R=r, W=w, NREG=nreg,
            FLAT=flat, num_warps=warps,
        )  # fmt: skip

    return [lambda i=i: call(i) for i in range(ROTATE)]


def main() -> None:
    layout, slots, ws2 = random_bank(EXPERTS)
    codes = {"gate+up": 2 * layout.part("gate_proj.weight").nbytes}
    codes["down"] = layout.part("down_proj.weight").nbytes
    shipped = decode_calls(layout, slots, ws2, "vram")
    per = {k.split("(")[0][-24:]: round(1e3 * v, 1) for k, v in launch_us(shipped).items()}
    print(f"decode kernels as shipped: graph {1e3 * graph_ms(shipped):.1f} us a call", per)
    # the same kernels with one route for every call: its 27.6 MB stay in L2, so what is left is the maths
    ids, w = route(1)
    x = torch.randn(layout.hidden_size, dtype=torch.bfloat16, device="cuda")
    loc = torch.arange(EXPERTS, dtype=torch.int32, device="cuda")
    for cfg in [None, *DECODE_SWEEP[:4]]:
        calls = [lambda c=cfg: nvfp4_moe_decode(x, ids[0], loc, ws2, w[0], layout, slots, config=c)] * ROTATE
        per = {k.split("(")[0][-24:]: round(1e3 * v, 1) for k, v in launch_us(calls).items()}
        print(f"L2-resident {cfg or 'tuned'}: graph {1e3 * graph_ms(calls):.1f} us", per)
    # gate+up at the tuned shape (4 rows, 16 groups a step, 2 warps), its parts added back one at a time
    for scales, xcols in ((False, False), (True, False), (True, True)):
        us = 1e3 * graph_ms(ablate_calls(layout, slots, scales, xcols))
        print(f"gate+up codes{' + scales' if scales else ''}{' + x columns' if xcols else ''}: {us:.2f} us")
    shapes = {
        "gate+up": [(4, 32, False, 2), (4, 64, False, 2), (4, 128, False, 2), (4, 512, False, 2),
                    (4, 256, True, 2), (4, 256, True, 4), (4, 1024, True, 4), (8, 64, False, 4),
                    (8, 256, True, 4), (2, 64, False, 1), (2, 128, False, 2), (1, 128, False, 1),
                    (16, 256, True, 4), (16, 512, True, 8), (32, 1024, True, 8)],
        "down": [(16, 8, False, 2), (16, 16, False, 2), (16, 32, False, 2), (16, 128, False, 2),
                 (16, 256, True, 2), (16, 256, True, 4), (32, 256, True, 4), (32, 512, True, 4),
                 (64, 1024, True, 8), (8, 128, False, 2), (16, 128, False, 4)],
    }  # fmt: skip
    for region, cases in shapes.items():
        for r, w, flat, warps in cases:
            us = 1e3 * graph_ms(read_calls(layout, slots, region, r, w, flat, warps))
            mb = codes[region] * 10 / 1e6
            print(
                f"{region:8s} R={r:3d} W={w:5d} {'flat' if flat else 'rows'} warps={warps}: {us:6.2f} us"
                f"  {mb / us:5.2f} TB/s ({mb:.1f} MB)"
            )


if __name__ == "__main__":
    main()
