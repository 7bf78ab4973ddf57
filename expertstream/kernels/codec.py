"""In-kernel NVFP4 / MXFP4 / E4M3 decoding shared by the Triton kernels, the optional Triton import, launches.

Triton is optional: without it this module still imports (CPU users run the `*_ref` twins) and
`require_triton()` raises. Kernel signatures use string annotations (`from __future__ import annotations`),
which Triton reads as constexpr markers, so nothing Triton-typed is evaluated at import time.
Bytes are read as uint8 and decoded with bit ops: the interpreter has no fp8 type, and subnormal E4M3 block
scales stay exact. The one exception is the FP8 matrices' weights on sm_89+ (`e4m3_native`).
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
try:  # programmatic dependent launch (Triton >= 3.4, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton, or none
    gdc_launch_dependents = gdc_wait = None

log = get_logger(__name__)

HAVE_TRITON = triton is not None
# E2M1 code c -> fp16 bits ((c & 8) << 12) | ((c & 7) << 9) = value * 2^-14 (exact; 0.5 is subnormal)
E2M1_SOFT_UNIT = 2.0**14
# E4M3 byte b -> fp16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) is the value times 2^-8 (E4M3 subnormals
# land on fp16 subnormals, exact)
E4M3_UNIT = 2.0**8
# capabilities whose PTX inline-asm E2M1 path failed to compile in this process (software from then on)
_PTX_FAILED: set[tuple[int, int]] = set()
# ... whose float8e4nv loads (`e4m3_native`) failed to compile: bit ops from then on
_NATIVE_FAILED: set[tuple[int, int]] = set()


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


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (a block that covers n elements)."""
    return 1 << (n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 activations must not be rounded to TF32 inside tl.dot; 16-bit inputs ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def e2m1_uses_ptx(capability: tuple[int, int] | None) -> bool:
    """Blackwell (sm_100 / sm_120, major >= 10) has `cvt.rn.f16x2.e2m1x2`; older chips decode in software."""
    return capability is not None and capability[0] >= 10 and tuple(capability) not in _PTX_FAILED


def e4m3_native(capability: tuple[int, int] | None) -> bool:
    """sm_89 and later convert E4M3 in hardware (`cvt.rn.f16x2.e4m3x2`), which Triton emits for float8e4nv
    loads: on the H200 the FP8 GEMV runs 8-25 % faster with it than with bit ops. The interpreter (no fp8
    type) and older chips decode raw bytes with bit ops."""
    return capability is not None and tuple(capability) >= (8, 9) and tuple(capability) not in _NATIVE_FAILED


def native_failed(capability: tuple[int, int], error: Exception) -> None:
    """Record that the float8e4nv loads failed on this capability: `e4m3_native` says no from now on."""
    log.warning("FP8 loads with the hardware E4M3 conversion failed on sm_%d%d (%s); using bit ops",
                *capability, error)  # fmt: skip
    _NATIVE_FAILED.add(tuple(capability))


def dependent_launch(capability: tuple[int, int] | None) -> bool:
    """sm_90+ can launch a kernel while the one before it runs (programmatic dependent launch): the second
    waits in-kernel (`gdc_wait`) for the first's results, after work that does not need them. Never when
    interpreted (no such instructions), whatever capability a test claims."""
    hopper = capability is not None and tuple(capability) >= (9, 0)
    return hopper and gdc_wait is not None and not interpreting()


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


# Blackwell's conversion of one byte to f16x2 (low nibble in the low half); `e2m1x4_asm` applies it to the
# four bytes inline_asm packs per register. A GPU test substitutes an emulation to run this path elsewhere.
E2M1_CVT = "cvt.rn.f16x2.e2m1x2 {d}, {b};"


def e2m1x4_asm(cvt: str = E2M1_CVT) -> str:
    """The PTX of `e2m1_word_cols` on Blackwell: the bytes of $4 split, `cvt` (with {d} and {b}) writing
    $0..$3."""
    body = "\n".join(cvt.format(d=f"${i}", b=f"b{i}") for i in range(4))
    return "{\n.reg .b8 b0, b1, b2, b3;\nmov.b32 {b0, b1, b2, b3}, $4;\n" + body + "\n}"


def e2m1_word_asm(cvt: str = E2M1_CVT) -> str:
    """The PTX of `e2m1_words`: word $4's nibbles regrouped so that byte j holds columns j and j + 4
    (two prmt over the even and odd nibbles), then `cvt` on each byte writing $0..$3."""
    body = "\n".join(cvt.format(d=f"${i}", b=f"b{i}") for i in range(4))
    return (
        "{\n.reg .b32 ev, od, lo, hi;\n.reg .b8 b0, b1, b2, b3;\n"
        "and.b32 ev, $4, 0x0F0F0F0F;\nshr.b32 od, $4, 4;\nand.b32 od, od, 0x0F0F0F0F;\n"
        # bytes of ev: columns 0 2 4 6, of od: 1 3 5 7; lo = (0, 1, 2, 3), hi = (4, 5, 6, 7) in byte order
        "prmt.b32 lo, ev, od, 0x5140;\nprmt.b32 hi, ev, od, 0x7362;\nshl.b32 hi, hi, 4;\nor.b32 lo, lo, hi;\n"
        "mov.b32 {b0, b1, b2, b3}, lo;\n" + body + "\n}"
    )


E2M1X4_ASM = tl.constexpr(e2m1x4_asm()) if HAVE_TRITON else e2m1x4_asm()
E2M1_WORD_ASM = tl.constexpr(e2m1_word_asm()) if HAVE_TRITON else e2m1_word_asm()


# a uint32 read as the two 16-bit values it holds: one register move, so the compiler keeps each pair in its
# register. Split with shifts and packed again, every pair cost a half-swap PRMT in sm_90 SASS (Triton 3.9):
# prefill gate+up's loop fell from 814 to 686 instructions per 128 weights a thread, decode gate+up from
# 2,080 to 1,952 instructions. The interpreter has no inline asm
PAIR_ASM = tl.constexpr("mov.b32 $0, $1;") if HAVE_TRITON else None
PAIR_ASM_OK = tl.constexpr(not interpreting()) if HAVE_TRITON else False


# start reading the line holding each address into L2 (nothing waits for it; the int32 result is 0)
L2_PREFETCH_ASM = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;") if HAVE_TRITON else None


@jit
def l2_prefetch(ptrs):
    """L2 prefetch of the lines at `ptrs` (device memory; compiled kernels only: no asm when interpreted)."""
    return tl.inline_asm_elementwise(L2_PREFETCH_ASM, "=r,l", [ptrs], tl.int32, is_pure=False, pack=1)


def prefetch_lines(nbytes: int) -> int:
    """LINES for `l2_prefetch_rows` of nbytes a row: a power of two past the lines a row can touch."""
    return next_pow2(cdiv(nbytes, 128) + 1)


@jit
def l2_prefetch_rows(rows, nbytes, LINES: tl.constexpr):
    """L2 prefetch of the first nbytes (>= 1) of each row starting at the byte pointers `rows` [BN]: one
    address a 128-byte step, [BN, LINES] spread over the program's threads, the steps past the row's end
    clamped to its last byte (which covers the tail line of a row that does not start on a line)."""
    off = tl.minimum(tl.arange(0, LINES) * 128, nbytes - 1)
    l2_prefetch(rows[:, None] + off[None, :])


@jit
def _halves(p, dtype: tl.constexpr):
    # uint32 pairs of 16-bit patterns -> (low half, high half) as dtype (fp16 or bf16)
    if PAIR_ASM_OK:  # one asm per two elements of [..., 2] (p twice), which it fills with p's two halves
        if dtype == tl.float16:  # (inline_asm_elementwise takes a dtype, not a constexpr holding one)
            pair = tl.inline_asm_elementwise(PAIR_ASM, "=r,r,r", [tl.join(p, p)], tl.float16, True, 2)
        else:
            pair = tl.inline_asm_elementwise(PAIR_ASM, "=r,r,r", [tl.join(p, p)], tl.bfloat16, True, 2)
        lo, hi = tl.split(pair)
    else:
        lo = (p & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True)
        hi = (p >> 16).to(tl.uint16).to(dtype, bitcast=True)
    return lo, hi


@jit
def e2m1_word_cols(w, dtype: tl.constexpr, USE_PTX: tl.constexpr):
    """int32 words of 8 E2M1 codes (nibble c = column c, the low nibble of byte 0 first) -> their 8 columns in
    `dtype`, column c of each word in the c-th, divided by e2m1_cols_unit. In software each code's bits are
    set straight into the dtype's sign, exponent and mantissa (magnitude bits at the top mantissa bit: value
    * 2^(1 - bias), 0.5 a subnormal), with no conversion; on Blackwell the hardware's fp16 values, converted.
    For 16-bit dtypes the two codes of byte i are set in one 32-bit pair (column 2i in the low half): byte i
    times 0x1001 puts its high nibble 16 bits above its low one, so one shift and mask serve both (5 integer
    ops per byte)."""
    u = w.to(tl.uint32, bitcast=True)
    # one branch per form and a single return: Triton compiles the code after a constexpr if's return too
    if USE_PTX:  # Blackwell: the hardware's conversion of each byte, true values in fp16
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=E2M1X4_ASM, constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.uint32,) * 4, is_pure=True,
            pack=1,
        )  # fmt: skip
        c0, c1 = _halves(p0, tl.float16)
        c2, c3 = _halves(p1, tl.float16)
        c4, c5 = _halves(p2, tl.float16)
        c6, c7 = _halves(p3, tl.float16)
        c0, c1, c2, c3 = c0.to(dtype), c1.to(dtype), c2.to(dtype), c3.to(dtype)
        c4, c5, c6, c7 = c4.to(dtype), c5.to(dtype), c6.to(dtype), c7.to(dtype)
    elif dtype == tl.float32:  # nibble c at bits 4c: sign to bit 31, magnitude to bits 22..24
        sg: tl.constexpr = 0x80000000
        mg: tl.constexpr = 0x01C00000
        c0 = (((u << 28) & sg) | ((u << 22) & mg)).to(tl.float32, bitcast=True)
        c1 = (((u << 24) & sg) | ((u << 18) & mg)).to(tl.float32, bitcast=True)
        c2 = (((u << 20) & sg) | ((u << 14) & mg)).to(tl.float32, bitcast=True)
        c3 = (((u << 16) & sg) | ((u << 10) & mg)).to(tl.float32, bitcast=True)
        c4 = (((u << 12) & sg) | ((u << 6) & mg)).to(tl.float32, bitcast=True)
        c5 = (((u << 8) & sg) | ((u << 2) & mg)).to(tl.float32, bitcast=True)
        c6 = (((u << 4) & sg) | ((u >> 2) & mg)).to(tl.float32, bitcast=True)
        c7 = ((u & sg) | ((u >> 6) & mg)).to(tl.float32, bitcast=True)
    else:
        # 16-bit: sign to bit 15 (31), magnitude to the top mantissa bit and the exponent's two lowest (bits
        # 9..11 in fp16, 6..8 in bf16; + 16)
        ms: tl.constexpr = 9 if dtype == tl.float16 else 6
        mg16: tl.constexpr = 0x0E000E00 if dtype == tl.float16 else 0x01C001C0
        t = (u & 0xFF) * 0x1001
        c0, c1 = _halves(((t << 12) & 0x80008000) | ((t << ms) & mg16), dtype)
        t = ((u >> 8) & 0xFF) * 0x1001
        c2, c3 = _halves(((t << 12) & 0x80008000) | ((t << ms) & mg16), dtype)
        t = ((u >> 16) & 0xFF) * 0x1001
        c4, c5 = _halves(((t << 12) & 0x80008000) | ((t << ms) & mg16), dtype)
        t = (u >> 24) * 0x1001
        c6, c7 = _halves(((t << 12) & 0x80008000) | ((t << ms) & mg16), dtype)
    return c0, c1, c2, c3, c4, c5, c6, c7


