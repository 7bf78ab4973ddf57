"""FP8 block-scaled matrix-vector / small-M matmul for the resident matrices: y = x w^T.

q [N, K] float8_e4m3fn, x [M, K], w = q * scale per block: one scale per (SN rows x SK columns), scale
[ceil(N/SN), ceil(K/SK)], FP32 or UE8M0 bytes (2^(byte - 127), byte 255 NaN, decoded in registers).
Row-scaled matrices (qwen4_exp's) are the (1 x K) case, scale [N]; DeepSeek-V4's shipped matrices the
(128 x 128) UE8M0 case. A scale that covers whole rows (one column block) multiplies the FP32 sums once;
one that changes along the row multiplies each BLOCK_K step's FP32 partial (BLOCK_K divides SK: a step never
straddles two blocks). From sm_89 the weights load as float8e4nv and convert in hardware
(`codec.e4m3_native`); elsewhere (the interpreter included) raw bytes decode with bit ops to fp16 holding
value * 2^-8 (exact, subnormals included), and 2^8 and the scales are applied on the FP32 accumulator. Both
give the exact E4M3 values; only the order of the FP32 sums differs.
- M = 1 (decode, every token; M <= 4 on request): a memory-bound GEMV without tensor cores. Each program owns
  BLOCK_N rows and streams them in 16-byte loads: [BLOCK_N, BLOCK_K] float8e4nv tiles (hardware), or int32
  words decoded 4 bytes at a time (bit ops, when K % 4 == 0); FP32 FMAs into one 2-D accumulator per row of
  x, reduced once at the end. SPLIT_K > 1
  writes FP32 partials [SPLIT_K, M, N] summed in a fixed order by torch (deterministic, no atomics).
  From sm_90 it is a dependent launch: it may start while the kernel before it runs (that kernel lets it
  with `gdc_launch_dependents`, as gdn_step and hc_mix do), reads its weights into L2 when they are at most
  PREFETCH_BYTES, and only then waits for x. The weights do not depend on the step; their read overlaps
  the kernel before.
- larger M: tiles dequantised to the activation dtype (exact for bf16 too: 4 significant bits)
  and tl.dot.
`matvec16` runs the same GEMV over 16-bit weights (bf16 / fp16 [N, K], loaded as they are, no row scale): the
decode path's BF16 matrices, which cuBLAS reads at ~0.9 TB/s at M = 1 (docs/kernels.md).
"""

from __future__ import annotations

import torch

from expertstream.formats.fp8 import e4m3_to_float
from expertstream.formats.mxfp4 import e8m0_to_float
from expertstream.kernels.codec import (
    E4M3_UNIT,
    cdiv,
    dependent_launch,
    device_capability,
    dot_precision,
    e4m3_f16,
    e4m3_native,
    e4m3x4_f16,
    e8m0_f32,
    f16x2_halves,
    gdc_launch_dependents,
    gdc_wait,
    jit,
    l2_prefetch_rows,
    native_failed,
    prefetch_lines,
    require_triton,
    tl,
    tuned_config,
)

# a matrix up to this size is read into L2 before x is ready (half the L2 of an 8 GB Blackwell card, so
# that the lines stay until the loads after the wait). On the H200 out_proj (15.7 MB) after gdn_step
# 13.7 us against 14.5 without the prefetch and 15.2 without the dependent launch; in_proj (42 MB) after
# hc_mix 17.0 us without, 17.4 with its first 1 KB a row (16 MB), 18.9 with all of it
PREFETCH_BYTES = 16 << 20
GEMV_MAX_M = 4  # the GEMV kernel keeps one FMA accumulator per row of x, up to 4 rows
# untuned shapes: 4 rows x 1,024 columns a step keep ~N/4 programs streaming 16-byte loads
GEMV_DEFAULT = dict(block_n=4, block_k=1024, num_warps=4, split_k=1)
# used by default only for M = 1: on the H200 M = 4 runs 2x slower than the tl.dot path
GEMV_DEFAULT_M = 1


# block-scaled along K: BLOCK_K is at most the scale block (128), so more rows a step keep 16-byte loads
GEMV_BLOCKED_DEFAULT = dict(block_n=16, block_k=128, num_warps=4, split_k=1)


