"""In-kernel NVFP4 / E4M3 decoding shared by the Triton kernels, the optional Triton import, launch checks.

Triton is optional: without it this module still imports (CPU users run the `*_ref` twins) and
`require_triton()` raises. Kernel signatures use string annotations (`from __future__ import annotations`),
which Triton reads as constexpr markers, so nothing Triton-typed is evaluated at import time.
Codes and scales are read as raw integers (bytes or words) and decoded with integer ops into float bit
patterns: the interpreter has no fp8 type, subnormal E4M3 block scales stay exact, and the software E2M1
path (sm_90) needs no float conversion instruction (4x slower than integer ops there).
"""

from __future__ import annotations

import os

import torch

from expertstream.log import get_logger

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install
    triton = tl = None

log = get_logger(__name__)

HAVE_TRITON = triton is not None
# software E2M1 decode: nibble c -> fp32 bits ((c & 8) << 28) | ((c & 7) << 22) = value * 2^-126 (exact; 0.5
# becomes the fp32 subnormal 2^-127), so no conversion instruction is needed
E2M1_SOFT_UNIT = 2.0**126
# E4M3 byte b -> fp16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) is the value times 2^-8 (E4M3 subnormals
# land on fp16 subnormals, exact)
E4M3_UNIT = 2.0**8
# prefill weight tiles hold weight / TILE_UNIT: e2m1 * e4m3 has <= 6 significant bits in [2^-10, 2688], so
# weight * 2^-7 is a normal fp32 in [2^-17, 21] whose low 16 bits are zero, exact in bf16 and in fp16
TILE_UNIT = 2.0**7
# capabilities whose PTX inline-asm E2M1 path failed to compile in this process (software from then on)
_PTX_FAILED: set[tuple[int, int]] = set()


