"""`expertstream check`: the engine's logits against transformers' qwen4_exp on the same weights.

The reference reads the snapshot's safetensors directly (safe_open), dequantizes NVFP4 experts and the FP8
PLE table with our codecs, and loads them into `Qwen4ExpForCausalLM`; none of the engine's readers (Workdir,
ExpertStore, PLE reader) are involved, so a reader or repack bug shows up as a logit difference.
Thresholds and their rationale: docs/check.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from expertstream.config import EngineConfig
from expertstream.experts.cpu_bank import CONTROLS
from expertstream.formats import nvfp4
from expertstream.formats.expert_block import PROJ
from expertstream.formats.fp8 import e4m3_to_float
from expertstream.log import get_logger
from expertstream.runtime.engine import Engine
from expertstream.tokenizer import Tokenizer

log = get_logger(__name__)

PREFIX = "model.language_model."
EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
PLE_SHARD_RE = re.compile(r"^(layers\.\d+\.ple\.ple_embedding\.ngram_embedding)\.shard_(\d+)\.weight$")
# the final mixer is built without injection in transformers; an exported `block_inject_weight` is unused
UNUSED_RE = re.compile(r"^hyper_connection_mixer\.block_inject_weight\.weight$")
# tensors the text model does not have: MTP head and vision tower
SKIP_RE = re.compile(r"^(mtp\.|model\.visual\.)")


@dataclass(frozen=True, slots=True)
class Thresholds:
    mean_abs: float  # bound on mean |Δlogit| over every position and vocab entry
    max_abs: float  # bound on max |Δlogit|
    tie_margin: float  # a disagreement is a near-tie when the reference's top-2 margin is below this
    relative: bool  # bounds are in units of the reference logits' standard deviation

    def scaled(self, logit_std: float) -> Thresholds:
        s = logit_std if self.relative else 1.0
        return Thresholds(self.mean_abs * s, self.max_abs * s, self.tie_margin * s, relative=False)


# rationale in docs/check.md
THRESHOLDS = {
    "float32": Thresholds(mean_abs=1e-3, max_abs=1e-2, tie_margin=2e-2, relative=False),
    "bfloat16": Thresholds(mean_abs=0.03, max_abs=1.0, tie_margin=0.1, relative=True),
}


def text_config_of(snapshot: Path) -> dict:
    with open(snapshot / "config.json") as f:
        config = json.load(f)
    text = dict(config.get("text_config", config))
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return text


def _snapshot_files(snapshot: Path) -> list[Path]:
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [snapshot / n for n in names]
    files = sorted(snapshot.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files (and no model.safetensors.index.json) in {snapshot}")
    return files


def reference_state_dict(snapshot: Path, text: dict, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The text weights under `Qwen4ExpForCausalLM` names, experts and PLE dequantized to FP32 on `device`
    (a GPU dequantizes a full-shape layer's 512 experts in a blink; the CPU takes tens of seconds)."""
    num_layers, num_experts = text["num_hidden_layers"], text["num_experts"]
    experts: dict[tuple[int, int, str, str], torch.Tensor] = {}
    ple_shards: dict[str, dict[int, torch.Tensor]] = {}
    ple_scales: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for path in _snapshot_files(snapshot):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if SKIP_RE.match(name):
                    continue
                if not name.startswith(PREFIX):
                    if name != "lm_head.weight":
                        raise ValueError(f"{path.name}: unexpected tensor {name} outside {PREFIX}")
                    out[name] = f.get_tensor(name)
                    continue
                short = name[len(PREFIX) :]
                if m := EXPERT_RE.match(short):
                    experts[(int(m[1]), int(m[2]), m[3], m[4])] = f.get_tensor(name)
                elif m := PLE_SHARD_RE.match(short):
                    ple_shards.setdefault(m[1], {})[int(m[2])] = f.get_tensor(name)
                elif short.endswith("ngram_embedding.weight_scale"):
                    ple_scales[short.rsplit(".", 1)[0]] = f.get_tensor(name)
                elif not UNUSED_RE.match(short):
                    out["model." + short] = f.get_tensor(name)

    for name, t in out.items():
        out[name] = t.to(device).float() if t.is_floating_point() else t.to(device)
    # experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
    for layer in range(num_layers):
        gate_up, down = [], []
        for e in range(num_experts):
            w = {}
            for proj in PROJ:
                parts = [
                    experts.get((layer, e, proj, k)) for k in ("weight", "weight_scale", "weight_scale_2")
                ]
                if any(p is None for p in parts):
                    raise ValueError(
                        f"{snapshot}: expert tensors of layer {layer} expert {e} {proj} are missing"
                    )
                w[proj] = nvfp4.dequantize(*(t.to(device) for t in parts), dtype=torch.float32)
            gate_up.append(torch.cat([w["gate_proj"], w["up_proj"]], dim=0))
            down.append(w["down_proj"])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(down)
    # PLE: row = fp8 * one bf16 scale; shards concatenated in shard order
    for module, shards in ple_shards.items():
        if module not in ple_scales:
            raise ValueError(f"{snapshot}: {PREFIX}{module}.weight_scale is missing")
        if sorted(shards) != list(range(len(shards))):
            raise ValueError(
                f"{snapshot}: {PREFIX}{module} shards are not 0..{len(shards) - 1}: {sorted(shards)}"
            )
        table = torch.cat([shards[i] for i in range(len(shards))]).to(device)
        out[f"model.{module}.weight"] = e4m3_to_float(table) * ple_scales[module].to(device).float()
    return out


