#!/usr/bin/env bash
# One device run: GPU check of the tiny model (Triton kernels, VRAM slots), the demo model's training, and the
# decode bench. Needs .whl/ (the transformers wheel CI uses) and .corpus/kjv.txt carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
python3 -m expertstream synth /tmp/tiny --preset tiny >/dev/null 2>&1 && python3 -m expertstream setup /tmp/tiny /tmp/tiny-wd >/dev/null 2>&1
for dt in bfloat16 float32; do
  python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype $dt --device cuda --long 2>&1 | grep -v INFO | tail -9 | tee -a $OUT/check_tiny_cuda.txt
done
if [ "${TRAIN_MINUTES:-0}" != 0 ]; then
  python3 scripts/train_demo.py --corpus .corpus/kjv.txt --out /tmp/demo --minutes "$TRAIN_MINUTES" 2>&1 | tee $OUT/train.log | grep -v "^step" | tail -12
  tar -C /tmp -cf - demo | split -b 15m - $OUT/demo.tar.part-
fi
python3 -m expertstream bench decode --layers "${BENCH_LAYERS:-4}" --tokens 24 --out $OUT/benchmarks.md --json 2>&1 | grep -v "%|" | tail -12
ls -la $OUT
