#!/usr/bin/env bash
# Device run for `bench serve` on a full-shape synthetic model (issue 36): Open WebUI's flow (the chat with
# the 36 default tools, alone and with its title, follow-ups and tags tasks), then aggregate decode
# throughput at 1, 2 and 4 concurrent requests against the expert bytes each step moves (RAM lookups, bytes
# over the bus, bytes from disk). Twice: with decode graphs (each sequence's token a graph replay of its
# own) and with --enforce-eager (the sequences' one-token rows share one fetch of their experts' union a
# layer, experts/segments.py). The budget (GPU_GB, 4 GiB by default) and the 2 GiB RAM cache hold less than
# the model's experts, so that blocks cross the bus and come from disk (with every block in RAM, decode
# reads them in place, per sequence). First tests/test_shared_fetch.py on the GPU. At most TOTAL_S (350 s)
# after the install; needs .whl/ carried; writes under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/expertstream-bench
L=${LAYERS:-4}
START=$(date +%s)  # the whole run stays within TOTAL_S: the two serve runs share what is left
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $OUT/gpu.txt
# the CUDA bank's shared fetch on the GPU (on the CPU these run through the Triton interpreter)
timeout 60 python3 -m pytest -p no:cacheprovider -rf tests/test_shared_fetch.py 2>&1 | tail -5 \
  | tee $OUT/shared_fetch_tests.txt
t0=$(date +%s)
python3 -c "from pathlib import Path; from expertstream.bench.model import ensure_model; ensure_model(Path('$W'), $L)" \
  > $OUT/model.txt 2>&1 || { tail -5 $OUT/model.txt; exit 1; }
echo "model: $L full-shape layers in $(( $(date +%s) - t0 )) s" | tee -a $OUT/model.txt
PLAN="--gpu-memory-gb ${GPU_GB:-4} --max-model-len 32768 --ram-cache-gb 2"
timeout 60 python3 -m expertstream plan $W/full-$L-wd $PLAN 2>&1 | grep -v INFO > $OUT/plan.txt
# a random model never ends a turn: the tasks without a limit (follow-ups, tags) stop at --max-tokens, the
# title at --title-tokens (Open WebUI's 1000 would take most of the run)
ARGS="$PLAN --max-tokens 64"
runs=2
for mode in graphs eager; do
  extra=$([ $mode = eager ] && echo --enforce-eager)
  t0=$(date +%s)
  limit=$(( (${TOTAL_S:-350} - (t0 - START)) / runs ))
  runs=$(( runs - 1 ))
  timeout $limit python3 -m expertstream bench serve $W/full-$L-wd --serve-args "$ARGS $extra" \
    --serve-log $OUT/server_$mode.log --chat-tokens 32 --title-tokens 128 --tokens 32 --json \
    > $OUT/serve_$mode.txt 2>&1
  echo "rc $? in $(( $(date +%s) - t0 )) s of $limit" >> $OUT/serve_$mode.txt
  grep -v '^{' $OUT/serve_$mode.txt | tail -22
done
head -16 $OUT/plan.txt