def build_reference(snapshot: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' `Qwen4ExpForCausalLM` holding the snapshot's weights (experts and PLE dequantized).

    Args:
        snapshot: directory of a Hugging Face snapshot in NVIDIA's NVFP4 export layout.
        dtype: dtype of the reference weights and activations.
        device: where the reference runs.

    Returns:
        The model in eval mode.
    """
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    snapshot = Path(snapshot)
    text = text_config_of(snapshot)
    # transformers accepts full_attention / indexed_attention; qwen_sparse_attention is the pre-5.18 name
    text["layer_types"] = [
        "full_attention" if t == "qwen_sparse_attention" else t for t in text.get("layer_types") or []
    ] or None
    config = Qwen4ExpTextConfig(**text)
    config._attn_implementation = "eager"
    state = reference_state_dict(snapshot, text, device)
    try:  # every weight is loaded next: skip the random initialisation (minutes for a full-shape model)
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = Qwen4ExpForCausalLM(config)
    # assign: the model takes the dequantized tensors as they are, no second copy of every weight
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"{snapshot}: reference weights do not match; missing {missing}, unexpected {unexpected}"
        )
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] float32 of a full no-cache forward."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    return model(input_ids=x, use_cache=False).logits[0].float().cpu()


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
    ref_std: float  # standard deviation of the reference logits
    greedy_match: int  # leading continuation tokens the engine's greedy choice agrees on
    greedy_len: int
    disagreements: list[dict] = field(default_factory=list)


@torch.no_grad()
def compare_prompt(engine, reference, prompt: Prompt, continuation: int) -> PromptResult:
    """Reference greedy rollout, then the engine prefilled on the prompt and teacher-forced on the rollout."""
    ids = list(prompt.ids)
    for _ in range(continuation - 1):
        ids.append(int(reference_logits(reference, ids)[-1].argmax()))
    ref = reference_logits(reference, ids)  # [T + C - 1, V]
    cont = ids[len(prompt.ids) :] + [int(ref[-1].argmax())]  # the C reference greedy tokens

    state = engine.new_state()
    rows = [engine.forward(state, prompt.ids, all_logits=True).float().cpu()]
    for tok in cont[:-1]:
        rows.append(engine.forward(state, [tok]).float().cpu()[None])
    ours = torch.cat(rows)  # [T + C - 1, V]
    assert ours.shape == ref.shape, (ours.shape, ref.shape)

    delta = (ours - ref).abs()
    ref_top2 = ref.topk(2, dim=-1).values
    ours_arg, ref_arg = ours.argmax(-1), ref.argmax(-1)
    disagree = (ours_arg != ref_arg).nonzero().flatten().tolist()
    greedy = (ours_arg[len(prompt.ids) - 1 :] == torch.tensor(cont)).int()
    return PromptResult(
        name=prompt.name,
        tokens=len(prompt.ids),
        positions=ref.shape[0],
        agree=ref.shape[0] - len(disagree),
        mean_abs=float(delta.mean()),
        max_abs=float(delta.max()),
        ref_std=float(ref.std()),
        greedy_match=int(greedy.cumprod(0).sum()),
        greedy_len=len(cont),
        disagreements=[
            {
                "position": p,
                "ref_margin": float(ref_top2[p, 0] - ref_top2[p, 1]),
                "ours": int(ours_arg[p]),
                "ref": int(ref_arg[p]),
            }
            for p in disagree
        ],
    )


def summarize(results: list[PromptResult], thresholds: Thresholds) -> dict:
    positions = sum(r.positions for r in results)
    limits = thresholds.scaled(sum(r.ref_std * r.positions for r in results) / positions)
    mean_abs = sum(r.mean_abs * r.positions for r in results) / positions
    max_abs = max(r.max_abs for r in results)
    ties_ok = all(d["ref_margin"] < limits.tie_margin for r in results for d in r.disagreements)
    passed = ties_ok and mean_abs <= limits.mean_abs and max_abs <= limits.max_abs
    return {
        "pass": passed,
        "positions": positions,
        "argmax_agreement": sum(r.agree for r in results) / positions,
        "mean_abs_dlogit": mean_abs,
        "max_abs_dlogit": max_abs,
        "disagreements_all_near_ties": ties_ok,
        "thresholds": asdict(limits),
    }


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
) -> dict:
    """Compare engine and reference; returns the report (its "pass" key decides the exit code)."""
    if dtype not in THRESHOLDS:
        raise ValueError(f"--dtype must be one of {sorted(THRESHOLDS)}, got {dtype!r}")
    if control not in CONTROLS:
        raise ValueError(f"--control must be one of {CONTROLS}, got {control!r}")
    if continuation < 1:
        raise ValueError(f"--continuation must be at least 1, got {continuation}")
    snapshot = Path(snapshot)
    text = text_config_of(snapshot)
    reference = build_reference(snapshot, getattr(torch, dtype), device)
    prompts = make_prompts(Tokenizer.from_dir(workdir), text, n_prompts, long, texts or [])
    # size the engine's caches to the longest prompt plus the rollout
    max_len = max(len(p.ids) for p in prompts) + continuation
    config = EngineConfig(
        model=str(workdir), device=device, dtype=dtype, max_model_len=max_len, prefill_piece=prefill_piece,
        prefill_span=prefill_span,
    )  # fmt: skip
    engine = Engine(config, control=control)
    try:
        results = [compare_prompt(engine, reference, p, continuation) for p in prompts]
    finally:
        engine.close()
    for r in results:
        log.info(
            "%s: %d tokens, argmax %d/%d, mean |dlogit| %.2e, max %.2e, greedy %d/%d",
            *(r.name, r.tokens, r.agree, r.positions, r.mean_abs, r.max_abs, r.greedy_match, r.greedy_len),
        )
    report = summarize(results, THRESHOLDS[dtype])
    report.update(
        dtype=dtype,
        device=device,
        control=control,
        workdir=str(workdir),
        snapshot=str(snapshot),
        prompts=[asdict(r) for r in results],
    )
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
    p.add_argument("--dtype", choices=sorted(THRESHOLDS), default="float32", help="dtype of both models")
    p.add_argument("--device", default="cpu", help="device of both models: cpu or cuda[:N]")
    p.add_argument(
        "--control", choices=CONTROLS, default="none", help="a deliberately broken engine (must fail)"
    )
    p.add_argument("--continuation", type=int, default=16, help="greedy tokens compared after each prompt")
    p.add_argument(
        "--prefill-piece", type=int, help="the engine's prompt piece (e.g. short, to check layer-major spans)"
    )
    p.add_argument("--prefill-span", type=int, help="the engine's prompt span (see `serve --help`)")
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
    )
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["pass"] else 1


def print_report(report: dict, out=sys.stdout) -> None:
    limits = report["thresholds"]
    print(
        f"{'prompt':<10} {'tokens':>6} {'argmax':>9} {'mean|dl|':>9} {'max|dl|':>9} {'greedy':>7}", file=out
    )
    for r in report["prompts"]:
        agree = f"{r['agree']}/{r['positions']}"
        greedy = f"{r['greedy_match']}/{r['greedy_len']}"
        errors = f"{r['mean_abs']:>9.2e} {r['max_abs']:>9.2e}"
        print(f"{r['name']:<10} {r['tokens']:>6} {agree:>9} {errors} {greedy:>7}", file=out)
        for d in r["disagreements"]:
            tie = "near-tie" if d["ref_margin"] < limits["tie_margin"] else "NOT a near-tie"
            print(
                f"  position {d['position']}: ours {d['ours']} ref {d['ref']}, ref top-2 margin "
                f"{d['ref_margin']:.3g} ({tie})",
                file=out,
            )
    print(
        f"{report['dtype']} {report['device']} control={report['control']}: argmax agreement "
        f"{report['argmax_agreement']:.2%} over {report['positions']} positions, mean |dlogit| "
        f"{report['mean_abs_dlogit']:.2e} (<= {limits['mean_abs']:g}), max {report['max_abs_dlogit']:.2e} "
        f"(<= {limits['max_abs']:g}): {'PASS' if report['pass'] else 'FAIL'}",
        file=out,
    )
