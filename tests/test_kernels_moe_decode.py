"""The NVFP4 MoE decode kernel against its plain-torch twin (interpreter on CPU); the twin in float64."""

import pytest
import torch
from kernel_helpers import DEV, LAUNCH_MECHANICS, LIMIT, cfg, close, decode, decode_ref

from expertstream.kernels import nvfp4_moe_decode, nvfp4_moe_decode_ref, nvfp4_moe_prefill_ref

pytest.importorskip("triton")


def test_random_scales_cover_subnormals(moe_bank):
    layout, slots, _ = moe_bank
    p = layout.part("down_proj.weight_scale")
    sb = slots[:, p.offset : p.offset + p.nbytes]
    assert ((sb > 0) & (sb < 8)).any()  # exponent 0, nonzero: subnormal


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_ids", [[2], [1, 4, 4, 0, 5]], ids=["k1", "k5dup"])
def test_decode_matches_ref(moe_bank, dtype, slot_ids):
    layout, slots, ws2 = moe_bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    ids = torch.tensor(slot_ids, dtype=torch.int32, device=DEV)
    w = torch.rand(len(slot_ids), device=DEV)
    # block sizes chosen so H/16 and I/16 groups are not multiples of BLOCK_G, nor rows of BLOCK_N
    got = decode(x[None], slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4))
    assert got.shape == (1, layout.hidden_size) and got.dtype == dtype
    close(got, decode_ref(x[None], slots, ids, ws2, w, layout), dtype)


@LAUNCH_MECHANICS
def test_decode_reads_host_rows_like_slots(moe_bank):
    # experts 0-2 in VRAM slots, 3-5 in (pinned) host rows, listed in another order: the kernel and its
    # twin follow the location table, and the sum equals the all-slots one bit for bit
    layout, slots, ws2 = moe_bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(2)).to(DEV)
    ids = torch.tensor([5, 0, 3, 3, 2], device=DEV)
    w = torch.rand(5, device=DEV)
    host = slots[3:].flip(0).cpu()  # expert 3 -> host row 2, 4 -> 1, 5 -> 0
    host = host.pin_memory() if DEV == "cuda" else host
    loc = torch.tensor([0, 1, 2, -3, -2, -1], dtype=torch.int32, device=DEV)
    vram = slots[:3].contiguous()
    got = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, vram, host, config=cfg(16, 4, 32, 4))
    assert torch.equal(got, decode(x, slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4)))
    ref = nvfp4_moe_decode_ref(x, ids, loc, ws2, w, layout, vram, host)
    assert torch.equal(ref, decode_ref(x, slots, ids, ws2, w, layout))
    # must-fail control: one expert pointed at the wrong host row changes the sum
    loc[4] = -3
    bad = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, vram, host, config=cfg(16, 4, 32, 4))
    assert torch.equal(bad, got)  # expert 4 is not routed: its entry is never read
    loc[3] = -2
    bad = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, vram, host, config=cfg(16, 4, 32, 4))
    assert not torch.allclose(bad, got)


@LAUNCH_MECHANICS
def test_decode_launch_shape_is_the_same_wherever_the_blocks_are(moe_bank, monkeypatch):
    # the tuned launch shape sets the order of the sums: blocks in host rows must take the shape (and give
    # the bits) of blocks in slots, so that the decode regimes (VRAM, RAM, disk) choose the same tokens
    import expertstream.kernels.nvfp4_moe as moe

    asked = []

    def tuned(kernel, device, key):
        asked.append(key)
        return cfg(16, 4, 32, 4)

    monkeypatch.setattr(moe, "tuned_config", tuned)
    layout, slots, ws2 = moe_bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEV)
    ids = torch.tensor([4, 1, 5, 0], device=DEV)
    w = torch.rand(4, device=DEV)
    host = slots[3:].flip(0).cpu()
    host = host.pin_memory() if DEV == "cuda" else host
    loc = torch.tensor([0, 1, 2, -3, -2, -1], dtype=torch.int32, device=DEV)
    got = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, slots[:3].contiguous(), host)
    assert torch.equal(got, decode(x, slots, ids, ws2, w, layout))
    assert len(asked) == 2 and asked[0] == asked[1]