@jit
def e2m1_cols_unit(dtype: tl.constexpr, USE_PTX: tl.constexpr):
    """The power of two e2m1_word_cols' values are divided by: 2^(bias - 1) in software, 1 on Blackwell."""
    if USE_PTX:
        return 1.0
    return 16384.0 if dtype == tl.float16 else 2.0**126


@jit
def e2m1_words(w, USE_PTX: tl.constexpr):
    """int32 words of 8 E2M1 codes (nibble c = column c, the low nibble of byte 0 first) -> four uint32
    fp16x2 bit patterns, pattern j holding column j (low half) and column j + 4 (high half); in software
    the values divided by E2M1_SOFT_UNIT, with 11 integer ops per word (two codes per op, not a byte each)."""
    if USE_PTX:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=E2M1_WORD_ASM,
            constraints="=r,=r,=r,=r,r",
            args=[w],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )
    else:
        # nibble at bits 4j (and 16 + 4j): sign -> bit 15 (31), magnitude -> bits 9..11 (25..27), as in
        # e2m1_word_cols; the masks drop what crosses between the halves
        u = w.to(tl.uint32, bitcast=True)
        p0 = ((u << 12) & 0x80008000) | ((u << 9) & 0x0E000E00)
        p1 = ((u << 8) & 0x80008000) | ((u << 5) & 0x0E000E00)
        p2 = ((u << 4) & 0x80008000) | ((u << 1) & 0x0E000E00)
        p3 = (u & 0x80008000) | ((u >> 3) & 0x0E000E00)
    return p0, p1, p2, p3


