"""The CUDA expert bank with several sequences' rows in one call (experts/segments.py), on the CPU through
the Triton interpreter: prompts share one sweep of the experts, one-token rows the fetch of their experts'
union, and every row's sum is the one its sequence alone gets."""

import pytest
import torch
from bank_helpers import ram_store

from expertstream.config import EngineConfig
from expertstream.experts import gpu_prefill
from expertstream.experts.gpu_bank import GpuExperts
from expertstream.kernels import nvfp4_moe
from expertstream.runtime.engine import Engine
from expertstream.store import ExpertStore
from expertstream.workdir.workdir import Workdir

pytest.importorskip("triton")  # conftest runs it through the interpreter when there is no CUDA
# bf16 repeats the fp32 cases at a second dtype: slow (the CPU runs them through the Triton interpreter)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def workdir(tiny_workdir, host_alloc):
    wd = Workdir(tiny_workdir)
    yield wd, host_alloc


def rows(wd, t, seed, shared):
    """t one-token rows whose first `shared` experts are the same in every row (overlapping routing)."""
    g = torch.Generator().manual_seed(seed)
    k, e = wd.text_config["num_experts_per_tok"], wd.num_experts
    common = torch.randperm(e, generator=g)[:shared]
    rest = [c for c in torch.randperm(e, generator=g).tolist() if c not in common.tolist()]
    ids = torch.stack([torch.cat((common, torch.tensor(rest[i * (k - shared) : (i + 1) * (k - shared)])))
                       for i in range(t)])  # fmt: skip
    w = torch.rand(t, k, generator=g)
    x = torch.randn(t, wd.layout.hidden_size, generator=g)
    return x, ids, w / w.sum(-1, keepdim=True)


def fresh_bank(wd, host_alloc, kernel_device, n_slots=64):
    store = ExpertStore(wd, 1 << 20, io_threads=2, **host_alloc)
    return store, GpuExperts(wd, store, n_slots, kernel_device, speculate=False)


