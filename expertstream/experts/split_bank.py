"""A CPU share of GPU decode: with every expert block in the pinned RAM cache, the CPU computes some of each
layer's routed experts in place (kernels/cpu_moe.c on the RAM rows) while the bus carries the rest to the
GPU bank's decode kernel, and the two sums are added on the GPU.

`SplitExperts` composes a CUDA bank (experts/gpu_bank.py) and the CPU kernel through the bank interface
(experts/bank.py). Until every block has a fixed RAM row, and for prompts, it is the GPU bank. Once they have,
a one-token call is host work ("eager" decode mode: the decode graphs keep the rest of the layer captured):
the last n of the K routed experts (top-k order: the smallest weights) go to the CPU, the first K - n to the
GPU, a split that needs nothing from the host, so the GPU kernel is queued at once, behind a copy of the
CPU's ids, weights and x to the host; the host waits for that copy alone, runs the CPU kernel while the bus
carries the GPU's blocks, and uploads its [H] sum, which is added on the GPU. A layer then takes about
max(bus bytes / bus rate, CPU bytes / CPU rate) instead of all its bytes over the bus.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from expertstream.experts.bank import BankCounters, ExpertBank, WrappedBank
from expertstream.kernels import cpu_moe
from expertstream.log import get_logger

log = get_logger(__name__)


def cpu_experts(k: int, cpu_gbps: float, bus_gbps: float) -> int:
    """Routed experts a layer the CPU takes so that both sides finish together: n / cpu = (k - n) / bus."""
    if cpu_gbps <= 0 or bus_gbps <= 0:
        return 0
    return min(k, round(k * cpu_gbps / (cpu_gbps + bus_gbps)))


class SplitExperts(WrappedBank):
    """The GPU bank with a CPU share of each RAM-resident decode layer (see the module docstring).

    Args:
        gpu: the CUDA bank (`GpuExperts`): `resident`, `host_blocks`, `ram_rows(layer)` and the staged
            decode methods are used; any other attribute is the GPU bank's.
        workdir: the `Workdir` (layout, global scales, K).
        share: fraction of a layer's K routed experts the CPU computes (rounded to whole experts); < 0: chosen
            from `cpu_gbps` and `bus_gbps` so that both sides take the same time.
        threads: callable -> the CPU kernel's threads now (`CpuThreads`).
        bus_gbps: the host -> device rate (needed when share < 0).
        cpu_gbps: the CPU kernel's rate; None: measured on the RAM cache's rows.
    """

    def __init__(
        self,
        gpu: ExpertBank,
        workdir,
        share: float,
        threads: Callable[[], int],
        bus_gbps: float | None = None,
        cpu_gbps: float | None = None,
    ):
        super().__init__(gpu)
        self.layout, self.threads = workdir.layout, threads
        self.k = k = workdir.text_config["num_experts_per_tok"]
        self.ws2 = workdir.expert_scales()[0].float()  # [L, E, 3] on the host
        host = gpu.host_blocks
        usable = host is not None and cpu_moe.library() is not None
        self.cpu_gbps, self.bus_gbps = cpu_gbps, bus_gbps
        if not usable:
            self.n_cpu = 0
            log.warning("--cpu-moe-share needs the pinned RAM cache and the CPU kernel (a C compiler): off")
        else:
            if self.cpu_gbps is None:  # the bench's bound takes it in either case
                self.cpu_gbps = cpu_moe.layer_rate(host, self.layout, k, threads())
            self.n_cpu = (
                min(k, round(share * k)) if share >= 0 else cpu_experts(k, self.cpu_gbps, bus_gbps or 0)
            )
            bus = f"bus {bus_gbps:.1f} GB/s" if bus_gbps else "bus not measured"
            log.info("CPU share of RAM-resident decode: %d of %d experts a layer (CPU kernel %.1f GB/s, %s)",
                     self.n_cpu, k, self.cpu_gbps, bus)  # fmt: skip
        pin = host is not None and host.is_pinned()
        h = workdir.layout.hidden_size
        self._out = torch.empty(h, pin_memory=pin)  # the CPU's sum, uploaded from here
        self._host = torch.empty(2 * k + h, pin_memory=pin)  # the CPU's ids and weights, and x
        self._copied = torch.cuda.Event() if pin else None  # that copy landed
        self.cpu_blocks = 0  # routed blocks the CPU computed
        self.split_calls = 0  # decode layers run split
        self._seconds = self._sync_seconds = 0.0
        self._syncs = 0

    # the GPU bank's state (cache, scales, ...) for the bench; the interface is WrappedBank's
    def __getattr__(self, name):
        if name == "bank":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.bank, name)

    @property
    def host_syncs(self) -> int:
        return self.bank.host_syncs + self._syncs

    @property
    def splitting(self) -> bool:
        """Decode runs split: a CPU share is set and every block has a fixed RAM row."""
        return self.n_cpu > 0 and self.bank.resident == "ram"

    @property
    def decode_mode(self) -> str:
        return "eager" if self.splitting else self.bank.decode_mode

    def warm_up(self, dtype: torch.dtype) -> None:
        """The GPU bank's warm-up, then the decode kernel for the GPU side's K - n experts with FP32 input (K
        is a compile-time constant of its down kernel)."""
        from expertstream.kernels import nvfp4_moe

        self.bank.warm_up(dtype)
        if not self.n_cpu:
            return
        dev, h = self.bank.cache.device, self.layout.hidden_size
        e2s = torch.zeros(self.bank.num_experts, dtype=torch.int32, device=dev)
        if self.k > self.n_cpu:
            n = self.k - self.n_cpu
            ids, w = torch.zeros(n, dtype=torch.int64, device=dev), torch.ones(n, device=dev)
            nvfp4_moe.nvfp4_moe_decode(torch.zeros(1, h, device=dev), ids, e2s, self.bank.scales[0], w,
                                       self.layout, self.bank.cache.slots, self.bank.host_blocks)  # fmt: skip

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, **kw):
        if x.shape[0] != 1 or not self.splitting:  # prompts and batches (`segments`): the GPU bank's
            return self.bank(layer, x, expert_ids, weights, **kw)
        return self._split(layer, x, expert_ids, weights)

    def _split(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        t0 = time.perf_counter()
        g, n = self.k - self.n_cpu, self.n_cpu
        # the CPU's experts, their weights and x copied to the host first, then the GPU's kernel queued
        # behind the copy: the host waits for the copy alone while the bus carries the GPU's blocks
        packed = torch.cat((expert_ids[0, g:].float(), weights[0, g:].float(), x[0].float()))
        host = self._host[: packed.numel()]
        host.copy_(packed, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        y = None
        if g:
            y = self.bank.decode_compute(layer, x.float(), expert_ids[:, :g], weights[:, :g])
            self.bank.decode_fixed_reads(g)
            self.bank.decode_launched()
        t1 = time.perf_counter()
        if self._copied is not None:
            self._copied.synchronize()
        self._sync_seconds += time.perf_counter() - t1
        self._syncs += 1
        ids = host[:n].long().tolist()
        rows = self.bank.ram_rows(layer)  # [E] every block's RAM row
        blocks = [self.bank.host_blocks[int(rows[e])] for e in ids]
        wt, xh = host[n : 2 * n, None], host[2 * n :][None]
        part = cpu_moe.moe(blocks, self.ws2[layer, ids], wt, xh, self.layout, self.threads())
        # the previous layer's upload from _out is done: this layer's copy, queued after it, has landed
        self._out.copy_(part[0])
        cpu_sum = self._out.to(x.device, non_blocking=True, copy=True)[None]
        self.cpu_blocks += n
        self.split_calls += 1
        self._seconds += time.perf_counter() - t0
        return cpu_sum if y is None else y + cpu_sum  # FP32 [1, H]: the caller casts

    def counters(self) -> BankCounters:
        c = self.bank.counters()
        return dataclasses.replace(
            c,
            bank_decode_seconds=c.bank_decode_seconds + self._seconds,
            bank_sync_seconds=c.bank_sync_seconds + self._sync_seconds,
        )

    @property
    def cpu_bytes(self) -> int:
        """Expert block bytes the CPU read (its share of decode)."""
        return self.cpu_blocks * self.layout.payload_bytes
