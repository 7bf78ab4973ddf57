"""Kernels against their plain-torch twins (interpreter on CPU); twins against the codecs in float64."""

import json
import subprocess
import sys

import pytest
import torch

from expertstream.formats import fp8, nvfp4
from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels import (
    codec,
    e2m1_uses_ptx,
    fp8_rows_matmul,
    fp8_rows_matmul_ref,
    matvec16,
    matvec16_ref,
    nvfp4_moe_decode,
    nvfp4_moe_decode_ref,
    nvfp4_moe_prefill,
    nvfp4_moe_prefill_ref,
)
from expertstream.kernels.nvfp4_moe import (
    combine_rows,
    combine_rows_ref,
    nvfp4_moe_prefill_rows,
    order_pairs,
    sort_pairs,
    tile_starts,
)

triton = pytest.importorskip("triton")
tl = triton.language
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: accumulation-order noise only; fp16: 2^-11 rounding of x, h and the output
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


def cfg(n_gu: int, g_gu: int, n_down: int, g_down: int, warps: int = 2) -> dict:
    """A decode launch config: rows per program and 16-element groups per step, gate+up then down."""
    return dict(block_n_gu=n_gu, block_g_gu=g_gu, block_n_down=n_down, block_g_down=g_down, num_warps=warps)


def random_slots(layout: ExpertLayout, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, block_bytes] blocks of random codes (all 16) and random E4M3 scales, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 256, (s, layout.block_bytes), dtype=torch.uint8, generator=g)
    for p in layout.parts:
        if p.dtype == "float8_e4m3fn":  # bytes 0x00..0x3F: 0, subnormals 2^-9..7*2^-9, normals up to 1.875
            slots[:, p.offset : p.offset + p.nbytes] = torch.randint(
                0, 0x40, (s, p.nbytes), dtype=torch.uint8, generator=g
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


def decode_ref(x, slots, slot_ids, ws2, w, layout):
    loc = torch.arange(slots.shape[0], dtype=torch.int32, device=slots.device)
    return nvfp4_moe_decode_ref(x, slot_ids, loc, ws2, w, layout, slots)


@pytest.fixture(scope="module", params=[(64, 32), (96, 48)], ids=["h64i32", "h96i48"])
def bank(request):
    h, i = request.param
    layout = ExpertLayout.for_dims(h, i, align=64)
    slots, ws2 = random_slots(layout, 6, seed=h)
    return layout, slots, ws2


def test_random_scales_cover_subnormals(bank):
    layout, slots, _ = bank
    p = layout.part("down_proj.weight_scale")
    sb = slots[:, p.offset : p.offset + p.nbytes]
    assert ((sb > 0) & (sb < 8)).any()  # exponent 0, nonzero: subnormal


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_ids", [[2], [1, 4, 4, 0, 5]], ids=["k1", "k5dup"])
def test_decode_matches_ref(bank, dtype, slot_ids):
    layout, slots, ws2 = bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    ids = torch.tensor(slot_ids, dtype=torch.int32, device=DEV)
    w = torch.rand(len(slot_ids), device=DEV)
    # block sizes chosen so H/16 and I/16 groups are not multiples of BLOCK_G, nor rows of BLOCK_N
    got = decode(x[None], slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4))
    assert got.shape == (1, layout.hidden_size) and got.dtype == dtype
    close(got, decode_ref(x[None], slots, ids, ws2, w, layout), dtype)


