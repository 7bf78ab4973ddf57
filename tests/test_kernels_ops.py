"""The small kernels against their twins: the GatedDeltaNet step, staging blocks into VRAM, copying rows,
the stream read, the decode counts; and `bench kernels`' table."""

import pytest
import torch
from kernel_helpers import DEV, cfg, close, random_slots

from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels import nvfp4_moe_decode

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
def test_gdn_step_matches_its_twin(dtype, gate):
    from expertstream.kernels.gdn_decode import gdn_step, gdn_step_ref

    g = torch.Generator().manual_seed(7)
    hk, hv, dk, dv = 2, 4, 16, 32

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    qkv = r(2 * hk * dk + hv * dv).to(DEV)
    b, a, z = r(hv).to(DEV, dtype), r(hv).to(DEV, dtype), r(hv * dv).to(DEV, dtype)
    a[0] = 25.0  # past softplus's threshold
    state = r(hv, dk, dv, scale=0.3).to(DEV)
    neg_a, dt_bias, norm_w = -r(hv).exp().to(DEV), r(hv).to(DEV, dtype), r(dv).to(DEV, dtype)
    kw = dict(num_k_heads=hk, eps=1e-6, gate=gate)
    s0, s_ref = state.clone(), state.clone()
    want = gdn_step_ref(qkv, b, a, z, s_ref, neg_a, dt_bias, norm_w, **kw)
    got = gdn_step(qkv, b, a, z, state, neg_a, dt_bias, norm_w, **kw)
    assert got.dtype == dtype and got.shape == (hv * dv,)
    close(got, want, dtype)
    torch.testing.assert_close(state, s_ref, rtol=1e-5, atol=1e-5)  # the state stays FP32 in both
    # must-fail control: the same comparison catches a decay left out of the kernel's input
    bad = gdn_step(qkv, b, a, z, s0, torch.zeros_like(neg_a), dt_bias, norm_w, **kw)
    with pytest.raises(AssertionError):
        close(bad, want, dtype)


def test_the_models_gdn_step_dispatch_uses_the_kernel(monkeypatch):
    """`kernel=True` at the call runs the model's fused op as its kernel, False as its twin (the fallback:
    test_decode_ops.py)."""
    from expertstream.kernels import gdn_decode as kernel
    from expertstream.models import base

    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv = 1, 2, 16, 16
    args = [torch.randn(2 * hk * dk + hv * dv, generator=g)] + [
        torch.randn(hv, generator=g) for _ in range(2)
    ]
    args += [torch.randn(hv * dv, generator=g), torch.randn(hv, dk, dv, generator=g)]
    args += [-torch.rand(hv, generator=g), torch.randn(hv, generator=g), torch.randn(dv, generator=g)]
    kw = dict(num_k_heads=hk, eps=1e-6, gate="silu")
    calls = []
    monkeypatch.setattr(base.gdn_step, "kernel", lambda *a, **k: calls.append(1) or kernel.gdn_step(*a, **k))
    want = kernel.gdn_step_ref(*[a.clone() for a in args], **kw)
    close(base.gdn_step(*[a.clone().to(DEV) for a in args], **kw, kernel=True).cpu(), want, torch.float32)
    assert calls == [1]  # CUDA, or the interpreter standing in for it
    close(base.gdn_step(*[a.clone().to(DEV) for a in args], **kw, kernel=False).cpu(), want, torch.float32)
    assert calls == [1]  # the twin


