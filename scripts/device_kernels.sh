#!/usr/bin/env bash
# Device run after a kernel change: every kernel in BF16 against its FP32 twin on real shapes, the decode
# kernel's time and per-launch split (scripts/decode_ab.py; with BASE=a `git archive` tar of an older commit,
# carried under .whl/, that commit's kernel first, timed by this tree's harness), then the config sweep of
# $SWEEP (default nvfp4_decode; empty: none), merged into the tree's tuned_configs.json, then (unless BENCH=0)
# `bench kernels` with the configs just picked. Needs .whl/ carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${KERNELS_S:-90} python3 scripts/device_kernel_check.py 2>&1 | tail -24 | tee $OUT/kernel_check.txt
if [ -n "${BASE:-}" ]; then
  mkdir -p /tmp/base && tar -xf "$BASE" -C /tmp/base && cp expertstream/bench/kernels.py /tmp/base/expertstream/
  (cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base timeout 150 python3 $OLDPWD/scripts/decode_ab.py 2>&1 \
    | grep -v INFO | sed 's/^/base /') | tee $OUT/ab.txt
fi
timeout 150 python3 scripts/decode_ab.py 2>&1 | grep -v INFO | sed 's/^/this /' | tee -a $OUT/ab.txt
if [ -n "${SWEEP-nvfp4_decode}" ]; then
  timeout ${SWEEP_S:-240} python3 -c "from expertstream.bench.kernels import sweep_configs; \
sweep_configs('expertstream/kernels/tuned_configs.json', tuple('${SWEEP-nvfp4_decode}'.split()))" 2>&1 \
    | grep -v INFO | grep -v "^{" | tee $OUT/sweep.txt
  cp expertstream/kernels/tuned_configs.json $OUT/tuned_configs.json
fi
[ "${BENCH:-1}" = 0 ] || timeout ${BENCH_S:-150} python3 -m expertstream bench kernels --out $OUT/kernels.md 2>&1 \
  | grep -v INFO | tail -24
