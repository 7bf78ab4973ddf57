"""The in-kernel codecs (E2M1, E4M3, the PTX conversion and its fallbacks) on every byte, the package without
Triton, and the tuned-config files."""

import json
import subprocess
import sys

import pytest
import torch
from kernel_helpers import DEV, FailingKernel

from expertstream.formats import fp8, mxfp4, nvfp4
from expertstream.kernels import codec, e2m1_uses_ptx

triton = pytest.importorskip("triton")
tl = triton.language


def test_e4m3_native_from_sm89():
    assert not codec.e4m3_native(None) and not codec.e4m3_native((8, 6))
    assert codec.e4m3_native((8, 9)) and codec.e4m3_native((9, 0)) and codec.e4m3_native((12, 0))


@triton.jit
def _decode_all_bytes(w_ptr, c_ptr, s_ptr, DTYPE: tl.constexpr):
    i = tl.arange(0, 256)
    w = tl.load(w_ptr + i)
    cols = codec.e2m1_word_cols(w, DTYPE, False)
    for c in tl.static_range(8):
        tl.store(c_ptr + c * 256 + i, cols[c].to(tl.float32) * codec.e2m1_cols_unit(DTYPE, False))
    tl.store(s_ptr + i, codec.e4m3_f16((w & 0xFF).to(tl.uint8)).to(tl.float32))


@pytest.mark.parametrize("dtype", [tl.float32, tl.float16] + ([tl.bfloat16] if DEV == "cuda" else []))
def test_in_kernel_codecs_exact_on_every_byte(dtype):
    # 256 words, every byte value once in each of the 4 byte positions: the 8 columns of each word in `dtype`
    # (fp32 / fp16 in the interpreter, bf16 too on a GPU) are the E2M1 table's values, -0.0 included
    i = torch.arange(256)
    b = [(i + 64 * j) % 256 for j in range(4)]
    w = (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24).to(torch.int64)
    cols, s = torch.empty(8, 256, device=DEV), torch.empty(256, device=DEV)
    w32 = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)  # the same bits as int32
    _decode_all_bytes[(1,)](w32.to(DEV), cols, s, dtype)
    table = nvfp4.e2m1_table(DEV)
    for c in range(8):
        want = table[((w >> (4 * c)) & 15).to(DEV)]
        assert torch.equal(cols[c], want) and torch.equal(torch.signbit(cols[c]), torch.signbit(want)), c
    ok = (b[0] & 0x7F) != 0x7F  # E4M3 NaN bytes are never block scales
    assert torch.equal((s.cpu() * codec.E4M3_UNIT)[ok], fp8.e4m3_to_float(b[0].to(torch.uint8))[ok])


@triton.jit
def _block_scales(b_ptr, s_ptr, MXFP4: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(s_ptr + i, codec.block_scale(tl.load(b_ptr + i), MXFP4))


def test_block_scales_exact_on_every_byte():
    # both formats' scale bytes decode to value * 2^-8 in fp32: UE8M0 (byte 0 a subnormal, 255 NaN) as
    # formats.mxfp4 decodes it, E4M3 as e4m3_f16
    b = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256, device=DEV)
    _block_scales[(1,)](b.to(DEV), got, True)
    want = mxfp4.e8m0_to_float(b) / codec.E4M3_UNIT
    assert torch.equal(got.cpu().isnan(), b == 255) and torch.equal(got.cpu()[:255], want[:255])
    _block_scales[(1,)](b.to(DEV), got, False)
    ok = (b & 0x7F) != 0x7F
    assert torch.equal((got.cpu() * codec.E4M3_UNIT)[ok], fp8.e4m3_to_float(b)[ok])


def test_ptx_e2m1_only_from_sm100():
    assert not e2m1_uses_ptx(None)
    assert not e2m1_uses_ptx((8, 9))
    assert not e2m1_uses_ptx((9, 0))
    assert e2m1_uses_ptx((10, 0)) and e2m1_uses_ptx((12, 0))