@pytest.mark.parametrize("first", [0, 3])
@pytest.mark.parametrize("programs", [2, 32])  # 2: each program loops over several (guess, chunk) steps
def test_stage_blocks_copies_ram_guesses_and_points_the_working_row_at_them(first, programs, monkeypatch):
    from expertstream.kernels import stage_blocks as module
    from expertstream.kernels.stage_blocks import stage_blocks, stage_blocks_ref

    monkeypatch.setattr(module, "PROGRAMS", programs)

    g = torch.Generator().manual_seed(first)
    b = 16 * 2500  # not a multiple of the kernel's chunk: the last chunk is partial
    host = torch.randint(0, 256, (6, b), dtype=torch.uint8, generator=g)
    host = host.pin_memory() if DEV == "cuda" else host
    # experts 0-5: expert e in RAM row 5 - e, except expert 2, which has VRAM slot 1
    loc = torch.tensor([-6, -5, 1, -3, -2, -1], dtype=torch.int32, device=DEV)
    ids = torch.tensor([4, 2, 0], device=DEV)  # guesses, best first; expert 2 is already in a slot
    slots = torch.zeros(first + 3, b, dtype=torch.uint8, device=DEV)
    want_slots, want_loc = slots.clone(), torch.empty_like(loc)
    out_loc = torch.full_like(loc, 99)
    copied, want_copied = torch.full((1,), 5, device=DEV), torch.full((1,), 5, device=DEV)
    stage_blocks_ref(ids, loc, host, want_slots, first, want_loc, want_copied)
    stage_blocks(ids, loc, host, slots, first, out_loc, copied=copied)
    assert torch.equal(out_loc, want_loc) and torch.equal(slots, want_slots)
    assert copied.item() == want_copied.item() == 5 + 2  # counted once a block, whatever the programs
    assert out_loc.tolist() == [first + 2, -5, 1, -3, first, -1]
    assert torch.equal(slots[first].cpu(), host[1]) and torch.equal(slots[first + 2].cpu(), host[5])
    assert not slots[first + 1].any()  # the guess already in VRAM was not copied
    # the decode kernel sees the same bytes through the working row as through the RAM rows
    layout = ExpertLayout.for_dims(64, 32, align=64)
    blocks, ws2 = random_slots(layout, 6, seed=9)
    ram = blocks.cpu().flip(0).contiguous()  # expert e in row 5 - e
    ram = ram.pin_memory() if DEV == "cuda" else ram
    base = torch.tensor([-6, -5, -4, -3, -2, -1], dtype=torch.int32, device=DEV)
    vram = torch.zeros(4, layout.block_bytes, dtype=torch.uint8, device=DEV)
    staged = torch.empty_like(base)
    stage_blocks(torch.tensor([3, 1], device=DEV), base, ram, vram, 2, staged)
    x = torch.randn(1, 64, generator=g).to(DEV)
    routed, w = torch.tensor([1, 5, 3], device=DEV), torch.rand(3, generator=g).to(DEV)
    scales = ws2  # per expert
    direct = nvfp4_moe_decode(x, routed, base, scales, w, layout, vram, ram, config=cfg(16, 4, 32, 4))
    through = nvfp4_moe_decode(x, routed, staged, scales, w, layout, vram, ram, config=cfg(16, 4, 32, 4))
    assert staged.tolist() == [-6, 3, -4, 2, -2, -1] and torch.equal(direct, through)


def test_stage_blocks_addresses_rows_past_2_gib():
    # a large VRAM cache puts the staging rows past 2^31 bytes: row offsets must be 64-bit. 1 MiB rows, the
    # staging row 2048 starts at 2 GiB (torch.empty leaves the untouched rows unallocated on a CPU box)
    from expertstream.kernels.stage_blocks import stage_blocks

    b, first = 1 << 20, 2048
    host = torch.arange(2 * b, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, b)
    host = host.pin_memory() if DEV == "cuda" else host
    slots = torch.empty(first + 1, b, dtype=torch.uint8, device=DEV)
    slots[first].zero_()
    loc = torch.tensor([-2, -1], dtype=torch.int32, device=DEV)
    out_loc = torch.empty_like(loc)
    stage_blocks(torch.tensor([0], device=DEV), loc, host, slots, first, out_loc)
    assert torch.equal(slots[first].cpu(), host[1]) and out_loc.tolist() == [first, -1]


