"""The CUDA expert bank, run on the CPU through the Triton interpreter, against the torch bank."""

import numpy as np
import pytest
import torch
from bank_helpers import ram_store, routing

from expertstream.experts.controls import controlled
from expertstream.experts.cpu_bank import StreamedExperts
from expertstream.experts.gpu_bank import GpuExperts
from expertstream.kernels import nvfp4_moe
from expertstream.memory_plan import hot_split, stage_guesses_for
from expertstream.store import ExpertStore
from expertstream.store.policy import most_routed
from expertstream.workdir.workdir import Workdir

pytest.importorskip("triton")  # conftest runs it through the interpreter when there is no CUDA


@pytest.fixture(scope="module")
def banks(tiny_workdir, host_alloc):
    wd = Workdir(tiny_workdir)
    store = ExpertStore(wd, 1 << 20, io_threads=2, **host_alloc)
    ref = StreamedExperts(wd, store, torch.float32)
    yield wd, store, ref
    store.close()


@pytest.mark.parametrize("n_slots", [8, 64])
def test_decode_and_prefill_match_the_torch_bank(banks, n_slots, kernel_device):
    wd, store, ref = banks
    bank = GpuExperts(wd, store, n_slots, kernel_device)
    for layer, t in ((0, 1), (2, 1), (0, 1), (3, 20)):
        x, ids, w = routing(wd, t, seed=layer * 10 + t)
        want = ref(layer, x, ids, w)
        got = bank(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    # the prompt's distinct experts run in groups of half the slots without a read-back per group; decode
    # syncs once per call
    passes = -(-torch.unique(ids).numel() // (n_slots // 2))
    assert bank.prefill_passes == passes
    assert bank.host_syncs == 3 + 1
    assert (
        0 < bank.sync_seconds < bank.decode_seconds
    )  # the three one-token calls' wall time, read-back inside
    if n_slots == 64:  # everything fits: the repeated decode of layer 0 was a VRAM hit
        assert bank.cache.stats.hits >= wd.text_config["num_experts_per_tok"]
    bank.close()


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
@pytest.mark.parametrize("n_slots", [8, 64])  # 8: every block pinned in RAM; 64: every block in a slot
def test_decode_reads_nothing_back_once_every_block_has_a_place(
    tiny_workdir, n_slots, kernel_device, host_alloc, monkeypatch
):
    wd = Workdir(tiny_workdir)
    n_layers, n_experts, k = wd.num_layers, wd.num_experts, wd.text_config["num_experts_per_tok"]
    with ExpertStore(wd, n_layers * n_experts * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32)
        bank = GpuExperts(wd, store, n_slots, kernel_device)
        x, _, w = routing(wd, 1, seed=0)
        for layer in range(n_layers):  # every block once through decode: the caches fill up
            for e0 in range(0, n_experts, k):
                ids = (torch.arange(e0, e0 + k) % n_experts)[None]
                assert not bank.resident
                bank(layer, *(v.to(kernel_device) for v in (x, ids, w)))
        assert bank.resident
        syncs = bank.host_syncs
        for seed in range(3):
            for layer in range(n_layers):
                x, ids, w = routing(wd, 1, seed=seed * 10 + layer)
                want = ref(layer, x, ids, w)
                got = bank(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
                torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        assert bank.host_syncs == syncs  # the location table answers every lookup on the device
        in_ram = 3 * n_layers * k if n_slots == 8 else 0
        assert bank.resident_ram_reads == in_ram
        # all in VRAM for good: the kernel is told there is no host pool (the HBM-tuned launch shape)
        pools = []
        real = nvfp4_moe.nvfp4_moe_decode
        monkeypatch.setattr(
            nvfp4_moe, "nvfp4_moe_decode", lambda *a, **kw: pools.append(a[7]) or real(*a, **kw)
        )
        bank(0, *(v.to(kernel_device) for v in (x, ids, w)))
        assert (pools[0] is None) == (n_slots == 64)
        bank.close()
        # the must-break control never reads RAM rows in place (its swapped blocks exist only as copies)
        control = controlled("swap-nibbles", store, lambda s: GpuExperts(wd, s, n_slots, kernel_device))
        for layer in range(n_layers):
            for e0 in range(0, n_experts, k):
                ids = (torch.arange(e0, e0 + k) % n_experts)[None]
                got = control(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
        want = ref(n_layers - 1, x, ids, w)
        assert (got - want).abs().max() > 0.1 * want.abs().max()
        assert not control.resident or n_slots == 64  # 64 slots: every (swapped) copy has its own slot
        control.close()


def test_prefill_reads_one_group_ahead(tiny_workdir, kernel_device, monkeypatch):
    """Group g's kernel launches after the reads of group g+1 were started, and no block is read twice."""
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 0, io_threads=2) as store:  # no RAM cache: every prompt block is a disk read
        bank = GpuExperts(wd, store, 8, kernel_device)  # groups of 4 experts
        misses_at_launch, real = [], nvfp4_moe.nvfp4_moe_prefill_rows

        def spy(*args, **kwargs):
            misses_at_launch.append(store.stats.misses)
            return real(*args, **kwargs)

        monkeypatch.setattr(nvfp4_moe, "nvfp4_moe_prefill_rows", spy)
        x, ids, w = routing(wd, 20, seed=3)
        bank(1, *(v.to(kernel_device) for v in (x, ids, w)))
        sizes = [min(4, n) for n in range(torch.unique(ids).numel(), 0, -4)]  # group sizes in order
        assert len(sizes) > 2
        assert misses_at_launch == [sum(sizes[: g + 2]) for g in range(len(sizes))]
        assert store.stats.misses == sum(sizes)
        bank.close()


def test_prefill_requests_nothing_once_ram_holds_every_block(tiny_workdir, kernel_device, host_alloc):
    """One block short of all, a prompt's passes request each block a group ahead and again in its fetch;
    with every block landed in the RAM cache the bank fixes each block's RAM row and its passes copy rows
    without a request. The sums are the same either way."""
    wd = Workdir(tiny_workdir)
    blocks = wd.num_layers * wd.num_experts
    x, ids, w = (v.to(kernel_device) for v in routing(wd, 20, seed=3))
    outs, requests = [], []
    for ram in (blocks - 1, blocks):  # one block short of all (reads ahead), then all
        # pinned on a GPU (host_alloc): a bank fixes only RAM rows its kernels can read
        with ExpertStore(wd, ram * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
            layers = [1] if ram < blocks else range(wd.num_layers)
            for h in store.request([(layer, e) for layer in layers for e in range(wd.num_experts)]):
                h.wait()
                h.release()
            assert (store.cached_blocks >= blocks) == (ram == blocks)
            bank = GpuExperts(wd, store, 8, kernel_device)  # groups of 4 experts
            before = store.stats.requests
            outs.append(bank(1, x, ids, w))
            requests.append(store.stats.requests - before)
            assert (bank.resident == "ram") == (ram == blocks)
            bank.close()
    distinct = torch.unique(ids).numel()
    assert distinct > 4  # several groups: each is requested ahead of its fetch, then by it
    assert requests == [2 * distinct, 0]
    assert torch.equal(outs[0], outs[1])


def test_warm_up_compiles_without_touching_the_cache(banks, kernel_device):
    wd, store, _ = banks
    bank = GpuExperts(wd, store, 8, kernel_device)
    bank.warm_up(torch.float32)
    assert bank.cache.stats.requests == 0 and not bank.cache.lru and bank.host_syncs == 0
    bank.close()


def test_prompt_passes_reuse_their_read_buffers(tiny_workdir, kernel_device):
    """Uncached prompt reads go to transient buffers: the bank keeps enough spares that a many-pass prompt
    allocates (and pins, on a GPU) about three groups' worth once, not a buffer per block."""
    from expertstream.store.reader import alloc_aligned

    wd = Workdir(tiny_workdir)
    allocs = []

    def alloc(n):
        allocs.append(n)
        return alloc_aligned(n)

    with ExpertStore(wd, 0, io_threads=2, alloc=alloc) as store:
        bank = GpuExperts(wd, store, 4, kernel_device)  # groups of 2 experts
        for layer in range(wd.num_layers):
            x, ids, w = routing(wd, 12, seed=layer)
            bank(layer, *(v.to(kernel_device) for v in (x, ids, w)))
        assert bank.prefill_passes >= 4 * wd.num_layers
        assert len(allocs) <= 3 * 2 + 2 < store.stats.misses
        bank.close()


def test_a_row_budget_splits_passes_and_fetches_each_block_once(banks, kernel_device):
    # 30 tokens with a budget of 7 tokens' rows per pass: more, smaller passes; each block still fetched once
    wd, store, ref = banks
    x, ids, w = routing(wd, 30, seed=3)
    args = [v.to(kernel_device) for v in (x, ids, w)]
    whole, chunked = GpuExperts(wd, store, 8, kernel_device), GpuExperts(wd, store, 8, kernel_device)
    chunked.set_prefill_chunk(7)
    a, b = whole(1, *args).cpu(), chunked(1, *args).cpu()
    want = ref(1, x, ids, w)
    for got in (a, b):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    assert chunked.prefill_passes > whole.prefill_passes > 1
    assert chunked.cache.stats.copies == whole.cache.stats.copies
    whole.close()
    chunked.close()


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_a_ram_resident_bank_runs_prompt_passes_from_fixed_rows(
    tiny_workdir, kernel_device, host_alloc, monkeypatch
):
    # every block in RAM: the bank adopts each block's RAM row, and a prompt's passes copy those rows into
    # the two halves of the slots in turn, outside the VRAM cache (no store request, nothing cached there);
    # decode after it still reads the RAM rows
    wd = Workdir(tiny_workdir)
    n_layers, n_experts = wd.num_layers, wd.num_experts
    with ExpertStore(wd, n_layers * n_experts * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        for h in store.request([(layer, e) for layer in range(n_layers) for e in range(n_experts)]):
            h.wait()
            h.release()
        ref = StreamedExperts(wd, store, torch.float32)
        bank = GpuExperts(wd, store, 8, kernel_device)  # passes of 4 experts
        x, ids, w = routing(wd, 1, seed=4)
        bank(0, *(v.to(kernel_device) for v in (x, ids, w)))  # a decode step first: some blocks cached
        assert bank.resident == "ram" and bank.cache.lru
        runs = []  # each pass's copy: a run of consecutive rows (one copy call), or None (pairs)
        real = bank.cache.load_pairs
        monkeypatch.setattr(
            bank.cache, "load_pairs", lambda *a, run=None: runs.append(run) or real(*a, run=run)
        )
        for layer in range(n_layers):
            xs, ids_p, ws = routing(wd, 20, seed=layer)
            before, copies = store.stats.requests, bank.cache.stats.copies
            got = bank(layer, *(v.to(kernel_device) for v in (xs, ids_p, ws))).cpu()
            assert store.stats.requests == before and not bank.cache.lru
            want = ref(layer, xs, ids_p, ws)  # (the torch bank requests its blocks)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
            assert bank.cache.stats.copies - copies == torch.unique(ids_p).numel()
            # the store read the blocks in (layer, expert) order into consecutive rows, and this prompt
            # routes every expert: each pass is one run of rows into one half of the slots (one copy call)
            assert runs and all(run is not None for run in runs)
            runs.clear()
        for layer in range(n_layers):
            want = ref(layer, x, ids, w)
            got = bank(layer, *(v.to(kernel_device) for v in (x, ids, w))).cpu()
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        bank.close()


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_ram_resident_passes_equal_the_cache_fetch_passes_bit_for_bit(
    tiny_workdir, kernel_device, host_alloc
):
    # the pass tables (one upload per layer) against the VRAM cache's fetch per pass: the same passes, slots
    # of the same size and the same kernels, so the same bits (and a prompt of each layer in turn, so the
    # tables of one layer are rewritten by the next)
    wd = Workdir(tiny_workdir)
    n_layers, n_experts, block = wd.num_layers, wd.num_experts, wd.layout.block_bytes
    outs = []
    for ram_blocks in (n_layers * n_experts, n_experts):  # every block in RAM (resident), a quarter
        with ExpertStore(wd, ram_blocks * block, io_threads=2, **host_alloc) as store:
            for h in store.request(
                [(layer, e) for layer in range(n_layers) for e in range(n_experts)][:ram_blocks]
            ):
                h.wait()
                h.release()
            bank = GpuExperts(wd, store, 8, kernel_device)
            got = []
            for rep in range(2):
                for layer in range(n_layers):
                    xs, ids, ws = routing(wd, 24, seed=10 * rep + layer)
                    got.append(bank(layer, *(v.to(kernel_device) for v in (xs, ids, ws))).cpu())
            assert (bank.resident == "ram") == (ram_blocks == n_layers * n_experts)
            outs.append(got)
            bank.close()
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_a_vram_resident_bank_is_fixed_even_with_staging_configured(tiny_workdir, kernel_device, host_alloc):
    # staging acts only on blocks in RAM: once every block has its own slot, no layer needs an eager point
    wd = Workdir(tiny_workdir)
    n_layers, n_experts, k = wd.num_layers, wd.num_experts, wd.text_config["num_experts_per_tok"]
    with ExpertStore(wd, n_layers * n_experts * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        bank = GpuExperts(wd, store, n_layers * n_experts + 4, kernel_device, stage_guesses=2)
        assert bank.stage_guesses == 2 and bank.cache.n_slots == n_layers * n_experts
        x, _, w = routing(wd, 1, seed=0)
        for layer in range(n_layers):
            for e0 in range(0, n_experts, k):
                assert bank.decode_mode == "staged"
                ids = (torch.arange(e0, e0 + k) % n_experts)[None]
                bank(layer, *(v.to(kernel_device) for v in (x, ids, w)))
        assert bank.resident == "vram" and bank.decode_mode == "fixed"
        bank.close()


def test_stage_guesses_auto_takes_half_of_k_from_slots_beyond_three_banks():
    # K = 10: the real 8 GiB plan's 30 slots leave none; its 0.9 x 8 GiB plan's 8 cache blocks buy 4
    assert [stage_guesses_for(-1, 10, n) for n in (20, 30, 31, 38, 40, 5000)] == [0, 0, 0, 4, 5, 5]
    # an explicit count needs two layers' K slots beside its 2 G rows
    assert [stage_guesses_for(g, 10, 30) for g in (0, 5, 6)] == [0, 5, 0]


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_staged_guesses_change_no_result_and_are_counted(tiny_workdir, kernel_device, host_alloc):
    """Every block in RAM, 2 guesses staged per layer: decode equals the unstaged bank bit for bit, the
    routed experts found staged are counted, the bus bytes are the in-place reads left plus the staged
    copies, and a prompt after it (slots shared with the staging rows' tensor) is still right."""
    wd = Workdir(tiny_workdir)
    n_layers, n_experts, k = wd.num_layers, wd.num_experts, wd.text_config["num_experts_per_tok"]
    g = torch.Generator().manual_seed(11)
    routers = {layer: torch.randn(n_experts, wd.layout.hidden_size, generator=g) for layer in range(n_layers)}
    with ExpertStore(wd, n_layers * n_experts * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        for h in store.request([(layer, e) for layer in range(n_layers) for e in range(n_experts)]):
            h.wait()
            h.release()
        ref = StreamedExperts(wd, store, torch.float32)
        plain = GpuExperts(wd, store, 4 * k, kernel_device)
        staged = GpuExperts(wd, store, 4 * k, kernel_device, stage_guesses=2)
        assert staged.stage_guesses == 2 and staged.cache.n_slots == 4 * k - 4
        # auto (the engine's default): at most K / 2, and only from slots beyond three banks of K
        autos = [GpuExperts(wd, store, n, kernel_device, stage_guesses=-1) for n in (5 * k, 3 * k + 2, 3 * k)]
        assert [a.stage_guesses for a in autos] == [k // 2, min(k // 2, 1), 0]
        for a in autos:
            a.close()
        for bank in (plain, staged):
            bank.set_router_weights({i: w.to(kernel_device) for i, w in routers.items()})
        hits, guess = 0, []
        for token in range(2):
            for layer in range(n_layers):
                x, ids, w = routing(wd, 1, seed=100 * token + layer)
                if layer > 0 and guess[0] not in ids[0].tolist():  # route to the best guess: a hit to count
                    ids[0, 0] = guess[0]
                args = [v.to(kernel_device) for v in (x, ids, w)]
                a, b = plain(layer, *args).cpu(), staged(layer, *args).cpu()
                assert torch.equal(a, b)
                torch.testing.assert_close(
                    b, ref(layer, x, ids, w), rtol=2e-5, atol=2e-5 * b.abs().max().item()
                )
                if layer > 0 and staged.resident == "ram":  # this layer's guesses came from the previous x
                    hits += len(set(ids[0].tolist()) & set(guess))
                guess = torch.topk(routers.get(layer + 1, routers[0]) @ x[0], 2).indices.tolist()
        # the bank was RAM-resident from the first layer on: every layer but the last staged 2 guesses
        assert staged.resident == "ram" and staged.stage_counts() == (2 * 2 * (n_layers - 1), hits)
        assert (
            plain.decode_mode == "fixed" and staged.decode_mode == "staged"
        )  # staging keeps an eager point per layer
        assert hits >= 2 * (n_layers - 1)
        # a token's start: layer 0's 2 guesses from its embedding row (here x), bit for bit; the call then
        # stages layer 1's 2 as every layer does
        x, ids, w = routing(wd, 1, seed=7)
        first = torch.topk(routers[0] @ x[0], 2).indices
        if first[0] not in ids[0]:
            ids[0, 0] = first[0]
        staged.decode_stage_first(x.to(kernel_device))
        args = [v.to(kernel_device) for v in (x, ids, w)]
        assert torch.equal(plain(0, *args).cpu(), staged(0, *args).cpu())
        found = len(set(ids[0].tolist()) & set(first.tolist()))
        n_staged, hits = 2 * 2 * (n_layers - 1) + 2 + 2, hits + found
        assert staged.stage_counts() == (n_staged, hits) and found >= 1
        block = wd.layout.block_bytes
        assert staged.bytes_in_place == (staged.resident_ram_reads - hits + n_staged) * block
        xs, ids, ws = routing(wd, 12, seed=5)
        got = staged(1, *(v.to(kernel_device) for v in (xs, ids, ws))).cpu()
        want = ref(1, xs, ids, ws)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        plain.close()
        staged.close()


def test_prompts_fill_a_vram_cache_that_can_hold_every_block(tiny_workdir, kernel_device, host_alloc):
    # every block in RAM, but slots for every block too: a prompt does not fix the RAM rows (decode should
    # read the blocks from VRAM once they are all there); its passes fill the VRAM cache
    wd = Workdir(tiny_workdir)
    blocks = wd.num_layers * wd.num_experts
    with ExpertStore(wd, blocks * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        for h in store.request([(layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts)]):
            h.wait()
            h.release()
        bank = GpuExperts(wd, store, blocks, kernel_device)
        xs, ids, ws = routing(wd, 20, seed=1)
        bank(1, *(v.to(kernel_device) for v in (xs, ids, ws)))
        assert bank.resident is None and len(bank.cache.lru) == torch.unique(ids).numel()
        bank.close()


def test_hot_split_leaves_a_hot_set_only_where_the_passes_leave_a_slot_a_layer():
    # the real model: 24 GiB (~4,100 cache slots) keeps passes of a whole layer and 64 hot blocks a layer;
    # 8 GiB (~6 cache blocks beside the 30 slots) has none and keeps its passes of half the slots
    assert hot_split(4139, 512, 10, 48) == (512, 64)
    assert hot_split(36, 512, 10, 48) == (18, 0)
    assert hot_split(40, 16, 4, 4) == (10, 5)  # the tiny model below: passes of 10, 5 hot blocks a layer
    assert hot_split(8, 16, 4, 4) == (4, 0)


def _hot_rows_hold_their_blocks(bank, store) -> bool:
    """Every hot block's slot (from the location table) holds that block's bytes."""
    slots, loc = bank.cache.slots.cpu(), bank.locations()
    keys = [(layer, e) for layer in range(loc.shape[0]) for e in bank.hot_set(layer)]
    handles = store.request(keys)
    try:
        return all(torch.equal(slots[loc[key]], h.wait()) for key, h in zip(keys, handles))
    finally:
        for h in handles:
            h.release()


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_a_ram_resident_bank_reads_its_hot_set_from_vram(tiny_workdir, kernel_device, host_alloc):
    """Every block in RAM and 40 cache slots: prompt passes take 20, and each layer's 5 most-routed blocks
    are copied into the other 20 and read from there. Decode equals a bank without a hot set bit for bit,
    a prompt moves its layer's hot set to what it routed most, and the blocks read from VRAM are counted
    out of the bus bytes."""
    wd = Workdir(tiny_workdir)
    n_layers, k, block = wd.num_layers, wd.text_config["num_experts_per_tok"], wd.layout.block_bytes
    with ram_store(wd, **host_alloc) as store:
        ref = StreamedExperts(wd, store, torch.float32)
        plain, hot = GpuExperts(wd, store, 8, kernel_device), GpuExperts(wd, store, 40, kernel_device)
        # a prompt on layer 2: experts 11-15 routed most, so they become its hot set when the bank adopts
        # the RAM rows (the other layers, with nothing routed yet, hold experts 0-4)
        ids = torch.tensor([[11, 12, 13, 14]] * 20 + [[15, 0, 1, 2]] * 12 + [[15, 3, 4, 5]] * 8)
        xs, _, ws = routing(wd, ids.shape[0], seed=3)
        for bank in (plain, hot):
            got = bank(2, *(v.to(kernel_device) for v in (xs, ids, ws))).cpu()
            want = ref(2, xs, ids, ws)
            torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        assert plain.resident == hot.resident == "ram"
        # 11 experts: passes of 4 beside no hot set, of 10 beside one (40 slots: 20 for passes, 5 x 4 hot)
        assert (plain.prefill_passes, hot.prefill_passes) == (3, 2)
        assert all(not plain.hot_set(layer) and len(hot.hot_set(layer)) == 5 for layer in range(n_layers))
        assert hot.hot_set(2) == [11, 12, 13, 14, 15] and hot.hot_set(0) == [0, 1, 2, 3, 4]
        assert _hot_rows_hold_their_blocks(hot, store)
        loc = hot.locations()  # decode reads the hot set from VRAM, past the passes' slots, the rest from RAM
        for layer in range(n_layers):
            assert (loc[layer] >= 0).nonzero().flatten().tolist() == hot.hot_set(layer)
            assert (loc[layer][hot.hot_set(layer)] >= 20).all()
        copies = hot.cache.stats.copies
        reads = hits = 0
        decoded = []  # layer 0's routed experts in decode (counted on the device)
        for token in range(3):
            for layer in range(n_layers):
                x, ids, w = routing(wd, 1, seed=50 + 10 * token + layer)
                args = [v.to(kernel_device) for v in (x, ids, w)]
                assert torch.equal(plain(layer, *args).cpu(), hot(layer, *args).cpu())
                hits += len(set(ids[0].tolist()) & set(hot.hot_set(layer)))
                reads += k
                if layer == 0:
                    decoded.extend(ids[0].tolist())
        assert hot.cache.stats.copies == copies  # decode copies nothing: the hot set is read in place
        assert hot.hot_hits() == hits and 0 < hits < reads and hot.resident_ram_reads == reads
        assert hot.bytes_in_place == (reads - hits) * block and plain.bytes_in_place == reads * block
        # a prompt on layer 0 routing experts 6-9 most: they enter its hot set, and the fifth is the expert
        # decode routed most there (decode's routing, counted on the device, joins the counts at a prompt)
        before = set(hot.hot_set(0))
        ids = torch.tensor([[6, 7, 8, 9]] * 40)
        xs, _, ws = routing(wd, ids.shape[0], seed=4)
        got = hot(0, *(v.to(kernel_device) for v in (xs, ids, ws))).cpu()
        want = ref(0, xs, ids, ws)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        counts = np.bincount(decoded, minlength=wd.num_experts) + np.bincount(ids.reshape(-1), minlength=16)
        after = set(hot.hot_set(0))
        assert after == set(most_routed(counts, 5).tolist()) and {6, 7, 8, 9} < after
        entered = len(after - before)
        assert hot.cache.stats.copies - copies == entered + len(torch.unique(ids))  # those entering, the pass
        assert _hot_rows_hold_their_blocks(hot, store)
        x, ids, w = routing(wd, 1, seed=9)
        ids[0, :2] = torch.tensor([6, min(before - after)])  # one hot, one that left
        args = [v.to(kernel_device) for v in (x, ids, w)]
        assert torch.equal(plain(0, *args).cpu(), hot(0, *args).cpu())
        plain.close()
        hot.close()


@pytest.mark.slow  # minutes under the Triton interpreter on a CPU; seconds on a GPU
def test_staged_guesses_skip_the_hot_set_and_both_are_counted(tiny_workdir, kernel_device, host_alloc):
    # staging beside a hot set: a hot guess is not copied, a routed hot block counts as a hot hit and not a
    # stage hit, and the bus bytes are the RAM reads left plus the staged copies
    wd = Workdir(tiny_workdir)
    n_layers, n_experts, k = wd.num_layers, wd.num_experts, wd.text_config["num_experts_per_tok"]
    g = torch.Generator().manual_seed(12)
    routers = {layer: torch.randn(n_experts, wd.layout.hidden_size, generator=g) for layer in range(n_layers)}
    with ram_store(wd, **host_alloc) as store:
        plain = GpuExperts(wd, store, 4 * k, kernel_device)
        both = GpuExperts(wd, store, 44, kernel_device, stage_guesses=2)  # 40 cache slots, 4 staging rows
        assert both.stage_guesses == 2
        for bank in (plain, both):
            bank.set_router_weights({i: w.to(kernel_device) for i, w in routers.items()})
        staged = hits = hot_hits = 0
        guess = None
        for token in range(3):
            for layer in range(n_layers):
                x, ids, w = routing(wd, 1, seed=200 + 10 * token + layer)
                args = [v.to(kernel_device) for v in (x, ids, w)]
                assert torch.equal(plain(layer, *args).cpu(), both(layer, *args).cpu())
                hot = set(both.hot_set(layer))  # the bank adopted the RAM rows on its first call
                routed = ids[0].tolist()
                if token or layer:  # the first call's reads were fetched (no guesses staged for it either)
                    hot_hits += sum(e in hot for e in routed)
                if guess is not None:
                    staged += sum(e not in hot for e in guess)
                    hits += sum(e in guess and e not in hot for e in routed)
                nxt = routers.get(layer + 1)
                guess = torch.topk(nxt @ x[0], 2).indices.tolist() if nxt is not None else None
            guess = None  # a token's last layer stages nothing; the next token starts unstaged here
        assert both.resident == "ram" and both.stage_counts() == (staged, hits)
        assert len(both.hot_set(0)) == 5 and both.hot_hits() == hot_hits > 0
        reads = 3 * n_layers * k - k
        assert both.resident_ram_reads == reads
        assert both.bytes_in_place == (reads - hits - hot_hits + staged) * wd.layout.block_bytes
        plain.close()
        both.close()


def test_counters_report_the_banks_own_counts(banks, kernel_device):
    """`counters()` names each count as the engine's stats do; RAM reads exclude staged and hot hits."""
    from expertstream.experts.bank import BankCounters, ExpertBank

    wd, store, ref = banks
    bank = GpuExperts(wd, store, 8, kernel_device)
    assert isinstance(bank, ExpertBank) and isinstance(ref, ExpertBank)
    assert ref.counters() == BankCounters()  # the torch bank has no VRAM tier
    bank.decode_seconds, bank.sync_seconds, bank.spec_seconds = 3.0, 2.0, 1.0
    bank.resident_reads, bank.resident_ram_reads = 7, 5
    c = bank.counters()
    assert (c.bank_decode_seconds, c.bank_sync_seconds, c.bank_spec_seconds) == (3.0, 2.0, 1.0)
    assert (c.resident_reads, c.resident_ram_reads) == (7, 5)
    assert (c.staged_blocks, c.stage_hits, c.hot_hits) == (0, 0, 0)
    assert c.bus_read_bytes == 5 * wd.layout.block_bytes  # the RAM reads crossed the bus in place
    bank.close()


def test_decode_misses_enter_the_ram_cache_and_prompt_misses_do_not(tiny_workdir, kernel_device, host_alloc):
    """After a prompt, a decode step run in stages (as the decode graphs run it) caches its misses in RAM, as
    the bank's call does; the prompt's misses bypass the RAM cache."""
    wd = Workdir(tiny_workdir)
    k = wd.text_config["num_experts_per_tok"]
    blocks = wd.num_layers * wd.num_experts
    with ExpertStore(wd, blocks * wd.layout.block_bytes, io_threads=2, **host_alloc) as store:
        bank = GpuExperts(wd, store, 8, kernel_device)
        xs, ids, ws = (v.to(kernel_device) for v in routing(wd, 12, seed=1))
        bank(0, xs, ids, ws)
        assert store.cached_blocks == 0
        x, ids, w = (v.to(kernel_device) for v in routing(wd, 1, seed=2))
        want = bank.decode_want(1, x, ids)
        bank.decode_prepare(1, want, k)
        bank.decode_compute(1, x, ids, w)
        bank.decode_launched()
        assert store.cached_blocks == k
        bank(2, x, ids, w)
        assert store.cached_blocks == 2 * k
        bank.close()
