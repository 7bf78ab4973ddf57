#!/usr/bin/env bash
# Device run 1 of 2 for the GPU runtime (issue 5), most important first, each step under its own time limit:
# GPU tests (graphs vs eager, the CUDA bank, speculation, VRAM cache), `check` of the tiny model with the
# engine on CUDA, and the decode bench (five regimes) with a torch.profiler trace of each. Needs .whl/ (the
# transformers wheel CI uses) carried; writes under $OUT (prof.tgz holds the traces).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
es() { python3 -m expertstream "$@"; }
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_gpu_experts.py \
  tests/test_speculation.py tests/test_vram_cache.py tests/test_decode_path.py tests/test_kernels.py 2>&1 \
  | tail -15 | tee $OUT/gpu_tests.txt
es synth /tmp/tiny --preset tiny >/dev/null 2>&1 && es setup /tmp/tiny /tmp/tiny-wd >/dev/null 2>&1
timeout 60 python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype bfloat16 --device cuda --long 2>&1 \
  | grep -v INFO | tail -9 | tee $OUT/check_tiny_cuda.txt
timeout ${DECODE_S:-300} python3 -m expertstream bench decode --layers 4 --tokens ${TOKENS:-12} --profile /tmp/prof \
  --speculation-width ${WIDTH:-1} \
  --out $OUT/benchmarks.md --json 2>&1 | grep -v "%|" | tail -4 > $OUT/bench_decode.txt
tar -C /tmp -czf $OUT/prof.tgz prof
tail -c 3000 $OUT/benchmarks.md
ls -la $OUT
