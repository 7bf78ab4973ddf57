#!/usr/bin/env bash
# Device run: Nsight Compute's view of the expert kernels, for what bounds them: speed of light (SM and memory
# throughput against peak), issue slots, warp stall reasons, the SASS lines warps stall on, shared-memory
# and L1/L2 traffic, occupancy. The lent H200s run on Firecracker, where ncu reads the hardware counters
# (the tool library's KINDS.md; first run 2026-12-01); --clock-control none leaves the clocks as they are.
# KERNELS: a regex of kernel names (default the decode and prefill launches); TARGET: the program (default
# scripts/ncu_target.py, TOKENS tokens of prompt); SKIP launches of those kernels are skipped (the first of
# each compiles), COUNT profiled. Writes $OUT/ncu.ncu-rep (for the Nsight Compute GUI), ncu.txt (sections),
# raw.txt (every metric) and src_N.csv (the Nth profiled launch's SASS with its stall samples); prints
# scripts/ncu_stalls.py's summary.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
"$NCU" --version | tail -1
KERNELS=${KERNELS:-_decode_gate_up_kernel|_decode_down_kernel|_prefill_gate_up_kernel|_prefill_down_kernel}
COUNT=${COUNT:-4}
timeout ${NCU_S:-500} "$NCU" --clock-control none -k regex:"$KERNELS" --launch-skip ${SKIP:-4} --launch-count $COUNT \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
  --section SourceCounters --import-source no --export $OUT/ncu --force-overwrite \
  ${TARGET:-python3 scripts/ncu_target.py --tokens ${TOKENS:-2451} --calls 3} >/dev/null 2>$OUT/ncu_stderr.txt
"$NCU" --import $OUT/ncu.ncu-rep --page details > $OUT/ncu.txt 2>&1
"$NCU" --import $OUT/ncu.ncu-rep --page raw > $OUT/raw.txt 2>&1
for i in $(seq 1 $COUNT); do
  "$NCU" --import $OUT/ncu.ncu-rep --page source --print-source sass --csv --launch-skip $((i - 1)) \
    --launch-count 1 > $OUT/src_$i.csv 2>&1
done
grep -E "^  [_a-z]|Duration|Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Spilling Requests  " \
  $OUT/ncu.txt | head -80
python3 scripts/ncu_stalls.py $OUT/raw.txt $OUT/src_*.csv
