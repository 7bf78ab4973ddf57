#!/usr/bin/env bash
# One device run: GPU check of the tiny model in bf16 (Triton kernels, VRAM slots), then train the demo model.
# Needs .whl/ (transformers wheel: the CI oracle's version) and .corpus/kjv.txt carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
python3 -m expertstream synth /tmp/tiny --preset tiny && python3 -m expertstream setup /tmp/tiny /tmp/tiny-wd >/dev/null 2>&1
python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype bfloat16 --device cuda --long 2>&1 | tee $OUT/check_tiny_bf16_cuda.txt | tail -12
python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype float32 --device cuda --long 2>&1 | tail -3 | tee -a $OUT/check_tiny_bf16_cuda.txt
python3 scripts/train_demo.py --corpus .corpus/kjv.txt --out /tmp/demo --minutes "${TRAIN_MINUTES:-6}" 2>&1 | tee $OUT/train.log | grep -v "^step" | tail -20
tar -C /tmp -cf - demo | split -b 15m - $OUT/demo.tar.part-
ls -la $OUT
