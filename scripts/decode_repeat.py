"""Is decode deterministic in each regime? (device only) The bench model's prompt and greedy tokens, run
--reps times from a new state in each regime, with every step's logits kept: a regime whose repetitions are
not bit-identical has a race (timing decides a result). Across regimes the logits differ by rounding (the
kernels' configs differ by where blocks live), so those are compared by max |dlogit| and first greedy
difference with the first regime's top-2 margin there.
Usage on a lent GPU: python3 scripts/decode_repeat.py [vram ram ...] [--reps 4] [--tokens 24]
"""

import argparse

import torch

from expertstream.bench.runtime import script_regimes, warm_caches
from expertstream.runtime.engine import Engine

p = argparse.ArgumentParser()
p.add_argument("regimes", nargs="*", default=["vram", "ram", "ram_unstaged"])
p.add_argument("--layers", type=int, default=4)
p.add_argument("--reps", type=int, default=4)
p.add_argument("--tokens", type=int, default=24)
args = p.parse_args()

regimes = script_regimes(args.layers)


def run(eng: Engine) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after the bench's prompt and every step's logits [steps, V] (FP32, on the host)."""
    state, ids, rows = eng.new_state(), list(range(1, 17)), []
    toks = []
    for _ in range(args.tokens + 1):
        logits = eng.forward(state, ids).reshape(-1).float()
        rows.append(logits.cpu())
        ids = [int(logits.argmax())]
        toks.append(ids[0])
    return toks, torch.stack(rows)


first = None
for name in args.regimes:
    cfg, blocks = regimes[name]
    eng = Engine(cfg, vram_cache_blocks=blocks)
    warm_caches(eng, vram=blocks >= eng.workdir.num_layers * eng.workdir.num_experts)
    reps = [run(eng) for _ in range(args.reps)]
    eng.close()
    toks, logits = reps[0]
    same = [torch.equal(r[1], logits) for r in reps[1:]]
    spread = max((r[1] - logits).abs().max().item() for r in reps[1:]) if reps[1:] else 0.0
    print(f"{name}: {args.reps} runs of {len(toks)} steps, bit-identical to the first: {same}, "
          f"max |dlogit| between runs {spread:.3g}", flush=True)  # fmt: skip
    if first is None:
        first = (name, toks, logits)
        continue
    fname, ftoks, flogits = first
    n = min(len(toks), len(ftoks))
    at = next((i for i in range(n) if toks[i] != ftoks[i]), None)
    upto = n if at is None else at + 1  # logits compare only while the contexts are the same
    dl = (logits[:upto] - flogits[:upto]).abs().max().item()
    top2 = flogits[at].topk(2).values if at is not None else None
    where = "same greedy tokens" if at is None else (
        f"tokens part at step {at} ({fname} top-2 margin {(top2[0] - top2[1]).item():.3g})"
    )  # fmt: skip
    print(f"  against {fname}: {where}; max |dlogit| while the contexts agree {dl:.3g}", flush=True)
