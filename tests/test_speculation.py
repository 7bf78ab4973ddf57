"""Next-layer speculation: guesses counted exactly, results unchanged, disk prefetch never ahead of demand."""

import logging
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from expertstream.config import EngineConfig
from expertstream.experts.gpu_bank import GpuExperts
from expertstream.runtime.engine import Engine
from expertstream.store import ExpertStore
from expertstream.workdir.workdir import Workdir

pytest.importorskip("triton")  # the GPU bank runs through the interpreter on CPU (conftest)


def one_token(wd, seed, routers=None, follow=False, dev="cpu"):
    """Per layer (x [1, H], ids [1, K], w [1, K]); with `follow`, layer l+1 routes exactly to its guess."""
    g = torch.Generator().manual_seed(seed)
    k, h = wd.text_config["num_experts_per_tok"], wd.layout.hidden_size
    steps = []
    for layer in range(wd.num_layers):
        x = torch.randn(1, h, generator=g)
        if follow and layer:
            ids = torch.topk(F.linear(steps[-1][0][0].cpu(), routers[layer].cpu()), k).indices[None]
        else:
            ids = torch.randperm(wd.num_experts, generator=g)[:k][None]
        w = torch.rand(1, k, generator=g)
        steps.append((x.to(dev), ids.to(dev), (w / w.sum()).to(dev)))
    return steps


def routers_for(wd, seed=0, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = wd.layout.hidden_size
    return {l: torch.randn(wd.num_experts, h, generator=g).to(dev) for l in range(wd.num_layers)}


@pytest.fixture
def store(tiny_workdir, host_alloc):
    wd = Workdir(tiny_workdir)
    with ExpertStore(
        wd, wd.num_layers * wd.num_experts * wd.layout.block_bytes, io_threads=2, **host_alloc
    ) as s:
        yield wd, s


def test_a_perfect_router_is_used_every_time(store, kernel_device):
    wd, s = store
    routers = routers_for(wd, dev=kernel_device)
    bank = GpuExperts(wd, s, 64, kernel_device)
    bank.set_router_weights(routers)
    k = wd.text_config["num_experts_per_tok"]
    for seed in range(2):
        for layer, (x, ids, w) in enumerate(one_token(wd, seed, routers, follow=True, dev=kernel_device)):
            bank(layer, x, ids, w)
    st = bank.spec.stats
    assert st.issued == 2 * (wd.num_layers - 1) * k  # no guess past the last layer
    assert st.used == st.issued
    assert bank.host_syncs == 2 * wd.num_layers  # the guess rides on the layer's one sync
    bank.close()


@pytest.fixture
def half_in_ram(tiny_workdir, kernel_device):
    """(workdir, store, routers, bank): half the blocks fit in RAM, so the bank keeps reading ids back."""
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 32 * wd.layout.block_bytes, io_threads=2) as s:
        routers = routers_for(wd, dev=kernel_device)
        bank = GpuExperts(wd, s, 64, kernel_device)
        bank.set_router_weights(routers)
        yield wd, s, routers, bank
        bank.close()


def test_random_routing_counts_used_guesses(half_in_ram, kernel_device):
    wd, _, routers, bank = half_in_ram  # never resident: every guess is scored
    used = 0
    steps = one_token(wd, seed=5, dev=kernel_device)
    for layer, (x, ids, w) in enumerate(steps):
        bank(layer, x, ids, w)
        if layer + 1 < wd.num_layers:
            guess = set(torch.topk(F.linear(x[0], routers[layer + 1]), len(ids[0])).indices.tolist())
            used += len(guess & set(steps[layer + 1][1][0].tolist()))
    st = bank.spec.stats
    assert (st.used, st.issued) == (used, (wd.num_layers - 1) * len(ids[0]))
    assert st.used < st.issued  # random routing: some guesses miss
    assert not bank.resident and bank.host_syncs == wd.num_layers


@pytest.mark.slow  # ~12 s: two banks through every layer of two tokens in the Triton interpreter
@pytest.mark.parametrize("n_slots", [9])
def test_speculation_never_changes_the_output(store, n_slots, kernel_device):
    wd, s = store
    on, off = (
        GpuExperts(wd, s, n_slots, kernel_device),
        GpuExperts(wd, s, n_slots, kernel_device, speculate=False),
    )
    on.set_router_weights(routers_for(wd, dev=kernel_device))
    off.set_router_weights(routers_for(wd, dev=kernel_device))
    for seed in range(2):
        for layer, (x, ids, w) in enumerate(
            one_token(wd, seed, routers_for(wd, dev=kernel_device), follow=seed == 1, dev=kernel_device)
        ):
            assert torch.equal(on(layer, x, ids, w), off(layer, x, ids, w))
    assert on.spec.stats.issued > 0 and off.spec is None
    on.close()
    off.close()