@jit
def e4m3_f16(b):
    """Raw E4M3 bytes (uint8) -> fp16 holding value * 2^-8, exactly (NaN bytes 0x7F/0xFF decode as +-480)."""
    c = b.to(tl.int32)
    return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


@jit
def e8m0_f32(b):
    """Raw UE8M0 bytes (uint8) -> fp32 2^(b - 127), exactly: the byte is the exponent field (byte 0 gives
    2^-127, an fp32 subnormal, and byte 255 NaN, as `formats.mxfp4.e8m0_to_float`)."""
    c = b.to(tl.int32)
    edge = ((c == 0) | (c == 255)).to(tl.int32)
    return ((c << 23) | (edge << 22)).to(tl.float32, bitcast=True)


@jit
def block_scale(b, MXFP4: tl.constexpr):
    """Block scale bytes (uint8) -> fp32 value * 2^-8, exactly: E4M3 (NVFP4, `e4m3_f16`) or UE8M0 (MXFP4),
    so that both formats share the units of the code decodes (`nvfp4_unit`, the prefill tiles')."""
    if MXFP4:
        s = e8m0_f32(b) * 0.00390625  # 2^-8
    else:
        s = e4m3_f16(b).to(tl.float32)
    return s


@jit
def nvfp4_unit(USE_PTX: tl.constexpr):
    """fp32 factor turning e2m1_words(...) * e4m3_f16(...) products into true values (a power of two)."""
    return 256.0 if USE_PTX else 4194304.0  # E4M3_UNIT, times E2M1_SOFT_UNIT in software