def test_ptx_compile_failure_falls_back_to_software(monkeypatch):
    kernel = FailingKernel("USE_PTX")
    monkeypatch.setattr(codec, "device_capability", lambda dev: (10, 0))
    monkeypatch.setattr(codec, "_PTX_FAILED", set())
    codec.launch_e2m1(kernel, (1,), torch.device("cpu"))
    codec.launch_e2m1(kernel, (1,), torch.device("cpu"))
    assert kernel.calls == [True, False, False]  # PTX tried once, then software for good
    monkeypatch.setattr(codec, "device_capability", lambda dev: (9, 0))
    codec.launch_e2m1(kernel, (1,), torch.device("cpu"))
    assert kernel.calls[-1] is False


def test_import_without_triton_and_launchers_raise():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, expertstream.kernels as K\n"
        "assert not K.HAVE_TRITON\n"
        "try:\n"
        "    K.fp8_rows_matmul(torch.zeros(1, 16), torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4))\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton is not installed' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@triton.jit
def _decode_words(w_ptr, e4_ptr):
    # every byte value in every byte position of a 32-bit word
    i = tl.arange(0, 256)
    w = tl.load(w_ptr + i).to(tl.uint32, bitcast=True)
    a, b = codec.e4m3x4_f16(w)
    a0, a2 = codec.f16x2_halves(a)
    b1, b3 = codec.f16x2_halves(b)
    tl.store(e4_ptr + i, a0)
    tl.store(e4_ptr + 256 + i, b1)
    tl.store(e4_ptr + 512 + i, a2)
    tl.store(e4_ptr + 768 + i, b3)


def every_byte_words() -> tuple[torch.Tensor, torch.Tensor]:
    """256 int32 words holding every byte value in every byte position, and their bits as int64."""
    b = torch.arange(256, dtype=torch.int64)
    raw = b | (((b + 85) % 256) << 8) | (((b + 170) % 256) << 16) | (((b + 37) % 256) << 24)
    return raw.to(torch.uint32).view(torch.int32), raw


def test_e4m3_word_codec_exact_on_every_byte():
    words, raw = every_byte_words()
    e4 = torch.empty(4, 256, device=DEV)
    _decode_words[(1,)](words.to(DEV), e4)
    byte = torch.stack([(raw >> (8 * j)) & 255 for j in range(4)]).to(torch.uint8)  # [4, 256], byte j
    ok = (byte & 0x7F) != 0x7F
    assert torch.equal((e4.cpu() * codec.E4M3_UNIT)[ok], fp8.e4m3_to_float(byte)[ok])


@triton.jit
def _decode_e2m1_words(w_ptr, out_ptr):
    # out[c, i] = column c of word i, through the four (j, j + 4) patterns
    i = tl.arange(0, 256)
    ps = codec.e2m1_words(tl.load(w_ptr + i), False)
    for j in tl.static_range(4):
        lo, hi = codec.f16x2_halves(ps[j])
        tl.store(out_ptr + j * 256 + i, lo)
        tl.store(out_ptr + (j + 4) * 256 + i, hi)


def test_e2m1_word_codec_exact_on_every_nibble():
    # every code in every nibble position of a 32-bit word (byte 0's low nibble is column 0), -0.0 included
    words, raw = every_byte_words()
    out = torch.empty(8, 256, device=DEV)
    _decode_e2m1_words[(1,)](words.to(DEV), out)
    want = nvfp4.e2m1_table()[torch.stack([(raw >> (4 * c)) & 15 for c in range(8)])]  # [8, 256]
    got = out.cpu() * codec.E2M1_SOFT_UNIT
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


# cvt.rn.f16x2.e2m1x2 in sm_90 PTX, from the PTX ISA's definition: each nibble's E2M1 value as f16 bits
# (magnitude m = 0: 0, 1: 0.5 = 0x3800, else (m + 28) << 9; the nibble's bit 3 is the sign), low nibble in
# the low half. Not the hardware: it runs the path's byte packing, half extraction and unit on this GPU.
_EMULATED_CVT = (
    """{{
.reg .b32 c, m, v, s, lo, hi;
.reg .pred p;
cvt.u32.u8 c, {b};
"""
    + "".join(
        f"""and.b32 m, c, 7;
add.u32 v, m, 28;
shl.b32 v, v, 9;
setp.lt.u32 p, m, 2;
selp.b32 v, 0x3800, v, p;
setp.eq.u32 p, m, 0;
selp.b32 v, 0, v, p;
and.b32 s, c, 8;
shl.b32 s, s, 12;
or.b32 {half}, v, s;
shr.u32 c, c, 4;
"""
        for half in ("lo", "hi")
    )
    + """shl.b32 hi, hi, 16;
or.b32 {d}, lo, hi;
}}"""
)

