#!/usr/bin/env bash
# The GPU box's checks and benches, one script: `bash scripts/device_check.sh [PART ...]` runs the named parts
# in order (default: tests kernels checks). Needs .whl/ carried (the wheels the box lacks, which
# scripts/device_wheels.sh downloads); writes under $OUT. Each part's time limit is an environment variable.
#   tests      the GPU tests, in the background beside the parts after it (~6 min; waited for at the end)
#   kernels    every kernel in BF16 on real shapes against its twin (scripts/device_kernel_check.py)
#   checks     `check` of the tiny model on CUDA (bf16, graphs, --long; then layer-major spans), and of the
#              4-layer full-shape model with spans, its dense matrices in BF16 as the snapshot stores them (the
#              bench's workdir of it holds FP8 DeltaNet matrices, whose cost docs/check.md measures apart)
#   depth      BF16 at depth (docs/check.md's three-way table): a full-shape model of $LAYERS (16) layers,
#              `check --fp8-dense both --layers` on it and on its cuts to $DEPTHS ("16 8 4")
#   decode     `bench decode` on 4 full-shape layers, regimes $REGIMES (vram ram disk): efficiency against the
#              bound, the regimes' greedy tokens, the block checksums' share of a disk-bound token
#   cpu-share  the CPU share of GPU decode (--cpu-moe-share): `bench cpu --with-copy` on $CPU_THREADS (14:
#              the split's default on 16 cores) threads (the kernel alone and beside the copy engine),
#              `plan`'s estimate, `bench decode` in vram ram ram_unstaged ram_CPU_share (the auto share on
#              the default threads: its breakdown, model, and the log's tuning by token time), then shares
#              $SHARES (0.4) by hand on $SHARE_THREADS (8) threads
#   cpu-auto   the auto share against `ram`, $AUTO_RUNS (4) fresh processes over $AUTO_TOKENS (128: past the
#              tuner's first 64-token watch) tokens of $AUTO_LAYERS (4) full-shape layers, on the default
#              threads or on $AUTO_THREADS (e.g. 12)
#   serve      `bench serve` (Open WebUI's flow, 1/2/4 concurrent decodes) on 4 full-shape layers, with decode
#              graphs and with --enforce-eager (shared fetches; $SERVE_MODES), in a $GPU_GB (4) GiB budget
#   ds4        DeepSeek-V4-Flash: full-shape layers through setup, `check` in bf16 on CUDA through the CUDA
#              expert bank (MXFP4 kernels) and the block-scaled FP8 kernels (its dense matrices as shipped),
#              `bench decode` in its regimes vram, ram and disk (~5 min)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/expertstream-bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/device.txt
tests_pid=

model() {  # the working directory of a full-shape synthetic model of $1 layers, made once
  python3 -c "from pathlib import Path; from expertstream.bench.model import ensure_model; \
ensure_model(Path('$W'), $1)" > $OUT/model_$1.txt 2>&1 || tail -3 $OUT/model_$1.txt
}

part_tests() {  # no -q: pyproject's addopts has one, and a second hides pytest's summary line
  (timeout ${TESTS_S:-420} python3 -m pytest -p no:cacheprovider -rf --durations=8 tests/test_kernels_*.py \
    tests/test_gpu_experts.py tests/test_controls.py tests/test_decode_graphs.py tests/test_speculation.py \
    tests/test_vram_cache.py tests/test_decode_path.py tests/test_decode_ops.py tests/test_memory_plan.py \
    tests/test_shared_fetch.py tests/test_kv_pool.py tests/test_split_bank.py tests/test_cpu_moe.py \
    tests/test_mailbox.py tests/test_constrained.py tests/test_engine_ds4.py 2>&1 | tail -30 > $OUT/gpu_tests.txt) &
  tests_pid=$!
}

part_kernels() {
  timeout ${KERNELS_S:-90} python3 scripts/device_kernel_check.py 2>&1 | tail -24 > $OUT/kernel_check.txt
  grep -E "FAIL|bit for bit|all kernels" $OUT/kernel_check.txt | tail -4
}