# ---------------------------------------------------------------- tuned configs recorded as data

_TUNED_PATH = os.path.join(os.path.dirname(__file__), "tuned_configs.json")
_tuned_cache: dict | None = None


def user_tuned_path() -> str:
    """Where `expertstream bench kernels --tune` records this machine's picks: $EXPERTSTREAM_TUNED, else
    tuned_configs.json under $XDG_CACHE_HOME/expertstream (~/.cache/expertstream)."""
    if os.environ.get("EXPERTSTREAM_TUNED"):
        return os.environ["EXPERTSTREAM_TUNED"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "expertstream", "tuned_configs.json")


def load_tuned(paths: list[str]) -> dict:
    """{device name: {kernel: {shape key: cfg}}} from each file in turn, a later file's entries over an
    earlier one's (a missing file is skipped; an unreadable one is skipped with a warning)."""
    import json

    merged: dict = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            log.warning("cannot read %s (%s); its kernel configs are not used", path, e)
            continue
        for device, kernels in data.items():
            for kernel, shapes in kernels.items():
                merged.setdefault(device, {}).setdefault(kernel, {}).update(shapes)
    return merged


def forget_tuned() -> None:
    """Drop the loaded picks: the next `tuned_config` reads the files again (after a --tune sweep)."""
    global _tuned_cache
    _tuned_cache = None


def tuned_config(kernel: str, device: torch.device, key: str) -> dict | None:
    """Config picked by a device sweep, or None off CUDA, for unknown devices and shapes (callers then use
    their shape heuristics). The shipped tuned_configs.json holds the H200's picks; the user's file
    (`user_tuned_path`, written by `expertstream bench kernels --tune`) overrides them."""
    global _tuned_cache
    if device.type != "cuda" or interpreting():
        return None
    if _tuned_cache is None:
        _tuned_cache = load_tuned([_TUNED_PATH, user_tuned_path()])
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
    lo, hi = _halves(r, tl.float16)
    return lo.to(tl.float32), hi.to(tl.float32)
