"""A CPU share of GPU decode: with every expert block in the pinned RAM cache, the CPU computes some of each
layer's routed experts in place (kernels/cpu_moe.c on the RAM rows) while the bus carries the rest to the
GPU bank's decode kernel, and the two sums are added on the GPU.

`SplitExperts` composes a CUDA bank (experts/gpu_bank.py) and the CPU kernel through the bank interface
(experts/bank.py). Until every block has a fixed RAM row, and for prompts, it is the GPU bank. Once they have,
a one-token call is host work ("eager" decode mode: the decode graphs keep the rest of the layer captured):
one read-back of the routing ids, weights and x (the layer's one sync), the GPU kernel launched on its
experts, the CPU kernel run on the others meanwhile, its [H] sum uploaded and added. A layer's time is then
about max(bus bytes / bus rate, CPU bytes / CPU rate) plus the sync, instead of all its bytes over the bus.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from expertstream.experts.bank import BankCounters, ExpertBank
from expertstream.kernels import cpu_moe
from expertstream.log import get_logger

log = get_logger(__name__)


def cpu_experts(k: int, cpu_gbps: float, bus_gbps: float) -> int:
    """Routed experts a layer the CPU takes so that both sides finish together: n / cpu = (k - n) / bus."""
    if cpu_gbps <= 0 or bus_gbps <= 0:
        return 0
    return min(k, round(k * cpu_gbps / (cpu_gbps + bus_gbps)))


def split_routed(ids: list[int], in_ram: list[bool], share: float) -> tuple[list[int], list[int]]:
    """(CPU positions, GPU positions) among a token's K routed experts: the CPU takes `share` of those whose
    block decode would read from RAM (rounded), the last ones (top-k lists them by falling weight: the
    CPU's sum, rounded differently from the GPU's, carries the smallest weights); blocks in VRAM (the hot
    set) stay on the GPU, where they cross no bus."""
    ram = [j for j in range(len(ids)) if in_ram[j]]
    cpu = ram[::-1][: round(share * len(ram))]
    return sorted(cpu), [j for j in range(len(ids)) if j not in cpu]


class SplitExperts(ExpertBank):
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
        self.gpu, self.layout, self.threads = gpu, workdir.layout, threads
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
        self._out = torch.empty(workdir.layout.hidden_size, pin_memory=host is not None and host.is_pinned())
        self.cpu_blocks = 0  # routed blocks the CPU computed
        self.split_calls = 0  # decode layers run split
        self._seconds = self._sync_seconds = 0.0
        self._syncs = 0

    # the GPU bank's state, and anything this bank does not change
    def __getattr__(self, name):
        if name == "gpu":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.gpu, name)

    @property
    def spec(self):
        return self.gpu.spec

    @property
    def resident(self):
        return self.gpu.resident

    @property
    def stall_seconds(self) -> float:
        return self.gpu.stall_seconds

    @property
    def host_syncs(self) -> int:
        return self.gpu.host_syncs + self._syncs

    @property
    def splitting(self) -> bool:
        """Decode runs split: a CPU share is set and every block has a fixed RAM row."""
        return self.n_cpu > 0 and self.gpu.resident == "ram" and self.gpu.control == "none"

    @property
    def decode_mode(self) -> str:
        return "eager" if self.splitting else self.gpu.decode_mode

    # the staged decode and the settings: the GPU bank's (ExpertBank defines them, so no __getattr__)
    def set_router_weights(self, routers):
        self.gpu.set_router_weights(routers)

    def set_prefill_chunk(self, tokens):
        self.gpu.set_prefill_chunk(tokens)

    def decode_want(self, layer, x, expert_ids):
        return self.gpu.decode_want(layer, x, expert_ids)

    def decode_prepare(self, layer, want, k):
        self.gpu.decode_prepare(layer, want, k)

    def decode_compute(self, layer, x, expert_ids, weights):
        return self.gpu.decode_compute(layer, x, expert_ids, weights)

    def decode_stage(self, layer, want, k):
        self.gpu.decode_stage(layer, want, k)

    def decode_stage_first(self, x):
        self.gpu.decode_stage_first(x)

    def decode_join(self):
        self.gpu.decode_join()

    def decode_launched(self):
        self.gpu.decode_launched()

    def decode_fixed_reads(self, n):
        self.gpu.decode_fixed_reads(n)

    def warm_up(self, dtype: torch.dtype) -> None:
        """The GPU bank's warm-up, then the decode kernel for every expert count the GPU side may get with
        FP32 input (K is a compile-time constant of its down kernel)."""
        from expertstream.kernels import nvfp4_moe

        self.gpu.warm_up(dtype)
        if not self.n_cpu:
            return
        dev, h = self.gpu.cache.device, self.layout.hidden_size
        e2s = torch.zeros(self.gpu.num_experts, dtype=torch.int32, device=dev)
        for n in range(max(1, self.k - self.n_cpu), self.k + 1):
            ids, w = torch.zeros(n, dtype=torch.int64, device=dev), torch.ones(n, device=dev)
            nvfp4_moe.nvfp4_moe_decode(torch.zeros(1, h, device=dev), ids, e2s, self.gpu.scales[0], w,
                                       self.layout, self.gpu.cache.slots, self.gpu.host_blocks)  # fmt: skip

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] != 1 or not self.splitting:
            return self.gpu(layer, x, expert_ids, weights)
        return self._split(layer, x, expert_ids, weights)

    def _split(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        t0 = time.perf_counter()
        k = expert_ids.shape[1]
        # the layer's one sync: ids, weights and x read back together
        packed = torch.cat((expert_ids[0].float(), weights[0].float(), x[0].float())).cpu()
        t1 = time.perf_counter()
        self._syncs += 1
        ids = packed[:k].long().tolist()
        rows = self.gpu.ram_rows(layer)  # [E] RAM row, -1 where decode reads VRAM (the hot set)
        on_cpu, on_gpu = split_routed(ids, [rows[e] >= 0 for e in ids], self.n_cpu / k)
        y = None
        if on_gpu:  # queued first: the bus carries its blocks while the CPU computes
            sel = torch.tensor(on_gpu).to(x.device, non_blocking=True)
            y = self.gpu.decode_compute(layer, x.float(), expert_ids[:, sel], weights[:, sel])
            self.gpu.decode_fixed_reads(len(on_gpu))
            self.gpu.decode_launched()
        if on_cpu:
            blocks = [self.gpu.host_blocks[int(rows[ids[j]])] for j in on_cpu]
            wt = packed[k:][on_cpu][:, None]  # [n, 1]
            ws2 = self.ws2[layer, [ids[j] for j in on_cpu]]
            part = cpu_moe.moe(blocks, ws2, wt, packed[2 * k :][None], self.layout, self.threads())
            self._out.copy_(part[0])  # the previous layer's upload is done: its sync came after it
            cpu_sum = self._out.to(x.device, non_blocking=True, copy=True)[None]
            y = cpu_sum if y is None else y + cpu_sum
            self.cpu_blocks += len(on_cpu)
        self.split_calls += 1
        self._sync_seconds += t1 - t0
        self._seconds += time.perf_counter() - t0
        return y  # FP32 [1, H]: the caller casts

    def counters(self) -> BankCounters:
        c = self.gpu.counters()
        return dataclasses.replace(
            c,
            bank_decode_seconds=c.bank_decode_seconds + self._seconds,
            bank_sync_seconds=c.bank_sync_seconds + self._sync_seconds,
        )

    @property
    def cpu_bytes(self) -> int:
        """Expert block bytes the CPU read (its share of decode)."""
        return self.cpu_blocks * self.layout.payload_bytes

    def close(self) -> None:
        self.gpu.close()
