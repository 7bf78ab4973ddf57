#!/usr/bin/env bash
# Device run for DeepSeek-V4-Flash (issue 40): a full-shape synthetic checkpoint (published per-layer dims)
# through setup, `check` in bf16 on CUDA against transformers' deepseek_v4 (2 layers x 32 experts, so the
# FP32 truth's dense experts fit; a ~2,200-token text prompt makes CSA's indexer drop entries and HCA
# compress), then `bench decode --model` on 3 layers x 256 experts (the eager path's ram and disk regimes).
# Needs .whl/ carried; writes under $OUT; about 6 minutes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=${W:-/tmp/ds4}
mkdir -p $W
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
python3 -m expertstream synth $W/check --preset ds4-full-shape --layers 2 --experts 32 >/dev/null 2>&1
timeout ${SETUP_S:-60} python3 -m expertstream setup $W/check $W/check-wd --no-progress 2>&1 | tail -2 \
  | tee $OUT/setup_check.txt
head -c 9000 expertstream/assets/demo-snapshot/heldout.txt > $W/long.txt
timeout ${CHECK_S:-180} python3 -m expertstream check $W/check-wd --snapshot $W/check --dtype bfloat16 \
  --device cuda --prompts 2 --continuation 8 --text "$(cat $W/long.txt)" 2>&1 | grep -v INFO | tail -9 \
  | tee $OUT/check_ds4_full_cuda.txt
rm -rf $W/check $W/check-wd
( time python3 -m expertstream synth $W/bench --preset ds4-full-shape --layers 3 ) 2>&1 | tail -3 \
  > $OUT/synth_bench.txt
( time timeout ${SETUP_S:-150} python3 -m expertstream setup $W/bench $W/bench-wd --no-progress ) 2>&1 \
  | tail -4 | tee $OUT/setup_bench.txt
timeout ${BENCH_S:-120} python3 -m expertstream bench decode --model $W/bench-wd --tokens 8 \
  --out $OUT/bench_decode_ds4.md 2>&1 | grep -v INFO | tail -8 | tee $OUT/bench_decode_ds4.txt