def test_guesses_not_in_ram_go_to_the_prefetch_reader(half_in_ram, kernel_device):
    wd, s, routers, bank = half_in_ram
    steps = one_token(wd, 0, routers, follow=True, dev=kernel_device)
    x, ids, w = steps[0]
    bank(0, x, ids, w)
    assert bank.spec.stats.prefetches == len(ids[0])
    deadline = time.monotonic() + 10
    while s.stats.prefetches + s.stats.prefetch_dropped < len(ids[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.stats.prefetches == len(ids[0])
    # routes exactly to the guess: served by the prefetched blocks (its own guesses for layer 2 may be
    # read meanwhile: they are queued before its kernel runs)
    bank(1, *steps[1])
    assert s.stats.prefetch_hits == len(ids[0]) and s.stats.prefetch_dropped == 0


def slow_reads(store, monkeypatch, seconds):
    real, log = store._reader.read_into, []

    def read_into(buf, offset):
        t0 = time.monotonic()
        time.sleep(seconds)
        n = real(buf, offset)
        log.append((offset, threading.current_thread().name, t0, time.monotonic()))
        return n

    monkeypatch.setattr(store._reader, "read_into", read_into)
    return log


def test_demand_reads_overtake_queued_prefetches(tiny_workdir, monkeypatch):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 32 * wd.layout.block_bytes, io_threads=2) as s:
        log = slow_reads(s, monkeypatch, 0.1)
        assert s.prefetch([(1, e) for e in range(6)]) == 6
        time.sleep(0.02)  # the prefetcher has started its first read
        t0 = time.monotonic()
        (h,) = s.request([(2, 0)])
        h.wait()
        waited = time.monotonic() - t0
        assert waited < 0.35  # one read plus at most the one prefetch already under way
        h.release()
        # a newer guess replaces the queue, far from drained: its dropped keys are counted
        assert s.prefetch([(3, 0)]) == 1
        assert s.stats.prefetch_dropped >= 3
        deadline = time.monotonic() + 10
        while s.stats.prefetches + s.stats.prefetch_dropped < 7 or s.stats.queue_depth:
            assert time.monotonic() < deadline, "the prefetch queue did not drain"
            time.sleep(0.01)
        s.close()  # joins the prefetcher: every read it started is in the log
        demand_end = next(end for off, _, _, end in log if off == wd.block_offset(2, 0))
        later = [start for off, name, start, _ in log if name == "expertstream-prefetch" and start > t0]
        assert later and min(later) >= demand_end  # no prefetch read started while demand was reading
        assert s.stats.prefetches + s.stats.prefetch_dropped == 7


def test_preload_fills_ram_below_guesses_and_demand(tiny_workdir, monkeypatch):
    wd = Workdir(tiny_workdir)
    keys = [(layer, e) for layer in range(wd.num_layers) for e in range(wd.num_experts)]
    with ExpertStore(wd, len(keys) * wd.layout.block_bytes, io_threads=2) as s:
        log = slow_reads(s, monkeypatch, 0.02)
        assert s.preload(keys) == len(keys)
        time.sleep(0.03)
        (h,) = s.request([(3, 9)])  # a demand read overtakes the preload queue
        h.wait()
        h.release()
        assert s.stats.preloads < len(keys) - 1  # still far from done
        s.prefetch([(2, 5)])  # a guess goes first, and does not drop the preloads
        deadline = time.monotonic() + 20
        while s.stats.cached_blocks < len(keys) or s.stats.queue_depth:
            assert time.monotonic() < deadline, "the preloads did not finish"
            time.sleep(0.01)
        st = s.stats
        assert st.cached_blocks == len(keys) and st.preloads + st.prefetches + 1 == len(keys)
        assert st.prefetches <= 1 and st.prefetch_dropped == 0
        guess = wd.block_offset(2, 5)
        order = [off for off, name, _, _ in log if name == "expertstream-prefetch"]
        assert guess in order and order.index(guess) < len(order) - 1  # read before the preloads finished
        assert all(h is not None for h in s.peek(keys))


def test_engine_preloads_only_what_the_ram_cache_holds(tiny_workdir, caplog):
    wd = Workdir(tiny_workdir)
    half = wd.num_layers * wd.num_experts * wd.layout.block_bytes / 2 / 2**30  # GiB: half the blocks
    small = EngineConfig(model=str(tiny_workdir), device="cpu", ram_cache_gb=half, preload_experts=True)
    with caplog.at_level(logging.WARNING, logger="expertstream.runtime.engine"):
        eng = Engine(small)
    assert "--preload-experts ignored" in caplog.text and not eng.store._preload_queue
    eng.close()
    eng = Engine(EngineConfig(model=str(tiny_workdir), device="cpu", ram_cache_gb=1, preload_experts=True))
    deadline = time.monotonic() + 20
    while eng.store.stats.cached_blocks < wd.num_layers * wd.num_experts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.store.stats.cached_blocks == wd.num_layers * wd.num_experts
    eng.close()


def test_peek_starts_no_read(tiny_workdir):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 8 * wd.layout.block_bytes, io_threads=2) as s:
        (h,) = s.request([(0, 1)])
        block = bytes(h.wait().numpy())
        h.release()
        got = s.peek([(0, 1), (0, 2)])
        assert got[1] is None and bytes(got[0].wait().numpy()) == block
        got[0].release()
        assert (s.stats.requests, s.stats.misses) == (1, 1)


