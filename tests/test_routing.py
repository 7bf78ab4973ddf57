"""`bench routing` and the cache policy: a deterministic replay, a frequency-aware order that keeps a hot
expert that LRU loses (in the replay and in both real caches), the bench mode end to end on the tiny model."""

import argparse
import json
import random

import pytest
import torch

from expertstream.bench import cli as bench
from expertstream.bench.routing import Trace, guess_accuracy, hot_set_rates, replay
from expertstream.experts.vram_cache import VramExpertCache
from expertstream.store.cache import BlockCache
from expertstream.store.policy import LfuPolicy, LruPolicy

HOT = (0, 0)


def hot_trace(tokens=40):
    """2 layers, top-1: layer 0 routes expert 0 every 4th token and a fresh expert otherwise; layer 1 always
    a fresh one. Between two uses of the hot block 7 other blocks stream past once, more than 4 slots hold."""
    fresh = iter(range(1, 1000))
    routed = [[[0 if t % 4 == 0 else next(fresh)], [next(fresh)]] for t in range(tokens)]
    return Trace(2, 1000, 1, routed, [[[], []] for _ in routed])


def test_replay_is_deterministic():
    rng = random.Random(0)
    hot = [rng.sample(range(16), 2) for _ in range(4)]  # a skewed workload: half the picks from 2 experts
    routed = [
        [rng.sample(range(16), 2) if rng.random() < 0.5 else hot[l] for l in range(4)] for _ in range(300)
    ]
    trace = Trace(4, 16, 2, routed, [[[]] * 4 for _ in routed])
    for policy in (LruPolicy, LfuPolicy):
        first = replay(trace, policy, 12)
        assert replay(trace, policy, 12) == first and 0 < first["hit_rate"] < 1


def test_frequency_aware_policy_keeps_the_hot_expert_and_lru_loses_it():
    trace = hot_trace()
    uses = sum(tok[0] == [0] for tok in trace.routed)  # 10
    lfu, lru = replay(trace, LfuPolicy, 4), replay(trace, LruPolicy, 4)
    assert lru["hit_rate"] == 0  # every hot use finds it evicted
    # the hot block misses twice (its count ties the stream's once), then stays: every later use hits
    assert lfu["hit_rate"] == (uses - 2) / (2 * len(trace.routed))
    with pytest.raises(ValueError, match="two layers"):
        replay(trace, LfuPolicy, 1)


def test_both_caches_keep_the_hot_expert():
    trace = hot_trace()

    def fetch_host(keys):
        return [
            type(
                "H",
                (),
                {
                    "wait": lambda self: torch.zeros(8, dtype=torch.uint8),
                    "release": lambda self: None,
                    "ready": True,
                },
            )()
            for _ in keys
        ]

    vram = VramExpertCache(fetch_host, 8, 4, torch.zeros(2, 1000, 3), "cpu")
    ram = BlockCache(4, 8, lambda n: torch.zeros(n, dtype=torch.uint8))
    for tok in trace.routed:
        for layer, experts in enumerate(tok):
            vram.fetch(layer, experts)
            key = (layer, experts[0])
            if ram.get(key) is None:
                ram.insert(key).done.set()  # landed and unpinned: evictable
    assert vram.stats.hits == 8 and HOT in vram.lru
    misses = 2 * len(trace.routed) - 8  # the same 8 hits; the first 4 misses fill free slots
    assert ram.get(HOT) is not None and ram.evictions == misses - 4


def test_a_hot_set_is_the_first_halfs_most_routed_experts():
    # 1 layer of 20 experts, top-2, 8 tokens: the first half routes 3 and 7 (3 once more), the second half
    # 3 with a fresh expert each time. A 1-expert hot set (5 %) holds 3: half the second half's blocks; 2
    # experts (10 %) hold 3 and 7, which the second half no longer routes: still half
    routed = [[[3, 7]], [[3, 7]], [[3, 7]], [[3, 1]]] + [[[3, e]] for e in (10, 11, 12, 13)]
    rows = hot_set_rates(Trace(1, 20, 2, routed, [[[]] for _ in routed]))
    assert [(r["per_layer"], r["hit_rate"], r["uniform"]) for r in rows[:2]] == [
        (1, 0.5, 0.05),
        (2, 0.5, 0.1),
    ]
    # 12.5 %: 2 experts (rounded); 25 %: 5, taking 3, 7, 1 and the lowest unrouted ids 0 and 2
    assert [r["per_layer"] for r in rows[2:]] == [2, 5] and rows[3]["hit_rate"] == 0.5


def test_guess_accuracy_per_layer():
    # layer 1's top-4 by its router, seen at layer 0, best first: the top 2 are the engine's guess.
    # token 0: both right in the top 2; token 1: one right in the top 2 (4), the other (5) fourth
    trace = Trace(2, 8, 2, [[[0, 1], [2, 3]], [[0, 1], [4, 5]]], [[[2, 3, 6, 0], []], [[4, 7, 6, 5], []]])
    (row,) = guess_accuracy(trace)
    assert (row["layer"], row["overlap"], row["all_right"]) == (1, 0.75, 0.5)
    assert row["recall_1k"] == 0.75 and row["recall_1.5k"] == 0.75 and row["recall_2k"] == 1.0


def test_bench_routing_on_the_tiny_model(tiny_workdir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    p = argparse.ArgumentParser()
    bench.configure_parser(p)
    argv = ["routing", str(tiny_workdir), "--text", str(text), "--tokens", "12", "--json"]
    runs = []
    for out in (None, tmp_path / "bench.md"):
        assert bench.main(p.parse_args(argv + (["--out", str(out)] if out else []))) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    a, b = runs
    assert a["caches"] == b["caches"] and a["guesses"] == b["guesses"]  # deterministic end to end
    L, K = a["num_layers"], a["k"]
    assert [c["share"] for c in a["caches"]][::2] == [0.02, 0.05, 0.10, 0.25, 0.50]
    assert {c["policy"] for c in a["caches"]} == {"LRU", "LFU"}
    assert a["hot_sets"] == b["hot_sets"] and [h["share"] for h in a["hot_sets"]] == [0.05, 0.10, 0.125, 0.25]
    assert all(0 <= h["hit_rate"] <= 1 for h in a["hot_sets"])
    # the trace's guesses are the engine's: its own counters agree with the per-layer overlaps
    assert a["spec_issued"] == 12 * (L - 1) * K
    assert a["spec_used"] == round(sum(g["overlap"] for g in a["guesses"]) * 12 * K)
    md = (tmp_path / "bench.md").read_text()
    assert "### Routing and cache policy" in md and "this CPU box" in md and "| 25% |" in md
    assert "| hot set (share of a layer's experts) |" in md
