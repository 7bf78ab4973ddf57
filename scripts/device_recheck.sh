#!/usr/bin/env bash
# Device run 2 of 2 for the GPU runtime (issue 5): `check` of a 4-layer full-shape model with the engine on
# CUDA (bf16), the prefill bench (vram / ram / disk regimes, 2,451 and 32,768 tokens), and the transformers +
# accelerate baseline beside the prefill. Needs .whl/ carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/expertstream-bench
python3 -c "from pathlib import Path; from expertstream.bench.model import ensure_model; ensure_model(Path('$W'), 4)" \
  >/dev/null 2>&1
timeout ${CHECK_S:-200} python3 -m expertstream check $W/full-4-wd --snapshot $W/full-4 --dtype bfloat16 --device cuda \
  --prompts 2 2>&1 | grep -v INFO | tail -9 | tee $OUT/check_full4_cuda.txt
timeout ${PREFILL_S:-240} python3 -m expertstream bench prefill --layers 4 ${BASELINE:+--baseline} --out $OUT/benchmarks.md \
  2>&1 | grep -v "%|" | tail -16 | tee $OUT/bench_prefill.txt
ls -la $OUT
