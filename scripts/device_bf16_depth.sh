#!/usr/bin/env bash
# Device run for BF16 at depth (docs/check.md's three-way table): one full-shape synthetic model of $LAYERS
# (16) layers with BF16 dense matrices; `check --dtype bfloat16 --device cuda` on it with the engine as stored
# and with the 8 GiB plan's FP8 DeltaNet matrices (--fp8-dense both), transformers' BF16 and the FP32 truth on
# the same prompts (one random, the chat one, one past the indexer budget; 64 greedy tokens each) and the
# per-layer table (--layers); then the same on the model cut to 8 layers (expertstream/bench/depth.py), with
# `bench decode` there (do the regimes choose the same tokens?; DECODE=0 skips it), then cut to 4. The device
# kernel check and the decode launch-shape tests run while the model is made. Needs .whl/ carried; writes
# under $OUT. All of it takes ~11 minutes (the model 3.7, a 16-layer check ~2.5, 8 layers 1.8, the bench 1).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/expertstream-bench L=${LAYERS:-16}  # $DEPTHS: the depths checked, deepest first (cuts are in place)
(timeout ${KERNELS_S:-90} python3 scripts/device_kernel_check.py > $OUT/kernel_check.txt 2>&1
 timeout 60 python3 -m pytest -p no:cacheprovider -rf tests/test_kernels_moe_decode.py -k "decode_launch_shape or decode_reads_host" \
   > $OUT/gpu_tests.txt 2>&1) &
t0=$(date +%s)
timeout ${MAKE_S:-330} python3 -c "
from expertstream.synth.synth import write_synthetic
from expertstream.workdir.repack import setup_workdir
write_synthetic('$W/full-$L', preset='full-shape', layers=$L)
setup_workdir('$W/full-$L', '$W/full-$L-wd', progress=False)" 2>&1 | grep -v "%|" | tail -3
echo "model of $L layers made in $(( $(date +%s) - t0 )) s; $(df -h /tmp | tail -1)" | tee $OUT/model.txt
wait
grep -E "FAIL|bit for bit|passed|failed" $OUT/kernel_check.txt $OUT/gpu_tests.txt
check() {  # the three-way check of the model as it now is ($1 layers)
  t=$(date +%s)
  timeout ${CHECK_S:-240} python3 -m expertstream check $W/full-$L-wd --snapshot $W/full-$L --dtype bfloat16 \
    --device cuda --prompts 1 --long --continuation 64 --fp8-dense both --layers --json > $OUT/check_$1.json \
    2> $OUT/check_$1.log
  python3 -c "import json; from expertstream.commands.check import print_report; \
print_report(json.load(open('$OUT/check_$1.json')))" > $OUT/check_$1.txt 2>&1
  echo "check of $1 layers: $(( $(date +%s) - t )) s"; grep "to the fp32 truth" $OUT/check_$1.txt
}
for n in ${DEPTHS:-$L 8 4}; do
  if [ $n -lt $L ]; then
    python3 -c "from expertstream.bench.depth import cut_model; cut_model('$W/full-$L', '$W/full-$L-wd', $n)" || break
  fi
  check $n
  if [ $n = 8 ] && [ "${DECODE:-1}" = 1 ]; then  # bench decode finds the cut model under its own name
    ln -sfn full-$L-wd $W/full-8-wd; ln -sfn full-$L $W/full-8
    timeout ${DECODE_S:-150} python3 -m expertstream bench decode --layers 8 --workdir $W --tokens ${TOKENS:-16} \
      --regimes ${REGIMES:-vram ram ram_unstaged ram_24_GiB_VRAM disk} --out $OUT/decode.md --json \
      > $OUT/decode.log 2>&1
    grep -E "FP8 row-scaled|\(BF16\)" $OUT/decode.log | sort | uniq -c | head -4
    grep -E "Greedy tokens identical|^\| (vram|ram|disk)" $OUT/decode.md
    rm -f $W/full-8-wd $W/full-8
  fi
done
