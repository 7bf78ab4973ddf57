#!/usr/bin/env bash
# The sweep that picked the demo model's shape (one device run): train candidates side by side on one GPU, score
# each with `expertstream ppl` and both controls on the held-out text, keep the best whose controls are >= 5x
# worse. Needs .whl/ (transformers wheel) and .corpus/kjv.txt carried; writes logs, sweep.json and the winner's
# snapshot (tar parts) under $OUT. Usage: MINUTES=5 scripts/demo_sweep.sh "ARGS A" "ARGS B" ...
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
i=0
for args in "$@"; do
  python3 scripts/train_demo.py --corpus .corpus/kjv.txt --out /tmp/cand$i --minutes "${MINUTES:-5}" $args \
    >$OUT/train$i.log 2>&1 &
  i=$((i + 1))
done
[ -n "${DURING:-}" ] && bash -c "$DURING" >$OUT/during.log 2>&1
wait
for j in $(seq 0 $((i - 1))); do
  (
    python3 -m expertstream setup /tmp/cand$j /tmp/wd$j >/dev/null 2>&1 || exit 1
    for c in none swap-nibbles no-experts; do
      python3 -m expertstream ppl /tmp/wd$j --text /tmp/cand$j/heldout.txt --max-model-len 512 --control $c --device cpu \
        --json 2>/dev/null | tail -1 >/tmp/ppl$j-$c.json
    done
  ) &
done
wait
python3 - "$OUT" "$@" <<'PY'
import json, sys, subprocess
out, runs = sys.argv[1], []
for j, args in enumerate(sys.argv[2:]):
    try:
        p = {c: json.load(open(f"/tmp/ppl{j}-{c}.json"))["engine"]["ppl"] for c in ("none", "swap-nibbles", "no-experts")}
    except Exception as e:
        print(j, args, "failed", e); continue
    card = json.load(open(f"/tmp/cand{j}/model_card.json"))
    worst = min(p["swap-nibbles"], p["no-experts"]) / p["none"]
    runs.append(dict(cand=j, args=args, ppl=p, control_ratio=worst, card=card))
    print(f"cand{j} [{args}] ppl {p['none']:.2f} swap {p['swap-nibbles']:.1f} no-experts {p['no-experts']:.1f} "
          f"ratio {worst:.2f} steps {card['steps']} best {card['best_step']}")
ok = [r for r in runs if r["control_ratio"] >= 5]
best = min(ok, key=lambda r: r["ppl"]["none"]) if ok else max(runs, key=lambda r: r["control_ratio"])
print("chosen", best["cand"], best["args"])
json.dump(dict(runs=runs, chosen=best["cand"]), open(f"{out}/sweep.json", "w"), indent=1)
subprocess.run(f"tar -C /tmp -cf - cand{best['cand']} | split -b 15m - {out}/demo.tar.part-", shell=True, check=True)
PY
