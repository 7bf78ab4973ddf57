#!/usr/bin/env bash
# Device run for correctness: the GPU runtime's tests (in the background, failures listed), every kernel in
# BF16 on real shapes against its twin (scripts/device_kernel_check.py, the GatedDeltaNet step included),
# `check` of the tiny model with the engine on CUDA (bf16, graphs, --long; then with layer-major spans of
# several pieces), then, once the tests are done, `check` of the 4-layer full-shape model with spans, then
# $AFTER. Needs .whl/ carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the tests run beside the checks below (~4 minutes; the GPU has room for both). No -q: pyproject's addopts
# has one, and a second hides pytest's summary line
(timeout ${TESTS_S:-420} python3 -m pytest -p no:cacheprovider -rf --durations=8 tests/test_kernels_*.py \
  tests/test_gpu_experts.py tests/test_controls.py tests/test_decode_graphs.py tests/test_speculation.py \
  tests/test_vram_cache.py tests/test_decode_path.py tests/test_decode_ops.py tests/test_memory_plan.py 2>&1 | tail -30 > $OUT/gpu_tests.txt) &
timeout ${KERNELS_S:-60} python3 scripts/device_kernel_check.py 2>&1 | tail -24 | tee $OUT/kernel_check.txt
python3 -m expertstream synth /tmp/tiny --preset tiny >/dev/null 2>&1
python3 -m expertstream setup /tmp/tiny /tmp/tiny-wd >/dev/null 2>&1
timeout ${TINY_S:-150} python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype bfloat16 --device cuda \
  --long 2>&1 | grep -v INFO | tail -9 | tee $OUT/check_tiny_cuda.txt
# layer-major prefill: spans of several pieces (each layer's experts once per span)
timeout ${TINY_S:-150} python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype bfloat16 --device cuda \
  --long --prefill-piece 8 --prefill-span 32 2>&1 | grep -v INFO | tail -9 | tee $OUT/check_tiny_spans_cuda.txt
W=/tmp/expertstream-bench
python3 -c "from pathlib import Path; from expertstream.bench.model import ensure_model; ensure_model(Path('$W'), 4)" \
  >/dev/null 2>&1
wait  # the 4-layer reference needs ~20 GiB of GPU memory, which the tests may be holding (it ran out beside them)
cat $OUT/gpu_tests.txt
timeout ${CHECK_S:-200} python3 -m expertstream check $W/full-4-wd --snapshot $W/full-4 --dtype bfloat16 --device cuda \
  --prompts 2 --prefill-piece 16 --prefill-span 64 2>&1 | grep -v INFO | tail -9 | tee $OUT/check_full4_cuda.txt
eval "${AFTER:-true}"  # more work once the checks are done (e.g. a bench)