def test_engine_speculation_changes_no_logit_and_is_counted(tiny_workdir, kernel_device):
    outs, stats = [], []
    for off in (False, True):
        eng = Engine(EngineConfig(model=str(tiny_workdir), device=kernel_device, no_speculation=off))
        st = eng.new_state()
        rows = [eng.forward(st, [1, 5, 9, 3])]
        for _ in range(3):
            rows.append(eng.forward(st, [int(rows[-1].argmax())]))
        outs.append(torch.stack(rows))
        stats.append(eng.stats())
        eng.close()
    assert torch.equal(outs[0], outs[1])
    layers, k = Workdir(tiny_workdir).num_layers, Workdir(tiny_workdir).text_config["num_experts_per_tok"]
    assert stats[0].spec_issued == 3 * (layers - 1) * k and 0 <= stats[0].spec_used <= stats[0].spec_issued
    assert stats[1].spec_issued == 0 and stats[1].prefetch_bytes_read == 0
    assert stats[0].host_syncs == stats[1].host_syncs == 4 * layers


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_cpu_affinity_pins_the_loading_thread_not_the_readers(tiny_workdir):
    cpus = os.sched_getaffinity(0)
    first = min(cpus)
    seen = {}

    def load():
        before = set(threading.enumerate())
        eng = Engine(EngineConfig(model=str(tiny_workdir), device="cpu", cpu_affinity=str(first)))
        seen["engine"] = os.sched_getaffinity(0)
        eng.forward(eng.new_state(), [1, 2])  # spawns the store's reader threads from the pinned thread
        readers = [
            t for t in threading.enumerate() if t.name.startswith("expertstream-io") and t not in before
        ]
        seen["readers"] = [os.sched_getaffinity(t.native_id) for t in readers]
        eng.close()

    t = threading.Thread(target=load)
    t.start()
    t.join()
    assert seen["engine"] == {first} and seen["readers"] and all(r == cpus for r in seen["readers"])
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineConfig(cpu_affinity="3-1")


def test_wider_guesses_are_issued_and_change_no_logit(tiny_workdir, kernel_device):
    outs, issued = [], []
    for width in (1.0, 2.0):
        cfg = EngineConfig(model=str(tiny_workdir), device=kernel_device, speculation_width=width)
        eng = Engine(cfg)
        st = eng.new_state()
        rows = [eng.forward(st, [1, 5, 9, 3])]
        for _ in range(3):
            rows.append(eng.forward(st, [int(rows[-1].argmax())]))
        outs.append(torch.stack(rows))
        issued.append(eng.stats().spec_issued)
        eng.close()
    assert torch.equal(outs[0], outs[1])
    assert issued[1] == 2 * issued[0] > 0  # top-2K guessed for every next layer
    with pytest.raises(ValueError, match="speculation_width"):
        EngineConfig(speculation_width=0.5)
