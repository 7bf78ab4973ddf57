"""Pieces the kernel tests share: the device, tolerances, random NVFP4 / MXFP4 expert blocks, decode in one
call."""

import pytest
import torch

from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels import nvfp4_moe_decode, nvfp4_moe_decode_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: accumulation-order noise only; fp16: 2^-11 rounding of x, h and the output; bf16: 2^-8
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# for tests of launch mechanics, which no shape changes: the bank of conftest.moe_bank at 64 x 32 in the quick
# loop, and at 96 x 48 (partial groups and row blocks) too in the full suite
LAUNCH_MECHANICS = pytest.mark.parametrize(
    "moe_bank",
    [pytest.param((64, 32), id="h64i32"), pytest.param((96, 48), id="h96i48", marks=pytest.mark.slow)],
    indirect=True,
)


def cfg(n_gu: int, g_gu: int, n_down: int, g_down: int, warps: int = 2) -> dict:
    """A decode launch config: rows per program and 16-element groups per step, gate+up then down."""
    return dict(block_n_gu=n_gu, block_g_gu=g_gu, block_n_down=n_down, block_g_down=g_down, num_warps=warps)


# UE8M0 scale bytes of random MXFP4 blocks: 2^-15 .. 2^-2, inside the range every activation dtype's prefill
# tiles hold exactly (nvfp4_moe._word_tile), and small enough that fp16 sums do not overflow
E8M0_BYTES = (112, 126)
# a SwiGLU limit (DeepSeek-V4's is 10) that random blocks' gate and up rows reach past: the clamp is exercised
LIMIT = 1.0


def random_slots(layout: ExpertLayout, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, block_bytes] blocks of random codes (all 16) and random scales: E4M3 with subnormals (NVFP4), or
    UE8M0 in E8M0_BYTES (MXFP4)."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 256, (s, layout.block_bytes), dtype=torch.uint8, generator=g)
    for p in layout.parts:
        if p.dtype == "float8_e4m3fn":  # bytes 0x00..0x3F: 0, subnormals 2^-9..7*2^-9, normals up to 1.875
            slots[:, p.offset : p.offset + p.nbytes] = torch.randint(
                0, 0x40, (s, p.nbytes), dtype=torch.uint8, generator=g
            )
        if p.dtype == "float8_e8m0fnu":
            slots[:, p.offset : p.offset + p.nbytes] = torch.randint(
                *E8M0_BYTES, (s, p.nbytes), dtype=torch.uint8, generator=g
            )
    ws2 = torch.rand(s, 3, generator=g) * 0.05 + 0.01
    return slots.to(DEV), ws2.to(DEV)


def close(got, want, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(
        got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item()
    )


def decode(x, slots, slot_ids, ws2, w, layout, **kw):
    """nvfp4_moe_decode with every block in a VRAM slot: expert i is slot i."""
    loc = torch.arange(slots.shape[0], dtype=torch.int32, device=slots.device)
    return nvfp4_moe_decode(x, slot_ids, loc, ws2, w, layout, slots, **kw)


def decode_ref(x, slots, slot_ids, ws2, w, layout, **kw):
    loc = torch.arange(slots.shape[0], dtype=torch.int32, device=slots.device)
    return nvfp4_moe_decode_ref(x, slot_ids, loc, ws2, w, layout, slots, **kw)


class FailingKernel:
    """Stands in for a Triton kernel whose form with `flag` set fails to compile: every launch's `flag` goes
    to `calls`; a launch without it runs `real` (when given)."""

    def __init__(self, flag: str, real=None):
        self.flag, self.real, self.calls = flag, real, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(kw[self.flag])
            if kw[self.flag]:
                raise RuntimeError("ptxas: unsupported instruction")
            if self.real is not None:
                self.real[grid](*args, **kw)

        return launch


def six_expert_prompt(layout, tokens: int, seed: int):
    """(ids [T, 3] over experts 0-5, x [T, H], weights [T, 3], expert e in slot e) on DEV."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (tokens, 3), generator=g).to(DEV)
    x = torch.randn(tokens, layout.hidden_size, generator=g).to(DEV)
    w = torch.rand(tokens, 3, generator=g).to(DEV)
    return ids, x, w, torch.arange(6, dtype=torch.int32, device=DEV)
