"""The FP8 row-scaled matmul and GEMV and the 16-bit GEMV against their plain-torch twins (interpreter on
CPU); the FP8 twin against dequantize-then-matmul in float64."""

import pytest
import torch
from kernel_helpers import DEV, FailingKernel, close

from expertstream.formats import fp8
from expertstream.kernels import (
    codec,
    fp8_block_matmul,
    fp8_block_matmul_ref,
    fp8_rows_matmul,
    fp8_rows_matmul_ref,
    matvec16,
    matvec16_ref,
)

pytest.importorskip("triton")

# the hardware E4M3 conversion (float8e4nv loads) runs on sm_89+ GPUs only; bit ops everywhere
NATIVE = [False] + ([True] if codec.e4m3_native(codec.device_capability(torch.device(DEV))) else [])


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (5, 33, 300), (20, 17, 48)])
def test_fp8_rows_matmul_matches_ref(dtype, m, n, k, native):
    g = torch.Generator().manual_seed(m * n)
    # every E4M3 byte but NaN, subnormals (exponent bits 0) included; one tiny row scale next to big ones
    q = torch.randint(0, 255, (n, k), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0x01
    assert ((q & 0x78) == 0).any()
    q = q.view(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=g) * 0.01
    scale[0] = 1e-6
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    q, scale = q.to(DEV), scale.to(DEV)
    cfg = dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, native=native)
    got = fp8_rows_matmul(x, q, scale, config=cfg)
    assert got.shape == (m, n) and got.dtype == dtype
    close(got, fp8_rows_matmul_ref(x, q, scale), dtype)
    # the twin is dequantize-then-matmul in float64
    want = x.double() @ fp8.dequantize_fp8_rows(q, scale, torch.float64).T
    torch.testing.assert_close(fp8_rows_matmul_ref(x.float(), q, scale).double(), want, rtol=1e-5, atol=1e-4)


def test_fp8_native_compile_failure_falls_back_to_bit_ops(monkeypatch):
    # a Triton that cannot load float8e4nv on this chip: the launch is retried with the bit-op form, once
    # and for good; the result is the bit-op form's (the interpreter runs it here)
    from expertstream.kernels import fp8_gemv

    kernel = FailingKernel("NATIVE", real=fp8_gemv._fp8_gemv_kernel)
    monkeypatch.setattr(fp8_gemv, "_fp8_gemv_kernel", kernel)
    monkeypatch.setattr(fp8_gemv, "device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(codec, "_NATIVE_FAILED", set())
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 0x7F, (12, 64), dtype=torch.uint8, generator=g).to(DEV)
    scale, x = torch.rand(12, generator=g).to(DEV), torch.randn(1, 64, generator=g).to(DEV)
    for _ in range(2):
        got = fp8_rows_matmul(x, q, scale)
        close(got, fp8_rows_matmul_ref(x, q, scale), torch.float32)
    assert kernel.calls == [True, False, False] and not codec.e4m3_native((9, 0))


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (2, 37, 132, dict(block_n=4, block_k=32, num_warps=1, split_k=2)),  # int32 words, split K
        (3, 21, 70, dict(block_n=8, block_k=16, num_warps=2, split_k=3)),  # bytes (K % 4 != 0), split K
        (4, 33, 256, dict(block_n=16, block_k=64, num_warps=4, split_k=1)),  # words, one pass
        (4, 19, 200, None),  # default: the tl.dot path for M > 1
        (1, 19, 200, None),  # default GEMV config for M = 1
    ],
)
def test_fp8_gemv_small_m_matches_ref(dtype, m, n, k, cfg, native):
    # the M <= 4 FMA GEMV (configs with split_k): every E4M3 byte but NaN, masked rows, partial last words
    g = torch.Generator().manual_seed(n * k)
    q = torch.randint(0, 255, (n, k), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0x02
    scale = torch.rand(n, generator=g) * 0.01
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    q, scale = q.to(DEV), scale.to(DEV)
    if cfg is None and native != NATIVE[-1]:  # the default config takes the device's conversion
        pytest.skip("the default config runs with the device's own conversion")
    got = fp8_rows_matmul(x, q, scale, config=cfg if cfg is None else {**cfg, "native": native})
    assert got.shape == (m, n) and got.dtype == dtype
    close(got, fp8_rows_matmul_ref(x, q, scale), dtype)


# 16-bit weights: fp16 on the CPU (the interpreter has no bf16), bf16 too on a GPU
W16 = [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("wdtype", W16)
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 37, 132, dict(block_n=4, block_k=32, num_warps=1, split_k=2)),  # split K, ragged last step
        (3, 21, 70, dict(block_n=8, block_k=16, num_warps=2, split_k=1)),  # masked rows and columns
        (4, 33, 256, dict(block_n=16, block_k=64, num_warps=4, split_k=1)),
        (1, 19, 200, None),  # the default config
    ],
)
def test_matvec16_matches_ref(wdtype, m, n, k, cfg):
    # the FP8 GEMV's kernel over 16-bit weights loaded as they are, no scale
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV, wdtype)
    x = torch.randn(m, k, generator=g).to(DEV)
    got = matvec16(x, w, config=cfg)
    assert got.shape == (m, n) and got.dtype == x.dtype
    close(got, matvec16_ref(x, w), torch.float32)


