"""A CPU share of GPU decode: with every expert block in the pinned RAM cache, the CPU computes some of each
layer's routed experts in place (kernels/cpu_moe.c on the RAM rows) while the bus carries the rest to the
GPU bank's decode kernel, and the two sums are added on the GPU.

`SplitExperts` composes a CUDA bank (experts/gpu_bank.py) and the CPU kernel through the bank interface
(experts/bank.py). Until every block has a fixed RAM row, and for prompts, it is the GPU bank. Once they have,
a one-token layer runs as the "split" decode mode's stages: the K routed experts are ordered with those
the GPU reads from VRAM (hot set, staged guesses) first and the rest in top-k order; the last n go to the
CPU, the first K - n to the GPU, a split that needs nothing from the host. split_send orders them, packs
the CPU's ids, weights and x into one buffer and copies it to pinned host memory, an event behind the
copy; split_gpu queues the GPU's share behind it (a kernel copies its blocks into the GPU bank's copy rows,
where the engine gives it K of them, then the decode kernel reads them from VRAM: a few blocks read in
place leave the bus partly idle); split_cpu (eager) waits for that event alone, runs the C kernel (which
gathers the blocks from the layer's address table itself) while the bus carries the GPU's blocks;
split_sum uploads the CPU's [H] sum and adds it. Where the device captures a copy to pinned memory and an
external event (`send_capturable`, probed once), split_send is captured too,
so the decode graphs keep one eager point a layer (split_cpu) and replay one graph between two of them.

A split layer then takes about d + max(CPU bytes / CPU rate, GPU bytes / bus rate) (the CPU's side holds
the sync and the kernel's call), against d + all its bytes over the bus: d, the layer's dense GPU work, is
in both, so the split pays only where the rest is shorter (`expert_seconds`, the first choice); once split
layers are timed, the CPU side's fixed cost joins it (`weighed_experts`). `SplitTimes` holds where the
time went, phase by phase, and with CUDA events the GPU's (the bench prints it). The kernel runs on the
free cores less `SPARE_CORES` unless --threads says otherwise (`split_threads`): on every core its spinning
pool starves the decode thread and the driver's.
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
from expertstream.kernels.stage_blocks import stage_blocks
from expertstream.log import get_logger

log = get_logger(__name__)


def expert_seconds(k: int, n: int, block_bytes: int, cpu_gbps: float, bus_gbps: float) -> float:
    """Seconds a decode layer's k routed experts take beyond its dense GPU work, which a split layer waits
    for as the bus alone does: with n on the CPU, the slower of the CPU's n blocks (the kernel's call,
    gathering its blocks included) and the bus's k - n; with none, the bus's k."""
    bus = (k - n) * block_bytes / (bus_gbps * 1e9)
    if n == 0:
        return bus
    if cpu_gbps <= 0:
        return math.inf
    return max(n * block_bytes / (cpu_gbps * 1e9), bus)


def cpu_experts(
    k: int, cpu_gbps: float, bus_gbps: float, block_bytes: int = 1, alone_gbps: float | None = None
) -> int:
    """Routed experts a layer the CPU takes: the n whose layer takes least by `expert_seconds` (both sides
    about equal), 0 when no share beats the bus alone, at `alone_gbps` when given (the bus's rate without
    the CPU reading the same RAM); the smaller n on a tie."""
    if cpu_gbps <= 0 or bus_gbps <= 0:
        return 0

    def cost(n: int) -> float:
        return expert_seconds(k, n, block_bytes, cpu_gbps, alone_gbps if n == 0 and alone_gbps else bus_gbps)

    return min(range(k + 1), key=cost)


def weighed_experts(k: int, cpu_block: float, gpu_block: float, fixed: float, alone: float) -> int:
    """Routed experts a layer the CPU takes once split layers were timed: the n whose layer takes least,
    max(fixed + n cpu_block, (k - n) gpu_block) seconds beyond its dense work (cpu_block and gpu_block:
    seconds a block on each side as measured, fixed: the CPU side's cost beyond its blocks), or `alone`
    (the bus alone's k blocks) for n = 0; the smaller n on a tie."""

    def cost(n: int) -> float:
        return alone if n == 0 else max(fixed + n * cpu_block, (k - n) * gpu_block)

    return min(range(k + 1), key=cost)


@dataclasses.dataclass
class SplitTimes:
    """Where the split decode layers' time goes, in seconds summed over them: the decode thread's phases in
    order, then the GPU's, from CUDA events while `SplitExperts.gpu_timing` is on."""

    calls: int = 0  # split layers
    launches: int = 0  # ... of which `launch` holds (each but a token's first)
    launch: float = 0.0  # from a split layer's end to the next one's wait (in a token): the stages between
    wait: float = 0.0  # for the CPU's x: the GPU work queued before it (the layer's dense part), the sync
    kernel: float = 0.0  # the CPU kernel (the C call: it gathers the blocks and scales, then computes)
    timed: int = 0  # split layers with GPU times
    gpu_share: float = 0.0  # GPU: from the send's end (order, packing, copy), the GPU's share of the experts
    gpu_idle: float = 0.0  # GPU: from there until the CPU's sum is computed (waiting for it)
    gpu_dense: float = 0.0  # GPU: from there to the next layer's start (upload, add, its dense work)
    dense_gaps: int = 0  # pairs of consecutive layers gpu_dense sums over

    @property
    def host(self) -> float:
        """The decode thread's time in split calls."""
        return self.launch + self.wait + self.kernel

    def __sub__(self, other: SplitTimes) -> SplitTimes:
        return SplitTimes(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


# how long the CPU kernel's idle threads spin before sleeping while decode splits: past a layer's dense GPU
# work (~0.4 ms for a full-shape layer on an H100), so that each call finds them running
SPLIT_SPIN_S = 0.002
# cores the kernel's threads leave to the rest of this process by default: the decode thread, the driver's
SPARE_CORES = 2


def split_threads(threads) -> Callable[[], int]:
    """The CPU share's threads from a `CpuThreads`: `--threads` as given, else its free cores less
    SPARE_CORES (at least 1)."""
    return lambda: threads.fixed or max(1, threads() - SPARE_CORES)


def send_capturable(device: torch.device) -> bool:
    """Whether a CUDA graph here holds split_send: a copy into pinned host memory and an external event the
    host waits on after a replay. Probed with a graph that sleeps on the GPU before the copy, so an event
    that did not wait for it would leave the old value."""
    try:
        src, dst = torch.zeros(1, device=device), torch.zeros(1, pin_memory=True)
        done, graph, stream = (
            torch.cuda.Event(external=True),
            torch.cuda.CUDAGraph(),
            torch.cuda.Stream(device),
        )
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                torch.cuda._sleep(1 << 20)  # ~0.5 ms
                dst.copy_(src, non_blocking=True)
                done.record()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        ok = True
        for value in (1.0, 2.0):
            src.fill_(value)
            graph.replay()
            done.synchronize()
            ok &= dst.item() == value
        torch.cuda.synchronize(device)
        why = "the host's wait on the captured event did not hold"
    except (RuntimeError, TypeError) as e:  # TypeError: a torch without Event(external=...)
        ok, why = False, str(e)
    if not ok:
        log.info("split_send stays eager: %s", why)
    return ok


class SplitExperts(WrappedBank):
    """The GPU bank with a CPU share of each RAM-resident decode layer (see the module docstring).

    Args:
        gpu: the CUDA bank (`GpuExperts`): `resident`, `host_blocks`, `ram_rows(layer)` and the staged
            decode methods are used; any other attribute is the GPU bank's.
        workdir: the `Workdir` (layout, global scales, K).
        share: fraction of a layer's K routed experts the CPU computes (rounded to whole experts); < 0: chosen
            from `cpu_gbps` and `bus_gbps` (`cpu_experts`), then once more from the rates and host work
            measured in the first split tokens (`weigh`), which may move the share or turn it off.
        threads: callable -> the CPU kernel's threads now (`split_threads`).
        bus_gbps: the host -> device rate (needed when share < 0).
        cpu_gbps: the CPU kernel's rate; None: measured on the RAM cache's rows on `threads()` threads.
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
        self.last_layer = workdir.num_layers - 1
        self.ws2 = workdir.expert_scales()[0].float().contiguous()  # [L, E, 3] on the host
        host = gpu.host_blocks
        usable = host is not None and cpu_moe.library() is not None and k <= cpu_moe.NMAX
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
            log.info("CPU share of RAM-resident decode: %d of %d experts a layer (CPU kernel %.1f GB/s on %d "
                     "threads, %s)", self.n_cpu, k, self.cpu_gbps, threads(), bus)  # fmt: skip
        pin = host is not None and host.is_pinned()
        h, dev = workdir.layout.hidden_size, gpu.cache.device
        self.captured_send = bool(self.n_cpu) and pin and send_capturable(dev)  # split_send in the graphs
        # the routed experts [1, K] and weights in the order split_send gives them (the GPU's first)
        self._ids = torch.zeros(1, k, dtype=torch.int64, device=dev)
        self._w = torch.zeros(1, k, device=dev)
        self._pos = torch.arange(k, device=dev)
        self._dev = torch.empty(2 * k + h, device=dev)  # the CPU's ids and weights, and x, packed on the GPU
        self._host = torch.empty(2 * k + h, pin_memory=pin)  # ... copied here
        # that copy landed (external: a captured record is a node the host can wait on after a replay)
        self._copied = (
            (torch.cuda.Event(external=True) if self.captured_send else torch.cuda.Event()) if pin else None
        )
        self._out = torch.empty(1, h, pin_memory=pin)  # the CPU's sum, uploaded from here by split_sum
        self._sum = torch.empty(1, h, device=dev)  # ... to here
        self._scratch = torch.empty(cpu_moe.scratch_floats(self.layout, k, 1))
        self._addr: torch.Tensor | None = None  # [L, E] each block's address in the RAM cache
        self._ended: tuple[int, float] | None = None  # the last split layer and when its call ended
        self._ev: tuple = ()  # the split layer's CUDA events, set by split_send
        self.cpu_blocks = 0  # routed blocks the CPU computed
        self.times = SplitTimes()
        self.kernel_log: collections.deque[float] = collections.deque(maxlen=4096)  # the last calls' kernel s
        self.gpu_timing = False  # record CUDA events per split layer for `split_times` (the bench)
        self._timed: list[tuple[int, tuple]] = []  # (layer, events) not read yet
        # the auto share is weighed again over the split calls after the first L up to 3L (L = layers: a
        # token each), at a token's last layer, with the GPU's times on (CUDA events) meanwhile
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

    @property
    def send_in_graph(self) -> bool:
        """split_send is graphable now: the device captures it, and no CUDA events are timed per layer."""
        return self.captured_send and not self.gpu_timing

    @property
    def decode_key(self) -> tuple:
        if not self.splitting:
            return self.bank.decode_key
        return (*self.bank.decode_key, self.n_cpu, self.send_in_graph)

    def warm_up(self, dtype: torch.dtype) -> None:
        """The GPU bank's warm-up, then the decode kernel for the GPU side's K - n experts (`_warm_share`)."""
        self.bank.warm_up(dtype)
        self._warm_share()

    def _warm_share(self) -> None:
        """The decode kernel for the GPU side's K - n experts with FP32 input compiled (K is a compile-time
        constant of its down kernel): before a capture, which cannot compile."""
        from expertstream.kernels import nvfp4_moe

        if not self.n_cpu or self.k == self.n_cpu:
            return
        dev, h, n = self.bank.cache.device, self.layout.hidden_size, self.k - self.n_cpu
        e2s = torch.zeros(self.bank.num_experts, dtype=torch.int32, device=dev)
        ids, w = torch.zeros(n, dtype=torch.int64, device=dev), torch.ones(n, device=dev)
        if self.copies:  # its copy kernel (every entry of e2s a slot: nothing is copied)
            stage_blocks(ids[:1], e2s, self.bank.host_blocks, self.bank.cache.slots, 0, e2s.clone())
        nvfp4_moe.nvfp4_moe_decode(torch.zeros(1, h, device=dev), ids, e2s, self.bank.scales[0], w,
                                   self.layout, self.bank.cache.slots, self.bank.host_blocks)  # fmt: skip

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, **kw):
        if x.shape[0] != 1 or not self.splitting:  # prompts and batches (`segments`): the GPU bank's
            return self.bank(layer, x, expert_ids, weights, **kw)
        return self._split(layer, x, expert_ids, weights)

    def _split(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        """A split layer eagerly: the stages the decode graphs run ("split" decode mode), in order."""
        self.split_send(layer, x, expert_ids, weights)
        part = self.split_gpu(layer, x)
        self.split_launched()
        self.split_cpu(layer)
        return self.split_sum(part)

    # A split layer as stages (experts/bank.py, "split"): the decode graphs capture split_gpu and split_sum,
    # split_send where `send_in_graph`, and run the others eagerly between them.

    def split_send(self, layer: int, x, expert_ids, weights) -> None:
        """The routed experts ordered so that those the GPU reads from VRAM (its hot set, guesses staged for
        the layer) come first, the rest after them in top-k order: the CPU takes the last n, blocks that
        would otherwise cross the bus. Its experts, their weights and x [1, H] are packed as FP32 into a
        fixed device buffer, copied to the pinned host buffer, an event behind the copy; the GPU's share is
        queued after it, so the host waits for the copy alone."""
        g, k = self.k - self.n_cpu, self.k
        if self.bank.decode_reads_vram:  # else every block crosses the bus: top-k order as it is
            order = (self._pos + k * self.bank.decode_in_vram(layer, expert_ids[0]).logical_not()).argsort()
            expert_ids, weights = expert_ids.index_select(1, order), weights.index_select(1, order)
        self._ids.copy_(expert_ids)
        self._w.copy_(weights)
        m = 2 * self.n_cpu + self.layout.hidden_size
        torch.cat((self._ids[0, g:].float(), self._w[0, g:], x[0].float()), out=self._dev[:m])
        self._host[:m].copy_(self._dev[:m], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.gpu_timing:  # timed tokens send eagerly: the GPU's share is timed from the send's end, so
            # that the eager launches of the order and the packing do not count as its time
            self._ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            self._ev[0].record()

    @property
    def copies(self) -> bool:
        """The GPU's share is copied into VRAM rows of its own before its kernel reads it (the GPU bank has
        K copy rows); else the kernel reads it in place."""
        return self.bank.copy_rows >= self.k

    def split_gpu(self, layer: int, x) -> torch.Tensor:
        """Graphable: the GPU bank's decode kernel on the first K - n experts of split_send's order, x in
        FP32 -> [1, H]."""
        g = self.k - self.n_cpu
        if not g:
            return torch.zeros(1, self.layout.hidden_size, device=x.device)
        return self.bank.decode_compute(layer, x.float(), self._ids[:, :g], self._w[:, :g], copy=self.copies)

    def split_launched(self) -> None:
        """The GPU's share is queued: its reads counted, the GPU bank told."""
        g = self.k - self.n_cpu
        if g:
            self.bank.decode_fixed_reads(g)
            self.bank.decode_launched()

    def split_cpu(self, layer: int) -> None:
        """Eager: wait for the copy, run the C kernel on the CPU's n experts from their RAM rows into the
        pinned buffer split_sum uploads (the previous layer's upload from it is done: this layer's copy,
        queued after it, has landed)."""
        n, times, ev = self.n_cpu, self.times, self._ev if self.gpu_timing else None
        t1 = time.perf_counter()
        if ev:
            ev[1].record()
        if self._copied is not None:
            self._copied.synchronize()
        t2 = time.perf_counter()
        if self._addr is None:
            self._addr = self._addresses()
        cpu_moe.moe_packed(self._addr[layer], self.ws2[layer], self._host, n, self._out, self._scratch,
                           self.layout, self.threads())  # fmt: skip
        t3 = time.perf_counter()
        if ev:  # the GPU idles from ev[1] to here (it waits for the CPU's sum)
            ev[2].record()
            self._timed.append((layer, ev))
        self.cpu_blocks += n
        times.calls += 1
        if self._ended is not None and self._ended[0] == layer - 1:  # since the previous layer's call
            times.launches += 1
            times.launch += t1 - self._ended[1]
        times.wait += t2 - t1
        times.kernel += t3 - t2
        self.kernel_log.append(t3 - t2)
        if self.adapt_calls and layer == self.last_layer:  # between tokens: the next one may run another n
            self._adapt()
        self._ended = (layer, time.perf_counter())

    def split_sum(self, part: torch.Tensor) -> torch.Tensor:
        """Graphable: the CPU's sum uploaded, plus the GPU's share, FP32 [1, H] (the caller casts)."""
        self._sum.copy_(self._out, non_blocking=True)
        return part + self._sum

    def _adapt(self) -> None:
        """At a token's end past the first of `adapt_calls`: note the times and turn the GPU's on; past the
        second, `weigh` the share with what the calls between measured."""
        if self._since is None:
            if self.times.calls >= self.adapt_calls[0]:
                self._since, self.gpu_timing = self.split_times(), self._copied is not None  # on CUDA
            return
        if self.times.calls < self.adapt_calls[1]:
            return
        t, self.adapt_calls, self.gpu_timing = self.split_times() - self._since, None, False
        self.weigh(t)

    def weigh(self, t: SplitTimes) -> None:
        """The share chosen again from the split layers' times `t`: a block's time on the CPU (its kernel
        calls, in place beside the bus's reads of the same RAM) and on the GPU (its share's CUDA events,
        when `t` has them; else the bus rate measured at start), and the CPU side's cost beyond its blocks:
        where the GPU waited for the CPU's sum, the GPU's share plus that wait less the CPU's call (the
        host's wake on the x copy, which a rate alone leaves out). It moves to the n that
        `weighed_experts` finds best: 0 (off: the GPU bank's "fixed" program) where the bus alone, at the
        rate measured at start, is faster; the decode graphs capture the new program (`decode_key`)."""
        k, n, payload = self.k, self.n_cpu, self.layout.payload_bytes
        call = t.kernel / t.calls  # a layer's CPU call, s
        cpu_block = call / n if call > 0 else math.inf
        timed = t.timed and t.gpu_share > 0 and k > n
        share = t.gpu_share / t.timed if timed else 0.0  # a layer's GPU share, s
        gpu_block = share / (k - n) if timed else payload / (self.bus_gbps * 1e9)
        waited = t.gpu_idle / t.timed if timed else 0.0
        fixed = max(0.0, share + waited - call) if waited > 0 else 0.0
        best = weighed_experts(k, cpu_block, gpu_block, fixed, k * payload / (self.bus_gbps * 1e9))
        moved = "kept" if best == n else f"-> {best}" + (" (off)" if not best else "")
        log.info("CPU share weighed again over %d split layers: kernel %.1f GB/s in place (%.1f alone), the "
                 "GPU's share %.1f GB/s (%s; the bus alone %.1f), the CPU side's fixed cost %.3f ms: %d of "
                 "%d experts on the CPU %s", t.calls, payload / cpu_block / 1e9, self.cpu_gbps,
                 payload / gpu_block / 1e9, "CUDA events" if timed else "not timed", self.bus_gbps,
                 fixed * 1e3, n, k, moved)  # fmt: skip
        self.n_cpu = best
        if best and best != n:
            self._warm_share()

    def _addresses(self) -> torch.Tensor:
        """[L, E] int64: the address of each block in the RAM cache (their rows are fixed for good once
        every block has one: the table is made at the first split call)."""
        rows = torch.stack([torch.from_numpy(self.bank.ram_rows(i)) for i in range(self.ws2.shape[0])])
        host = self.bank.host_blocks
        return (rows.long() * host.stride(0) + host.data_ptr()).contiguous()

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