def jit(fn=None, *, do_not_specialize=()):
    """triton.jit when Triton is installed (else the plain function). `do_not_specialize` names integer
    arguments that vary per call (pair counts): one compiled variant instead of one per divisibility."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    return triton.jit(fn, do_not_specialize=list(do_not_specialize)) if HAVE_TRITON else fn


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(*tensors: torch.Tensor) -> None:
    """Raise unless Triton can launch on these tensors (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed: install expertstream[triton] or use the *_ref kernels")
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all kernel inputs must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {dev}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 activations must not be rounded to TF32 inside tl.dot; 16-bit inputs ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def e2m1_uses_ptx(capability: tuple[int, int] | None) -> bool:
    """Blackwell (sm_100 / sm_120, major >= 10) has `cvt.rn.f16x2.e2m1x2`; older chips decode in software."""
    return capability is not None and capability[0] >= 10 and tuple(capability) not in _PTX_FAILED


def device_capability(device: torch.device) -> tuple[int, int] | None:
    return None if device.type != "cuda" or interpreting() else torch.cuda.get_device_capability(device)


def launch_e2m1(kernel, grid, device: torch.device, *args, **kwargs) -> None:
    """Launch an E2M1-decoding kernel with USE_PTX picked by capability; fall back to software once if the
    PTX path fails to compile (it is only exercised on Blackwell)."""
    cap = device_capability(device)
    if e2m1_uses_ptx(cap):
        try:
            kernel[grid](*args, **kwargs, USE_PTX=True)
            return
        except Exception as e:  # compile failure: record it and use the identical software path
            log.warning("PTX E2M1 decode failed on sm_%d%d (%s); using the software decode", *cap, e)
            _PTX_FAILED.add(tuple(cap))
    kernel[grid](*args, **kwargs, USE_PTX=False)


@jit
def _e2m1x4_ptx(r, PACK: tl.constexpr):
    # sm_100+ hardware decode of the 4 code bytes in each 32-bit register -> 4 f16x2 registers (low nibble in
    # the low half). PACK = 4: r holds uint8 bytes, one int32 result per byte; PACK = 1: r holds int32 words,
    # a 4-tuple of int32 results (bytes 0..3).
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b8 b0, b1, b2, b3;
        mov.b32 {b0, b1, b2, b3}, $4;
        cvt.rn.f16x2.e2m1x2 $0, b0;
        cvt.rn.f16x2.e2m1x2 $1, b1;
        cvt.rn.f16x2.e2m1x2 $2, b2;
        cvt.rn.f16x2.e2m1x2 $3, b3;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[r],
        dtype=tl.int32 if PACK == 4 else (tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=PACK,
    )


@jit
def e2m1_f32(m, Q: tl.constexpr):
    """E2M1 nibble at bits Q..Q+3 of uint32 m (Q <= 20; other set bits only at >= Q + 16 or < Q - 12) -> fp32
    value * 2^-126, from bits: the product with 2^(22-Q) + 2^(28-Q) puts the magnitude at bits 22..24 and the
    sign at bit 31 without carries, the mask drops the copies. One IMAD + one LOP3, no conversion; exact (0.5
    becomes the fp32 subnormal 2^-127)."""
    return ((m * ((1 << (22 - Q)) + (1 << (28 - Q)))) & 0x81C00000).to(tl.float32, bitcast=True)


@jit
def e2m1_unit(USE_PTX: tl.constexpr):
    """fp32 factor turning e2m1_pair / e2m1x8 values into true values (a power of two)."""
    return 1.0 if USE_PTX else 8.507059173023462e37  # E2M1_SOFT_UNIT in software


@jit
def e2m1_pair(b, USE_PTX: tl.constexpr):
    """Packed uint8 bytes -> (low-nibble, high-nibble) fp32 values; in software divided by E2M1_SOFT_UNIT."""
    if USE_PTX:
        r = _e2m1x4_ptx(b, 4)
        lo, hi = f16x2_halves(r)
    else:
        c = b.to(tl.uint32)
        lo = e2m1_f32(c & 0xF, 0)
        hi = e2m1_f32(c & 0xF0, 4)
    return lo, hi


@jit
def e2m1x8(w, USE_PTX: tl.constexpr):
    """uint32 words of 8 E2M1 codes (column 8i + p at bits 4p..4p+3 of word i) -> 8-tuple of fp32 tensors,
    element p; in software divided by E2M1_SOFT_UNIT."""
    if USE_PTX:
        r0, r1, r2, r3 = _e2m1x4_ptx(w, 1)
        c0, c1 = f16x2_halves(r0)
        c2, c3 = f16x2_halves(r1)
        c4, c5 = f16x2_halves(r2)
        c6, c7 = f16x2_halves(r3)
    else:
        # 4 masked copies hold two nibbles 16 bits apart: 5 ops per word, then 2 per element
        m0 = w & 0x000F000F  # nibbles 0 and 4
        m1 = w & 0x00F000F0  # 1 and 5
        w8 = w >> 8
        m2 = w8 & 0x000F000F  # 2 and 6
        m3 = w8 & 0x00F000F0  # 3 and 7
        c0 = e2m1_f32(m0, 0)
        c1 = e2m1_f32(m1, 4)
        c2 = e2m1_f32(m2, 0)
        c3 = e2m1_f32(m3, 4)
        c4 = e2m1_f32(m0, 16)
        c5 = e2m1_f32(m1, 20)
        c6 = e2m1_f32(m2, 16)
        c7 = e2m1_f32(m3, 20)
    return c0, c1, c2, c3, c4, c5, c6, c7


@jit
def e4m3_f16(b):
    """Raw E4M3 bytes (uint8) -> fp16 holding value * 2^-8, exactly (NaN bytes 0x7F/0xFF decode as +-480)."""
    c = b.to(tl.int32)
    return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


@jit
def e4m3_f32(b):
    """Raw E4M3 bytes (uint8) -> their fp32 value, exactly and without a conversion instruction: the fp32 bits
    ((b & 0x80) << 24) | ((b & 0x7F) << 20) are value * 2^-120 (E4M3 subnormals land on fp32 subnormals),
    and the product with 2^120 is exact (NaN bytes 0x7F/0xFF decode as +-480)."""
    c = b.to(tl.uint32)
    return (((c & 0x80) << 24) | ((c & 0x7F) << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e36


@jit
def nvfp4_tile_scale(sb, USE_PTX: tl.constexpr):
    """E4M3 scale bytes -> fp32 factor f with e2m1_pair(...) * f = weight / TILE_UNIT exactly: scale 2^119
    in software (codes are value * 2^-126; 448 * 2^119 < 2^128), scale * 2^-7 with PTX."""
    return e4m3_f32(sb) * (0.0078125 if USE_PTX else 6.646139978924579e35)


@jit
def exact_cast(v, dtype: tl.constexpr):
    """fp32 values exactly representable in dtype (<= 8 significant bits, in range) -> dtype; bf16 takes the
    top half of the fp32 bits (its low half is zero), no conversion instruction."""
    if dtype == tl.bfloat16:
        return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


# ---------------------------------------------------------------- tuned configs recorded as data

_TUNED_PATH = os.path.join(os.path.dirname(__file__), "tuned_configs.json")
_tuned_cache: dict | None = None


def tuned_config(kernel: str, device: torch.device, key: str) -> dict | None:
    """Config picked by the device sweep (tuned_configs.json: {device name: {kernel: {shape key: cfg}}}),
    or None off CUDA, for unknown devices and shapes (callers then use their shape heuristics)."""
    global _tuned_cache
    if device.type != "cuda" or interpreting():
        return None
    if _tuned_cache is None:
        import json

        try:
            with open(_TUNED_PATH) as f:
                _tuned_cache = json.load(f)
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s); using default kernel configs", _TUNED_PATH, e)
            _tuned_cache = {}
    cfg = _tuned_cache.get(torch.cuda.get_device_name(device), {}).get(kernel, {}).get(key)
    return dict(cfg) if cfg else None


@jit
def e4m3x4_f16(w):
    """uint32 words of 4 E4M3 bytes -> (bytes 0 and 2, bytes 1 and 3) as fp16x2 bit patterns (value * 2^-8,
    low byte in the low half); 7 integer ops per 4 bytes instead of 5 per byte."""
    lo = ((w << 8) & 0x80008000) | ((w << 7) & 0x3F803F80)
    hi = (w & 0x80008000) | ((w >> 1) & 0x3F803F80)
    return lo, hi


@jit
def f16x2_halves(r):
    """uint32 fp16x2 bit patterns -> (low half, high half) as fp32 (exact)."""
    lo = r.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (r >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi
