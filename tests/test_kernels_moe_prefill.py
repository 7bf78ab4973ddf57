"""The NVFP4 MoE prefill kernels (grouped GEMM over sorted pairs, passes over tile ranges, the combine)
against their plain-torch twins (interpreter on CPU)."""

import pytest
import torch
from kernel_helpers import DEV, LAUNCH_MECHANICS, LIMIT, close, decode, random_slots, six_expert_prompt

from expertstream.formats.expert_block import ExpertLayout
from expertstream.kernels import nvfp4_moe_prefill, nvfp4_moe_prefill_ref
from expertstream.kernels.nvfp4_moe import (
    combine_rows,
    combine_rows_ref,
    nvfp4_moe_prefill_rows,
    order_pairs,
    sort_pairs,
    tile_starts,
)

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,block_m", [(1, 16), (9, 16), (40, 32)])
def test_prefill_matches_ref(moe_bank, dtype, t, block_m):
    layout, slots, ws2 = moe_bank
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


# bf16 tiles only on a GPU: the interpreter does not run the bf16 bit casts of the tile decode
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * (DEV == "cuda"))
@pytest.mark.parametrize("limit", [None, LIMIT], ids=["unclamped", "clamped"])
@pytest.mark.parametrize("t,block_m", [(9, 16), (40, 32)])
def test_mxfp4_prefill_matches_ref(mx_bank, dtype, limit, t, block_m):
    # DeepSeek-V4's experts: MXFP4 blocks (a UE8M0 scale per 32 codes), with and without its SwiGLU clamp;
    # duplicate ids, a long run of one expert, unmapped experts never routed
    layout, slots, ws2 = mx_bank
    g = torch.Generator().manual_seed(t + 1)
    e2s = torch.tensor([3, 0, 5, 1, 4, 2, 0, -1], dtype=torch.int32, device=DEV)
    ids = torch.randint(0, 4, (t, 3), generator=g)
    ids[0, 1] = ids[0, 0]
    ids[5:] = 6
    x = torch.randn(t, layout.hidden_size, generator=g).to(DEV, dtype)
    w = torch.rand(t, 3, generator=g).to(DEV)
    ids = ids.to(DEV)
    cfg = dict(block_m=block_m, block_n=32, block_k=16, num_warps=4, num_stages=2)
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=cfg, swiglu_limit=limit)
    assert got.shape == x.shape and got.dtype == dtype
    want = nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout, swiglu_limit=limit)
    close(got, want, dtype)
    if limit is not None:  # the clamp changes this sum: the comparison above tests it
        assert not torch.allclose(want, nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout), rtol=0.05)
    with pytest.raises(AssertionError, match="block_k 8"):  # a step holds whole 16-byte scale groups
        nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config={**cfg, "block_k": 8})


@pytest.mark.slow  # several interpreted prefill launches
def test_mxfp4_prefill_scale_words_host_rows_and_decode():
    # MXFP4 at H = I = 128 (4 scale groups a row): scale words (block_k >= 64) give the byte reads' bits;
    # blocks in pinned host RAM the slots' bits; one token equals decode
    layout = ExpertLayout.for_format("mxfp4", 128, 128, align=64)
    slots, ws2 = random_slots(layout, 6, seed=14)
    ids, x, w, e2s = six_expert_prompt(layout, 12, seed=15)
    cfg = dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    want = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=cfg, swiglu_limit=LIMIT)
    close(want, nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout, swiglu_limit=LIMIT), torch.float32)
    got = nvfp4_moe_prefill(
        x, slots, ids, e2s, ws2, w, layout, config={**cfg, "scale_words": True}, swiglu_limit=LIMIT
    )
    assert torch.equal(got, want)
    host = slots.cpu()
    host = host.pin_memory() if DEV == "cuda" else host
    got = nvfp4_moe_prefill(x, host, ids, e2s, ws2, w, layout, config=cfg, swiglu_limit=LIMIT)
    assert torch.equal(got, want)
    one = nvfp4_moe_prefill(x[:1], slots, ids[:1], e2s, ws2, w[:1], layout, swiglu_limit=LIMIT)
    close(one, decode(x[:1], slots, ids[0].int(), ws2, w[0], layout, swiglu_limit=LIMIT), torch.float32)


@LAUNCH_MECHANICS
def test_prefill_down_launch_in_a_shape_of_its_own(moe_bank):
    # the down launch's own block_n / block_k / warps / stages ("down" in the config) change no sum
    layout, slots, ws2 = moe_bank
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


@LAUNCH_MECHANICS
def test_prefill_register_cap_goes_to_the_shape_that_names_it(moe_bank, monkeypatch):
    # maxnreg caps gate+up's launch, never down's unless down's own shape names one, and a pass's launch
    # shape replaces the order's whole (its cap too); the sums do not change
    from expertstream.kernels import nvfp4_moe

    layout, slots, ws2 = moe_bank
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


@pytest.mark.parametrize("dims", [(64, 64), (96, 48)], ids=["words", "fallback"])
def test_prefill_scale_words_equal_scale_bytes(dims, monkeypatch):
    # scale_words reads a step's four scale bytes of a row as one int32 word: bit for bit the byte reads'
    # sums. Used where each row's step holds whole words (K / 16 a multiple of 4, block_k >= 32): with
    # H = I = 64 both launches; with 96 / 48 (6 and 3 groups a row) neither. Down follows gate+up unless
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

    layout = ExpertLayout.for_dims(64, 64, align=64)
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


@LAUNCH_MECHANICS
def test_prefill_one_token_equals_decode(moe_bank):
    layout, slots, ws2 = moe_bank
    x = torch.randn(1, layout.hidden_size, device=DEV)
    ids = torch.tensor([[4, 1, 1]], device=DEV)
    w = torch.rand(1, 3, device=DEV)
    e2s = torch.arange(6, dtype=torch.int32, device=DEV)
    a = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout)
    b = decode(x, slots, ids[0].int(), ws2, w[0], layout)
    close(a, b, torch.float32)


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


@LAUNCH_MECHANICS
@pytest.mark.parametrize("combine", [combine_rows, combine_rows_ref])
def test_prefill_passes_over_tile_ranges_give_the_whole_sum(moe_bank, combine):
    """Passes over disjoint groups of consecutive experts, each launched over its experts' tiles only, add
    up to the one-launch sum; a pass writes only its rows and its tokens' sums; an expert with no slot in
    a pass's range (a gap) is neither computed nor read."""
    layout, slots, ws2 = moe_bank
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


@LAUNCH_MECHANICS
def test_prefill_with_a_sorted_order_equals_the_launcher_sorting_itself(moe_bank):
    # `bench kernels` times prefill with its pairs sorted before the capture: the same bits
    layout, slots, ws2 = moe_bank
    ids, x, w, e2s = six_expert_prompt(layout, 10, seed=8)
    order = order_pairs(ids, 6, layout)
    got = nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, order=order)
    assert torch.equal(got, nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout))


@LAUNCH_MECHANICS
def test_prefill_reads_blocks_in_pinned_host_ram_like_slots(moe_bank):
    # blocks in pinned host RAM read in place over the bus (`bench kernels`' in-place row): the same bits
    # as from the device's slots
    layout, slots, ws2 = moe_bank
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


@pytest.mark.parametrize("combine", [combine_rows, combine_rows_ref])
def test_combine_adds_a_tokens_rows_in_expert_order_however_passes_group_them(combine):
    """Passes over consecutive experts in ascending order give each token's sum as 0 + its rows one after
    another, its experts ascending, whichever experts share a pass: the FP32 bits do not depend on the
    grouping (a bank's prompts share passes grouped by all of their experts)."""
    g = torch.Generator().manual_seed(4)
    t, k, e, h, bm = 24, 4, 8, 40, 2
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    e2s = torch.arange(e, dtype=torch.int32, device=DEV)
    counts = torch.bincount(ids.reshape(-1), minlength=e).tolist()
    starts = tile_starts(counts, bm)
    # rows of magnitudes 1e-3 .. 1e3: additions in another order round otherwise
    n = starts[-1] * bm
    y = torch.randn(n, h, generator=g) * 10.0 ** torch.randint(-3, 4, (n, 1), generator=g)
    row, seen = [], [0] * e  # each pair's tile row: its expert's tiles, pairs in order
    for x in ids.reshape(-1).tolist():
        row.append(starts[x] * bm + seen[x])
        seen[x] += 1
    want = torch.zeros(t, h)
    for tok in range(t):
        for kk in sorted(range(k), key=lambda kk: int(ids[tok, kk])):
            want[tok] = want[tok] + y[row[tok * k + kk]]
    y = y.to(DEV)
    for groups in ([list(range(e))], [[0, 1, 2], [3], [4, 5, 6, 7]], [[x] for x in range(e)]):
        order, passes = _passes(ids.to(DEV), e2s, groups, block_m=bm)
        total = torch.empty(t, h, device=DEV)
        for i, (m, (t0, t1)) in enumerate(passes):
            combine(y[t0 * bm : t1 * bm], order, m, (t0, t1), total, accumulate=i > 0)
        assert torch.equal(total.cpu(), want), groups


@pytest.mark.slow  # every shape of the sweep: ~10 s a bank in the interpreter on 2 cores
def test_every_prefill_sweep_candidate_matches_ref(moe_bank):
    # as for decode: every shape the sweep may record (both launches', the pass's, and down's own after
    # the first) must be a valid launch. On the GPU in a 16-bit dtype, as the sweep times them: FP32 tiles
    # take twice the shared memory (64 x 256 x 64 at three stages: 256 KiB, over an H200 SM's 227 KiB)
    from expertstream.bench.sweep import DOWN_SWEEP, PASS_SWEEP, PREFILL_SWEEP

    dtype = torch.float16 if DEV == "cuda" else torch.float32
    layout, slots, ws2 = moe_bank
    ids, x, w, e2s = six_expert_prompt(layout, 20, seed=8)
    x = x.to(dtype)
    want = nvfp4_moe_prefill_ref(x, slots, ids, e2s, ws2, w, layout)
    configs = PREFILL_SWEEP + [{"block_m": 64, **c} for c in PASS_SWEEP]
    configs += [{**PREFILL_SWEEP[0], "down": d} for d in DOWN_SWEEP]
    for config in configs:
        close(nvfp4_moe_prefill(x, slots, ids, e2s, ws2, w, layout, config=config), want, dtype)


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
