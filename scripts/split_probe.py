"""Probe (device): prefill gate+up with the weights as the wgmma register operand, decoded from the codes in
the MMA's own layout. Per step two dots: the low nibbles (even columns) against x's even columns, the high
nibbles (odd columns) against the odd ones; x is permuted once so that each 16-column group holds its 8 even
columns, then its 8 odd ones (16-byte runs for the async copies). Times it against the engine's gate+up on
the same tiles and checks h."""

import sys

import torch
import triton
import triton.language as tl

from expertstream.bench.kernels import EXPERTS, TOPK, graph_ms, random_bank
from expertstream.kernels import nvfp4_moe as nm
from expertstream.kernels.codec import e4m3_f16

# 4 code bytes (b0 b1 | b2 b3 of one register) -> bf16 pairs (lo b0, lo b1), (lo b2, lo b3), (hi ..), (hi ..)
# code bits: sign to bit 15, magnitude to bits 6..8 (value * 2^-126); nibble masked, then one multiply places
# both fields (no overlap), one mask keeps them
# per output register: (scratch register, source pair, nibble mask, multiplier), low nibbles then high
_SPLIT_OPS = [("l", "p", 0x000F000F, 0x1040), ("l", "q", 0x000F000F, 0x1040),
              ("h", "p", 0x00F000F0, 0x104), ("h", "q", 0x00F000F0, 0x104)]  # fmt: skip
SPLIT_ASM = tl.constexpr(
    "{\n.reg .b32 p, q, l, h;\nprmt.b32 p, $4, 0, 0x4140;\nprmt.b32 q, $4, 0, 0x4342;\n"
    + "".join(
        f"and.b32 {r}, {src}, 0x{mask:08X};\nmul.lo.u32 {r}, {r}, 0x{mul:X};\n"
        f"and.b32 ${i}, {r}, 0x81C081C0;\n"
        for i, (r, src, mask, mul) in enumerate(_SPLIT_OPS)
    )
    + "}"
)


