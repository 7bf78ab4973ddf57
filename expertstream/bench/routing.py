"""`expertstream bench routing [WORKDIR]`: real routing traced on the CPU, replayed through cache policies.

Hit rates and guess accuracy depend only on which experts the router picks, not on the hardware, so this
runs the engine on the CPU (default: the bundled demo model, a trained one; random-weight models route
uniformly and show no locality). A short prompt of the text is fed at once, then N tokens of it one at a
time (teacher forcing: the decode path on realistic text). A wrapper around the engine's bank records each
decode call's routed ids and the next-layer guess (`Speculator.guess`, the engine's own). The trace is then
replayed through `LruPolicy` and `LfuPolicy` (expertstream/store/policy.py, the code the caches run) at
several cache sizes, with the VRAM cache's constraint: the current and the previous layer's blocks stay; and
through a RAM-resident bank's hot set (`most_routed`, the bank's own choice): each layer's most-routed
experts over the trace's first half, read from VRAM in its second half.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from expertstream.experts.bank import ExpertBank
from expertstream.store.policy import Key, LfuPolicy, LruPolicy, most_routed

POLICIES: dict[str, Callable[[], LruPolicy | LfuPolicy]] = {"LRU": LruPolicy, "LFU": LfuPolicy}
SHARES = (0.02, 0.05, 0.10, 0.25, 0.50)  # cache sizes as a share of all L x E blocks
# hot sets as a share of a layer's experts (12.5 %: the real model's at 24 GiB)
HOT_SHARES = (0.05, 0.10, 0.125, 0.25)
PROMPT = 16  # tokens fed as one prompt before tracing starts
# the full model, for the labelled extrapolation only: 48 MoE layers, top-10, 2,764,800-byte blocks
REAL_LAYERS, REAL_K, REAL_BLOCK_BYTES = 48, 10, 2_764_800


@dataclass(slots=True)
class Trace:
    num_layers: int
    num_experts: int
    k: int
    routed: list[list[list[int]]]  # [token][layer] -> the K routed expert ids
    guessed: list[list[list[int]]]  # [token][layer] -> layer + 1's top-2K by its router, best first ([] last)


class RoutingRecorder(ExpertBank):
    """Wraps a bank; records each decode call's routed ids and the next-layer guess, then delegates (an
    eager bank: each decode call is one host stage)."""

    def __init__(self, bank, spec):
        self.bank, self.spec = bank, spec
        self.calls: list[tuple[int, list[int], list[int]]] = []  # (layer, routed, guess for layer + 1)

    def __call__(self, layer, x, expert_ids, weights):
        if x.shape[0] == 1:
            # x [1, H], expert_ids [1, K]: the bank's guess on the same input, twice as wide (its first K are
            # the bank's own, topk being sorted), to see what wider guesses would catch
            guess = self.spec.guess(layer, x, 2 * expert_ids.shape[1])
            self.calls.append((layer, expert_ids[0].tolist(), [] if guess is None else guess.tolist()))
        return self.bank(layer, x, expert_ids, weights)


def record(workdir: str, text: str, tokens: int) -> tuple[Trace, dict]:
    """Teacher-force `tokens` tokens of `text` after a PROMPT-token prompt; returns the trace and the
    engine's own guess counters (spec_issued, spec_used) over the traced tokens."""
    from expertstream.config import EngineConfig
    from expertstream.runtime.engine import Engine

    engine = Engine(
        EngineConfig(model=workdir, device="cpu", dtype="float32", max_model_len=PROMPT + tokens + 1)
    )
    try:
        ids = engine.tokenizer.encode(text)
        if len(ids) < PROMPT + tokens:
            raise SystemExit(f"the text has {len(ids)} tokens; --tokens {tokens} needs {PROMPT + tokens}")
        if engine.bank.spec is None or not engine.bank.spec.routers:
            raise SystemExit("bench routing needs the engine's next-layer guess (a bank with speculation)")
        recorder = RoutingRecorder(engine.bank, engine.bank.spec)
        for layer in engine.model.layers:
            layer.mlp.bank = recorder
        state = engine.new_state()
        engine.forward(state, ids[:PROMPT])
        before = engine.stats()
        for t in ids[PROMPT : PROMPT + tokens]:
            engine.forward(state, [t])
        after = engine.stats()
    finally:
        engine.close()
    L, E, K = engine.args.num_hidden_layers, engine.args.num_experts, engine.args.num_experts_per_tok
    assert len(recorder.calls) == tokens * L, "one decode bank call per layer per token"
    routed = [[recorder.calls[t * L + i][1] for i in range(L)] for t in range(tokens)]
    guessed = [[recorder.calls[t * L + i][2] for i in range(L)] for t in range(tokens)]
    counters = {
        "spec_issued": after.spec_issued - before.spec_issued,
        "spec_used": after.spec_used - before.spec_used,
    }
    return Trace(L, E, K, routed, guessed), counters


