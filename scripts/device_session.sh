#!/usr/bin/env bash
# Device run 1 of 2, most important first, each step under its own time limit: the GPU tests (kernels, the
# CUDA bank, graphs vs eager, speculation, VRAM cache), the kernels in BF16 against their FP32 twins on
# real shapes, `bench kernels`, the decode bench (five regimes) with a torch.profiler trace of each, then a
# sweep of the decode kernel's launch configs. Needs .whl/ (the transformers wheel CI uses) carried; writes
# under $OUT (prof.tgz holds the traces, tuned_configs.json the sweep's merged result).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider tests/test_kernels.py tests/test_gpu_experts.py \
  tests/test_decode_graphs.py tests/test_speculation.py tests/test_vram_cache.py tests/test_decode_path.py 2>&1 \
  | tail -15 | tee $OUT/gpu_tests.txt
timeout 60 python3 scripts/device_kernel_check.py 2>&1 | tail -20 | tee $OUT/kernel_check.txt
timeout 90 python3 -m expertstream bench kernels --out $OUT/kernels.md 2>&1 | grep -v INFO | tail -20
timeout ${DECODE_S:-200} python3 -m expertstream bench decode --layers 4 --tokens ${TOKENS:-12} --profile /tmp/prof \
  --out $OUT/benchmarks.md --json 2>&1 | grep -v "%|" | tail -4 > $OUT/bench_decode.txt
tar -C /tmp -czf $OUT/prof.tgz prof
tail -c 2500 $OUT/benchmarks.md
cp expertstream/kernels/tuned_configs.json /tmp/tuned.json
timeout ${SWEEP_S:-70} python3 -c "from expertstream.bench.kernels import sweep_configs; sweep_configs('/tmp/tuned.json', ('nvfp4_decode',))" \
  2>&1 | grep -v INFO | tail -14 | tee $OUT/sweep.txt
cp /tmp/tuned.json $OUT/tuned_configs.json
ls -la $OUT