part_checks() {
  python3 -m expertstream synth /tmp/tiny --preset tiny > /dev/null 2>&1
  python3 -m expertstream setup /tmp/tiny /tmp/tiny-wd > /dev/null 2>&1
  for spans in "" "--prefill-piece 8 --prefill-span 32"; do
    timeout ${TINY_S:-150} python3 -m expertstream check /tmp/tiny-wd --snapshot /tmp/tiny --dtype bfloat16 \
      --device cuda --long $spans 2>&1 | grep -v INFO | tail -9 >> $OUT/check_tiny_cuda.txt
  done
  grep -E "PASS|FAIL" $OUT/check_tiny_cuda.txt
  model 4
  python3 -m expertstream setup $W/full-4 $W/full-4-bf16-wd --no-progress > /dev/null 2>&1
  [ -n "$tests_pid" ] && wait $tests_pid  # the 4-layer reference needs ~20 GiB of GPU memory
  timeout ${CHECK_S:-200} python3 -m expertstream check $W/full-4-bf16-wd --snapshot $W/full-4 --dtype bfloat16 \
    --device cuda --prompts 2 --prefill-piece 16 --prefill-span 64 2>&1 | grep -v INFO | tail -9 \
    > $OUT/check_full4_cuda.txt
  grep -E "PASS|FAIL" $OUT/check_full4_cuda.txt
}

part_depth() {  # the cuts are in place: deepest first
  local L=${LAYERS:-16} n t
  model $L
  for n in ${DEPTHS:-$L 8 4}; do
    if [ $n -lt $L ]; then
      python3 -c "from expertstream.bench.depth import cut_model; cut_model('$W/full-$L', '$W/full-$L-wd', $n)" \
        || break
    fi
    t=$(date +%s)
    timeout ${CHECK_S:-240} python3 -m expertstream check $W/full-$L-wd --snapshot $W/full-$L --dtype bfloat16 \
      --device cuda --prompts 1 --long --continuation 64 --fp8-dense both --layers --json > $OUT/check_$n.json \
      2> $OUT/check_$n.log
    python3 -c "import json; from expertstream.commands.check import print_report; \
print_report(json.load(open('$OUT/check_$n.json')))" > $OUT/check_$n.txt 2>&1
    echo "check of $n layers: $(( $(date +%s) - t )) s"; grep "to the fp32 truth" $OUT/check_$n.txt
  done
}

part_decode() {
  model 4
  timeout ${DECODE_S:-240} python3 -m expertstream bench decode --layers 4 --workdir $W --tokens ${TOKENS:-16} \
    --regimes ${REGIMES:-vram ram disk} --out $OUT/decode.md > $OUT/decode.log 2>&1
  grep -E "^\| (vram|ram|disk)|Greedy tokens|Block checksums" $OUT/decode.md
}

part_cpu_share() {  # ~3 min: kernel beside the copy engine; plan; decode with every expert in RAM
  local share
  model 4
  timeout ${KERNEL_S:-45} python3 -m expertstream bench cpu --threads ${CPU_THREADS:-14} --with-copy --tokens 0 \
    2>&1 | grep -v INFO > $OUT/cpu_bench.txt
  grep -E "RAM read|full-shape|streams" $OUT/cpu_bench.txt
  timeout ${PLAN_S:-30} python3 -m expertstream plan $W/full-4-wd --gpu-memory-gb 8 --ram-cache-gb 7 2>&1 \
    | grep -v INFO | tail -4 | tee $OUT/cpu_share_plan.txt
  # vram gives d (a layer's dense GPU work) to the split's model; the auto share, on the free cores less 2,
  # tunes itself by token time over its first tokens and may move or turn off (the log's lines)
  timeout ${BENCH_S:-170} python3 -m expertstream bench decode --layers 4 --workdir $W --tokens 16 \
    --regimes vram ram ram_unstaged ram_CPU_share --out $OUT/cpu_share.md > $OUT/cpu_share.log 2>&1
  grep -E "^\| (vram|ram)|Greedy tokens|CPU share\`|^Model" $OUT/cpu_share.md
  grep -E "CPU share (of|tuned)" $OUT/cpu_share.log | sed 's/.*INFO[^:]*: //'
  # the share set by hand: split on every layer, its breakdown; on $SHARE_THREADS (8) of the cores
  for share in ${SHARES:-0.4}; do
    timeout ${SHARES_S:-60} python3 -m expertstream bench decode --layers 4 --workdir $W --tokens 16 \
      --regimes ram_CPU_share --cpu-moe-share $share --threads ${SHARE_THREADS:-8} \
      --out $OUT/cpu_share_$share.md > /dev/null 2>&1
    grep -E "^\| ram, CPU share|CPU share\`|^Model" $OUT/cpu_share_$share.md
  done
}

