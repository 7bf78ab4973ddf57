import torch

from expertstream.formats import fp8, nvfp4
from expertstream.formats.expert_block import ExpertLayout


def test_every_e2m1_code_in_both_nibbles():
    # byte 0xLH: element 2j = low nibble, element 2j+1 = high nibble
    codes = torch.arange(16, dtype=torch.uint8)
    packed = torch.tensor([[(c | ((15 - c) << 4)) for c in range(16)]], dtype=torch.uint8)  # [1, 16]
    out = nvfp4.unpack_codes(packed)[0]
    assert out[0::2].tolist() == codes.tolist()
    assert out[1::2].tolist() == list(range(15, -1, -1))
    # scale 1.0 (E4M3 0x38), global 1.0: values are the table itself
    scale = torch.full((1, 2), 0x38, dtype=torch.uint8)
    w = nvfp4.dequantize(packed, scale, 1.0)[0]
    assert w[0::2].tolist() == list(nvfp4.E2M1_VALUES)
    assert torch.signbit(w[16]).item()  # code 8 is -0.0


def test_e4m3_hand_bytes_including_subnormals_and_max():
    raw = torch.tensor([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x81, 0x7F], dtype=torch.uint8)
    got = fp8.e4m3_to_float(raw)
    want = [0.0, 2.0**-9, 7 * 2.0**-9, 2.0**-6, 1.0, 448.0, -448.0, -(2.0**-9)]
    assert got[:8].tolist() == want
    assert torch.isnan(got[8])
    # agrees with torch's own float8 decoding on every non-NaN byte
    allb = torch.arange(256, dtype=torch.uint8)
    ok = (allb & 0x7F) != 0x7F
    assert torch.equal(fp8.e4m3_to_float(allb)[ok], allb.view(torch.float8_e4m3fn).float()[ok])


def test_subnormal_block_scale_decodes_exactly():
    packed = torch.tensor([[0x77] * 8], dtype=torch.uint8)  # sixteen codes of 7 (= 6.0)
    scale = torch.tensor([[0x03]], dtype=torch.uint8)  # 3 * 2^-9
    w = nvfp4.dequantize(packed, scale, torch.tensor(0.5))
    assert torch.all(w == 6.0 * 3 * 2.0**-9 * 0.5)


def test_quantize_rounds_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0, 0.0, 0.1])
    codes = nvfp4.round_to_e2m1(x)
    vals = nvfp4.e2m1_table()[codes.long()]
    assert vals.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 0.0, 0.0]


def test_quantize_matches_modelopt_rules_and_round_trips():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w[3, :16] = 0.0  # an all-zero block gets scale 1.0
    w[5, 16:32] *= 1e-6  # tiny block: subnormal / clamped scale
    q, s, ws2 = nvfp4.quantize(w)
    assert q.shape == (64, 64) and s.shape == (64, 8) and s.dtype == torch.float8_e4m3fn
    assert torch.isclose(ws2, w.abs().max() / (6 * 448))
    assert s.float()[3, 0] == 1.0
    assert s.float().min() >= 2.0**-9
    back = nvfp4.dequantize(q, s, ws2)
    # error bound: half the largest E2M1 step (1.0 between 4 and 6) times the block scale, plus E4M3 rounding
    bs = s.float().repeat_interleave(16, 1) * ws2
    assert torch.all((back - w).abs() <= bs * 1.0 + 1e-6)
    rel = (back - w).norm() / w.norm()
    assert rel < 0.12
    # re-quantizing the decoded weight is a fixed point
    q2, s2, _ = nvfp4.quantize(back, float(ws2))
    assert torch.equal(nvfp4.dequantize(q2, s2, ws2), back)


def test_fp8_rows_and_blocks_round_trip():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=g) * torch.linspace(0.01, 10, 256)[:, None]
    q, sc = fp8.quantize_fp8_rows(w)
    back = fp8.dequantize_fp8_rows(q, sc)
    assert torch.all((back - w).abs() <= w.abs().amax(1, keepdim=True) * 2**-4)
    q, si = fp8.quantize_fp8_blocks(w[:, :256])
    assert si.shape == (2, 2)
    back = fp8.dequantize_fp8_blocks(q, si)
    assert (back - w[:, :256]).norm() / w[:, :256].norm() < 0.05


def test_expert_block_layout_real_dims_and_round_trip():
    lay = ExpertLayout.for_dims(2560, 640)
    assert lay.payload_bytes == 2_764_800 and lay.block_bytes == 2_764_800
    assert [p.offset for p in lay.parts] == [0, 819_200, 1_638_400, 2_457_600, 2_560_000, 2_662_400]
    small = ExpertLayout.for_dims(64, 32)
    assert small.block_bytes % 4096 == 0
    g = torch.Generator().manual_seed(2)
    tensors = {}
    for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
        w = torch.randn(*shape, generator=g)
        q, s, _ = nvfp4.quantize(w)
        tensors[f"{proj}.weight"], tensors[f"{proj}.weight_scale"] = q, s
    block = torch.frombuffer(bytearray(small.pack(tensors)), dtype=torch.uint8)
    ones = torch.ones(3)
    got = small.dequantize(block, ones)
    for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
        want = nvfp4.dequantize(tensors[f"{proj}.weight"], tensors[f"{proj}.weight_scale"], 1.0)
        assert torch.equal(got[j], want)
