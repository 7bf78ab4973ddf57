#!/usr/bin/env bash
# Device run for speed after a runtime change: the GPU tests named in $TESTS, with SWEEP=1 a sweep of the
# decode kernel's configs (blocks in HBM and in pinned host RAM) merged into the tree's tuned_configs.json,
# the decode bench ($REGIMES; BASELINE=1 adds transformers + accelerate offloading), then the prefill bench
# on $PROMPTS ($PREFILL_REGIMES; the shortest prompt profiled per regime: pprof.tgz, op tables). Needs .whl/
# carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${TESTS_S:-100} python3 -m pytest -p no:cacheprovider -rf ${TESTS:-tests/test_speculation.py} 2>&1 \
  | tail -12 | tee $OUT/gpu_tests.txt
if [ "${SWEEP:-0}" = 1 ]; then
  timeout ${SWEEP_S:-90} python3 -c "from expertstream.bench.kernels import sweep_configs; \
sweep_configs('expertstream/kernels/tuned_configs.json', ('nvfp4_decode',))" 2>&1 | grep -v INFO | grep -v "^{" \
    | tee $OUT/sweep.txt
  cp expertstream/kernels/tuned_configs.json $OUT/tuned_configs.json
fi
timeout ${DECODE_S:-200} python3 -m expertstream bench decode --layers 4 --tokens ${TOKENS:-12} ${REGIMES:+--regimes $REGIMES} \
  ${BASELINE:+--baseline} --out $OUT/benchmarks.md --json 2>&1 | grep -v "%|" | tail -3 > $OUT/bench_decode.txt
tail -c 1800 $OUT/benchmarks.md
timeout ${PREFILL_S:-170} python3 -m expertstream bench prefill --layers 4 --prompts ${PROMPTS:-2451} \
  ${PREFILL_REGIMES:+--regimes $PREFILL_REGIMES} --profile /tmp/pprof --out $OUT/benchmarks.md 2>&1 | grep -v "%|" | tail -14 | tee $OUT/bench_prefill.txt
tar -C /tmp --exclude='*.json' -czf $OUT/pprof.tgz pprof 2>/dev/null
