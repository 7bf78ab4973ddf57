"""Probe (device only): FP8 M = 1 GEMV variants against the shipped kernel, graph-timed as `bench kernels`.

Variants, each swept over a few launch shapes on the DeltaNet shapes:
  shipped     fp8_rows_matmul as the engine calls it (tuned config);
  shipped s1  its GEMV kernel launched with each config (hardware conversion, num_stages 1);
  native      a minimal kernel: the weight loaded as float8e4nv and converted by Triton (sm_89+: the
              hardware cvt), x loaded as [BK] and broadcast over the rows;
  read        a read-only stream of the same bytes (xor of the words): what a Triton stream reaches here;
  native pdl  native launched with programmatic dependent launch (Hopper's griddepcontrol): each call waits
              for the one before it (gdc_wait) but is launched, and may be resident, before it ends; "pdl
              early" also lets the next call launch at its own start (gdc_launch_dependents);
  read pdl    the read-only stream so launched (both forms).
Tried on 2026-12-01 and dropped: tl.dot of the converted tile with x padded to 16 columns (2.5-5x slower); x
loaded as [1, BK] in the weights' layout (half the speed); the shipped bit-op word form with each word's
bytes converted by `cvt.rn.f16x2.e4m3x2` in inline PTX (13:47: no faster than native, 10.35 / 7.07 / 7.88
against 10.17 / 6.94 / 7.28 us).
Prints us per call and % of the copy rate measured in the same run. Usage: python3 scripts/fp8_gemv_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from expertstream.bench.kernels import FP8_SHAPES, graph_ms, measure_ceilings
from expertstream.kernels import fp8_gemv, fp8_rows_matmul
from expertstream.kernels.fp8_gemv import fp8_rows_matmul_ref

COPIES = 8  # weight copies per graph: 8 x 15.7-26 MB is past L2
try:  # Triton >= 3.4: programmatic dependent launch
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _grid_dependency(PDL: tl.constexpr):
    # PDL 1: wait for the call before; 2: and let the next call launch at once
    if PDL == 2:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()


@triton.jit
def _native(
    x_ptr, q_ptr, s_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    _grid_dependency(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < N
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in tl.static_range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < K
        w = tl.load(
            q_ptr + n.to(tl.int64)[:, None] * K + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0
        )
        acc += w.to(tl.float32) * tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, 1) * tl.load(s_ptr + n, mask=nm, other=0.0)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _read(q_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr = 0):
    _grid_dependency(PDL)
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
        pdl = 2 if kind.endswith("pdl early") else 1 if kind.endswith("pdl") else 0
        launch = dict(launch_pdl=True) if pdl else {}
        if kind.startswith("native"):
            return lambda: _native[grid](
                x, f8, scale, out, n, K=k, BN=bn, BK=b, num_warps=nw, PDL=pdl, **launch
            )  # fmt: skip
        return lambda: _read[grid](
            q.view(torch.int32), iout, n, K=k, BN=bn, BW=b, num_warps=nw, PDL=pdl, **launch
        )  # fmt: skip

    fns = [one(q) for q in qs]
    err = None
    if not kind.startswith("read"):
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
       for kind in ("native", "native pdl", "native pdl early")},
    **{kind: [dict(bn=bn, b=b, warps=w) for bn, b, w in [(4, 256, 4), (8, 128, 4), (2, 512, 4), (4, 128, 4)]]
       for kind in ("read", "read pdl", "read pdl early")},
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
