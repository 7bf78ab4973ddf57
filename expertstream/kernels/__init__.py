"""Triton kernels: an asserting launcher beside each `@triton.jit` function, and a plain-torch `*_ref` twin.

Importing this package never needs Triton; the launchers raise when it is missing (use the `*_ref` twins).
"""

from expertstream.kernels.codec import HAVE_TRITON, e2m1_uses_ptx
from expertstream.kernels.fp8_gemv import (
    fp8_block_matmul,
    fp8_block_matmul_ref,
    fp8_rows_matmul,
    fp8_rows_matmul_ref,
    matvec16,
    matvec16_ref,
)
from expertstream.kernels.gdn_decode import gdn_step, gdn_step_ref
from expertstream.kernels.nvfp4_moe import (
    nvfp4_moe_decode,
    nvfp4_moe_decode_ref,
    nvfp4_moe_prefill,
    nvfp4_moe_prefill_ref,
)

__all__ = [
    "HAVE_TRITON",
    "e2m1_uses_ptx",
    "fp8_block_matmul",
    "fp8_block_matmul_ref",
    "fp8_rows_matmul",
    "fp8_rows_matmul_ref",
    "gdn_step",
    "gdn_step_ref",
    "matvec16",
    "matvec16_ref",
    "nvfp4_moe_decode",
    "nvfp4_moe_decode_ref",
    "nvfp4_moe_prefill",
    "nvfp4_moe_prefill_ref",
]