def test_decode_reads_host_rows_like_slots(bank):
    # experts 0-2 in VRAM slots, 3-5 in (pinned) host rows, listed in another order: the kernel and its
    # twin follow the location table, and the sum equals the all-slots one bit for bit
    layout, slots, ws2 = bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(2)).to(DEV)
    ids = torch.tensor([5, 0, 3, 3, 2], device=DEV)
    w = torch.rand(5, device=DEV)
    host = slots[3:].flip(0).cpu()  # expert 3 -> host row 2, 4 -> 1, 5 -> 0
    host = host.pin_memory() if DEV == "cuda" else host
    loc = torch.tensor([0, 1, 2, -3, -2, -1], dtype=torch.int32, device=DEV)
    vram = slots[:3].contiguous()
    got = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, vram, host, config=cfg(8, 2, 4, 2))
    assert torch.equal(got, decode(x, slots, ids, ws2, w, layout, config=cfg(8, 2, 4, 2)))
    ref = nvfp4_moe_decode_ref(x, ids, loc, ws2, w, layout, vram, host)
    assert torch.equal(ref, decode_ref(x, slots, ids, ws2, w, layout))
    # must-fail control: one expert pointed at the wrong host row changes the sum
    loc[4] = -3
    bad = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, vram, host, config=cfg(8, 2, 4, 2))
    assert torch.equal(bad, got)  # expert 4 is not routed: its entry is never read
    loc[3] = -2
    bad = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, vram, host, config=cfg(8, 2, 4, 2))
    assert not torch.allclose(bad, got)


def test_decode_launch_shape_is_the_same_wherever_the_blocks_are(bank, monkeypatch):
    # the tuned launch shape sets the order of the sums: blocks in host rows must take the shape (and give
    # the bits) of blocks in slots, so that the decode regimes (VRAM, RAM, disk) choose the same tokens
    import expertstream.kernels.nvfp4_moe as moe

    asked = []

    def tuned(kernel, device, key):
        asked.append(key)
        return cfg(8, 2, 4, 2)

    monkeypatch.setattr(moe, "tuned_config", tuned)
    layout, slots, ws2 = bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEV)
    ids = torch.tensor([4, 1, 5, 0], device=DEV)
    w = torch.rand(4, device=DEV)
    host = slots[3:].flip(0).cpu()
    host = host.pin_memory() if DEV == "cuda" else host
    loc = torch.tensor([0, 1, 2, -3, -2, -1], dtype=torch.int32, device=DEV)
    got = nvfp4_moe_decode(x, ids, loc, ws2, w, layout, slots[:3].contiguous(), host)
    assert torch.equal(got, decode(x, slots, ids, ws2, w, layout))
    assert len(asked) == 2 and asked[0] == asked[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,block_m", [(1, 16), (9, 16), (40, 32)])
def test_prefill_matches_ref(bank, dtype, t, block_m):
    layout, slots, ws2 = bank
    g = torch.Generator().manual_seed(t)
    e, k = 10, 3
    # experts 0..9 map to 6 slots; experts 7, 8 have no slot and are never routed; 9 shares no tokens
    e2s = torch.tensor([3, 0, 5, 1, 4, 2, 0, -1, -1, 1], dtype=torch.int32, device=DEV)
    ids = torch.randint(0, 4, (t, k), generator=g)  # few experts: several tiles per expert, most get none
    ids[0, 1] = ids[0, 0]  # a duplicate id within one token
    if t > 8:
        ids[5:] = 6  # a long run of one expert, spanning tiles
    x = torch.randn(t, layout.hidden_size, generator=g).to(DEV, dtype)
    w = torch.rand(t, k, generator=g).to(DEV)
    ids = ids.to(DEV)
    cfg = dict(block_m=block_m, block_n=32, block_k=16, num_warps=4, num_stages=2)
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=cfg)
    assert got.shape == x.shape and got.dtype == dtype
    close(got, nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout), dtype)
    assert e < 11  # the mapping above covers every id drawn


def test_prefill_down_launch_in_a_shape_of_its_own(bank):
    # the down launch's own block_n / block_k / warps / stages ("down" in the config) change no sum
    layout, slots, ws2 = bank
    ids, x, w, e2s = six_expert_prompt(layout, 24, seed=5)
    cfg = dict(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
    want = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=cfg)
    down = dict(block_n=64, block_k=8, num_warps=4, num_stages=3)
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "down": down})
    close(got, want, torch.float32)
    close(got, nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout), torch.float32)
    with pytest.raises(AssertionError, match="block_k 12"):  # the down shape is the one launched
        nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "down": {**down, "block_k": 12}})


