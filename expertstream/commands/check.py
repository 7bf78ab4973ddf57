"""`expertstream check`: the engine's logits against transformers' qwen4_exp on the same weights.

The truth is transformers in FP32 on the snapshot's dequantized weights (expertstream/check_reference.py).
In FP32 the engine must match it within absolute bounds. In BF16 transformers also runs in BF16 on the same
prompts, and the engine passes when it is about as close to the truth as transformers' own BF16 is: its bounds
come from that measurement, in the same run. Rules and their rationale: docs/check.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from expertstream.commands import check_layers
from expertstream.commands.check_reference import (  # noqa: F401 (build_reference and friends are imported from here)
    build_reference,
    build_references,
    read_snapshot,
    reference_logits,
    reference_state_dict,
    text_config_of,
)
from expertstream.config import EngineConfig
from expertstream.experts.controls import CONTROLS
from expertstream.log import get_logger
from expertstream.runtime.engine import Engine
from expertstream.tokenizer import Tokenizer

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Thresholds:
    mean_abs: float  # bound on mean |Δlogit| over every position and vocab entry
    max_abs: float  # bound on max |Δlogit|
    tie_margin: float  # a disagreement is a near-tie when the reference's top-2 margin is below this


# FP32: absolute bounds (rationale in docs/check.md)
FP32_THRESHOLDS = Thresholds(mean_abs=1e-3, max_abs=1e-2, tie_margin=2e-2)
# BF16: the engine's mean |Δlogit| to the truth may be this multiple of transformers' BF16 one, and its argmax
# agreement with the truth this much below transformers' BF16 agreement
DISTANCE_RATIO = 1.25
AGREEMENT_SLACK = 0.01
DTYPES = ("bfloat16", "float32")
FP8_DENSE_CHOICES = ("off", "on", "both")


@dataclass(slots=True)
class Prompt:
    name: str
    ids: list[int]


def make_prompts(tokenizer, text: dict, n_random: int, long: bool, texts: list[str]) -> list[Prompt]:
    """Deterministic prompts: random ids with an eos inside (PLE segment reset), a chat text, a long one."""
    vocab = min(tokenizer.vocab_size, text["vocab_size"])
    eos = text["eos_token_id"] if isinstance(text["eos_token_id"], int) else text["eos_token_id"][0]
    gen = torch.Generator().manual_seed(1234)
    prompts = []
    for i in range(n_random):
        ids = torch.randint(0, vocab, (24 + 8 * i,), generator=gen).tolist()
        ids[len(ids) // 3] = eos
        prompts.append(Prompt(f"random-{i}", ids))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts.append(Prompt("chat", tokenizer.encode(chat)))
    prompts += [Prompt(f"text-{i}", tokenizer.encode(t)) for i, t in enumerate(texts)]
    if long:
        budget, ratio = text.get("indexer_budget"), text.get("indexer_compress_ratio")
        if not budget or not ratio:
            raise ValueError("--long needs indexer_budget and indexer_compress_ratio in the model config")
        # a query past budget + ratio - 1 visible tokens makes the indexer drop blocks; go 4 blocks further
        ids = torch.randint(0, vocab, (budget + 5 * ratio + 3,), generator=gen).tolist()
        ids[len(ids) // 2] = eos
        prompts.append(Prompt("long", ids))
    return prompts


@dataclass(slots=True)
class PromptResult:
    name: str
    tokens: int
    positions: int
    agree: int
    mean_abs: float
    max_abs: float
    ref_std: float  # standard deviation of the truth's logits
    greedy_match: int  # leading continuation positions where this side's argmax is the truth's
    greedy_len: int
    disagreements: list[dict] = field(default_factory=list)


@dataclass(slots=True)
class EnginePass:
    """An engine's logits [T + C - 1, V] over a prompt and its continuation, and its prompt pass's layer
    records (`check --layers`)."""

    logits: torch.Tensor
    layers: dict | None = None


@torch.no_grad()
def engine_pass(engine, prompt: Prompt, continuation: int, tokens: list[int] | None, rec=None):
    """The engine prefilled on the prompt (all logits), then `continuation` tokens: its own greedy choices
    when `tokens` is None, else `tokens` (teacher forcing). Returns (EnginePass, the C tokens)."""
    state = engine.new_state()
    if rec is not None:
        rec.active = True
    try:
        rows = [engine.forward(state, prompt.ids, all_logits=True).float().cpu()]
    finally:
        if rec is not None:
            rec.active = False
    cont = []
    for i in range(continuation):
        cont.append(int(rows[-1][-1].argmax()) if tokens is None else tokens[i])
        if i < continuation - 1:
            rows.append(engine.forward(state, [cont[-1]]).float().cpu()[None])
    return EnginePass(torch.cat(rows), rec.take() if rec is not None else None), cont


def measure(name: str, ours: torch.Tensor, truth: torch.Tensor, prompt_len: int) -> PromptResult:
    """One side's logits [P, V] against the truth's over the same P positions."""
    assert ours.shape == truth.shape, (ours.shape, truth.shape)
    delta = (ours - truth).abs()
    top2 = truth.topk(2, dim=-1).values
    ours_arg, truth_arg = ours.argmax(-1), truth.argmax(-1)
    disagree = (ours_arg != truth_arg).nonzero().flatten().tolist()
    greedy = (ours_arg[prompt_len - 1 :] == truth_arg[prompt_len - 1 :]).int()
    return PromptResult(
        name=name,
        tokens=prompt_len,
        positions=truth.shape[0],
        agree=truth.shape[0] - len(disagree),
        mean_abs=float(delta.mean()),
        max_abs=float(delta.max()),
        ref_std=float(truth.std()),
        greedy_match=int(greedy.cumprod(0).sum()),
        greedy_len=truth.shape[0] - prompt_len + 1,
        disagreements=[
            {
                "position": p,
                "ref_margin": float(top2[p, 0] - top2[p, 1]),
                "ours": int(ours_arg[p]),
                "ref": int(truth_arg[p]),
            }
            for p in disagree
        ],
    )


def distances(results: list[PromptResult]) -> dict:
    """Position-weighted totals over prompts: positions, argmax agreement, mean and max |Δlogit|, and the
    largest truth top-2 margin at a disagreement."""
    positions = sum(r.positions for r in results)
    return {
        "positions": positions,
        "argmax_agreement": sum(r.agree for r in results) / positions,
        "mean_abs_dlogit": sum(r.mean_abs * r.positions for r in results) / positions,
        "max_abs_dlogit": max(r.max_abs for r in results),
        "max_disagreement_margin": max(
            (d["ref_margin"] for r in results for d in r.disagreements), default=0.0
        ),
    }


def summarize(results: list[PromptResult], thresholds: Thresholds = FP32_THRESHOLDS) -> dict:
    """The FP32 verdict: absolute bounds on mean and max |Δlogit|, and every disagreement a near-tie."""
    out = distances(results)
    ties_ok = all(d["ref_margin"] < thresholds.tie_margin for r in results for d in r.disagreements)
    out["pass"] = (
        ties_ok
        and out["mean_abs_dlogit"] <= thresholds.mean_abs
        and out["max_abs_dlogit"] <= thresholds.max_abs
    )
    out["disagreements_all_near_ties"] = ties_ok
    out["thresholds"] = asdict(thresholds)
    return out


def summarize_ratio(results: list[PromptResult], reference: dict) -> dict:
    """The BF16 verdict against transformers' own BF16 (`distances` of it, same prompts and positions): mean
    |Δlogit| to the truth at most DISTANCE_RATIO times its, argmax agreement at most AGREEMENT_SLACK below."""
    out = distances(results)
    limits = {
        "mean_abs": DISTANCE_RATIO * reference["mean_abs_dlogit"],
        "argmax_agreement": reference["argmax_agreement"] - AGREEMENT_SLACK,
    }
    out["pass"] = (
        out["mean_abs_dlogit"] <= limits["mean_abs"] and out["argmax_agreement"] >= limits["argmax_agreement"]
    )
    ref_mean, ref_max = reference["mean_abs_dlogit"], reference["max_abs_dlogit"]
    out["distance_ratio"] = out["mean_abs_dlogit"] / ref_mean if ref_mean else float("inf")
    out["max_ratio"] = out["max_abs_dlogit"] / ref_max if ref_max else float("inf")
    out["thresholds"] = limits
    return out


def engine_variants(config: EngineConfig, fp8_dense: str) -> list[tuple[str, EngineConfig]]:
    """(name, config) of each engine the check runs: as the workdir stores its matrices, and with
    `--fp8-dense` also (or only) with the big DeltaNet matrices FP8 row-scaled at load."""
    if fp8_dense not in FP8_DENSE_CHOICES:
        raise ValueError(f"--fp8-dense must be one of {FP8_DENSE_CHOICES}, got {fp8_dense!r}")
    fp8 = ("engine fp8-dense", dataclasses.replace(config, fp8_dense=True))
    return {"off": [("engine", config)], "on": [fp8], "both": [("engine", config), fp8]}[fp8_dense]


def run_engines(variants, control: str, prompts: list[Prompt], continuation: int, layers: bool):
    """Every engine variant over every prompt, one engine loaded at a time: ({name: [EnginePass per prompt]},
    the continuation of each prompt). The first variant chooses the continuation (its own greedy tokens);
    the others, and the references after them, are teacher-forced on it, so all are measured at the same
    positions. The engines run first and are closed before the references load, so the two never share
    the GPU."""
    passes, conts = {}, None
    for name, cfg in variants:
        engine = Engine(cfg, control=control)
        rec = check_layers.record_engine(engine.model) if layers else None
        try:
            out = [
                engine_pass(engine, p, continuation, conts[i] if conts else None, rec)
                for i, p in enumerate(prompts)
            ]
        finally:
            if rec is not None:
                rec.close()
            engine.close()
        passes[name] = [o for o, _ in out]
        conts = conts or [c for _, c in out]
    gc.collect()  # a closed engine's VRAM goes back once its reference cycles (model <-> bank) are gone
    if torch.cuda.is_available():  # the engine's VRAM budget is a per-process allocator limit: lift it
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    return passes, conts


def run_check(
    workdir: str | Path,
    snapshot: str | Path,
    n_prompts: int = 4,
    long: bool = False,
    dtype: str = "float32",
    device: str = "cpu",
    control: str = "none",
    texts: list[str] | None = None,
    continuation: int = 16,
    prefill_piece: int | None = None,
    prefill_span: int | None = None,
    fp8_dense: str = "off",
    layers: bool = False,
    gpu_memory_gb: float | None = None,
) -> dict:
    """Compare the engine with the truth (and in BF16 with transformers' BF16); returns the report (its
    "pass" key decides the exit code)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if control not in CONTROLS:
        raise ValueError(f"--control must be one of {CONTROLS}, got {control!r}")
    if continuation < 1:
        raise ValueError(f"--continuation must be at least 1, got {continuation}")
    snapshot = Path(snapshot)
    text = text_config_of(snapshot)
    prompts = make_prompts(Tokenizer.from_dir(workdir), text, n_prompts, long, texts or [])
    # size the engine's caches to the longest prompt plus the continuation
    max_len = max(len(p.ids) for p in prompts) + continuation
    config = EngineConfig(
        model=str(workdir), device=device, dtype=dtype, max_model_len=max_len, prefill_piece=prefill_piece,
        prefill_span=prefill_span, gpu_memory_gb=gpu_memory_gb,
    )  # fmt: skip
    passes, conts = run_engines(engine_variants(config, fp8_dense), control, prompts, continuation, layers)

    # the references: the FP32 truth, and in BF16 transformers' BF16 twin, sharing one read of the snapshot
    truth, *rest = build_references(
        snapshot, [torch.float32, *([torch.bfloat16] * (dtype == "bfloat16"))], device
    )
    twin = rest[0] if rest else None
    models = {"truth": truth, **({"transformers bf16": twin} if twin is not None else {})}
    recs = {n: check_layers.record_transformers(m) for n, m in models.items()} if layers else {}
    results = {name: [] for name in [*models][1:] + [*passes]}
    layer_rows = {name: [] for name in results}
    for i, p in enumerate(prompts):
        ids = p.ids + conts[i][:-1]
        logits, records = {}, {}
        for name, model in models.items():
            if name in recs:
                recs[name].active = True
            try:
                logits[name] = reference_logits(model, ids)
            finally:
                if name in recs:
                    recs[name].active = False
                    records[name] = {k: v[: len(p.ids)] for k, v in recs[name].take().items()}
        sides = {**{n: logits[n] for n in [*models][1:]}, **{n: passes[n][i].logits for n in passes}}
        for name, ours in sides.items():
            results[name].append(measure(p.name, ours, logits["truth"], len(p.ids)))
            if layers:
                rows = records.get(name) or passes[name][i].layers
                layer_rows[name].append(
                    (len(p.ids), check_layers.compare(rows, records["truth"], text["num_experts_per_tok"]))
                )
        for name, r in results.items():
            log.info(
                "%s %s: %d tokens, argmax %d/%d, mean |dlogit| %.2e, max %.2e, greedy %d/%d", name,
                *(p.name, r[-1].tokens, r[-1].agree, r[-1].positions, r[-1].mean_abs, r[-1].max_abs),
                *(r[-1].greedy_match, r[-1].greedy_len),
            )  # fmt: skip
    for rec in recs.values():
        rec.close()

    report = dict(
        dtype=dtype, device=device, control=control, workdir=str(workdir), snapshot=str(snapshot),
        rule="ratio" if twin is not None else "absolute", continuation=continuation,
    )  # fmt: skip
    if twin is not None:
        ref = distances(results["transformers bf16"])
        report["reference"] = {**ref, "prompts": [asdict(r) for r in results["transformers bf16"]]}
    engines = []
    for name in passes:
        verdict = summarize_ratio(results[name], ref) if twin is not None else summarize(results[name])
        engines.append({"name": name, **verdict, "prompts": [asdict(r) for r in results[name]]})
    # the first engine's verdict at the top level; "pass" is every engine's
    report.update({k: v for k, v in engines[0].items() if k != "name"}, engines=engines)
    report["pass"] = all(e["pass"] for e in engines)
    if layers:
        report["layers"] = {
            name: {f"{k[0]}:{k[1]}": m for k, m in check_layers.merge(rows).items()}
            for name, rows in layer_rows.items()
        }
    return report


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="working directory made by `expertstream setup`")
    p.add_argument("--snapshot", required=True, help="the Hugging Face snapshot the workdir was made from")
    p.add_argument(
        "--prompts", type=int, default=4, help="random-token prompts (a chat prompt is always added)"
    )
    p.add_argument(
        "--long", action="store_true", help="add a prompt long enough that the indexer drops blocks"
    )
    p.add_argument("--text", action="append", default=[], help="an extra text prompt (repeatable)")
    p.add_argument(
        "--dtype", choices=DTYPES, default="float32",
        help="float32: the engine against the FP32 truth, absolute bounds; bfloat16: the engine and "
        "transformers' BF16 both against the FP32 truth, the engine's bounds from transformers' error",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="device of the engine and the references: cpu or cuda[:N]")
    p.add_argument(
        "--control", choices=CONTROLS, default="none", help="a deliberately broken engine (must fail)"
    )
    p.add_argument("--continuation", type=int, default=16, help="greedy tokens compared after each prompt")
    p.add_argument(
        "--prefill-piece", type=int, help="the engine's prompt piece (e.g. short, to check layer-major spans)"
    )
    p.add_argument("--prefill-span", type=int, help="the engine's prompt span (see `serve --help`)")
    p.add_argument("--gpu-memory-gb", type=float, help="the engine's VRAM budget (see `serve --help`)")
    p.add_argument(
        "--fp8-dense", choices=FP8_DENSE_CHOICES, default="off",
        help="the engine with the big DeltaNet matrices FP8 row-scaled at load (the 8 GiB plan's format): "
        "off, on, or both engines against the same references",
    )  # fmt: skip
    p.add_argument(
        "--layers", action="store_true",
        help="also compare every layer's intermediate results with the truth's over the prompts",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def main(args: argparse.Namespace) -> int:
    report = run_check(
        args.model,
        args.snapshot,
        n_prompts=args.prompts,
        long=args.long,
        dtype=args.dtype,
        device=args.device,
        control=args.control,
        texts=args.text,
        continuation=args.continuation,
        prefill_piece=args.prefill_piece,
        prefill_span=args.prefill_span,
        fp8_dense=args.fp8_dense,
        layers=args.layers,
        gpu_memory_gb=args.gpu_memory_gb,
    )
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["pass"] else 1


def _prompt_rows(name: str, prompts: list[dict], tie_margin: float | None, out) -> None:
    for r in prompts:
        agree = f"{r['agree']}/{r['positions']}"
        greedy = f"{r['greedy_match']}/{r['greedy_len']}"
        errors = f"{r['mean_abs']:>9.2e} {r['max_abs']:>9.2e}"
        print(f"{name:<18} {r['name']:<10} {r['tokens']:>6} {agree:>9} {errors} {greedy:>7}", file=out)
        for d in r["disagreements"]:
            tie = (
                ""
                if tie_margin is None
                else " (near-tie)"
                if d["ref_margin"] < tie_margin
                else " (NOT a near-tie)"
            )
            print(
                f"  position {d['position']}: ours {d['ours']} truth {d['ref']}, truth top-2 margin "
                f"{d['ref_margin']:.3g}{tie}",
                file=out,
            )


def print_report(report: dict, out=sys.stdout) -> None:
    cols = f"{'prompt':<10} {'tokens':>6} {'argmax':>9} {'mean|dl|':>9} {'max|dl|':>9} {'greedy':>7}"
    print(f"{'side':<18} {cols}", file=out)
    ratio = report["rule"] == "ratio"
    if ratio:
        _prompt_rows("transformers bf16", report["reference"]["prompts"], None, out)
    for e in report["engines"]:
        _prompt_rows(e["name"], e["prompts"], None if ratio else e["thresholds"]["tie_margin"], out)
    where = f"{report['dtype']} {report['device']} control={report['control']}"
    if ratio:
        r = report["reference"]
        print(
            f"{where}: transformers bf16 to the fp32 truth: argmax agreement {r['argmax_agreement']:.2%} "
            f"over {r['positions']} positions, mean |dlogit| {r['mean_abs_dlogit']:.3e}, max "
            f"{r['max_abs_dlogit']:.3e}",
            file=out,
        )
    for e in report["engines"]:
        limits, verdict = e["thresholds"], "PASS" if e["pass"] else "FAIL"
        if ratio:
            print(
                f"{where}: {e['name']} to the fp32 truth: argmax agreement {e['argmax_agreement']:.2%} (>= "
                f"{limits['argmax_agreement']:.2%}), mean |dlogit| {e['mean_abs_dlogit']:.3e} (<= "
                f"{limits['mean_abs']:.3e}, {e['distance_ratio']:.2f}x transformers bf16's), max "
                f"{e['max_abs_dlogit']:.3e} ({e['max_ratio']:.2f}x): {verdict}",
                file=out,
            )
        else:
            print(
                f"{where}: {e['name']}: argmax agreement {e['argmax_agreement']:.2%} over {e['positions']} "
                f"positions, mean |dlogit| {e['mean_abs_dlogit']:.2e} (<= {limits['mean_abs']:g}), max "
                f"{e['max_abs_dlogit']:.2e} (<= {limits['max_abs']:g}): {verdict}",
                file=out,
            )
    if "layers" in report:
        sides = {n: {tuple(_key(k)): m for k, m in v.items()} for n, v in report["layers"].items()}
        print("\n".join(check_layers.table(sides)), file=out)


def _key(k: str) -> tuple[int, str]:
    layer, op = k.split(":")
    return int(layer), op