def test_refs_equal_float64_dequantize_then_matmul(moe_bank):
    layout, slots, ws2 = moe_bank
    x = torch.randn(3, layout.hidden_size, dtype=torch.float64, device=DEV)
    ids = torch.tensor([[0, 2], [2, 2], [5, 1]], device=DEV)
    w = torch.rand(3, 2, dtype=torch.float64, device=DEV)
    want = torch.zeros_like(x)
    for t in range(3):
        for k in range(2):
            gate, up, down = (m.double() for m in layout.dequantize(slots[ids[t, k]], ws2[ids[t, k]]))
            h = torch.nn.functional.silu(gate @ x[t]) * (up @ x[t])
            want[t] += w[t, k] * (down @ h)
    e2s = torch.arange(6, device=DEV)
    pre = nvfp4_moe_prefill_ref(x.float(), slots, ids, e2s, ws2, w.float(), layout)
    torch.testing.assert_close(pre.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    dec = decode_ref(x[2].float(), slots, ids[2].int(), ws2, w[2].float(), layout)
    torch.testing.assert_close(dec.double(), want[2], rtol=1e-5, atol=1e-5 * want.abs().max().item())


@LAUNCH_MECHANICS
def test_swapped_nibbles_fail(moe_bank):
    # must-fail control: the same comparison catches a block decoded with its nibbles swapped
    layout, slots, ws2 = moe_bank
    x = torch.randn(layout.hidden_size, device=DEV)
    ids = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    w = torch.rand(2, device=DEV)
    swapped = slots.clone()
    codes = layout.part("down_proj.weight").offset
    swapped[:, :codes] = (slots[:, :codes] << 4) | (slots[:, :codes] >> 4)
    got = decode(x, swapped, ids, ws2, w, layout)
    with pytest.raises(AssertionError):
        close(got, decode_ref(x, slots, ids, ws2, w, layout), torch.float32)


@LAUNCH_MECHANICS
def test_decode_is_deterministic(moe_bank):
    # the partials are summed in a fixed order (by whichever program of a row block finishes last, in expert
    # order): two calls give the same bits (other splits round differently: on the GPU the compiler fuses
    # the looped sum into FMAs)
    layout, slots, ws2 = moe_bank
    x = torch.randn(layout.hidden_size, device=DEV)
    ids = torch.tensor([3, 1, 3, 0], dtype=torch.int32, device=DEV)
    w = torch.rand(4, device=DEV)
    a = decode(x, slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4))
    b = decode(x, slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4))
    assert torch.equal(a, b)


@pytest.mark.slow  # every shape of the sweep: ~10 s a bank in the interpreter on 2 cores
def test_every_decode_sweep_candidate_matches_ref(moe_bank):
    # `bench kernels` may record any of them as a device's default: each must be a valid launch
    from expertstream.bench.sweep import DECODE_SWEEP

    layout, slots, ws2 = moe_bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(6)).to(DEV)
    ids = torch.tensor([1, 4, 4, 0, 5], dtype=torch.int32, device=DEV)
    w = torch.rand(5, device=DEV)
    want = decode_ref(x, slots, ids, ws2, w, layout)
    for config in DECODE_SWEEP:
        close(decode(x, slots, ids, ws2, w, layout, config=config), want, torch.float32)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_decode_split_down_matches_ref(moe_bank, split):
    # K = 5 experts in `split` down programs per row block: 5, 3 + 2 and 2 + 2 + 1 experts each
    layout, slots, ws2 = moe_bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEV)
    ids = torch.tensor([1, 4, 4, 0, 5], dtype=torch.int32, device=DEV)
    w = torch.rand(5, device=DEV)
    got = decode(x, slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4) | {"split_down": split})
    close(got, decode_ref(x, slots, ids, ws2, w, layout), torch.float32)


# ---------------------------------------------------------------- MXFP4 (DeepSeek-V4's experts)

LIMITS = pytest.mark.parametrize("limit", [None, LIMIT], ids=["unclamped", "clamped"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@LIMITS
def test_mxfp4_decode_matches_ref(mx_bank, dtype, limit):
    layout, slots, ws2 = mx_bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(11)).to(DEV, dtype)
    ids = torch.tensor([1, 4, 4, 0, 5], dtype=torch.int32, device=DEV)  # a duplicate
    w = torch.rand(5, device=DEV)
    # 16-element groups' worth of codes per step: 2 and 1 MXFP4 groups, not dividing H / 32 at 96
    got = decode(x[None], slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 2), swiglu_limit=limit)
    assert got.shape == (1, layout.hidden_size) and got.dtype == dtype
    want = decode_ref(x[None], slots, ids, ws2, w, layout, swiglu_limit=limit)
    close(got, want, dtype)
    if limit is not None:  # the clamp changes this sum: the comparison above tests it
        assert not torch.allclose(want, decode_ref(x[None], slots, ids, ws2, w, layout), rtol=0.05)