_PTX_PATH_SCRIPT = """
import torch, triton.language as tl
from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels import codec, nvfp4_moe_decode, nvfp4_moe_prefill
codec.E2M1X4_ASM = tl.constexpr(codec.e2m1x4_asm(CVT))  # before any kernel compiles in this process
codec.E2M1_WORD_ASM = tl.constexpr(codec.e2m1_word_asm(CVT))
layout = ExpertLayout.for_dims(256, 128, align=64)
g = torch.Generator().manual_seed(3)
slots = torch.randint(0, 256, (12, layout.block_bytes), dtype=torch.uint8, generator=g)
for p in layout.parts:
    if p.dtype == "float8_e4m3fn":
        s = torch.randint(0, 0x40, (12, p.nbytes), dtype=torch.uint8, generator=g)
        slots[:, p.offset : p.offset + p.nbytes] = s
slots, ws2 = slots.cuda(), (torch.rand(12, 3, generator=g) * 0.05 + 0.01).cuda()
x = torch.randn(40, 256, generator=g).cuda().to(torch.bfloat16)
ids = torch.randint(0, 12, (40, 4), generator=g).cuda()
w = torch.rand(40, 4, generator=g).cuda()
loc = torch.arange(12, dtype=torch.int32, device="cuda")
host = slots[8:].cpu().pin_memory()
host_loc = torch.cat((loc[:8], -1 - torch.arange(4, dtype=torch.int32, device="cuda")))
outs = []
for ptx in (False, True):
    codec.e2m1_uses_ptx = lambda cap, ptx=ptx: ptx
    outs.append([nvfp4_moe_decode(x[0], ids[0], loc, ws2, w[0], layout, slots),
                 nvfp4_moe_decode(x[1], ids[1], host_loc, ws2, w[1], layout, slots, host),
                 nvfp4_moe_prefill(x, slots, ids, loc, ws2, w, layout)])
assert not codec._PTX_FAILED, codec._PTX_FAILED
for soft, ptx in zip(*outs):
    assert torch.equal(soft, ptx), (soft - ptx).abs().max()
print("identical")
"""


@pytest.mark.gpu  # inline PTX runs on a GPU only
def test_ptx_path_equals_software_with_an_emulated_conversion():
    # the PTX E2M1 path of every kernel, its conversion emulated (above), against the software path: the
    # same bits. In a fresh process, since the conversion is a global each kernel compiles in.
    script = _PTX_PATH_SCRIPT.replace("CVT", repr(_EMULATED_CVT))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "identical" in run.stdout, run.stderr[-3000:]


def test_user_tuned_configs_override_the_shipped_ones(tmp_path, monkeypatch):
    # `bench kernels --tune` writes a user file; its entries replace the shipped ones shape by shape, the
    # rest of the shipped file stays; a missing file is skipped, an unreadable one too
    shipped, user, broken = tmp_path / "shipped.json", tmp_path / "user.json", tmp_path / "broken.json"
    shipped.write_text(json.dumps({"GPU": {"fp8_gemv": {"1x2": {"block_n": 8}, "3x4": {"block_n": 16}}}}))
    other = {"k": {"s": {"a": 1}}}
    user.write_text(json.dumps({"GPU": {"fp8_gemv": {"1x2": {"block_n": 4}}}, "Other": other}))
    broken.write_text("{not json")
    merged = codec.load_tuned([str(shipped), str(user), str(broken), str(tmp_path / "missing.json")])
    assert merged["GPU"]["fp8_gemv"] == {"1x2": {"block_n": 4}, "3x4": {"block_n": 16}}
    assert merged["Other"] == other
    assert codec.load_tuned([str(user), str(shipped)])["GPU"]["fp8_gemv"]["1x2"] == {"block_n": 8}  # order
    monkeypatch.setenv("EXPERTSTREAM_TUNED", str(user))
    assert codec.user_tuned_path() == str(user)
    monkeypatch.delenv("EXPERTSTREAM_TUNED")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert codec.user_tuned_path() == str(tmp_path / "expertstream" / "tuned_configs.json")