def test_one_token_rows_of_several_sequences_fetch_each_block_once(workdir, kernel_device):
    wd, host_alloc = workdir
    k = wd.text_config["num_experts_per_tok"]
    x, ids, w = (v.to(kernel_device) for v in rows(wd, 3, seed=1, shared=k // 2))
    distinct = torch.unique(ids).numel()
    assert distinct < 3 * k
    store, alone_bank = fresh_bank(wd, host_alloc, kernel_device)
    alone = torch.cat([alone_bank(0, x[i : i + 1], ids[i : i + 1], w[i : i + 1]) for i in range(3)])
    assert alone_bank.cache.stats.requests == 3 * k  # each sequence asks for its own K blocks
    alone_bank.close()
    store.close()
    store, bank = fresh_bank(wd, host_alloc, kernel_device)
    got = bank(0, x, ids, w, segments=[(0, 1), (1, 2), (2, 3)])
    # the union once: each distinct block asked of the VRAM cache once and read from the store once
    assert bank.cache.stats.requests == distinct and store.stats.requests == distinct
    assert torch.equal(got, alone)
    bank.close()
    store.close()


def test_a_union_larger_than_half_the_slots_goes_in_groups(workdir, kernel_device):
    wd, host_alloc = workdir
    k = wd.text_config["num_experts_per_tok"]
    x, ids, w = (v.to(kernel_device) for v in rows(wd, 3, seed=2, shared=0))  # 3 K distinct blocks
    store, bank = fresh_bank(wd, host_alloc, kernel_device, n_slots=4 * k)  # half the slots: 2 K
    alone = torch.cat([bank(1, x[i : i + 1], ids[i : i + 1], w[i : i + 1]) for i in range(3)])
    requests = bank.cache.stats.requests
    got = bank(1, x, ids, w, segments=[(0, 1), (1, 2), (2, 3)])
    assert torch.equal(got, alone) and bank.cache.stats.requests - requests == 3 * k
    bank.close()
    store.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_among_them_gets_the_sums_of_its_own_call(workdir, kernel_device, dtype):
    """A prompt's FP32 sums and the one-token rows' sums (x's dtype, widened exactly) share the output."""
    wd, host_alloc = workdir
    k = wd.text_config["num_experts_per_tok"]
    x, ids, w = (v.to(kernel_device) for v in rows(wd, 6, seed=3, shared=k // 2))
    x = x.to(dtype)
    store, bank = fresh_bank(wd, host_alloc, kernel_device)
    prompt = bank(2, x[:4], ids[:4], w[:4])
    ones = torch.cat([bank(2, x[i : i + 1], ids[i : i + 1], w[i : i + 1]) for i in (4, 5)])
    got = bank(2, x, ids, w, segments=[(0, 4), (4, 5), (5, 6)])
    assert got.dtype == torch.float32 and torch.equal(got[:4], prompt) and torch.equal(got[4:], ones.float())
    bank.close()
    store.close()


# three prompts (t tokens routed among these experts) and a one-token row routed to experts no prompt
# routes: the prompts' union is 12 experts, B's run in other passes alone than beside A and C, and C's 40
# tokens on 4 experts make 64-row tiles where A's and B's take 16
PROMPTS = ((5, [0, 1, 2, 3]), (7, [2, 5, 6, 9, 10, 11]), (40, [11, 12, 13, 14]))
ROW = [4, 7, 8, 15]
# a launch shape for passes of a few experts (tuned_configs.json `HxIxpass`), other than the orders' own
PASS = dict(block_n=16, block_k=16, num_warps=2, num_stages=2)


def batch(wd, dtype, device):
    """x [T, H], expert_ids [T, K], weights [T, K] of the three prompts and the row, and their segments."""
    k = wd.text_config["num_experts_per_tok"]
    parts = [(t, torch.tensor(e)) for t, e in PROMPTS] + [(1, torch.tensor(ROW))]
    g = torch.Generator().manual_seed(7)
    ids = torch.cat([pool[torch.stack([torch.randperm(len(pool), generator=g)[:k] for _ in range(t)])]
                     for t, pool in parts])  # fmt: skip
    w = torch.rand(ids.shape, generator=g)
    x = torch.randn(ids.shape[0], wd.layout.hidden_size, generator=g)
    ends = torch.cumsum(torch.tensor([t for t, _ in parts]), 0).tolist()
    segments = list(zip([0] + ends[:-1], ends))
    return x.to(device, dtype), ids.to(device), (w / w.sum(-1, keepdim=True)).to(device), segments


def record_launches(monkeypatch) -> list:
    """The list that gets (prompt tokens, the launch's experts, its rows) of each prompt launch from here."""
    seen, real = [], nvfp4_moe.nvfp4_moe_prefill_rows

    def record(x, slots, e2s, ws2, weights, layout, order, tiles, *args, **kwargs):
        experts = tuple(order.tile_expert[tiles[0] : tiles[1]].unique().tolist())
        seen.append((x.shape[0], experts, (tiles[1] - tiles[0]) * order.config["block_m"]))
        real(x, slots, e2s, ws2, weights, layout, order, tiles, *args, **kwargs)

    monkeypatch.setattr(nvfp4_moe, "nvfp4_moe_prefill_rows", record)
    return seen


@pytest.mark.parametrize("regime", ["disk", "ram"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prompts_share_one_sweep_and_get_the_sums_of_their_own_calls(
    workdir, kernel_device, dtype, regime, monkeypatch
):
    """Three prompts and a one-token row in one call, in passes of 4 experts (8 slots): each block the
    prompts route is fetched (disk) or copied from its RAM row (ram) once for all of them, and each
    sequence's sums are the bits of its own call, though a prompt's experts fall into other passes."""
    wd, host_alloc = workdir
    k = wd.text_config["num_experts_per_tok"]
    # a prompt takes the pass launch shape where alone it runs in several passes (A and C do not, in "ram")
    monkeypatch.setattr(gpu_prefill, "tuned_config", lambda kernel, device, key: dict(PASS))
    x, ids, w, segments = batch(wd, dtype, kernel_device)
    union = torch.unique(ids[: segments[-1][0]]).numel()
    assert union == 12
    chunk = 8 if regime == "disk" else None  # 32 rows a prompt and pass (more only for one expert)

    def bank_of():
        if regime == "ram":
            store = ram_store(wd, **host_alloc)
        else:
            store = ExpertStore(wd, 1 << 20, io_threads=2, **host_alloc)
        bank = GpuExperts(wd, store, 8, kernel_device, speculate=False)
        bank.set_prefill_chunk(chunk)
        return store, bank

    launched = record_launches(monkeypatch)
    store, bank = bank_of()
    alone = [bank(1, x[a:b], ids[a:b], w[a:b]) for a, b in segments]
    bank.close()
    store.close()
    alone_passes = [experts for t, experts, _ in launched if t == 7]
    launched.clear()
    store, bank = bank_of()
    requests, copies, reads = bank.cache.stats.requests, bank.cache.stats.copies, store.stats.misses
    got = bank(1, x, ids, w, segments=segments)
    assert got.dtype == torch.float32
    for (a, b), want in zip(segments, alone):
        assert torch.equal(got[a:b], want.float())
    if regime == "disk":  # every block of the call asked of the VRAM cache once and read from the drive once
        assert bank.cache.stats.requests - requests == store.stats.misses - reads == union + k
        assert all(rows <= chunk * k or len(experts) == 1 for _, experts, rows in launched)
    else:  # the prompts' blocks copied from their RAM rows once; the row's read in place
        assert bank.resident == "ram" and bank.cache.stats.copies - copies == union
    # B's experts fall into other passes beside A's and C's than alone
    assert [experts for t, experts, _ in launched if t == 7] != alone_passes
    bank.close()
    store.close()


@pytest.mark.gpu  # the engine runs the CUDA bank on CUDA only
def test_the_engine_gives_batched_prompts_on_cuda_the_logits_of_each_alone(tiny_workdir):
    """bf16, the plan's 12 slots (passes of 6 experts): three prompts in one `forward_batch` get the logits
    of each alone bit for bit, and each layer asks the VRAM cache once for each block any of them routes."""
    cfg = EngineConfig(model=str(tiny_workdir), device="cuda", dtype="bfloat16", max_model_len=512,
                       gpu_memory_gb=4, prefill_piece=16, prefill_span=128)  # fmt: skip
    eng = Engine(cfg, vram_cache_blocks=0)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(0, eng.args.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 60)]
    stats = eng.bank.cache.stats
    before = stats.requests
    alone = [eng.forward(eng.new_state(), p) for p in ps]
    alone_requests, before = stats.requests - before, stats.requests
    got = eng.forward_batch([(eng.new_state(), p) for p in ps])
    for a, b in zip(alone, got):
        assert torch.equal(a, b)
    layers, experts = eng.args.num_hidden_layers, eng.workdir.num_experts
    assert stats.requests - before <= layers * experts < alone_requests
    eng.close()