@LIMITS
def test_mxfp4_decode_reads_host_rows_like_slots(mx_bank, limit):
    # as for NVFP4: experts 3-5 in (pinned) host rows, the rest in slots; the sum is the all-slots one bit
    # for bit, and the twin follows the same table
    layout, slots, ws2 = mx_bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(12)).to(DEV)
    ids = torch.tensor([5, 0, 3, 3, 2], device=DEV)
    w = torch.rand(5, device=DEV)
    host = slots[3:].flip(0).cpu()
    host = host.pin_memory() if DEV == "cuda" else host
    loc = torch.tensor([0, 1, 2, -3, -2, -1], dtype=torch.int32, device=DEV)
    vram = slots[:3].contiguous()
    kw = dict(swiglu_limit=limit)
    got = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, vram, host, config=cfg(16, 4, 32, 4), **kw)
    assert torch.equal(got, decode(x, slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4), **kw))
    ref = nvfp4_moe_decode_ref(x, ids, loc, ws2, w, layout, vram, host, **kw)
    assert torch.equal(ref, decode_ref(x, slots, ids, ws2, w, layout, **kw))
    close(got, ref, torch.float32)


def test_mxfp4_refs_equal_the_clamped_bank_sum(mx_bank):
    # both twins in MXFP4 with the clamp equal the CPU bank's routed sum (experts/cpu_bank.py, the eager
    # path's semantics) over the blocks' float64 dequantisation; weight_scale_2 is not read
    from expertstream.experts.cpu_bank import DenseExperts

    layout, slots, ws2 = mx_bank
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, layout.hidden_size, generator=g, dtype=torch.float64).to(DEV)
    ids = torch.tensor([[0, 2], [2, 2], [5, 1]], device=DEV)
    w = torch.rand(3, 2, generator=g, dtype=torch.float64).to(DEV)
    mats = [[m.double() for m in layout.dequantize(slots[e], None)] for e in range(6)]
    gate_up = torch.stack([torch.cat(m[:2]) for m in mats])  # [E, 2I, H]
    down = torch.stack([m[2] for m in mats])
    want = DenseExperts([gate_up], [down], swiglu_limit=LIMIT)(0, x, ids, w)
    e2s = torch.arange(6, device=DEV)
    tol = dict(rtol=1e-5, atol=1e-5 * want.abs().max().item())
    pre = nvfp4_moe_prefill_ref(x.float(), slots, ids, e2s, ws2, w.float(), layout, swiglu_limit=LIMIT)
    torch.testing.assert_close(pre.double(), want, **tol)
    dec = decode_ref(x[2].float(), slots, ids[2].int(), ws2, w[2].float(), layout, swiglu_limit=LIMIT)
    torch.testing.assert_close(dec.double(), want[2], **tol)
    unclamped = DenseExperts([gate_up], [down])(0, x, ids, w)
    with pytest.raises(AssertionError, match="not close"):  # must-fail control: the clamp matters here
        torch.testing.assert_close(pre.double(), unclamped, **tol)


def test_mxfp4_swapped_nibbles_and_nvfp4_scales_fail(mx_bank):
    # must-fail controls: the same comparison catches MXFP4 blocks decoded with their nibbles swapped, and
    # MXFP4 blocks read through the NVFP4 decode
    from expertstream.formats.expert_block import ExpertLayout

    layout, slots, ws2 = mx_bank
    x = torch.randn(layout.hidden_size, device=DEV)
    ids = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    w = torch.rand(2, device=DEV)
    want = decode_ref(x, slots, ids, ws2, w, layout)
    swapped = slots.clone()
    codes = layout.part("gate_proj.weight_scale").offset
    swapped[:, :codes] = (slots[:, :codes] << 4) | (slots[:, :codes] >> 4)
    with pytest.raises(AssertionError, match="not close"):
        close(decode(x, swapped, ids, ws2, w, layout), want, torch.float32)
    nv = ExpertLayout.for_dims(layout.hidden_size, layout.intermediate_size, align=64)
    as_nv = torch.zeros(slots.shape[0], nv.block_bytes, dtype=torch.uint8, device=DEV)
    as_nv[:, : layout.block_bytes] = slots  # the same codes at the same offsets, scales read as E4M3
    with pytest.raises(AssertionError, match="not close"):
        close(decode(x, as_nv, ids, torch.ones_like(ws2), w, nv), want, torch.float32)