def record_launches(monkeypatch, pick) -> list:
    """The list that gets pick(kernel, grid, launch kwargs) of every kernel launch from here on."""
    from expertstream.kernels import nvfp4_moe

    seen, launch = [], nvfp4_moe.launch_e2m1

    def record(kernel, grid, device, *args, **kwargs):
        seen.append(pick(kernel, grid, kwargs))
        launch(kernel, grid, device, *args, **kwargs)

    monkeypatch.setattr(nvfp4_moe, "launch_e2m1", record)
    return seen


def test_prefill_register_cap_goes_to_the_shape_that_names_it(bank, monkeypatch):
    # maxnreg caps gate+up's launch, never down's unless down's own shape names one, and a pass's launch
    # shape replaces the order's whole (its cap too); the sums do not change
    from expertstream.kernels import nvfp4_moe

    layout, slots, ws2 = bank
    ids, x, w, e2s = six_expert_prompt(layout, 24, seed=9)
    cfg = dict(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
    want = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=cfg)
    seen = record_launches(monkeypatch, lambda kernel, grid, kw: (kernel.fn.__name__, kw.get("maxnreg")))
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "maxnreg": 128})
    assert seen == [("_prefill_gate_up_kernel", 128), ("_prefill_down_kernel", None)]
    close(got, want, torch.float32)
    seen.clear()
    down = dict(block_n=64, block_k=8, num_warps=4, num_stages=3, maxnreg=96)
    nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "down": down})
    assert seen == [("_prefill_gate_up_kernel", None), ("_prefill_down_kernel", 96)]
    seen.clear()
    order = order_pairs(ids, e2s.numel(), layout, config={**cfg, "maxnreg": 128})
    y, work = nvfp4_moe.prefill_buffers(x, layout, order.tiles * cfg["block_m"])
    shape = dict(block_n=32, block_k=16, num_warps=4, num_stages=2)
    nvfp4_moe_prefill_rows(x, slots, e2s, ws2, w, layout, order, (0, order.tiles), y, work, launch=shape)
    assert seen == [("_prefill_gate_up_kernel", None), ("_prefill_down_kernel", None)]


@pytest.mark.parametrize("dims", [(128, 64), (96, 48)], ids=["words", "fallback"])
def test_prefill_scale_words_equal_scale_bytes(dims, monkeypatch):
    # scale_words reads a step's four scale bytes of a row as one int32 word: bit for bit the byte reads'
    # sums. Used where each row's step holds whole words (K / 16 a multiple of 4, block_k >= 32): with
    # H = 128, I = 64 both launches; with 96 / 48 (6 and 3 groups a row) neither. Down follows gate+up unless
    # its own shape says otherwise; a pass's launch shape replaces the order's choice
    from expertstream.kernels import nvfp4_moe

    h, i = dims
    layout = ExpertLayout.for_dims(h, i, align=64)
    slots, ws2 = random_slots(layout, 6, seed=h + 1)
    ids, x, w, e2s = six_expert_prompt(layout, 24, seed=10)
    cfg = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    want = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=cfg)
    close(want, nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout), torch.float32)
    seen = record_launches(monkeypatch, lambda kernel, grid, kw: kw["SCALE_WORDS"])
    words = h // 16 % 4 == 0
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "scale_words": True})
    assert seen == [words, words] and torch.equal(got, want)
    seen.clear()
    down = dict(block_n=32, block_k=32, num_warps=4, num_stages=2, scale_words=False)
    got = nvfp4_moe_prefill(
        x, slots, ids, e2s, ws2, w, layout, config={**cfg, "scale_words": True, "down": down}
    )
    assert seen == [words, False] and torch.equal(got, want)
    seen.clear()
    got = nvfp4_moe_prefill(
        x, slots, ids, e2s, ws2, w, layout, config={**cfg, "block_k": 16, "scale_words": True}
    )
    assert seen == [False, False]
    seen.clear()
    order = order_pairs(ids, e2s.numel(), layout, config={**cfg, "scale_words": True})
    y, work = nvfp4_moe.prefill_buffers(x, layout, order.tiles * cfg["block_m"])
    shape = dict(block_n=32, block_k=32, num_warps=4, num_stages=2)
    nvfp4_moe_prefill_rows(x, slots, e2s, ws2, w, layout, order, (0, order.tiles), y, work, launch=shape)
    assert seen == [False, False]


