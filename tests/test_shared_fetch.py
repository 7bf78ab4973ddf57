"""The CUDA expert bank with several sequences' rows in one call (experts/segments.py), on the CPU through
the Triton interpreter: one-token rows share the fetch of their experts' union, and every row's sum is the
one its sequence alone gets."""

import pytest
import torch

from expertstream.experts.gpu_bank import GpuExperts
from expertstream.store import ExpertStore
from expertstream.workdir.workdir import Workdir

pytest.importorskip("triton")  # conftest runs it through the interpreter when there is no CUDA


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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
