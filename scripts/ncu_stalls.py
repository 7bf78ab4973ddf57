"""Summarise an Nsight Compute report made by scripts/device_ncu.sh: per kernel, the warp stall reasons
(cycles per issued instruction; their sum is the kernel's warp cycles per issued instruction) and the SASS
lines where the sampled warps stalled most, with their top reasons. Usage: python3 scripts/ncu_stalls.py
RAW.txt [SOURCE.csv ...] (RAW: `ncu --import R --page raw`; SOURCE: `--page source --print-source sass --csv`
of one kernel each)."""

import csv
import re
import sys

STALL = re.compile(r"\s+smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio\s+\S+\s+([\d.,]+)")
KERNEL = re.compile(r"\s+(\w+) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")


def stalls(raw_path: str) -> None:
    """Per kernel of the raw page: the stall reasons of at least 0.05 cycles per issued instruction."""
    for line in open(raw_path):
        if m := KERNEL.match(line):
            print(m.group(1))
        elif (m := STALL.match(line)) and float(m.group(2).replace(",", "")) >= 0.05:
            print(f"   {m.group(1):22s} {m.group(2)}")


def hot_lines(csv_path: str, top: int = 12) -> None:
    """The SASS lines of one kernel's source page with the most stall samples, and their top 3 reasons."""
    rows = list(csv.reader(open(csv_path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    name = rows[head - 1][1] if head else csv_path
    col = {h: i for i, h in enumerate(rows[head])}
    data = [r for r in rows[head + 1 :] if len(r) == len(rows[head])]
    samples = col["Warp Stall Sampling (All Samples)"]
    total = sum(int(r[samples] or 0) for r in data) or 1
    reasons = [h for h in col if h.startswith("stall_") and "Not Issued" not in h]
    print(f"{name}: {total} samples")
    for r in sorted(data, key=lambda r: -int(r[samples] or 0))[:top]:
        why = sorted(((int(r[col[h]] or 0), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"  {100 * int(r[samples]) / total:5.1f}%  {r[1].strip()[:56]:56s} {why}")


if __name__ == "__main__":
    stalls(sys.argv[1])
    for path in sys.argv[2:]:
        hot_lines(path)