def test_prefill_tile_major_order_changes_no_bit(monkeypatch):
    # tile_major launches each tile's n blocks together (a 1-D grid): the same programs in another order,
    # so the same bits. Down follows gate+up unless its own shape says otherwise; a pass's launch shape
    # replaces the order's choice
    from expertstream.kernels import nvfp4_moe

    layout = ExpertLayout.for_dims(128, 64, align=64)
    slots, ws2 = random_slots(layout, 6, seed=3)
    ids, x, w, e2s = six_expert_prompt(layout, 24, seed=12)
    cfg = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    want = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=cfg)
    seen = record_launches(monkeypatch, lambda kernel, grid, kw: (len(grid), kw["TILE_MAJOR"]))
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "tile_major": True})
    assert seen == [(1, True), (1, True)] and torch.equal(got, want)
    seen.clear()
    down = dict(block_n=64, block_k=16, num_warps=4, num_stages=2, tile_major=False)
    got = nvfp4_moe_prefill(
        x, slots, ids, e2s, ws2, w, layout, config={**cfg, "tile_major": True, "down": down}
    )
    assert seen == [(1, True), (2, False)]
    close(got, want, torch.float32)  # down's other block_k sums in another order
    seen.clear()
    nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "tile_major": True, "down": {}})
    assert seen == [(1, True), (1, True)]  # a down shape that does not name it follows gate+up
    seen.clear()
    order = order_pairs(ids, e2s.numel(), layout, config={**cfg, "tile_major": True})
    y, work = nvfp4_moe.prefill_buffers(x, layout, order.tiles * cfg["block_m"])
    shape = dict(block_n=32, block_k=32, num_warps=4, num_stages=2)
    nvfp4_moe_prefill_rows(x, slots, e2s, ws2, w, layout, order, (0, order.tiles), y, work, launch=shape)
    assert seen == [(2, False), (2, False)]


def test_prefill_one_token_equals_decode(bank):
    layout, slots, ws2 = bank
    x = torch.randn(1, layout.hidden_size, device=DEV)
    ids = torch.tensor([[4, 1, 1]], device=DEV)
    w = torch.rand(1, 3, device=DEV)
    e2s = torch.arange(6, dtype=torch.int32, device=DEV)
    a = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout)
    b = decode(x, slots, ids[0].int(), ws2, w[0], layout)
    close(a, b, torch.float32)


def test_refs_equal_float64_dequantize_then_matmul(bank):
    layout, slots, ws2 = bank
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


def test_swapped_nibbles_fail(bank):
    # must-fail control: the same comparison catches a block decoded with its nibbles swapped
    layout, slots, ws2 = bank
    x = torch.randn(layout.hidden_size, device=DEV)
    ids = torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    w = torch.rand(2, device=DEV)
    swapped = slots.clone()
    codes = layout.part("down_proj.weight").offset
    swapped[:, :codes] = (slots[:, :codes] << 4) | (slots[:, :codes] >> 4)
    got = decode(x, swapped, ids, ws2, w, layout)
    with pytest.raises(AssertionError):
        close(got, decode_ref(x, slots, ids, ws2, w, layout), torch.float32)