@triton.jit
def _split_tiles(blk, w_off, s_off, k0, n, row_bytes, row_groups, BLOCK_K: tl.constexpr):
    # (W_lo, W_hi) [BN, BK] bf16: codes of even / odd columns of packed bytes k0 .. k0 + BK - 1, times s 2^-8
    kk = k0 + tl.arange(0, BLOCK_K)
    b = tl.load(blk + w_off + n[:, None] * row_bytes + kk[None, :])
    g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    sb = tl.load(blk + s_off + n[:, None] * row_groups + g[None, :])
    s = (e4m3_f16(sb).to(tl.float32) * 2.0**126).to(tl.bfloat16)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (n.shape[0], BLOCK_K // 8, 8)), (n.shape[0], BLOCK_K))
    lo, hi = tl.inline_asm_elementwise(
        SPLIT_ASM, "=r,=r,=r,=r,r", [b], (tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
    )
    return lo * s, hi * s


@triton.jit(do_not_specialize=("P", "K", "T0"))
def _split_gate_up_kernel(
    x_ptr, pair_ptr, tile_expert_ptr, e2s_ptr, slots_ptr, ws2_ptr, h_ptr, P, K, T0, block_bytes, H, I,
    gw_off, uw_off, gs_off, us_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    slot, blk, pair, rows, valid = nm._tile(tile_expert_ptr, e2s_ptr, pair_ptr, slots_ptr, block_bytes, T0, P,
                                            BLOCK_M)  # fmt: skip
    if slot < 0:
        return
    tok = (pair // K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    xrow = x_ptr + tok[None, :] * H
    for k0 in range(0, H // 2, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        col = 16 * (kk // 8) + kk % 8  # even column 2 kk of the permuted x; odd: + 8
        xe = tl.load(xrow + col[:, None], mask=valid[None, :], other=0.0)  # [BK, BM]
        xo = tl.load(xrow + 8 + col[:, None], mask=valid[None, :], other=0.0)
        lo, hi = _split_tiles(blk, gw_off, gs_off, k0, n, H // 2, H // 16, BLOCK_K)
        acc_g = tl.dot(lo, xe, acc_g)
        acc_g = tl.dot(hi, xo, acc_g)
        lo, hi = _split_tiles(blk, uw_off, us_off, k0, n, H // 2, H // 16, BLOCK_K)
        acc_u = tl.dot(lo, xe, acc_u)
        acc_u = tl.dot(hi, xo, acc_u)
    g = acc_g * (tl.load(ws2_ptr + slot * 3) * 256.0)
    u = acc_u * (tl.load(ws2_ptr + slot * 3 + 1) * 256.0)
    hv = g * tl.sigmoid(g) * u
    tl.store(h_ptr + rows[None, :].to(tl.int64) * I + n[:, None], hv.to(h_ptr.dtype.element_ty),
             mask=valid[None, :])  # fmt: skip


def permute_cols(x):
    # [T, H]: each 16-column group as its 8 even columns, then its 8 odd ones
    t, h = x.shape
    return x.view(t, h // 16, 8, 2).transpose(2, 3).reshape(t, h)


def launch_split(xp, args, h, p, layout, cfg: dict, grid, offs: dict) -> None:
    """The split kernel over the tiles of `args`, on xp = permute_cols(x)."""
    H, I = layout.hidden_size, layout.intermediate_size
    _split_gate_up_kernel[grid](
        xp, *args, h, p, TOPK, 0, layout.block_bytes, H, I, *offs.values(), BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip


def compare(layout, slots, ws2, ids, x, cfg: dict, name: str, launch, prep=None) -> None:
    """h of the engine's gate+up and of `launch` (launch_split's signature, given prep(x), made once and not
    timed) on the same tiles, and their times (graph-timed, one call per graph)."""
    bm, bn, bk, nw, ns = (cfg[k] for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
    e2s = torch.arange(EXPERTS, dtype=torch.int32, device=slots.device)
    off = nm._offsets(layout)
    H, I = layout.hidden_size, layout.intermediate_size
    order = nm.order_pairs(ids, EXPERTS, layout, config=cfg)
    h_ref = torch.zeros(order.tiles * bm, I, dtype=x.dtype, device=x.device)
    h_new = torch.zeros_like(h_ref)
    p = ids.numel()
    args = (order.pair_ids, order.tile_expert, e2s, slots, ws2)
    grid = (order.tiles, triton.cdiv(I, bn))
    offs = dict(gw_off=off["gw_off"], uw_off=off["uw_off"], gs_off=off["gs_off"], us_off=off["us_off"])

    def old():
        nm.launch_e2m1(
            nm._prefill_gate_up_kernel, grid, x.device, x, *args, h_ref, p, TOPK, 0, **offs,
            block_bytes=layout.block_bytes, H=H, I=I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            DOT_PRECISION="tf32", SCALE_WORDS=False, TILE_MAJOR=False, num_warps=nw,
            num_stages=ns,
        )  # fmt: skip

    xin = prep(x) if prep else x

    def new():
        launch(xin, args, h_new, p, layout, cfg, grid, offs)

    old()
    new()
    torch.cuda.synchronize()
    d = (h_new.float() - h_ref.float()).abs()
    print(f"T={x.shape[0]} {cfg}: max |h {name} - h old| {d.max().item():.3e} (max |h| "
          f"{h_ref.float().abs().max().item():.3e})", flush=True)  # fmt: skip
    print(f"  old {1e3 * graph_ms([old]):.1f} us  {name} {1e3 * graph_ms([new]):.1f} us", flush=True)


def main(tokens: int, shapes: list[tuple], name: str, launch, prep=None) -> None:
    """compare() for each (block_m, block_n, block_k, num_warps, num_stages) of `shapes`."""
    from expertstream.bench.kernels import _prompt

    layout, slots, ws2 = random_bank(EXPERTS)
    ids, _, x = _prompt(layout, EXPERTS, tokens, tokens, slots.device)
    keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    for shape in shapes:
        compare(layout, slots, ws2, ids, x, dict(zip(keys, shape, strict=True)), name, launch, prep)


if __name__ == "__main__":
    shapes = [(16, 128, 32, 4, 4), (64, 128, 64, 4, 3), (64, 64, 64, 4, 3), (16, 64, 64, 4, 3),
              (32, 128, 64, 4, 3), (64, 128, 32, 4, 4)]  # fmt: skip
    for t in [int(a) for a in sys.argv[1:]] or [512, 2451, 8192]:
        main(t, shapes, "split", launch_split, permute_cols)