part_cpu_auto() {  # each process times `ram` and the split in turn: the ratio is within one process
  local i threads=${AUTO_THREADS:+--threads $AUTO_THREADS} layers=${AUTO_LAYERS:-4}
  model $layers
  for i in $(seq ${AUTO_RUNS:-4}); do
    # shellcheck disable=SC2086
    timeout ${AUTO_S:-120} python3 -m expertstream bench decode --layers $layers --workdir $W \
      --tokens ${AUTO_TOKENS:-128} --regimes ram ram_CPU_share --cpu-moe-share -1 $threads \
      --out $OUT/cpu_auto_$i.md > $OUT/cpu_auto_$i.log 2>&1
    echo "auto share, process $i: rc $?"
    grep -E "^\| ram|CPU share\` a token|Greedy tokens" $OUT/cpu_auto_$i.md
    grep -E "CPU share (of|tuned|on|off)" $OUT/cpu_auto_$i.log | sed 's/.*INFO[^:]*: //'
  done
}

part_serve() {  # a random model never ends a turn: the tasks stop at --max-tokens, the title at --title-tokens
  model 4
  local plan="--gpu-memory-gb ${GPU_GB:-4} --max-model-len 32768 --ram-cache-gb 2" mode extra
  timeout 60 python3 -m expertstream plan $W/full-4-wd $plan 2>&1 | grep -v INFO > $OUT/serve_plan.txt
  for mode in ${SERVE_MODES:-graphs eager}; do
    extra=$([ $mode = eager ] && echo --enforce-eager)
    timeout ${SERVE_S:-170} python3 -m expertstream bench serve $W/full-4-wd --serve-args "$plan --max-tokens 64 \
$extra" --serve-log $OUT/server_$mode.log --chat-tokens 32 --title-tokens 128 --tokens 32 > $OUT/serve_$mode.md 2>&1
    echo "$mode: rc $?"; tail -16 $OUT/serve_$mode.md
  done
}

part_ds4() {  # check: 2 layers x 32 experts (the FP32 truth's dense experts fit); bench: 3 layers x 256
  local D=/tmp/ds4
  [ -n "$tests_pid" ] && wait $tests_pid  # tests that plan on 0.9 of the GPU refuse a GPU shared with it
  python3 -m expertstream synth $D/check --preset ds4-full-shape --layers 2 --experts 32 > /dev/null 2>&1
  timeout ${SETUP_S:-150} python3 -m expertstream setup $D/check $D/check-wd --no-progress 2>&1 | tail -2
  head -c 9000 expertstream/assets/demo-snapshot/heldout.txt > $D/long.txt  # CSA drops entries, HCA compresses
  timeout ${CHECK_S:-180} python3 -m expertstream check $D/check-wd --snapshot $D/check --dtype bfloat16 \
    --device cuda --prompts 2 --continuation 8 --text "$(cat $D/long.txt)" 2>&1 | tee $D/check.log \
    | grep -v INFO | tail -9 | tee $OUT/check_ds4_cuda.txt
  grep -m1 "FP8 kernels" $D/check.log | tee -a $OUT/check_ds4_cuda.txt  # the FP8 matrices as shipped
  rm -rf $D/check $D/check-wd
  python3 -m expertstream synth $D/bench --preset ds4-full-shape --layers 3 > /dev/null 2>&1
  timeout ${SETUP_S:-150} python3 -m expertstream setup $D/bench $D/bench-wd --no-progress 2>&1 | tail -2
  timeout ${BENCH_S:-150} python3 -m expertstream bench decode --model $D/bench-wd --tokens 8 \
    --out $OUT/decode_ds4.md 2>&1 | grep -v INFO | tail -9
}

for part in ${@:-tests kernels checks}; do
  echo "== $part ($(date -u +%H:%M:%S))"
  "part_${part//-/_}"
done
if [ -n "$tests_pid" ]; then wait $tests_pid; tail -12 $OUT/gpu_tests.txt; fi