def test_sort_pairs_groups_every_pair_once():
    slot_of_pair = torch.tensor([3, 0, 3, 3, 1, 3, 0, 3, 3, 3], device=DEV)
    pair_ids, tile_slot, row_of_pair = sort_pairs(slot_of_pair, num_groups=5, block_m=4)
    p = slot_of_pair.numel()
    assert tile_slot.tolist() == [0, 1, 3, 3, -1, -1, -1, -1]  # slots 2, 4 have no pairs
    assert pair_ids[row_of_pair.long()].tolist() == list(range(p))  # each pair's row holds it
    counts = torch.bincount(slot_of_pair, minlength=5).tolist()
    assert tile_starts(counts, 4) == [0, 1, 2, 2, 4, 4]
    tiles = pair_ids.view(-1, 4)
    real = pair_ids[pair_ids < p]
    assert sorted(real.tolist()) == list(range(p))
    for tile, s in zip(tiles.tolist(), tile_slot.tolist()):
        assert all(slot_of_pair[q] == s for q in tile if q < p)
        if s < 0:
            assert all(q == p for q in tile)


def test_sort_pairs_leaves_out_unmapped_pairs():
    slot_of_pair = torch.tensor([3, -1, 3, -1, 1, 3, -1, 3, 3], device=DEV)
    pair_ids, tile_slot, row_of_pair = sort_pairs(slot_of_pair, num_groups=5, block_m=4)
    p = slot_of_pair.numel()
    assert tile_slot.tolist()[:3] == [1, 3, 3] and set(tile_slot.tolist()[3:]) == {-1}
    real = pair_ids[pair_ids < p]
    assert sorted(real.tolist()) == [0, 2, 4, 5, 7, 8]
    assert (row_of_pair[slot_of_pair < 0] == pair_ids.numel()).all()  # left out: past the last row


def _passes(ids, e2s, groups, block_m):
    # (expert -> slot map of each pass, with the other experts at -1; its tile range) for groups of experts
    order = order_pairs(ids, e2s.numel(), None, config=dict(block_m=block_m, block_n=16, block_k=16,
                                                           num_warps=2, num_stages=2))  # fmt: skip
    starts = tile_starts(torch.bincount(ids.reshape(-1), minlength=e2s.numel()).tolist(), block_m)
    out = []
    for members in groups:
        m = torch.full_like(e2s, -1)
        m[members] = e2s[members]
        out.append((m, (starts[members[0]], starts[members[-1] + 1])))
    return order, out


