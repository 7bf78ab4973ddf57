"""Probe (device): the prefill kernels written in Triton's Gluon dialect, where the wgmma waits are explicit.
Each step's wgmmas are issued asynchronously, the previous step's stay in flight, and the next step's reads
are in flight while this step decodes its tiles into the other of two shared-memory buffers: its x (or h)
tile by cp.async into a ring of three, its code words and scale bytes into registers. Same tiles, decoding
and units as `nvfp4_moe._prefill_gate_up_kernel` and `_prefill_down_kernel` (words, two codes of a byte in
one pair scaled by one bf16x2 multiply); bf16 only; needs BLOCK_N to divide I and H, BLOCK_K to divide
H / 2 and I / 2 (the real model's shapes), and BLOCK_M = 64 (one warp group's M), 4 warps. Compares h
(gate+up, through split_probe.compare) and y (down, on random h) and the times with the engine's kernels
on the same tiles. Runs with Triton 3.6 (the lent H200s) and 3.9.

Measured 2026-12-01 (docs/benchmarks.md, sixteenth session): bit-identical to the engine's kernels; at
their best shapes (gate+up 64 x 64 x 64, down 64 x 128 x 64) 2-9 % (gate+up) and 3-10 % (down) faster
than the engine's best of the same four shapes at T = 512, 2,451 and 8,192. Not built into the engine:
Hopper only (the target Blackwell cards have no wgmma), on an experimental API, for a gain that meets no
goal."""

import sys

import torch
import triton
from split_probe import main
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from expertstream.bench.kernels import EXPERTS, TOPK, _prompt, graph_ms, random_bank
from expertstream.kernels import nvfp4_moe as nm

# the names of Triton 3.9 or of the lent 3.6: a CTA-wide thread barrier, and cp.async into shared memory
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

PAIR_ASM: gl.constexpr = gl.constexpr("mov.b32 $0, $1;")


@gluon.jit
def _halves(p):
    pair = gl.inline_asm_elementwise(PAIR_ASM, "=r,r,r", [gl.join(p, p)], gl.bfloat16, True, 2)
    return gl.split(pair)


MUL_ASM: gl.constexpr = gl.constexpr("mul.rn.bf16x2 $0, $1, $2;")


@gluon.jit
def _pair(t, sp):
    # a byte's two codes (t = byte * 0x1001) as a bf16x2 pair times the scale pair sp (HMUL2)
    p = ((t << 12) & 0x80008000) | ((t << 6) & 0x01C001C0)
    q = gl.inline_asm_elementwise(MUL_ASM, "=r,r,r", [p, sp], gl.uint32, True, 1)
    return _halves(q)


@gluon.jit
def _word_loads(blk, w_off, s_off, k0, n, row_bytes, row_groups, BLOCK_K: gl.constexpr, WL: gl.constexpr):
    # a step's code words [BW, BN] (uint32) and scale bytes [BW / 2, BN] (int32) of rows n (SliceLayout(0,
    # WL)) over packed bytes k0 .. k0 + BK - 1, none past the row's end (zeros: the step after the last)
    BW: gl.constexpr = BLOCK_K // 4
    ww = k0 // 4 + gl.arange(0, BW, layout=gl.SliceLayout(1, WL))
    words = (blk + w_off).to(gl.pointer_type(gl.int32))
    wm = (ww < row_bytes // 4)[:, None]
    u = gl.load(words + n[None, :] * (row_bytes // 4) + ww[:, None], mask=wm, other=0).to(
        gl.uint32, bitcast=True
    )
    SL: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([2, 1, 2], [4, 8, 1], [1, 4, 1], [2, 0, 1]))
    g = k0 // 8 + gl.arange(0, BW // 2, layout=gl.SliceLayout(1, SL))
    ns = gl.convert_layout(n, gl.SliceLayout(0, SL))
    sb = gl.load(blk + s_off + ns[None, :] * row_groups + g[:, None], mask=(g < row_groups)[:, None], other=0)
    return u, sb.to(gl.int32)


@gluon.jit
def _word_decode(u, sb, BLOCK_K: gl.constexpr):
    # W^T tile [2 BK, BN] bf16 times 2^-8 (as the Triton kernel's) of _word_loads' words and scales
    BW: gl.constexpr = BLOCK_K // 4
    f16 = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(gl.int16).to(gl.float16, bitcast=True)
    s16 = (f16.to(gl.float32) * 2.0**126).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    sp = (s16 | (s16 << 16)).to(gl.uint32, bitcast=True)
    sp = gl.reshape(gl.permute(gl.join(sp, sp), (0, 2, 1)), (BW, u.shape[1]))  # a word's scale pair
    sp = gl.convert_layout(sp, u.type.layout)
    c0, c1 = _pair((u & 0xFF) * 0x1001, sp)
    c2, c3 = _pair(((u >> 8) & 0xFF) * 0x1001, sp)
    c4, c5 = _pair(((u >> 16) & 0xFF) * 0x1001, sp)
    c6, c7 = _pair((u >> 24) * 0x1001, sp)
    t = gl.join(gl.join(gl.join(c0, c4), gl.join(c2, c6)), gl.join(gl.join(c1, c5), gl.join(c3, c7)))
    return gl.reshape(gl.permute(t, (0, 2, 3, 4, 1)), (2 * BLOCK_K, u.shape[1]))


# the x (or h) tile [BM, 2 BK], 16 B a thread; the code words [BW, BN], 16 B a thread along K
XL = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
WL = gl.constexpr(gl.BlockedLayout([4, 1], [4, 8], [1, 4], [0, 1]))


def layouts(block_m: int, block_n: int, block_k: int) -> dict:
    """The kernels' MMA accumulator layout (one warp group, M = 64) and shared layouts of the x tile and
    the dequantised W^T tile [2 BK, BN] (K contiguous), as constexpr arguments."""
    return dict(
        MMA=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16]),
        XS=gl.NVMMASharedLayout.get_default_for([block_m, 2 * block_k], gl.bfloat16),
        WS=gl.NVMMASharedLayout.get_default_for([2 * block_k, block_n], gl.bfloat16, transposed=True),
    )


@gluon.jit
def _tile(T0, tile_expert_ptr, e2s_ptr, slots_ptr, block_bytes, BLOCK_N: gl.constexpr):
    # program's tile T0 + program_id(0): (tile, its expert's slot (int64) or -1, the slot's block, the
    # program's columns n [BN] in SliceLayout(0, WL)), as nvfp4_moe._tile
    tile = T0 + gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    slot = gl.where(e >= 0, gl.load(e2s_ptr + gl.maximum(e, 0)).to(gl.int64), -1)
    n = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, WL))
    return tile, slot, slots_ptr + gl.maximum(slot, 0) * block_bytes, n


