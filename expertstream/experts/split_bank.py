"""A CPU share of GPU decode: with every expert block in the pinned RAM cache, the CPU computes some of each
layer's routed experts in place (kernels/cpu_moe.c on the RAM rows) while the bus carries the rest to the
GPU bank's decode kernel, and the two sums are added on the GPU.

`SplitExperts` composes a CUDA bank (experts/gpu_bank.py) and the CPU kernel through the bank interface
(experts/bank.py). Until every block has a fixed RAM row, and for prompts, it is the GPU bank. Once they have,
a one-token layer runs as the "split" decode mode's stages: the last n of the K routed experts (top-k
order: the smallest weights) go to the CPU, the first K - n to the GPU, a split that needs nothing from the
host. Eagerly, the CPU's ids, weights and x are copied to the host (split_send); the GPU's share is queued
behind that copy (split_gpu, in the decode graphs a captured launch); the host waits for the copy alone,
runs the CPU kernel while the bus carries the GPU's blocks and uploads its [H] sum (split_cpu); the sum is
added on the GPU (split_sum, captured with the rest of the layer).

A split layer then takes about d + max(CPU bytes / CPU rate, GPU bytes / bus rate) + the host work in
series (launch, gather, upload, the sync), against d + all its bytes over the bus in one graph: d, the
layer's dense GPU work, is in both, so the split pays only where the rest is shorter (`expert_seconds`).
`SplitTimes` holds where the time went, phase by phase, and with CUDA events the GPU's (the bench prints it).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable

import torch

from expertstream.experts.bank import BankCounters, ExpertBank, WrappedBank
from expertstream.kernels import cpu_moe
from expertstream.log import get_logger

log = get_logger(__name__)


def expert_seconds(
    k: int, n: int, block_bytes: int, cpu_gbps: float, bus_gbps: float, overhead_s: float = 0.0
) -> float:
    """Seconds a decode layer's k routed experts take beyond its dense GPU work, which a split layer waits
    for as the bus alone does: with n on the CPU, the slower of the CPU's n blocks and the bus's k - n,
    plus `overhead_s` of host work in series that a split layer adds (launches, gathering, the upload, the
    sync); with none, the bus's k."""
    bus = (k - n) * block_bytes / (bus_gbps * 1e9)
    if n == 0:
        return bus
    if cpu_gbps <= 0:
        return math.inf
    return max(n * block_bytes / (cpu_gbps * 1e9), bus) + overhead_s


def cpu_experts(
    k: int, cpu_gbps: float, bus_gbps: float, block_bytes: int = 1, overhead_s: float = 0.0
) -> int:
    """Routed experts a layer the CPU takes: the n whose layer takes least by `expert_seconds` (both sides
    about equal without overhead; 0 when no share beats the bus alone; the smaller n on a tie)."""
    if cpu_gbps <= 0 or bus_gbps <= 0:
        return 0
    return min(range(k + 1), key=lambda n: expert_seconds(k, n, block_bytes, cpu_gbps, bus_gbps, overhead_s))


