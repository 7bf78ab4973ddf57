"""The FP8 row-scaled matmul and GEMV and the 16-bit GEMV against their plain-torch twins (interpreter on
CPU); the FP8 twin against dequantize-then-matmul in float64."""

import pytest
import torch
from kernel_helpers import DEV, FailingKernel, close

from expertstream.formats import fp8
from expertstream.kernels import codec, fp8_rows_matmul, fp8_rows_matmul_ref, matvec16, matvec16_ref

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