def fp8_rows_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of `fp8_rows_matmul` (FP32 maths, output in x.dtype)."""
    return fp8_block_matmul_ref(x, q, scale[:, None], (1, q.shape[1]))


def fp8_block_matmul_ref(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Plain-torch twin of `fp8_block_matmul` (FP32 maths, output in x.dtype)."""
    return (x.float() @ dequantize_fp8_scaled(q, scale, block).T).to(x.dtype)


def dequantize_fp8_scaled(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [N, K] e4m3 (or raw uint8) with one scale per (SN x SK) block, scale [ceil(N/SN), ceil(K/SK)] FP32 or
    UE8M0 -> w [N, K] float32 (exact: a product of an E4M3 value and a scale)."""
    n, k = q.shape
    s = scale.float() if scale.dtype == torch.float32 else e8m0_to_float(scale)
    if block[0] > 1:
        s = s.repeat_interleave(block[0], 0)[:n]
    if block[1] < k:
        s = s.repeat_interleave(block[1], 1)[:, :k]
    return e4m3_to_float(q).mul_(s)  # (one column block: s [N, 1] broadcasts along the row)


def fp8_config(m: int, n: int, k: int, device: torch.device, scale_k: int = 0) -> dict:
    """The default config of `fp8_block_matmul` for x [m, k] and q [n, k] on `device`; scale_k: columns per
    scale block when the scale changes along the row (0: one scale per row block)."""
    if m <= GEMV_DEFAULT_M and scale_k:  # (tuned_configs.json holds row-scaled shapes only)
        return GEMV_BLOCKED_DEFAULT
    if m <= GEMV_DEFAULT_M:
        cfg = tuned_config("fp8_gemv", device, f"{n}x{k}x{m}") or tuned_config("fp8_gemv", device, f"{n}x{k}")
        return cfg or GEMV_DEFAULT
    # narrow column blocks keep every SM streaming; M rounds up to the 16-row dot minimum (H200 sweep)
    if n <= 4096:
        return dict(block_m=16 if m <= 16 else 64, block_n=16, block_k=128, num_warps=2, num_stages=4)
    return dict(block_m=16 if m <= 16 else 64, block_n=32, block_k=256, num_warps=4, num_stages=4)


def fp8_rows_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, config: dict | None = None
) -> torch.Tensor:
    """x [M, K] @ (q * scale[:, None])^T for an FP8 row-scaled matrix: `fp8_block_matmul` with (1 x K) blocks,
    scale [N] float32."""
    assert scale.dtype == torch.float32 and scale.shape == q.shape[:1], (
        f"scale {scale.dtype} {tuple(scale.shape)}"
    )
    return fp8_block_matmul(x, q, scale[:, None], (1, q.shape[1]), config=config)


def fp8_block_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] @ w^T for an FP8 block-scaled matrix w = q * scale[n // SN, k // SK].

    Args:
        x: [M, K] activations (fp32 / fp16 / bf16), contiguous.
        q: [N, K] float8_e4m3fn, or its raw uint8 bytes, contiguous.
        scale: [ceil(N / SN), ceil(K / SK)] float32, or UE8M0 (float8_e8m0fnu or its uint8 bytes), contiguous.
        block: (SN, SK), rows and columns a scale covers; SK a power of two >= 16 unless SK >= K.
        config: GEMV (M <= GEMV_MAX_M): block_n, block_k (a power of two >= 4), num_warps, split_k, pdl
            (bool, default True: a dependent launch from sm_90) and prefetch (bytes of each row read into L2
            before x; default the whole row up to PREFETCH_BYTES of weights, else none); tl.dot: block_m,
            block_n, block_k, num_warps, num_stages. block_k is cut to SK where the scale changes along the
            row. Default (`fp8_config`): the GEMV for M = 1 (tuned_configs.json for this device and shape,
            else a heuristic), tl.dot above. Either may set native (bool) to force the hardware E4M3
            conversion on or off (tests compare the two).

    Returns:
        [M, N] in x.dtype.
    """
    require_triton(x, q, scale)
    assert x.dim() == 2 and x.is_contiguous(), f"x {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert q.dtype in (torch.float8_e4m3fn, torch.uint8) and q.dim() == 2 and q.is_contiguous(), (
        f"q {q.dtype}"
    )
    m, k = x.shape
    n = q.shape[0]
    assert q.shape[1] == k, f"q {tuple(q.shape)} does not match x {tuple(x.shape)}"
    sn, sk = block
    assert sn >= 1 and sk >= 1, f"block {block}"
    assert scale.dtype in (torch.float32, torch.float8_e8m0fnu, torch.uint8) and scale.is_contiguous(), (
        f"scale {scale.dtype}"
    )
    assert scale.shape == (cdiv(n, sn), cdiv(k, sk)), (
        f"scale {tuple(scale.shape)} for q {tuple(q.shape)}, {block}"
    )
    scale_k = sk if sk < k else 0  # 0: one column block, the scale applied once to each row's sums
    assert not scale_k or (sk >= 16 and sk & (sk - 1) == 0), f"column block {sk}: a power of two >= 16"
    if scale.dtype != torch.float32:
        scale = scale.view(torch.uint8)
    cfg = dict(config or fp8_config(m, n, k, x.device, scale_k))
    if scale_k:
        cfg["block_k"] = min(cfg["block_k"], scale_k)
    scales = (scale, sn, scale_k)
    if "native" in cfg:
        return _launch(x, q, scales, cfg, cfg["native"])
    cap = device_capability(x.device)
    if not e4m3_native(cap):
        return _launch(x, q, scales, cfg, False)
    try:
        return _launch(x, q, scales, cfg, True)
    except Exception as e:  # a Triton without fp8 loads for this chip: the identical bit-op form from now on
        native_failed(cap, e)
        return _launch(x, q, scales, cfg, False)