def test_every_matvec16_sweep_candidate_matches_ref():
    # `bench kernels` may record any of them as a device's default
    from expertstream.bench.sweep import MATVEC16_SWEEP

    g = torch.Generator().manual_seed(11)
    w = (torch.randn(37, 300, generator=g) * 0.05).to(DEV, torch.float16)
    x = torch.randn(1, 300, generator=g).to(DEV)
    for cfg in MATVEC16_SWEEP:
        close(matvec16(x, w, config=cfg), matvec16_ref(x, w), torch.float32)


def _blocked(n: int, k: int, block: tuple[int, int], e8m0: bool, seed: int):
    """Random E4M3 bytes (every one but NaN, subnormals included) and one scale per block: UE8M0 bytes
    2^-20..2^-4 (DeepSeek-V4's stored form) or FP32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 255, (n, k), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0x03
    shape = (-(-n // block[0]), -(-k // block[1]))
    if e8m0:
        scale = torch.randint(107, 124, shape, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    else:
        scale = torch.rand(shape, generator=g) * 0.01
    return q.view(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("e8m0", [True, False], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize(
    "m,n,k,block,cfg",
    [
        # 128 x 128 blocks with partial edge blocks in both dims: the GEMV (words, split K over blocks) ...
        (1, 200, 300, (128, 128), dict(block_n=4, block_k=256, num_warps=2, split_k=2)),
        (4, 130, 260, (128, 128), dict(block_n=8, block_k=64, num_warps=2, split_k=1)),
        (1, 70, 150, (32, 32), dict(block_n=4, block_k=64, num_warps=1, split_k=1)),  # bytes (K % 4 != 0)
        # ... and tl.dot, block_k above the column block (cut to it)
        (4, 200, 300, (128, 128), dict(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=2)),
        (64, 150, 270, (128, 128), dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)),
        (64, 40, 96, (16, 16), dict(block_m=64, block_n=16, block_k=16, num_warps=2, num_stages=2)),
        # one column block (SK >= K): the scale multiplies the sums once, per (SN x K) row block
        (1, 50, 90, (16, 128), dict(block_n=4, block_k=32, num_warps=1, split_k=1)),
        (64, 50, 90, (16, 128), dict(block_m=16, block_n=16, block_k=32, num_warps=2, num_stages=2)),
        (1, 200, 256, (128, 128), None),  # the default configs
        (64, 200, 256, (128, 128), None),
    ],
)
def test_fp8_block_matmul_matches_ref(dtype, m, n, k, block, cfg, e8m0, native):
    q, scale = _blocked(n, k, block, e8m0, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEV, dtype)
    q, scale = q.to(DEV), scale.to(DEV)
    if cfg is None and native != NATIVE[-1]:
        pytest.skip("the default config runs with the device's own conversion")
    cfg = cfg if cfg is None else {**cfg, "native": native}
    got = fp8_block_matmul(x, q, scale, block, config=cfg)
    assert got.shape == (m, n) and got.dtype == dtype
    want = fp8_block_matmul_ref(x, q, scale, block)
    close(got, want, dtype)
    # the scales matter: one block's scale doubled changes exactly that block's rows
    s2 = scale.clone()
    s2.view(torch.uint8)[-1, -1] += 1 if e8m0 else 0
    if not e8m0:
        s2[-1, -1] *= 2
    moved = (fp8_block_matmul(x, q, s2, block, config=cfg) - got).abs().amax(0) > 0
    rows = torch.arange(n, device=moved.device) >= (scale.shape[0] - 1) * block[0]
    assert moved[rows].any() and not moved[~rows].any()


def test_fp8_block_matmul_twin_is_the_blockwise_dequantization():
    # the twin against the format's own UE8M0 dequantization (float64 product)
    from expertstream.formats import mxfp4

    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    q, scale = mxfp4.quantize_fp8_blocks_e8m0(w)
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    want = x.double() @ mxfp4.dequantize_fp8_blocks_e8m0(q, scale, dtype=torch.float64).T
    torch.testing.assert_close(
        fp8_block_matmul_ref(x, q, scale, (128, 128)).double(), want, rtol=1e-5, atol=1e-5
    )
    # the row-scaled form is the (1 x K) case
    rs = torch.rand(200, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(
        fp8_rows_matmul_ref(x, q, rs), fp8_block_matmul_ref(x, q, rs[:, None], (1, 300))
    )


def test_fp8_block_matmul_asserts_shapes():
    q, scale = _blocked(200, 300, (128, 128), True, seed=1)
    x = torch.randn(1, 300).to(DEV)
    with pytest.raises(AssertionError, match="scale"):
        fp8_block_matmul(x, q.to(DEV), scale[:1].contiguous().to(DEV), (128, 128))
    with pytest.raises(AssertionError, match="column block"):
        fp8_block_matmul(x, q.to(DEV), torch.ones(2, 10).to(DEV), (128, 30))