@gluon.jit
def _gl_gate_up_kernel(
    x_ptr, pair_ptr, tile_expert_ptr, e2s_ptr, slots_ptr, ws2_ptr, h_ptr, P, K, T0, block_bytes, H, I,
    gw_off, uw_off, gs_off, us_off, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    MMA: gl.constexpr, XS: gl.constexpr, WS: gl.constexpr,
):  # fmt: skip
    # h = silu(x gate^T) (x up^T) for the tile's rows, as nvfp4_moe._prefill_gate_up_kernel; each step's two
    # wgmmas asynchronous, the previous step's in flight, and the next step's reads in flight while this
    # step decodes: its x tile by cp.async into a ring of three (the step before last's wgmmas may still
    # read one), its words and scales into registers (the Triton kernels' scale bytes, read in the step,
    # were their top stall in Nsight Compute)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_M, 2 * BLOCK_K], XS)
    g_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 2 * BLOCK_K, BLOCK_N], WS)
    u_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 2 * BLOCK_K, BLOCK_N], WS)

    tile, slot, blk, n = _tile(T0, tile_expert_ptr, e2s_ptr, slots_ptr, block_bytes, BLOCK_N)
    if slot >= 0:
        m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        pair = gl.load(pair_ptr + tile * BLOCK_M + m)
        valid = pair < P
        tok = (pair // K).to(gl.int64)
        acc_g = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA))
        acc_u = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA))
        xp = x_ptr + tok[:, None] * H + gl.arange(0, 2 * BLOCK_K, layout=gl.SliceLayout(0, XL))[None, :]
        _async_load(x_smem.index(0), xp, mask=valid[:, None])
        async_copy.commit_group()
        ug, sg = _word_loads(blk, gw_off, gs_off, 0, n, H // 2, H // 16, BLOCK_K, WL)
        uu, su = _word_loads(blk, uw_off, us_off, 0, n, H // 2, H // 16, BLOCK_K, WL)
        for k0 in range(0, H // 2, BLOCK_K):
            step = k0 // BLOCK_K
            b = step % 2
            # the step before last's wgmmas are done: g/u buffer b and x slot (step + 1) % 3 are free
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
            nk = k0 + BLOCK_K
            _async_load(x_smem.index((step + 1) % 3), xp + 2 * nk, mask=valid[:, None] & (nk < H // 2))
            async_copy.commit_group()
            ug_next, sg_next = _word_loads(blk, gw_off, gs_off, nk, n, H // 2, H // 16, BLOCK_K, WL)
            uu_next, su_next = _word_loads(blk, uw_off, us_off, nk, n, H // 2, H // 16, BLOCK_K, WL)
            g_smem.index(b).store(_word_decode(ug, sg, BLOCK_K))
            u_smem.index(b).store(_word_decode(uu, su, BLOCK_K))
            async_copy.wait_group(1)  # this step's x is in (the next step's may not be)
            fence_async_shared()
            _barrier()
            acc_g = warpgroup_mma(x_smem.index(step % 3), g_smem.index(b), acc_g, is_async=True)
            acc_u = warpgroup_mma(x_smem.index(step % 3), u_smem.index(b), acc_u, is_async=True)
            ug, sg, uu, su = ug_next, sg_next, uu_next, su_next
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        g = acc_g * (gl.load(ws2_ptr + slot * 3) * 256.0)
        u = acc_u * (gl.load(ws2_ptr + slot * 3 + 1) * 256.0)
        hv = g * (1.0 / (1.0 + gl.exp(-g))) * u
        rows = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        vm = gl.load(pair_ptr + tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))) < P
        nn = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        gl.store(h_ptr + rows[:, None].to(gl.int64) * I + nn[None, :], hv.to(gl.bfloat16), mask=vm[:, None])


@gluon.jit
def _gl_down_kernel(
    h_ptr, pair_ptr, tile_expert_ptr, e2s_ptr, slots_ptr, ws2_ptr, w_ptr, y_ptr, P, T0, block_bytes, H, I,
    dw_off, ds_off, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, MMA: gl.constexpr,
    XS: gl.constexpr, WS: gl.constexpr,
):  # fmt: skip
    # y[i BM + m, n] = w[pair] * h[i BM + m] down^T, as nvfp4_moe._prefill_down_kernel; one wgmma a step, the
    # previous one in flight, the next step's reads as in _gl_gate_up_kernel
    h_smem = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_M, 2 * BLOCK_K], XS)
    d_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 2 * BLOCK_K, BLOCK_N], WS)

    tile, slot, blk, n = _tile(T0, tile_expert_ptr, e2s_ptr, slots_ptr, block_bytes, BLOCK_N)
    if slot >= 0:
        m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        valid = gl.load(pair_ptr + tile * BLOCK_M + m) < P
        rows = (gl.program_id(0) * BLOCK_M + m).to(gl.int64)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA))
        hp = h_ptr + rows[:, None] * I + gl.arange(0, 2 * BLOCK_K, layout=gl.SliceLayout(0, XL))[None, :]
        _async_load(h_smem.index(0), hp, mask=valid[:, None])
        async_copy.commit_group()
        ud, sd = _word_loads(blk, dw_off, ds_off, 0, n, I // 2, I // 16, BLOCK_K, WL)
        for k0 in range(0, I // 2, BLOCK_K):
            step = k0 // BLOCK_K
            b = step % 2
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the step before last's wgmma is done
            nk = k0 + BLOCK_K
            _async_load(h_smem.index((step + 1) % 3), hp + 2 * nk, mask=valid[:, None] & (nk < I // 2))
            async_copy.commit_group()
            ud_next, sd_next = _word_loads(blk, dw_off, ds_off, nk, n, I // 2, I // 16, BLOCK_K, WL)
            d_smem.index(b).store(_word_decode(ud, sd, BLOCK_K))
            async_copy.wait_group(1)
            fence_async_shared()
            _barrier()
            acc = warpgroup_mma(h_smem.index(step % 3), d_smem.index(b), acc, is_async=True)
            ud, sd = ud_next, sd_next
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        pair = gl.load(pair_ptr + tile * BLOCK_M + mm)
        vm = pair < P
        rw = gl.load(w_ptr + pair, mask=vm, other=0.0)
        yv = acc * (gl.load(ws2_ptr + slot * 3 + 2) * 256.0) * rw[:, None]
        ro = (gl.program_id(0) * BLOCK_M + mm).to(gl.int64)
        nn = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
        gl.store(y_ptr + ro[:, None] * H + nn[None, :], yv.to(gl.bfloat16), mask=vm[:, None])


def launch_gluon(x, args, h, p, layout, cfg: dict, grid, offs: dict) -> None:
    """The Gluon kernel over the tiles of `args` (split_probe.launch_split's signature)."""
    H, I = layout.hidden_size, layout.intermediate_size
    _gl_gate_up_kernel[grid](
        x, *args, h, p, TOPK, 0, layout.block_bytes, H, I, *offs.values(), BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"],
        **layouts(cfg["block_m"], cfg["block_n"], cfg["block_k"]),
    )  # fmt: skip


def compare_down(tokens: int, shape: tuple) -> None:
    """y of the engine's down launch and of the Gluon one on the same tiles and random h, and their times."""
    bm, bn, bk, nw, ns = shape
    layout, slots, ws2 = random_bank(EXPERTS)
    ids, w, x = _prompt(layout, EXPERTS, tokens, tokens, slots.device)
    cfg = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
    order = nm.order_pairs(ids, EXPERTS, layout, config=cfg)
    H, I, off = layout.hidden_size, layout.intermediate_size, nm._offsets(layout)
    h = torch.randn(order.tiles * bm, I, dtype=torch.bfloat16, device=x.device)
    y_ref = torch.zeros(order.tiles * bm, H, dtype=x.dtype, device=x.device)
    y_new = torch.zeros_like(y_ref)
    e2s = torch.arange(EXPERTS, dtype=torch.int32, device=x.device)
    args = (order.pair_ids, order.tile_expert, e2s, slots, ws2, w)
    grid, p = (order.tiles, triton.cdiv(H, bn)), ids.numel()

    def old():
        nm.launch_e2m1(
            nm._prefill_down_kernel, grid, x.device, h, *args, y_ref, p, 0, dw_off=off["dw_off"],
            ds_off=off["ds_off"], block_bytes=layout.block_bytes, H=H, I=I, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, DOT_PRECISION="tf32", SCALE_WORDS=False, TILE_MAJOR=False, num_warps=nw,
            num_stages=ns,
        )  # fmt: skip

    def new():
        _gl_down_kernel[grid](
            h, *args, y_new, p, 0, layout.block_bytes, H, I, off["dw_off"], off["ds_off"], BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, **layouts(bm, bn, bk),
        )  # fmt: skip

    old()
    new()
    torch.cuda.synchronize()
    d, top = (y_new.float() - y_ref.float()).abs().max().item(), y_ref.float().abs().max().item()
    print(f"down T={tokens} {cfg}: max |y gluon - y old| {d:.3e} (max |y| {top:.3e})")
    print(f"  old {1e3 * graph_ms([old]):.1f} us  gluon {1e3 * graph_ms([new]):.1f} us", flush=True)


if __name__ == "__main__":
    # (block_m, block_n, block_k, num_warps, num_stages): stages are the engine kernel's (Gluon's are two)
    shapes = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4)]
    for t in [int(a) for a in sys.argv[1:]] or [512, 2451, 8192]:
        main(t, shapes, "gluon", launch_gluon)
        for shape in shapes:
            compare_down(t, shape)