def _launch(x: torch.Tensor, q: torch.Tensor, scales: tuple, cfg: dict, native: bool) -> torch.Tensor:
    # scales: (scale tensor, rows a scale covers, columns a scale covers or 0 for whole rows)
    m, k = x.shape
    n = q.shape[0]
    if "split_k" in cfg and m <= GEMV_MAX_M:  # a GEMV config (the default one for M = 1, or explicit)
        return _gemv(x, q, scales, cfg, native)
    scale, sn, sk = scales
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (cdiv(n, cfg["block_n"]), cdiv(m, cfg["block_m"]))
    _fp8_dot_kernel[grid](
        x, _weights(q, native), scale, out, m, n, k, UNIT=1.0 if native else E4M3_UNIT, NATIVE=native,
        SCALE_N=sn, SCALE_K=sk, E8M0=scale.dtype == torch.uint8, BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], DOT_PRECISION=dot_precision(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def matvec16_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of `matvec16` (FP32 maths, output in x.dtype)."""
    return (x.float() @ w.float().T).to(x.dtype)


def matvec16_config(n: int, k: int, device: torch.device) -> dict:
    """The default config of `matvec16` for w [n, k] on `device`."""
    return tuned_config("matvec16", device, f"{n}x{k}") or GEMV_DEFAULT


def matvec16(x: torch.Tensor, w: torch.Tensor, *, config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ w^T for a 16-bit weight w [N, K], M <= GEMV_MAX_M: the FP8 GEMV without the E4M3 decode.

    Args:
        x: [M, K] activations (fp32 / fp16 / bf16), contiguous.
        w: [N, K] bf16 or fp16, contiguous.
        config: block_n, block_k, num_warps, split_k, pdl, prefetch as for the FP8 GEMV; default
            (`matvec16_config`): tuned_configs.json ("matvec16", "NxK") for this device, else GEMV_DEFAULT.

    Returns:
        [M, N] in x.dtype.
    """
    require_triton(x, w)
    assert x.dim() == 2 and x.is_contiguous() and x.shape[0] <= GEMV_MAX_M, f"x {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert w.dtype in (torch.bfloat16, torch.float16) and w.dim() == 2 and w.is_contiguous(), f"w {w.dtype}"
    assert w.shape[1] == x.shape[1], f"w {tuple(w.shape)} does not match x {tuple(x.shape)}"
    n, k = w.shape
    return _gemv(x, w, None, config or matvec16_config(n, k, x.device), native=False)


def _weights(q: torch.Tensor, native: bool) -> torch.Tensor:
    # float8e4nv for the hardware conversion, raw bytes for the bit-op decode
    return q.view(torch.float8_e4m3fn) if native else q.view(torch.uint8)


@jit(do_not_specialize=("M",))  # prompt pieces of any length (a ragged last one): one compiled variant
def _fp8_dot_kernel(
    x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K, UNIT: tl.constexpr, NATIVE: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, E8M0: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # program (n block, m block): out[m, n] = UNIT * sum_k x[m, k] * (q[n, k] / UNIT) * scale[n / SN, k / SK]
    # (SCALE_K 0: one scale a row block, applied to the sums; else to each BLOCK_K step's dot)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = m < M
    nmask = n < N
    srow = _scale_row(n, K, SCALE_N, SCALE_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        xt = tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(
            q_ptr + n[None, :].to(tl.int64) * K + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0
        )
        w = _e4m3(b, NATIVE).to(xt.dtype)
        if SCALE_K == 0:
            acc = tl.dot(xt, w, acc, input_precision=DOT_PRECISION)  # [BM, BN]
        else:
            s = _scales(scale_ptr + srow + k0 // SCALE_K, nmask, E8M0)
            acc += tl.dot(xt, w, input_precision=DOT_PRECISION) * s[None, :]
    s = _end_scale(scale_ptr, srow, nmask, UNIT, BLOCK_N, SCALE_K == 0, E8M0)
    out = (acc * s[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[:, None] * N + n[None, :], out, mask=mmask[:, None] & nmask[None, :])


@jit
def _scale_row(n, K, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    # [BN] offsets of rows n's scale rows in scale [ceil(N / SN), ceil(K / SK)] (one column when SK is 0)
    if SCALE_K == 0:
        r = n // SCALE_N
    else:
        r = (n // SCALE_N) * ((K + SCALE_K - 1) // SCALE_K)
    return r


@jit
def _scales(ptrs, mask, E8M0: tl.constexpr):
    # [BN] FP32 scales, stored FP32 or as UE8M0 bytes (decoded exactly; masked rows read 1)
    if E8M0:
        s = e8m0_f32(tl.load(ptrs, mask=mask, other=127))
    else:
        s = tl.load(ptrs, mask=mask, other=0.0)
    return s


@jit
def _end_scale(scale_ptr, srow, nmask, UNIT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
               E8M0: tl.constexpr):  # fmt: skip
    # [BN] what multiplies the FP32 sums: the row block's scale (ROWS) and UNIT, or UNIT alone
    if ROWS:
        s = _scales(scale_ptr + srow, nmask, E8M0) * UNIT
    else:
        s = tl.full([BLOCK_N], UNIT, tl.float32)
    return s


@jit
def _e4m3(b, NATIVE: tl.constexpr):
    # E4M3 weights -> fp16: loaded as float8e4nv, the true value (hardware); as bytes, value * 2^-8 (bit ops)
    if NATIVE:  # (an early return would still compile the bit ops on fp8)
        w = b.to(tl.float16)
    else:
        w = e4m3_f16(b)
    return w


def _gemv(x: torch.Tensor, q: torch.Tensor, scales, cfg: dict, native: bool) -> torch.Tensor:
    # q: FP8 with its scales (tensor, SN, SK or 0, as `_launch`), or 16-bit weights (scales None) as they are
    m, k = x.shape
    n = q.shape[0]
    bk, split = cfg["block_k"], cfg.get("split_k", 1)
    wide = scales is None
    scale, sn, sk = (q, 1, 0) if wide else scales
    # 4-byte words of bit-op decoded bytes need aligned rows; the hardware conversion loads bytes
    words = not wide and not native and k % 4 == 0 and q.data_ptr() % 4 == 0
    qv = q if wide else _weights(q, native)
    if words:
        qv = qv.view(torch.int32)
    k_split = cdiv(cdiv(k, split), bk) * bk  # columns per split, whole BLOCK_K steps (disjoint ranges)
    split = cdiv(k, k_split)
    bm = 1 << max(0, (m - 1).bit_length())
    dst = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    pdl = cfg.get("pdl", True) and dependent_launch(device_capability(x.device))
    elem = q.element_size()
    ahead = min(k_split * elem, cfg.get("prefetch", k_split * elem if n * k * elem <= PREFETCH_BYTES else 0))
    _fp8_gemv_kernel[(cdiv(n, cfg["block_n"]), split)](
        x, qv, scale, dst, m, n, K=k, K_SPLIT=k_split, NATIVE=native, WIDE=wide,
        UNIT=1.0 if native or wide else E4M3_UNIT, SCALE_N=sn, SCALE_K=sk, E8M0=scale.dtype == torch.uint8,
        BLOCK_M=bm, BLOCK_N=cfg["block_n"], BLOCK_K=bk, WORDS=words, PDL=pdl, AHEAD=ahead,
        LINES=prefetch_lines(ahead), num_warps=cfg["num_warps"], num_stages=1,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return dst[0] if split == 1 else dst.sum(0).to(x.dtype)  # fixed-order sum: deterministic


@jit
def _x_words(x_ptr, mrow, M, K: tl.constexpr, w0, c0, c1, c2, c3, BW: tl.constexpr):
    # sum over the 4 columns of each word of x[mrow, 4i + j] * c_j, [BN, BW]; zero past M. x is loaded
    # contiguously ([4 BW]) and split in registers, so the compiler keeps the weights' vectorised layout.
    kk = 4 * w0 + tl.arange(0, 4 * BW)
    xv = tl.load(x_ptr + mrow * K + kk, mask=kk < tl.where(mrow < M, K, 0), other=0.0).to(tl.float32)
    ev, od = tl.split(tl.reshape(xv, [BW, 2, 2]))  # [BW, 2]: (x[4i], x[4i+2]), (x[4i+1], x[4i+3])
    x0, x2 = tl.split(ev)
    x1, x3 = tl.split(od)
    return x0[None, :] * c0 + x1[None, :] * c1 + x2[None, :] * c2 + x3[None, :] * c3


@jit
def _fp8_gemv_kernel(
    x_ptr, q_ptr, scale_ptr, out_ptr, M, N, K: tl.constexpr, K_SPLIT: tl.constexpr, UNIT: tl.constexpr,
    NATIVE: tl.constexpr, WIDE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WORDS: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr, LINES: tl.constexpr,
):  # fmt: skip
    # program (n block, k split): out[split, m, n] = UNIT sum_{k in split} x[m, k] q[n, k] / UNIT scale[n, k]
    # with scale[n, k] = scale[n / SN, k / SK] (SCALE_K 0: one a row block, applied to the sums; else to each
    # step's products); WIDE: 16-bit q as it is, no scale (scale_ptr unused).
    # One 2-D [BN, BW] accumulator per token row (BLOCK_M <= 4): a 3-D tile would push every decoded weight
    # through shared memory. K constexpr: the static loop unrolls so the row loads of all steps overlap.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    rows = n.to(tl.int64)[:, None]
    srow = _scale_row(n, K, SCALE_N, SCALE_K)
    if PDL:  # launched while the kernel before runs: let the next start too, read AHEAD bytes a row, wait
        gdc_launch_dependents()
        if AHEAD > 0:
            ELEM: tl.constexpr = 2 if WIDE else 1  # bytes a weight
            k0 = tl.program_id(1) * K_SPLIT
            row = tl.minimum(n, N - 1).to(tl.int64) * K + k0
            starts = q_ptr.to(tl.pointer_type(tl.uint8)) + ELEM * row  # [BN]
            l2_prefetch_rows(starts, tl.minimum(AHEAD, ELEM * (K - k0)), LINES)
        gdc_wait()
    BW: tl.constexpr = BLOCK_K // 4 if WORDS else BLOCK_K
    acc0 = tl.zeros([BLOCK_N, BW], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BW], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BW], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BW], tl.float32)
    if WORDS:
        # q as int32 words [N, K/4]: word i holds columns 4i..4i+3 (byte 0 lowest)
        for k0 in tl.static_range(0, K_SPLIT // 4, BW):
            # word offsets from pid * constexpr keep the divisibility that 16-byte vector loads need
            w0 = tl.program_id(1) * (K_SPLIT // 4) + k0
            wi = w0 + tl.arange(0, BW)
            wmask = wi < K // 4
            w = tl.load(q_ptr + rows * (K // 4) + wi[None, :], mask=nmask[:, None] & wmask[None, :], other=0)
            lo, hi = e4m3x4_f16(w.to(tl.uint32, bitcast=True))
            c0, c2 = f16x2_halves(lo)
            c1, c3 = f16x2_halves(hi)
            s = _step_scale(scale_ptr, srow, 4 * w0, nmask, SCALE_K, E8M0)
            acc0 += _x_words(x_ptr, 0, M, K, w0, c0, c1, c2, c3, BW) * s
            if BLOCK_M > 1:
                acc1 += _x_words(x_ptr, 1, M, K, w0, c0, c1, c2, c3, BW) * s
            if BLOCK_M > 2:
                acc2 += _x_words(x_ptr, 2, M, K, w0, c0, c1, c2, c3, BW) * s
                acc3 += _x_words(x_ptr, 3, M, K, w0, c0, c1, c2, c3, BW) * s
    else:
        for k0 in tl.static_range(0, K_SPLIT, BW):
            col = tl.program_id(1) * K_SPLIT + k0
            kk = col + tl.arange(0, BW)
            kmask = kk < K
            # other=0.0: Triton casts a float to either element type (an int does not cast to fp8)
            b = tl.load(q_ptr + rows * K + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            if WIDE:
                c = b.to(tl.float32)
            else:
                # (through fp16 or straight: the same speed)
                c = _e4m3(b, NATIVE).to(tl.float32) * _step_scale(scale_ptr, srow, col, nmask, SCALE_K, E8M0)
            # x as [BW] broadcast over the rows: loaded [1, BW] in the weights' layout, the hardware-converted
            # kernel runs at half the speed on the H200
            acc0 += c * tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if BLOCK_M > 1:
                xm = kk < tl.where(M > 1, K, 0)
                acc1 += c * tl.load(x_ptr + K + kk, mask=xm, other=0.0).to(tl.float32)[None, :]
            if BLOCK_M > 2:
                xm = kk < tl.where(M > 2, K, 0)
                acc2 += c * tl.load(x_ptr + 2 * K + kk, mask=xm, other=0.0).to(tl.float32)[None, :]
                xm = kk < tl.where(M > 3, K, 0)
                acc3 += c * tl.load(x_ptr + 3 * K + kk, mask=xm, other=0.0).to(tl.float32)[None, :]
    s = _end_scale(scale_ptr, srow, nmask, UNIT, BLOCK_N, not WIDE and SCALE_K == 0, E8M0)
    dst = out_ptr + tl.program_id(1) * M * N + n
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (tl.sum(acc0, axis=1) * s).to(ty), mask=nmask)
    if BLOCK_M > 1:
        tl.store(dst + N, (tl.sum(acc1, axis=1) * s).to(ty), mask=n < tl.where(M > 1, N, 0))
    if BLOCK_M > 2:
        tl.store(dst + 2 * N, (tl.sum(acc2, axis=1) * s).to(ty), mask=n < tl.where(M > 2, N, 0))
        tl.store(dst + 3 * N, (tl.sum(acc3, axis=1) * s).to(ty), mask=n < tl.where(M > 3, N, 0))


@jit
def _step_scale(scale_ptr, srow, col, nmask, SCALE_K: tl.constexpr, E8M0: tl.constexpr):
    # [BN, 1] the scales of the column block holding this step's columns (col the first); 1 when one scale
    # covers the row (applied to the sums; the multiply by 1 folds away)
    if SCALE_K == 0:
        s = 1.0
    else:
        s = _scales(scale_ptr + srow + col // SCALE_K, nmask, E8M0)[:, None]
    return s