@pytest.mark.parametrize("programs", [2, 32])  # 2: each program loops over several (pair, chunk) steps
def test_copy_rows_copies_each_pairs_ram_row_into_its_slot_and_nothing_else(programs, monkeypatch):
    from expertstream.kernels import stage_blocks as module
    from expertstream.kernels.stage_blocks import copy_rows, copy_rows_ref

    monkeypatch.setattr(module, "PROGRAMS", programs)
    g = torch.Generator().manual_seed(programs)
    b = 16 * 2500  # not a multiple of the kernel's chunk: the last chunk is partial
    host = torch.randint(0, 256, (6, b), dtype=torch.uint8, generator=g)
    host = host.pin_memory() if DEV == "cuda" else host
    pairs = torch.tensor([[4, 2], [0, 5], [5, 0], [1, 1]], dtype=torch.int32, device=DEV)  # the last unused
    slots = torch.zeros(6, b, dtype=torch.uint8, device=DEV)
    want = slots.clone()
    copy_rows_ref(pairs, 3, host, want)
    copy_rows(pairs, 3, host, slots)
    assert torch.equal(slots, want)
    for row, slot in ((4, 2), (0, 5), (5, 0)):
        assert torch.equal(slots[slot].cpu(), host[row])
    assert not slots[[1, 3, 4]].any()  # pair 3 is past n: slot 1 untouched
    copy_rows(pairs, 0, host, slots)  # nothing to copy: no launch


@pytest.mark.parametrize("nbytes", [4, 4096, 3 * 4096 + 20])  # one word, one piece, a partial last piece
def test_stream_read_xors_each_piece_of_the_rows_it_is_given(nbytes):
    from expertstream.kernels.stream_read import PIECE, stream_read, stream_read_ref

    g = torch.Generator().manual_seed(nbytes)
    rows = torch.randint(0, 256, (5, 4 * 4096), dtype=torch.uint8, generator=g).to(DEV)
    ids = torch.tensor([3, 0, 3], device=DEV)
    got = stream_read(rows, ids, nbytes)
    assert got.shape == (3, -(-nbytes // PIECE)) and torch.equal(got, stream_read_ref(rows, ids, nbytes))
    words = rows[3, :nbytes].cpu().view(torch.int32)
    first = words[: PIECE // 4]
    want = first[0].item()
    for v in first[1:].tolist():
        want ^= v
    assert got[0, 0].item() == want and torch.equal(got[0], got[2])


@pytest.mark.parametrize("hot", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_decode_counts_match_ref(hot, staged):
    from expertstream.kernels.decode_counts import decode_counts, decode_counts_ref

    # experts 0-9; 2, 5 and 7 in VRAM (the hot set); routed 7, 1, 5, 9, 3; staged 3, 7, 8 (7 is hot)
    loc = torch.tensor([-1, -2, 4, -3, -4, 0, -5, 9, -6, -7], dtype=torch.int32, device=DEV)
    ids = torch.tensor([7, 1, 5, 9, 3], device=DEV)
    guesses = torch.tensor([3, 7, 8], device=DEV)
    out = []
    for fn in (decode_counts, decode_counts_ref):
        counts = torch.arange(10, device=DEV) if hot else None
        hits, stage_hits = torch.full((), 2, device=DEV), torch.full((1,), 3, device=DEV)
        g = (guesses, stage_hits) if staged else (None, None)
        fn(ids, loc, counts, hits if hot else None, *g)
        out.append((None if counts is None else counts.tolist(), hits.item(), stage_hits.item()))
    assert out[0] == out[1]
    counts, hits, stage_hits = out[0]
    if hot:
        assert counts == [0, 2, 2, 4, 4, 6, 6, 8, 8, 10] and hits == 2 + 2  # 7 and 5
    assert stage_hits == 3 + (0 if not staged else 1 if hot else 2)  # 3, and 7 when it is not hot


def test_kernel_table_shows_the_read_floor_where_there_is_one():
    from expertstream.bench.kernels import Row, table

    rows = [
        Row("nvfp4_moe_decode", "k=10", 24.7, 1100, 0.1, 26, 26, ">= 50% HBM", 11.25),
        Row("gdn", "s", 5, 1, 0, 1, 1, "-"),
    ]
    text = table(rows, {"copy_gbps": 4244.0, "bf16_tflops": 683.0}).splitlines()
    assert "read floor us" in text[2]
    assert text[4].split("|")[8].strip() == "11.2" and text[5].split("|")[8].strip() == "-"
