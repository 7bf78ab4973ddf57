#!/usr/bin/env bash
# A shorter device run after a fix: GPU graph tests, `check` (tiny, and the 4-layer full-shape model built by
# the decode bench) with the engine on CUDA, and the decode bench. Needs .whl/ carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
python3 -m expertstream synth /tmp/tiny --preset tiny >/dev/null 2>&1 && python3 -m expertstream setup /tmp/tiny /tmp/tiny-wd >/dev/null 2>&1
timeout 45 python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype bfloat16 --device cuda --long 2>&1 \
  | grep -v INFO | tail -9 | tee $OUT/check_tiny_cuda.txt
timeout ${DECODE_S:-170} python3 -m expertstream bench decode --layers 4 --tokens 12 --out $OUT/benchmarks.md 2>&1 \
  | grep -v "%|" | tail -12 | tee $OUT/bench_decode.txt
W=/tmp/expertstream-bench
timeout ${CHECK_S:-70} python3 -m expertstream check $W/full-4-wd --snapshot $W/full-4 --dtype bfloat16 --device cuda \
  --prompts 2 2>&1 | grep -v INFO | tail -9 | tee $OUT/check_full4_cuda.txt
