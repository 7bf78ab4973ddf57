#!/usr/bin/env bash
# Device run: Nsight Compute's view of the expert kernels (scripts/ncu_target.py), for what bounds them:
# speed of light (SM and memory throughput against peak), issue slots and warp stall reasons, shared-memory
# and L1/L2 traffic, occupancy. The lent H200s run on Firecracker, where ncu reads the hardware counters
# (the tool library's KINDS.md, seen 2026-11-04); --clock-control none leaves the clocks as they are.
# TOKENS (default 2451) sets the prompt; each kernel's second launch is profiled (the first compiles).
# Writes $OUT/ncu.txt (sections as text) and $OUT/ncu.ncu-rep (for the Nsight Compute GUI).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ncu --version | tail -1
timeout ${NCU_S:-500} ncu --clock-control none \
  -k regex:"_decode_gate_up_kernel|_decode_down_kernel|_prefill_gate_up_kernel|_prefill_down_kernel" \
  --launch-skip 4 --launch-count 4 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
  --export $OUT/ncu --force-overwrite \
  python3 scripts/ncu_target.py --tokens ${TOKENS:-2451} --calls 3 >/dev/null 2>$OUT/ncu_stderr.txt
ncu --import $OUT/ncu.ncu-rep --page details > $OUT/ncu.txt 2>&1
grep -E "^  [_a-z]|Duration|Throughput|Issue Slots Busy|Executed Ipc|No Eligible|Achieved Occupancy|Shared Memory|Stall" \
  $OUT/ncu.txt | head -120