@pytest.mark.parametrize("combine", [combine_rows, combine_rows_ref])
def test_prefill_passes_over_tile_ranges_give_the_whole_sum(bank, combine):
    """Passes over disjoint groups of consecutive experts, each launched over its experts' tiles only, add
    up to the one-launch sum; a pass writes only its rows and its tokens' sums; an expert with no slot in
    a pass's range (a gap) is neither computed nor read."""
    layout, slots, ws2 = bank
    g = torch.Generator().manual_seed(5)
    t, k = 12, 3
    ids = torch.randint(0, 6, (t, k), generator=g).to(DEV)
    x = torch.randn(t, layout.hidden_size, generator=g).to(DEV)
    w = torch.rand(t, k, generator=g).to(DEV)
    e2s = torch.arange(6, dtype=torch.int32, device=DEV)
    order, passes = _passes(ids, e2s, [[0, 1, 2], [3, 4, 5]], block_m=4)
    rows = max(b - a for _, (a, b) in passes) * 4
    y = torch.empty(rows, layout.hidden_size, device=DEV)
    work = torch.empty(rows, layout.intermediate_size, device=DEV)
    total = torch.full((t, layout.hidden_size), 5.0, device=DEV)
    for i, (m, tiles) in enumerate(passes):
        # another launch shape for the second pass
        launch = dict(block_n=32, block_k=64, num_warps=2, num_stages=2) if i else None
        y.fill_(7.0)
        nvfp4_moe_prefill_rows(x, slots, m, ws2, w, layout, order, tiles, y, work, launch=launch)
        used = (tiles[1] - tiles[0]) * 4
        assert not (y[:used] == 7.0).all() and (y[used:] == 7.0).all()
        combine(y, order, m, tiles, total, accumulate=i > 0)
        if i == 0:  # tokens with no pair in the first group sum to 0
            touched = (ids < 3).any(dim=1)
            assert (total[~touched] == 0).all() and (total[touched] != 0).any(dim=1).all()
    want = nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout)
    close(total, want, torch.float32)
    # a range that spans an unmapped expert (2) skips its tiles and its rows
    m, _ = _passes(ids, e2s, [[1, 3]], block_m=4)[1][0]
    starts = tile_starts(torch.bincount(ids.reshape(-1), minlength=6).tolist(), 4)
    tiles = (starts[1], starts[4])
    y.fill_(float("nan"))
    nvfp4_moe_prefill_rows(x, slots, m, ws2, w, layout, order, tiles, y, work)
    combine(y, order, m, tiles, total, accumulate=False)
    ids13 = torch.where((ids == 1) | (ids == 3), ids, -1)
    keep = (ids13 >= 0).float()
    want = nvfp4_moe_prefill_ref(x, slots, ids13.clamp(min=0), e2s, ws2, w * keep, layout)
    assert not total.isnan().any()
    close(total, want, torch.float32)


