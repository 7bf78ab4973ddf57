"""How many threads CPU compute may use: `--threads`, or the cores this process may run on that other
processes leave free, re-measured while it runs.

Why: torch's intra-op pool takes every core by default; when another process keeps one of two cores busy,
each parallel op waits for the thread the scheduler parked behind it, and decode collapsed from 18 to
4.7 tokens/s. Free cores = allowed cores (affinity, cgroup quota) - the busy time of those cores that is
not ours, over the last `period` seconds (/proc/stat and /proc/self/stat).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from expertstream.log import get_logger

log = get_logger(__name__)


def allowed_cores() -> int:
    """Cores this process may run on: its affinity, capped by a cgroup v2 CPU quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _busy_ticks(cpus: set[int] | None) -> int | None:
    """Non-idle clock ticks of `cpus` (all when None) since boot, from /proc/stat; None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *vals = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in vals[:8]]  # user nice system idle iowait irq softirq steal
        busy += sum(v) - v[3] - v[4]
    return busy


def _own_ticks() -> int | None:
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime of every thread of this process


class CpuThreads:
    """Callable -> the threads CPU compute may use now; keeps torch's intra-op pool at the same number.

    Args:
        fixed: `--threads`; 0 sizes to the free cores, re-measured at most every `period` seconds.
    """

    def __init__(self, fixed: int = 0, period: float = 0.5):
        if fixed < 0:
            raise ValueError(f"threads must be >= 0 (0: the free cores), got {fixed}")
        self.fixed, self.period = fixed, period
        self.cores = allowed_cores()
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.n = fixed or self.cores
        self._sample = self._take()
        self._apply()

    def _take(self) -> tuple[float, int, int] | None:
        busy, own = _busy_ticks(self._cpus), _own_ticks()
        return None if busy is None or own is None else (time.monotonic(), busy, own)

    def others(self) -> float | None:
        """Cores' worth of busy time of other processes since the last sample (None: not measurable)."""
        now = self._take()
        if now is None or self._sample is None:
            return None
        (t0, b0, o0), (t1, b1, o1) = self._sample, now
        self._sample = now
        if t1 - t0 <= 0:
            return None
        return max(0.0, ((b1 - b0) - (o1 - o0)) / self._hz / (t1 - t0))

    def __call__(self) -> int:
        if self.fixed or self._sample is None or time.monotonic() - self._sample[0] < self.period:
            return self.n
        others = self.others()
        if others is not None:
            # a core more than 60 % busy with someone else is not free
            n = max(1, min(self.cores, int(self.cores - others + 0.4)))
            if n != self.n:
                log.debug("CPU threads %d -> %d (others use %.1f of %d cores)", self.n, n, others, self.cores)
                self.n = n
                self._apply()
        return self.n

    def _apply(self) -> None:
        if torch.get_num_threads() != self.n:
            torch.set_num_threads(self.n)
