#!/usr/bin/env bash
# Device run for the CPU share of GPU decode (--cpu-moe-share): the split bank's tests on CUDA, the CPU
# expert kernel on the box's cores, `plan`'s estimate, then `bench decode` on a 4-layer full-shape model
# in the regimes with every expert in RAM: `ram` (staged), `ram unstaged` and `ram, CPU share` (the same
# with the share the rates measured at start balance), and the share set by hand. Goal: `ram, CPU share`
# at least 1.3x `ram`. Needs .whl/ carried; writes under $OUT; about 6 minutes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W=/tmp/expertstream-bench
(python3 -c "from pathlib import Path; from expertstream.bench.model import ensure_model; ensure_model(Path('$W'), 4)" \
  > $OUT/model.txt 2>&1) &
timeout ${TESTS_S:-120} python3 -m pytest -p no:cacheprovider -rf tests/test_split_bank.py tests/test_cpu_moe.py 2>&1 \
  | tail -8 | tee $OUT/tests.txt
# the kernel alone: RAM read rate and a full-shape layer's ten experts for one token, on 1, 8 and 16 threads
timeout ${KERNEL_S:-60} python3 -c "
from expertstream.bench import cpu
from expertstream.kernels import cpu_moe
for n in (1, 8, 16):
    ms, gbps = cpu.kernel_rate(n, 1, 2)
    bw = cpu_moe.read_rate(threads=n)
    print(f'{n:2d} threads: RAM read {bw:.1f} GB/s; 10 experts, 1 token {ms:.2f} ms, {gbps:.1f} GB/s ({gbps / bw:.0%})')
" 2>&1 | tee $OUT/kernel.txt
wait
python3 -m expertstream plan $W/full-4-wd --gpu-memory-gb 8 --ram-cache-gb 7 2>&1 | grep -v INFO | tail -4 \
  | tee $OUT/plan.txt
timeout ${BENCH_S:-270} python3 -m expertstream bench decode --layers 4 --regimes ram ram_unstaged ram_CPU_share \
  --out $OUT/bench_decode.md --json 2>&1 | grep -v INFO | tail -40 > $OUT/bench_decode.txt
tail -12 $OUT/bench_decode.md
# the share by hand: 0.3, 0.5 of each layer's experts on the CPU (the bench's regime with a fixed share)
timeout ${SHARES_S:-90} python3 -c "
import dataclasses, time, torch
from expertstream.bench.runtime import decoding_engine, script_regimes
cfg, blocks = script_regimes(4)['ram_CPU_share']
for share in (0.3, 0.5):
    eng, st, tok = decoding_engine(dataclasses.replace(cfg, cpu_moe_share=share), blocks)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(16):
        tok = int(eng.forward(st, [tok]).argmax())
    print(f'--cpu-moe-share {share}: {(time.perf_counter() - t0) / 16 * 1e3:.2f} ms/token, {eng.bank.n_cpu} experts a layer on the CPU')
    eng.close()
" 2>&1 | grep -v INFO | tail -4 | tee $OUT/shares.txt