def six_expert_prompt(layout, tokens: int, seed: int):
    """(ids [T, 3] over experts 0-5, x [T, H], weights [T, 3], expert e in slot e) on DEV."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (tokens, 3), generator=g).to(DEV)
    x = torch.randn(tokens, layout.hidden_size, generator=g).to(DEV)
    w = torch.rand(tokens, 3, generator=g).to(DEV)
    return ids, x, w, torch.arange(6, dtype=torch.int32, device=DEV)


def test_prefill_with_a_sorted_order_equals_the_launcher_sorting_itself(bank):
    # `bench kernels` times prefill with its pairs sorted before the capture: the same bits
    layout, slots, ws2 = bank
    ids, x, w, e2s = six_expert_prompt(layout, 10, seed=8)
    order = order_pairs(ids, 6, layout)
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, order=order)
    assert torch.equal(got, nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout))


def test_prefill_reads_blocks_in_pinned_host_ram_like_slots(bank):
    # blocks in pinned host RAM read in place over the bus (`bench kernels`' in-place row): the same bits
    # as from the device's slots
    layout, slots, ws2 = bank
    ids, x, w, e2s = six_expert_prompt(layout, 12, seed=11)
    host = slots.cpu()
    host = host.pin_memory() if DEV == "cuda" else host
    got = nvfp4_moe_prefill(x, host, ids, e2s, ws2, w, layout)
    assert torch.equal(got, nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout))
    if DEV == "cuda":  # pageable host memory is not readable by a kernel: refused before any launch
        with pytest.raises(ValueError, match="one device"):
            nvfp4_moe_prefill(x, slots.cpu(), ids, e2s, ws2, w, layout)


def test_combine_rows_equals_its_twin_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    t, k, e, h = 9, 4, 7, 40
    ids = torch.randint(0, e, (t, k), generator=g).to(DEV)
    e2s = torch.arange(e, dtype=torch.int32, device=DEV)
    e2s[4] = -1  # in the range, no slot: its rows are skipped
    order, [(m, tiles)] = _passes(ids, e2s, [[1, 2, 3, 4, 5]], block_m=2)
    y = torch.randn((tiles[1] - tiles[0]) * 2, h, generator=g).to(DEV)
    for accumulate in (False, True):
        start = torch.randn(t, h, generator=g).to(DEV)
        got, want = start.clone(), start.clone()
        combine_rows(y, order, m, tiles, got, accumulate)
        combine_rows_ref(y, order, m, tiles, want, accumulate)
        assert torch.equal(got, want)


# the hardware E4M3 conversion (float8e4nv loads) runs on sm_89+ GPUs only; bit ops everywhere
NATIVE = [False] + ([True] if codec.e4m3_native(codec.device_capability(torch.device(DEV))) else [])


def test_e4m3_native_from_sm89():
    assert not codec.e4m3_native(None) and not codec.e4m3_native((8, 6))
    assert codec.e4m3_native((8, 9)) and codec.e4m3_native((9, 0)) and codec.e4m3_native((12, 0))


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


def test_ptx_e2m1_only_from_sm100():
    assert not e2m1_uses_ptx(None)
    assert not e2m1_uses_ptx((8, 9))
    assert not e2m1_uses_ptx((9, 0))
    assert e2m1_uses_ptx((10, 0)) and e2m1_uses_ptx((12, 0))


def test_ptx_compile_failure_falls_back_to_software(monkeypatch):
    calls = []

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, USE_PTX, **kw):
                calls.append(USE_PTX)
                if USE_PTX:
                    raise RuntimeError("ptxas: unsupported instruction")

            return launch

    monkeypatch.setattr(codec, "device_capability", lambda dev: (10, 0))
    monkeypatch.setattr(codec, "_PTX_FAILED", set())
    codec.launch_e2m1(FakeKernel(), (1,), torch.device("cpu"))
    codec.launch_e2m1(FakeKernel(), (1,), torch.device("cpu"))
    assert calls == [True, False, False]  # PTX tried once, then software for good
    monkeypatch.setattr(codec, "device_capability", lambda dev: (9, 0))
    codec.launch_e2m1(FakeKernel(), (1,), torch.device("cpu"))
    assert calls[-1] is False


def test_fp8_native_compile_failure_falls_back_to_bit_ops(monkeypatch):
    # a Triton that cannot load float8e4nv on this chip: the launch is retried with the bit-op form, once
    # and for good; the result is the bit-op form's (the interpreter runs it here)
    from expertstream.kernels import fp8_gemv

    real, calls = fp8_gemv._fp8_gemv_kernel, []

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, NATIVE, **kw):
                calls.append(NATIVE)
                if NATIVE:
                    raise RuntimeError("unsupported conversion")
                real[grid](*args, NATIVE=NATIVE, **kw)

            return launch

    monkeypatch.setattr(fp8_gemv, "_fp8_gemv_kernel", Failing())
    monkeypatch.setattr(fp8_gemv, "device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(codec, "_NATIVE_FAILED", set())
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 0x7F, (12, 64), dtype=torch.uint8, generator=g).to(DEV)
    scale, x = torch.rand(12, generator=g).to(DEV), torch.randn(1, 64, generator=g).to(DEV)
    for _ in range(2):
        got = fp8_rows_matmul(x, q, scale)
        close(got, fp8_rows_matmul_ref(x, q, scale), torch.float32)
    assert calls == [True, False, False] and not codec.e4m3_native((9, 0))


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


def test_decode_is_deterministic(bank):
    # the partials are summed in a fixed order (by whichever program of a row block finishes last, in expert
    # order): two calls give the same bits (other splits round differently: on the GPU the compiler fuses
    # the looped sum into FMAs)
    layout, slots, ws2 = bank
    x = torch.randn(layout.hidden_size, device=DEV)
    ids = torch.tensor([3, 1, 3, 0], dtype=torch.int32, device=DEV)
    w = torch.rand(4, device=DEV)
    a = decode(x, slots, ids, ws2, w, layout, config=cfg(8, 2, 4, 2))
    b = decode(x, slots, ids, ws2, w, layout, config=cfg(8, 2, 4, 2))
    assert torch.equal(a, b)


def test_every_decode_sweep_candidate_matches_ref(bank):
    # `bench kernels` may record any of them as a device's default: each must be a valid launch
    from expertstream.bench.sweep import DECODE_SWEEP

    layout, slots, ws2 = bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(6)).to(DEV)
    ids = torch.tensor([1, 4, 4, 0, 5], dtype=torch.int32, device=DEV)
    w = torch.rand(5, device=DEV)
    want = decode_ref(x, slots, ids, ws2, w, layout)
    for config in DECODE_SWEEP:
        close(decode(x, slots, ids, ws2, w, layout, config=config), want, torch.float32)


def test_every_prefill_sweep_candidate_matches_ref(bank):
    # as for decode: every shape the sweep may record (both launches', the pass's, and down's own after
    # the first) must be a valid launch. On the GPU in a 16-bit dtype, as the sweep times them: FP32 tiles
    # take twice the shared memory (64 x 256 x 64 at three stages: 256 KiB, over an H200 SM's 227 KiB)
    from expertstream.bench.sweep import DOWN_SWEEP, PASS_SWEEP, PREFILL_SWEEP

    dtype = torch.float16 if DEV == "cuda" else torch.float32
    layout, slots, ws2 = bank
    ids, x, w, e2s = six_expert_prompt(layout, 20, seed=8)
    x = x.to(dtype)
    want = nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout)
    configs = PREFILL_SWEEP + [{"block_m": 64, **c} for c in PASS_SWEEP]
    configs += [{**PREFILL_SWEEP[0], "down": d} for d in DOWN_SWEEP]
    for config in configs:
        close(nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=config), want, dtype)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_decode_split_down_matches_ref(bank, split):
    # K = 5 experts in `split` down programs per row block: 5, 3 + 2 and 2 + 2 + 1 experts each
    layout, slots, ws2 = bank
    x = torch.randn(layout.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEV)
    ids = torch.tensor([1, 4, 4, 0, 5], dtype=torch.int32, device=DEV)
    w = torch.rand(5, device=DEV)
    got = decode(x, slots, ids, ws2, w, layout, config=cfg(16, 4, 32, 4) | {"split_down": split})
    close(got, decode_ref(x, slots, ids, ws2, w, layout), torch.float32)


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
    direct = nvfp4_moe_decode(x, routed, base, scales, w, layout, vram, ram, config=cfg(8, 2, 4, 2))
    through = nvfp4_moe_decode(x, routed, staged, scales, w, layout, vram, ram, config=cfg(8, 2, 4, 2))
    assert staged.tolist() == [-6, 3, -4, 2, -2, -1] and torch.equal(direct, through)


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


def test_kernel_table_shows_the_read_floor_where_there_is_one():
    from expertstream.bench.kernels import Row, table

    rows = [
        Row("nvfp4_moe_decode", "k=10", 24.7, 1100, 0.1, 26, 26, ">= 50% HBM", 11.25),
        Row("gdn", "s", 5, 1, 0, 1, 1, "-"),
    ]
    text = table(rows, {"copy_gbps": 4244.0, "bf16_tflops": 683.0}).splitlines()
    assert "read floor us" in text[2]
    assert text[4].split("|")[8].strip() == "11.2" and text[5].split("|")[8].strip() == "-"


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


def test_bench_pass_calls_fill_only_their_groups_tokens():
    # `bench kernels`' engine-pass row: each call maps the next group of the span's experts to slots, and
    # adds exactly the sums of the tokens routed to that group, as the one-launch kernel would
    from expertstream.bench.kernels import pass_calls

    layout = ExpertLayout.for_dims(64, 32, align=64)
    slots, ws2 = random_slots(layout, 24, seed=9)
    calls, ids, total = pass_calls(layout, slots, ws2, n=2, tokens=12, group=3)
    groups = torch.unique(ids)
    for i, call in enumerate(calls):
        call()
        hit = torch.isin(ids, groups[: 3 * (i + 1)]).any(dim=1)
        assert torch.equal(total.abs().sum(dim=1) > 0, hit)


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