def replay(trace: Trace, policy: Callable[[], LruPolicy | LfuPolicy], capacity: int) -> dict:
    """Demand accesses of the trace through a `capacity`-block cache ordered by `policy`.

    Like `VramExpertCache.fetch`: a layer's hits are touched first, then its misses take slots; the current
    and the previous layer's blocks are never evicted.
    """
    if capacity < 2 * trace.k:
        raise ValueError(f"a cache of {capacity} blocks cannot hold two layers of {trace.k} experts")
    order, hits, requests = policy(), 0, 0
    previous: set[Key] = set()
    for token in trace.routed:
        for layer, experts in enumerate(token):
            keys = [(layer, e) for e in sorted(set(experts))]
            keep = previous | set(keys)
            for key in keys:
                requests += 1
                if key in order:
                    hits += 1
                    order.access(key)
            for key in keys:
                if key in order:
                    continue
                if len(order) >= capacity:
                    order.remove(next(v for v in order.victims() if v not in keep))
                order.access(key)
            previous = set(keys)
    tokens = len(trace.routed)
    return {"hit_rate": hits / requests, "misses_per_token": (requests - hits) / tokens}


def hot_set_rates(trace: Trace) -> list[dict]:
    """A fixed hot set per layer, as a RAM-resident bank keeps one: the `most_routed` q of the layer's E
    experts by the routing of the trace's first half (the bank counts what it has seen), and the share of
    the second half's routed blocks found in it, against q / E for routing with no preference."""
    half = len(trace.routed) // 2
    counts = np.zeros((trace.num_layers, trace.num_experts), dtype=np.int64)
    for token in trace.routed[:half]:
        for layer, experts in enumerate(token):
            counts[layer, experts] += 1
    rows = []
    for share in HOT_SHARES:
        q = max(1, round(share * trace.num_experts))
        hot = [set(most_routed(counts[layer], q).tolist()) for layer in range(trace.num_layers)]
        found = sum(len(hot[layer] & set(experts)) for token in trace.routed[half:] for layer, experts in
                    enumerate(token))  # fmt: skip
        routed = (len(trace.routed) - half) * trace.num_layers * trace.k
        rows.append(
            {"share": share, "per_layer": q, "hit_rate": found / routed, "uniform": q / trace.num_experts}
        )
    return rows


GUESS_WIDTHS = (1.0, 1.5, 2.0)  # guess sizes as multiples of K: the engine guesses K


def guess_accuracy(trace: Trace) -> list[dict]:
    """Per guessed layer (1..L-1): the share of the layer's K routed experts found among its router's top
    w*K guesses (w in GUESS_WIDTHS; at w = 1 this is the engine's used / issued), and how often all K were
    among the top K."""
    rows = []
    for layer in range(1, trace.num_layers):
        row: dict = {"layer": layer}
        pairs = list(zip(trace.guessed, trace.routed))
        for w in GUESS_WIDTHS:
            n = round(w * trace.k)
            found = [len(set(tok[layer - 1][:n]) & set(routed[layer])) for tok, routed in pairs]
            row[f"recall_{w:g}k"] = sum(found) / (trace.k * len(found))
            if w == 1.0:
                row["overlap"] = row[f"recall_{w:g}k"]
                row["all_right"] = sum(f == trace.k for f in found) / len(found)
        rows.append(row)
    return rows


def measure(trace: Trace, block_bytes: int) -> list[dict]:
    blocks = trace.num_layers * trace.num_experts
    rows = []
    for share in SHARES:
        capacity = max(2 * trace.k, round(share * blocks))
        for name, policy in POLICIES.items():
            r = replay(trace, policy, capacity)
            miss_rate = 1 - r["hit_rate"]
            rows.append(
                {
                    "share": share,
                    "blocks": capacity,
                    "policy": name,
                    "hit_rate": r["hit_rate"],
                    "blocks_per_token": r["misses_per_token"],
                    "bytes_per_token": r["misses_per_token"] * block_bytes,
                    # assumes the full model keeps the same miss rate at the same cache share
                    "extrapolated_bytes_per_token": miss_rate * REAL_LAYERS * REAL_K * REAL_BLOCK_BYTES,
                }
            )
    return rows


