"""Probe (device only): FP8 M = 1 GEMV variants against the shipped kernel, graph-timed as `bench kernels`.

Variants, each swept over a few launch shapes on the DeltaNet shapes:
  shipped     fp8_rows_matmul as the engine calls it (tuned config);
  shipped s1  its GEMV kernel launched with each config (hardware conversion, num_stages 1);
  native      a minimal kernel: the weight loaded as float8e4nv and converted by Triton (sm_89+: the
              hardware cvt), x loaded as [BK] and broadcast over the rows;
  native x2d  the same with x loaded as [1, BK] in the weights' layout (half the speed on the H200);
  read        a read-only stream of the same bytes (xor of the words): what a Triton stream reaches here.
  hwword      the shipped bit-op word form (16-byte int32 loads, x split in registers) with each word's
              bytes converted by `cvt.rn.f16x2.e4m3x2` in inline PTX instead of bit ops (13:47: no faster
              than native, 10.35 / 7.07 / 7.88 against 10.17 / 6.94 / 7.28 us);
Tried on 2026-12-01 and dropped: tl.dot of the converted tile with x padded to 16 columns (2.5-5x slower).
Prints us per call and % of the copy rate measured in the same run. Usage: python3 scripts/fp8_gemv_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertstream.bench_kernels import FP8_SHAPES, graph_ms, measure_ceilings
from expertstream.kernels import fp8_gemv, fp8_rows_matmul
from expertstream.kernels.codec import f16x2_halves
from expertstream.kernels.fp8_gemv import fp8_rows_matmul_ref

COPIES = 8  # weight copies per graph: 8 x 15.7-26 MB is past L2


@triton.jit
def _native(
    x_ptr, q_ptr, s_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    X2D: tl.constexpr = False,
):  # fmt: skip
    # X2D: x loaded as [1, BK] in the weights' layout (the shipped kernel's form until 2026-12-01 13:30: half
    # the speed with the hardware conversion)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in tl.static_range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        w = tl.load(
            q_ptr + n.to(tl.int64)[:, None] * K + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0
        )
        c = w.to(tl.float32)
        if X2D:
            acc += c * tl.load(x_ptr + kk[None, :], mask=km[None, :], other=0.0).to(tl.float32)
        else:
            acc += c * tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, 1) * tl.load(s_ptr + n, mask=nm, other=0.0)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nm)


# a word of 4 E4M3 bytes -> (bytes 0 and 2, bytes 1 and 3) as fp16x2, as codec.e4m3x4_f16 pairs them
E4M3X4_CVT = tl.constexpr(
    "{\n.reg .b32 t;\n.reg .b16 l, h;\nprmt.b32 t, $2, 0, 0x3120;\nmov.b32 {l, h}, t;\n"
    "cvt.rn.f16x2.e4m3x2 $0, l;\ncvt.rn.f16x2.e4m3x2 $1, h;\n}"
)


@triton.jit
def _hwword(x_ptr, q_ptr, s_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    # the shipped bit-op word form (16-byte int32 word loads, x split in registers) with the hardware cvt
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    acc = tl.zeros([BN, BW], tl.float32)
    for w0 in tl.static_range(0, K // 4, BW):
        wi = w0 + tl.arange(0, BW)
        w = tl.load(q_ptr + n.to(tl.int64)[:, None] * (K // 4) + wi[None, :], mask=nm[:, None], other=0)
        lo, hi = tl.inline_asm_elementwise(
            asm=E4M3X4_CVT, constraints="=r,=r,r", args=[w], dtype=(tl.uint32, tl.uint32), is_pure=True,
            pack=1,
        )  # fmt: skip
        c0, c2 = f16x2_halves(lo)
        c1, c3 = f16x2_halves(hi)
        acc += fp8_gemv._x_words(x_ptr, 0, 1, K, w0, c0, c1, c2, c3, BW)
    y = tl.sum(acc, 1) * tl.load(s_ptr + n, mask=nm, other=0.0)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _read(q_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    acc = tl.zeros([BN, BW], tl.int32)
    for w0 in tl.static_range(0, K // 4, BW):
        wi = w0 + tl.arange(0, BW)
        acc ^= tl.load(q_ptr + n.to(tl.int64)[:, None] * (K // 4) + wi[None, :], mask=nm[:, None], other=0)
    tl.store(out_ptr + n, tl.xor_sum(acc, 1), mask=nm)


def calls(kind: str, n: int, k: int, cfg: dict):
    qs = [torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, device="cuda") for _ in range(COPIES)]
    scale = torch.rand(n, device="cuda")
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    iout = torch.empty(n, dtype=torch.int32, device="cuda")
    bn, b, nw = cfg["bn"], cfg["b"], cfg["warps"]
    grid = (triton.cdiv(n, max(bn, 1)),)

    def one(q):
        f8 = q.view(torch.float8_e4m3fn)
        if kind == "shipped":
            return lambda: fp8_rows_matmul(x, f8, scale)
        if kind.startswith("shipped"):  # the shipped kernel with this config and num_stages
            stages = int(kind[-1])  # (1 and 3 timed the same on 2026-12-01)
            return lambda: fp8_gemv._fp8_gemv_kernel[(grid[0], 1)](
                x, f8, scale, out, 1, n, K=k, K_SPLIT=k, UNIT=1.0, NATIVE=True, BLOCK_M=1, BLOCK_N=bn,
                BLOCK_K=b, WORDS=False, num_warps=nw, num_stages=stages,
            )  # fmt: skip
        if kind == "hwword":
            words = q.view(torch.int32)
            return lambda: _hwword[grid](x, words, scale, out, n, K=k, BN=bn, BW=b // 4, num_warps=nw)
        if kind.startswith("native"):
            x2d = kind.endswith("x2d")
            return lambda: _native[grid](x, f8, scale, out, n, K=k, BN=bn, BK=b, num_warps=nw, X2D=x2d)
        return lambda: _read[grid](q.view(torch.int32), iout, n, K=k, BN=bn, BW=b, num_warps=nw)

    fns = [one(q) for q in qs]
    err = None
    if kind != "read":
        fns[0]()
        got = fp8_rows_matmul(x, qs[0].view(torch.float8_e4m3fn), scale) if kind == "shipped" else out
        if kind.startswith("shipped "):
            got = out
        ref = fp8_rows_matmul_ref(x.float(), qs[0].view(torch.float8_e4m3fn), scale)
        err = (got.float() - ref).abs().max().item() / ref.abs().max().item()
    return fns, err


SWEEPS = {
    "shipped": [dict(bn=0, b=0, warps=0)],
    **{kind: [dict(bn=bn, b=b, warps=w) for bn, b, w in [(16, 256, 4), (16, 512, 8), (8, 1024, 4)]]
       for kind in ("native", "native x2d")},
    "hwword": [dict(bn=bn, b=b, warps=w) for bn, b, w in
               [(16, 256, 4), (16, 512, 4), (16, 512, 8), (8, 512, 4), (8, 1024, 4), (4, 1024, 4),
                (32, 256, 8)]],
    "read": [dict(bn=bn, b=b, warps=w) for bn, b, w in [(4, 256, 4), (8, 128, 4), (2, 512, 4), (4, 128, 4)]],
}  # fmt: skip


def main() -> None:
    import triton.testing

    copy_gbps, _ = measure_ceilings(triton.testing.do_bench)
    print(f"copy {copy_gbps:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    for n, k in FP8_SHAPES:
        for kind, cfgs in SWEEPS.items():
            best = None
            for cfg in cfgs:
                try:
                    fns, err = calls(kind, n, k, cfg)
                    us = 1e3 * graph_ms(fns, reps=20)
                except Exception as e:  # noqa: BLE001  # registers or shared memory: skip the shape
                    print(f"{n}x{k} {kind} {cfg} skipped: {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                pct = 100 * n * k / us / 1e3 / copy_gbps
                print(f"{n}x{k} {kind:7s} {cfg} {us:6.2f} us {pct:4.0f}% err {err}", flush=True)
                best = min(best or (us, cfg), (us, cfg), key=lambda r: r[0])
            if best:
                print(
                    f"== {n}x{k} {kind} best {best[0]:.2f} us {100 * n * k / best[0] / 1e3 / copy_gbps:.0f}%"
                )


if __name__ == "__main__":
    main()