@dataclasses.dataclass
class SplitTimes:
    """Where the split decode layers' time goes, in seconds summed over them: the decode thread's phases in
    order, then the GPU's, from CUDA events while `SplitExperts.gpu_timing` is on."""

    calls: int = 0  # split layers
    launch: float = 0.0  # x, ids and weights packed, their copy to the host queued, the GPU's share launched
    wait: float = 0.0  # waiting for that copy: the GPU work queued before it (the layer's dense part) + sync
    gather: float = 0.0  # the CPU's block addresses and scales gathered
    kernel: float = 0.0  # the CPU kernel (the C call)
    upload: float = 0.0  # the CPU's sum uploaded and added to the GPU's
    timed: int = 0  # split layers with GPU times
    gpu_share: float = 0.0  # GPU: the packing, its copy and the GPU's share of the experts
    gpu_idle: float = 0.0  # GPU: from there to the sum, mostly waiting for the CPU's
    gpu_dense: float = 0.0  # GPU: from a split layer's sum to the next layer's start (its dense work)
    dense_gaps: int = 0  # pairs of consecutive layers gpu_dense sums over

    @property
    def host(self) -> float:
        """The decode thread's time in split calls."""
        return self.launch + self.wait + self.gather + self.kernel + self.upload

    def __sub__(self, other: SplitTimes) -> SplitTimes:
        return SplitTimes(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


# how long the CPU kernel's idle threads spin before sleeping while decode splits: past a layer's dense GPU
# work (~0.4 ms for a full-shape layer on an H100), so that each call finds them running
SPLIT_SPIN_S = 0.002


class SplitExperts(WrappedBank):
    """The GPU bank with a CPU share of each RAM-resident decode layer (see the module docstring).

    Args:
        gpu: the CUDA bank (`GpuExperts`): `resident`, `host_blocks`, `ram_rows(layer)` and the staged
            decode methods are used; any other attribute is the GPU bank's.
        workdir: the `Workdir` (layout, global scales, K).
        share: fraction of a layer's K routed experts the CPU computes (rounded to whole experts); < 0: chosen
            from `cpu_gbps` and `bus_gbps` (`cpu_experts`), then once more from the kernel's rate and the
            host work measured in the first split tokens (`_adapt`), which may turn the share off.
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
                min(k, round(share * k))
                if share >= 0
                else cpu_experts(k, self.cpu_gbps, bus_gbps or 0, self.layout.payload_bytes)
            )
            if self.n_cpu:  # the pool's threads stay up over a layer's dense GPU work between two calls
                cpu_moe.set_spin(SPLIT_SPIN_S)
            bus = f"bus {bus_gbps:.1f} GB/s" if bus_gbps else "bus not measured"
            log.info("CPU share of RAM-resident decode: %d of %d experts a layer (CPU kernel %.1f GB/s, %s)",
                     self.n_cpu, k, self.cpu_gbps, bus)  # fmt: skip
        pin = host is not None and host.is_pinned()
        h = workdir.layout.hidden_size
        self._out = torch.empty(1, h, pin_memory=pin)  # the CPU's sum, uploaded from here
        self._host = torch.empty(2 * k + h, pin_memory=pin)  # the CPU's ids and weights, and x
        self._copied = torch.cuda.Event() if pin else None  # that copy landed
        self._sum = torch.empty(1, h, device=gpu.cache.device)  # the CPU's sum on the GPU, read by split_sum
        self._t0, self._ev = 0.0, ()  # the split layer's start and CUDA events, set by split_send
        # the CPU kernel's arguments, kept from call to call: ids, block addresses, global scales, scratch
        self._ids, self._ptrs = torch.empty(k, dtype=torch.long), torch.empty(k, dtype=torch.long)
        self._ws2, self._scratch = torch.empty(k, 3), torch.empty(cpu_moe.scratch_floats(self.layout, k, 1))
        self._addr: torch.Tensor | None = None  # [L, E] each block's address in the RAM cache
        self.cpu_blocks = 0  # routed blocks the CPU computed
        self.times = SplitTimes()
        self.kernel_log: collections.deque[float] = collections.deque(maxlen=4096)  # the last calls' kernel s
        self.gpu_timing = False  # record CUDA events per split layer for `split_times` (the bench)
        self._timed: list[tuple[int, tuple]] = []  # (layer, events) not read yet
        # the auto share is weighed again over split calls L + 1 .. 3L (L = layers: a token each)
        self.adapt_calls = (workdir.num_layers, 3 * workdir.num_layers) if share < 0 and bus_gbps else None
        self._since: SplitTimes | None = None

    # the GPU bank's state (cache, scales, ...) for the bench; the interface is WrappedBank's
    def __getattr__(self, name):
        if name == "bank":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.bank, name)

    @property
    def host_syncs(self) -> int:
        return self.bank.host_syncs + self.times.calls

    @property
    def splitting(self) -> bool:
        """Decode runs split: a CPU share is set and every block has a fixed RAM row."""
        return self.n_cpu > 0 and self.bank.resident == "ram"

    @property
    def decode_mode(self) -> str:
        return "split" if self.splitting else self.bank.decode_mode

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
        """A split layer eagerly: the stages the decode graphs run ("split" decode mode), in order."""
        self.split_send(layer, x, expert_ids, weights)
        part = self.split_gpu(layer, x, expert_ids, weights)
        self.split_launched()
        self.split_cpu(layer)
        return self.split_sum(part)

    # A split layer as stages (experts/bank.py, "split"): the decode graphs capture split_gpu and split_sum,
    # and run split_send and split_cpu eagerly between them.

    def split_send(self, layer: int, x, expert_ids, weights) -> None:
        """Eager: the CPU's experts, their weights and x [1, H] copied to the pinned host buffer, an event
        behind the copy; the GPU's share is queued after it, so the host waits for the copy alone."""
        self._t0 = time.perf_counter()
        g = self.k - self.n_cpu
        if self.gpu_timing:
            self._ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            self._ev[0].record()
        packed = torch.cat((expert_ids[0, g:].float(), weights[0, g:].float(), x[0].float()))
        self._host[: packed.numel()].copy_(packed, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def split_gpu(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        """Graphable: the GPU bank's decode kernel on the first K - n routed experts, x in FP32 -> [1, H]."""
        g = self.k - self.n_cpu
        if not g:
            return torch.zeros(1, self.layout.hidden_size, device=x.device)
        return self.bank.decode_compute(layer, x.float(), expert_ids[:, :g], weights[:, :g])

    def split_launched(self) -> None:
        """The GPU's share is queued: its reads counted, the GPU bank told."""
        g = self.k - self.n_cpu
        if g:
            self.bank.decode_fixed_reads(g)
            self.bank.decode_launched()

    def split_cpu(self, layer: int) -> None:
        """Eager: wait for the copy, run the C kernel on the CPU's n experts from their RAM rows, upload its
        sum into the fixed device buffer `split_sum` reads."""
        n, times, ev = self.n_cpu, self.times, self._ev if self.gpu_timing else None
        t1 = time.perf_counter()
        if ev:
            ev[1].record()
        if self._copied is not None:
            self._copied.synchronize()
        t2 = time.perf_counter()
        host, h = self._host, self.layout.hidden_size
        ids = self._ids[:n].copy_(host[:n])  # float -> int64
        ptrs, ws2 = self._ptrs[:n], self._ws2[:n]
        torch.index_select(self._rows(layer), 0, ids, out=ptrs)
        torch.index_select(self.ws2[layer], 0, ids, out=ws2)
        t3 = time.perf_counter()
        # into the upload buffer: the previous layer's upload from it is done, since this layer's copy,
        # queued after it, has landed
        cpu_moe.moe_into(ptrs, ws2, host[n : 2 * n, None], host[2 * n : 2 * n + h][None], self._out,
                         self._scratch, self.layout, self.threads())  # fmt: skip
        t4 = time.perf_counter()
        self._sum.copy_(self._out, non_blocking=True)  # the previous layer's sum has been read by now
        if ev:
            ev[2].record()
            self._timed.append((layer, ev))
        self.cpu_blocks += n
        t5 = time.perf_counter()
        times.calls += 1
        times.launch += t1 - self._t0
        times.wait += t2 - t1
        times.gather += t3 - t2
        times.kernel += t4 - t3
        self.kernel_log.append(t4 - t3)
        times.upload += t5 - t4
        if self.adapt_calls and times.calls in self.adapt_calls:
            self._adapt()

    def split_sum(self, part: torch.Tensor) -> torch.Tensor:
        """Graphable: the GPU's share plus the CPU's uploaded sum, FP32 [1, H] (the caller casts)."""
        return part + self._sum

    def _adapt(self) -> None:
        """At the first of `adapt_calls`, note the times; at the second, weigh the share again with what the
        calls between measured: the CPU kernel's rate in place (beside the bus's reads of the same RAM,
        against the rate measured alone at start) and the host work a split layer adds in series (launch,
        gather, upload; a lower bound: the sync's latency is not in it). Where the bus alone is faster the
        share turns off (decode becomes the GPU bank's "fixed" program); it never moves to another n, whose
        shapes the captured decode graphs do not hold: the log names the best n for --cpu-moe-share."""
        if self._since is None:
            self._since = dataclasses.replace(self.times)
            return
        t, self.adapt_calls = self.times - self._since, None
        k, n, payload = self.k, self.n_cpu, self.layout.payload_bytes
        rate = n * payload * t.calls / t.kernel / 1e9 if t.kernel > 0 else 0.0
        overhead = (t.launch + t.gather + t.upload) / t.calls
        keep = expert_seconds(k, n, payload, rate, self.bus_gbps, overhead) < expert_seconds(
            k, 0, payload, rate, self.bus_gbps
        )
        best = cpu_experts(k, rate, self.bus_gbps, payload, overhead)
        log.info("CPU share weighed again over %d split layers: kernel %.1f GB/s in place (%.1f alone), %.0f "
                 "us of host work a layer: %d of %d experts on the CPU %s (the best at these rates: %d, "
                 "--cpu-moe-share %.2f)", t.calls, rate, self.cpu_gbps, overhead * 1e6, n, k,
                 "kept" if keep else "lose to the bus alone: off", best, best / k)  # fmt: skip
        if not keep:
            self.n_cpu = 0

    def _rows(self, layer: int) -> torch.Tensor:
        """[E] int64: the address of each of `layer`'s blocks in the RAM cache (their rows are fixed for good
        once every block has one: the table is made at the first split call)."""
        if self._addr is None:
            rows = torch.stack([torch.from_numpy(self.bank.ram_rows(i)) for i in range(self.ws2.shape[0])])
            host = self.bank.host_blocks
            self._addr = rows.long() * host.stride(0) + host.data_ptr()
        return self._addr[layer]

    def split_times(self) -> SplitTimes:
        """A copy of the split layers' times so far; with `gpu_timing`, waits for the GPU to read the events
        recorded since the last call (stats only, never on the decode path)."""
        if self._timed:
            self._timed[-1][1][2].synchronize()
            t, prev = self.times, None
            for layer, ev in self._timed:
                t.timed += 1
                t.gpu_share += ev[0].elapsed_time(ev[1]) / 1e3
                t.gpu_idle += ev[1].elapsed_time(ev[2]) / 1e3
                if prev is not None and layer == prev[0] + 1:  # the dense GPU work between the two
                    t.gpu_dense += prev[1][2].elapsed_time(ev[0]) / 1e3
                    t.dense_gaps += 1
                prev = (layer, ev)
            self._timed = []
        return dataclasses.replace(self.times)

    def counters(self) -> BankCounters:
        c, t = self.bank.counters(), self.times
        return dataclasses.replace(
            c,
            bank_decode_seconds=c.bank_decode_seconds + t.host,
            bank_sync_seconds=c.bank_sync_seconds + t.wait,
        )

    @property
    def cpu_bytes(self) -> int:
        """Expert block bytes the CPU read (its share of decode)."""
        return self.cpu_blocks * self.layout.payload_bytes
