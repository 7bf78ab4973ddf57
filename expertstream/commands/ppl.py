"""`expertstream ppl WORKDIR --text FILE`: perplexity of the engine, optionally of transformers beside it.

A text longer than the context is scored with a sliding window: windows of max_model_len tokens, starting
every `stride` tokens; each token is scored once, in the first window that predicts it with the most context
(the Hugging Face perplexity recipe). Every window starts from a fresh state.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from expertstream.config import EngineConfig
from expertstream.default_model import resolve_model
from expertstream.experts.controls import CONTROLS
from expertstream.log import get_logger

log = get_logger(__name__)

# engine logits are taken this many positions at a time, so [T, V] never exists for a long window
CHUNK = 512


@dataclass(slots=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood, nats per token
    scored: int  # tokens scored (all but the first)
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.scored / max(self.seconds, 1e-9)


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) per window over n tokens; positions 1..n-1 are scored once."""
    # stride < window: each window's first token is context for the token after it, so nothing goes unscored
    if window < 2 or not 0 < stride < window:
        raise ValueError(f"need window >= 2 and 0 < stride < window, got window {window}, stride {stride}")
    out, scored_to, begin = [], 1, 0
    while scored_to < n:
        end = min(begin + window, n)
        out.append((begin, end, scored_to))
        scored_to, begin = end, begin + stride
    return out


def nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of -log p(target) over rows: logits [R, V], targets [R]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -float(logp.gather(-1, targets[:, None].to(logp.device)).sum())


def _result(total: float, scored: int, seconds: float) -> Perplexity:
    return Perplexity(ppl=math.exp(total / scored), nll=total / scored, scored=scored, seconds=seconds)


@torch.no_grad()
def engine_perplexity(engine, ids: list[int], window: int, stride: int) -> Perplexity:
    """Perplexity of the engine; each window is fed in CHUNK-token pieces with all logits."""
    t0, total, scored = time.perf_counter(), 0.0, 0
    for begin, end, first in windows(len(ids), window, stride):
        state = engine.new_state()
        for start in range(begin, end - 1, CHUNK):
            stop = min(start + CHUNK, end - 1)
            # row r of the logits predicts ids[start + r + 1]
            logits = engine.forward(state, ids[start:stop], all_logits=True)
            lo = max(first - 1, start)  # rows before the first scored target only build context
            if lo < stop:
                total += nll_sum(logits[lo - start :], torch.tensor(ids[lo + 1 : stop + 1]))
                scored += stop - lo
    return _result(total, scored, time.perf_counter() - t0)


@torch.no_grad()
def reference_perplexity(model, ids: list[int], window: int, stride: int) -> Perplexity:
    """Perplexity of transformers' model (`check.build_reference`) on the same windows, one forward each."""
    from expertstream.commands.check import reference_logits

    t0, total, scored = time.perf_counter(), 0.0, 0
    for begin, end, first in windows(len(ids), window, stride):
        logits = reference_logits(model, ids[begin:end])  # [end - begin, V]
        total += nll_sum(logits[first - 1 - begin : end - 1 - begin], torch.tensor(ids[first:end]))
        scored += end - first
    return _result(total, scored, time.perf_counter() - t0)


def run_ppl(
    config: EngineConfig,
    text: str,
    control: str = "none",
    stride: int | None = None,
    reference: str | None = None,
) -> dict:
    """Engine (and optionally reference) perplexity of a text; returns the report."""
    from expertstream.runtime.engine import Engine

    if control not in CONTROLS:
        raise ValueError(f"--control must be one of {CONTROLS}, got {control!r}")
    engine = Engine(config, control=control)
    try:
        ids = engine.tokenizer.encode(text)
        if len(ids) < 2:
            raise ValueError(f"the text has {len(ids)} tokens; perplexity needs at least 2")
        window = engine.config.max_model_len  # the engine may clamp it to max_position_embeddings
        stride = stride or max(1, window // 2)
        ours = engine_perplexity(engine, ids, window, stride)
    finally:
        engine.close()
    log.info("engine: ppl %.4f over %d tokens, %.1f tok/s", ours.ppl, ours.scored, ours.tokens_per_s)
    report = {
        "workdir": config.model,
        "control": control,
        "tokens": len(ids),
        "window": window,
        "stride": stride,
        "engine": {**asdict(ours), "tokens_per_s": ours.tokens_per_s},
    }
    if reference:
        from expertstream.commands.check_reference import build_references

        ref = reference_perplexity(build_references(reference, [torch.float32])[0], ids, window, stride)
        log.info("reference: ppl %.4f, %.1f tok/s", ref.ppl, ref.tokens_per_s)
        report["reference"] = {**asdict(ref), "tokens_per_s": ref.tokens_per_s, "snapshot": str(reference)}
        report["ppl_ratio"] = ours.ppl / ref.ppl
    return report


def configure_parser(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)  # --max-model-len is the window
    p.add_argument("--text", required=True, type=Path, help="UTF-8 text file to score")
    p.add_argument("--stride", type=int, default=None, help="window start spacing (default: half the window)")
    p.add_argument("--control", choices=CONTROLS, default="none", help="a deliberately broken engine")
    p.add_argument("--reference", default=None, help="snapshot: also score with transformers (FP32, CPU)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def main(args: argparse.Namespace) -> int:
    args.model = resolve_model(args.model)
    report = run_ppl(
        EngineConfig.from_args(args), args.text.read_text(), args.control, args.stride, args.reference
    )
    if args.json:
        print(json.dumps(report))
        return 0
    for name, key in ((f"engine ({args.control})", "engine"), ("transformers", "reference")):
        if key in report:
            r = report[key]
            print(f"{name}: ppl {r['ppl']:.4f} over {r['scored']} tokens, {r['tokens_per_s']:.1f} tok/s")
    if "ppl_ratio" in report:
        print(f"engine / transformers ppl: {report['ppl_ratio']:.5f}")
    return 0