def tables(
    trace: Trace,
    caches: list[dict],
    hot_sets: list[dict],
    guesses: list[dict],
    counters: dict,
    block_bytes: int,
) -> str:
    L, E, K = trace.num_layers, trace.num_experts, trace.k
    lines = [
        f"Routing of {len(trace.routed)} teacher-forced decode tokens, {L} layers x {E} experts, top-{K} "
        f"({block_bytes:,} B blocks, {L * E} blocks in all). Replay: demand accesses only (no early "
        "copies), the current and the previous layer's blocks never evicted.",
        "",
        "| cache share | blocks | policy | hit rate | blocks moved/token | KB/token (this model) "
        "| MB/token x48 layers top-10 (extrapolated) |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in caches:
        lines.append(
            f"| {r['share']:.0%} | {r['blocks']} | {r['policy']} | {r['hit_rate']:.1%} "
            f"| {r['blocks_per_token']:.2f} | {r['bytes_per_token'] / 1e3:.1f} "
            f"| {r['extrapolated_bytes_per_token'] / 1e6:.0f} |"
        )
    lines += [
        "",
        "Extrapolated column: this model's miss rate x 48 layers x 10 experts x 2,764,800 B, assuming the "
        "full model misses as often at the same cache share (not measured).",
        "",
        "| hot set (share of a layer's experts) | experts a layer | routed blocks found in it | with no "
        "preference |",
        "|---:|---:|---:|---:|",
        *(
            f"| {h['share']:.1%} | {h['per_layer']} | {h['hit_rate']:.1%} | {h['uniform']:.1%} |"
            for h in hot_sets
        ),
        "",
        "Hot set: each layer's most-routed experts over the first half of the trace, and the second half's "
        "routed blocks found there (what a RAM-resident bank reads from VRAM instead of over the bus).",
        "",
        "| guessed layer | overlap with the real top-k (used / issued) | all K right "
        + "".join(f"| routed found in top {w:g}K " for w in GUESS_WIDTHS[1:])
        + "|",
        "|---:|---:|---:|" + "---:|" * (len(GUESS_WIDTHS) - 1),
    ]
    for g in guesses:
        wider = "".join(f"| {g[f'recall_{w:g}k']:.1%} " for w in GUESS_WIDTHS[1:])
        lines.append(f"| {g['layer']} | {g['overlap']:.1%} | {g['all_right']:.1%} {wider}|")
    issued, used = counters["spec_issued"], counters["spec_used"]
    mean = {w: sum(g[f"recall_{w:g}k"] for g in guesses) / max(1, len(guesses)) for w in GUESS_WIDTHS[1:]}
    lines += [
        f"| all | {used / issued if issued else 0:.1%} | - "
        + "".join(f"| {mean[w]:.1%} " for w in GUESS_WIDTHS[1:])
        + "|",
        "",
        f"Engine counters over the same tokens: spec_issued {issued}, spec_used {used} "
        f"(used fraction {used / issued if issued else 0:.1%}).",
    ]
    return "\n".join(lines) + "\n"


def default_text(workdir: str) -> Path:
    from expertstream.workdir.workdir import Workdir

    path = Path(Workdir(workdir).manifest["source"]["snapshot"]) / "heldout.txt"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass --text FILE")
    return path


def run(args: argparse.Namespace) -> int:
    from expertstream.bench.cli import emit
    from expertstream.default_model import resolve_model
    from expertstream.workdir.workdir import Workdir

    workdir = resolve_model(args.model)
    text_path = args.text or default_text(workdir)
    t0 = time.perf_counter()
    trace, counters = record(workdir, text_path.read_text(encoding="utf-8"), args.tokens)
    block_bytes = Workdir(workdir).layout.block_bytes
    caches, hot_sets, guesses = measure(trace, block_bytes), hot_set_rates(trace), guess_accuracy(trace)
    table = tables(trace, caches, hot_sets, guesses, counters, block_bytes)
    payload = {
        "workdir": workdir,
        "text": str(text_path),
        "tokens": args.tokens,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "k": trace.k,
        "block_bytes": block_bytes,
        "caches": caches,
        "hot_sets": hot_sets,
        "guesses": guesses,
        **counters,
        "seconds": time.perf_counter() - t0,
    }
    emit(args, "Routing and cache policy", "this CPU box", table, payload)
    return 0
