"""A CPU share of GPU decode: with every expert block in the pinned RAM cache, the CPU computes some of each
layer's routed experts in place (kernels/cpu_moe.c on the RAM rows) while the bus carries the rest to the
GPU bank's decode kernel, and the two sums are added on the GPU.

`SplitExperts` composes a CUDA bank (experts/gpu_bank.py) and the CPU kernel through the bank interface
(experts/bank.py). Until every block has a fixed RAM row, and for prompts, it is the GPU bank. Once they have,
a one-token layer runs as the "split" decode mode's stages, all device work: the K routed experts are
ordered with those the GPU reads from VRAM (hot set, staged guesses) first and the rest in top-k order; the
last n go to the CPU, the first K - n to the GPU, a split that needs nothing from the host. split_send
orders them, packs the CPU's ids, weights and x into one buffer and posts it to the split server through a
pinned mailbox (kernels/mailbox.py); split_gpu queues the GPU's share behind it (where the engine gives the
GPU bank K copy rows, a kernel first copies its RAM blocks there, then the decode kernel reads them from
VRAM: a few blocks read in place leave the bus partly idle); split_take spins on the GPU until the server's
answer lands and adds it. The server (`cpu_moe.SplitServer`, a C thread) spins on the mailbox, gathers the
request's blocks from the layers' address table and runs the kernel while the bus carries the GPU's blocks.
No host call or sync sits between a layer's GPU and CPU work, so the decode graphs replay a token without an
eager point for the split; the host only arms the server once a token is queued (`split_launched`).

A split layer then takes about d + max(CPU bytes / CPU rate, GPU bytes / bus rate) (the CPU's side holds
the mailbox's two bus round trips and the kernel), against d + all its bytes over the bus: d, the layer's
dense GPU work, is in both, so the split pays only where the rest is shorter (`expert_seconds`, the first
choice); the auto share then tunes itself by token time (`ShareTuner`), 0 included. `SplitTimes`
holds where the time went: the server's kernel calls, and with CUDA events the GPU's (the bench prints it).
The kernel runs on the free cores less `SPARE_CORES` unless --threads says otherwise (`split_threads`): on
every core its spinning pool starves the decode thread and the driver's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from expertstream.experts.bank import ExpertBank, WrappedBank
from expertstream.kernels import cpu_moe, mailbox
from expertstream.kernels.stage_blocks import stage_blocks
from expertstream.log import get_logger

log = get_logger(__name__)


def expert_seconds(
    k: int, n: int, block_bytes: int, cpu_gbps: float, bus_gbps: float, in_vram: float = 0.0
) -> float:
    """Seconds a decode layer's k routed experts take beyond its dense GPU work, which a split layer waits
    for as the bus alone does: with n on the CPU, the slower of the CPU's n blocks (the kernel's call,
    gathering its blocks included) and the bus's; with none, the bus's. `in_vram` of the k (a hot set's
    expected hits) are read from VRAM: the CPU takes the blocks that would cross the bus first
    (`SplitExperts.split_send`), so the bus carries max(0, k - in_vram - n)."""
    bus = max(0.0, k - in_vram - n) * block_bytes / (bus_gbps * 1e9)
    if n == 0:
        return bus
    if cpu_gbps <= 0:
        return math.inf
    return max(n * block_bytes / (cpu_gbps * 1e9), bus)


def cpu_experts(
    k: int,
    cpu_gbps: float,
    bus_gbps: float,
    block_bytes: int = 1,
    alone_gbps: float | None = None,
    in_vram: float = 0.0,
) -> int:
    """Routed experts a layer the CPU takes: the n whose layer takes least by `expert_seconds` (both sides
    about equal), 0 when no share beats the bus alone, at `alone_gbps` when given (the bus's rate without
    the CPU reading the same RAM); the smaller n on a tie."""
    if cpu_gbps <= 0 or bus_gbps <= 0:
        return 0

    def cost(n: int) -> float:
        bus = alone_gbps if n == 0 and alone_gbps else bus_gbps
        return expert_seconds(k, n, block_bytes, cpu_gbps, bus, in_vram)

    return min(range(k + 1), key=cost)


class ShareTuner:
    """The auto share tuned on the box by token time, for as long as decode runs: n is the routed experts a
    layer the CPU takes (0: the GPU bank alone), from n0. Each token's time comes from the decode graphs'
    CUDA events (`add`). A first descent times each n it tries over TUNE_TOKENS tokens (the median counts)
    and moves to an unmeasured neighbour of the fastest so far until both of its neighbours are measured;
    it then keeps the fastest (`settled`). The kept n is then watched: each WATCH_TOKENS tokens its time
    becomes their mean, and where another measured n is now faster it moves there (and watches that). The
    mean is what a user waits for: a few CPU calls that a busy core or a preempted thread stretches to
    milliseconds leave a few tokens' median alone but not the mean (on the H200 box a share kept by its
    3-token median then ran at 0.93x the bus alone). Times older than FORGET_WINDOWS windows are
    dropped, so their neighbours are measured again: the box's load changes (another process takes cores,
    then leaves). A neighbour of the fastest whose one median reads above RETIME times the fastest is timed
    once more before it counts: one step of n moves one block between the two sides, which cannot cost half
    a token, while a few slow tokens can (on an H100 box two first descents read 8.6 and 9.8 ms at 5 of 10
    beside 2.7-2.9 at 4, and kept 4). A rate model cannot see where a split layer's time goes on a given box
    (the bus's and the CPU's reads of the same RAM, the mailbox's round trips, the GPU's share's copy);
    tokens can."""

    def __init__(self, k: int, n0: int):
        self.k, self.n = k, n0
        self.times: dict[int, float] = {}  # n -> seconds a token (a first median, then a watch's mean)
        self._when: dict[int, int] = {}  # n -> the window that set times[n]
        self._samples: list[float] = []
        self._once: set[int] = set()  # n whose time, where it has one, is a median not yet timed again
        self._again: int | None = None  # the n being timed again
        self.windows = 0  # timing windows ended so far
        self.settled = False  # the first descent has ended: the kept n is watched

    def best(self) -> int:
        return min(self.times, key=self.times.get) if self.times else self.n

    def next(self) -> int | None:
        """The n to measure next, or None once the fastest has both neighbours measured (a neighbour's one
        median above RETIME times the fastest is measured again)."""
        if self.n not in self.times:
            return self.n
        best = self.best()
        near = [c for c in (best + 1, best - 1) if 0 <= c <= self.k]
        for c in near:
            if c not in self.times:
                return c
        for c in near:
            if c in self._once and self.times[c] > RETIME * self.times[best]:
                return c
        return None

    def add(self, seconds: float) -> int:
        """One replayed token's seconds at the current n -> the n to run from the next token."""
        self._samples.append(seconds)
        watching = self.n in self.times
        if len(self._samples) < (WATCH_TOKENS if watching else TUNE_TOKENS):
            return self.n
        s = sorted(self._samples)
        self.times[self.n] = sum(s) / len(s) if watching else s[len(s) // 2]
        if watching or self._again == self.n:  # a mean, or a median timed again: it stands
            self._once.discard(self.n)
        else:
            self._once.add(self.n)
        self._samples, self._again = [], None
        self.windows += 1
        self._when[self.n] = self.windows
        if watching:
            for c in [c for c, w in self._when.items() if self.windows - w > FORGET_WINDOWS]:
                del self.times[c], self._when[c]
        nxt = self.next()
        if nxt in self.times:  # timed once more: its first median is dropped, the next one counts
            del self.times[nxt], self._when[nxt]
            self._again = nxt
        self.settled = self.settled or nxt is None
        self.n = self.best() if nxt is None else nxt
        return self.n


@dataclasses.dataclass
class SplitTimes:
    """Where the split decode layers' time goes, in seconds summed over them: the server's kernel calls, then
    the GPU's, from CUDA events while `SplitExperts.gpu_timing` is on."""

    calls: int = 0  # split layers the server answered
    kernel: float = 0.0  # its kernel calls (each gathers the blocks and scales, then computes)
    timed: int = 0  # split layers with GPU times
    gpu_share: float = 0.0  # GPU: from the send's end (order, packing, post), the GPU's share of the experts
    gpu_idle: float = 0.0  # GPU: from there until the CPU's answer has landed (waiting for it)
    gpu_dense: float = 0.0  # GPU: from there to the next layer's start (the add, its dense work)
    dense_gaps: int = 0  # pairs of consecutive layers gpu_dense sums over

    def __sub__(self, other: SplitTimes) -> SplitTimes:
        return SplitTimes(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


# how long the CPU kernel's idle threads and the split server spin before sleeping while decode splits:
# past a layer's dense GPU work (~0.4 ms for a full-shape layer on an H100), so that requests find them up
SPLIT_SPIN_S = 0.002
# cores the kernel's threads leave to the rest of this process by default: the decode thread, the driver's
SPARE_CORES = 2
TUNE_TOKENS = 3  # replayed tokens the auto share first times each n over (`ShareTuner`)
WATCH_TOKENS = 64  # replayed tokens a kept n is watched over (the mean counts)
FORGET_WINDOWS = 8  # timing windows after which a time is measured again (~512 tokens while watching)
RETIME = 1.5  # a neighbour's first median this many times the fastest is timed once more (`ShareTuner`)


def split_threads(threads) -> Callable[[], int]:
    """The CPU share's threads from a `CpuThreads`: `--threads` as given, else its free cores less
    SPARE_CORES (at least 1)."""
    return lambda: threads.fixed or max(1, threads() - SPARE_CORES)


class SplitExperts(WrappedBank):
    """The GPU bank with a CPU share of each RAM-resident decode layer (see the module docstring).

    Args:
        gpu: the CUDA bank (`GpuExperts`): `resident`, `host_blocks`, `ram_rows(layer)` and the staged
            decode methods are used; any other attribute is the GPU bank's.
        workdir: the `Workdir` (layout, global scales, K).
        share: fraction of a layer's K routed experts the CPU computes (rounded to whole experts); < 0: chosen
            from `cpu_gbps` and `bus_gbps` (`cpu_experts`), then tuned by the first decode tokens' time
            (`ShareTuner`), which may move the share or turn it off.
        threads: callable -> the CPU kernel's threads now (`split_threads`).
        bus_gbps: the host -> device rate (needed when share < 0): the bus alone's.
        share_gbps: the rate at which the GPU's share crosses while the CPU reads its own (the staging
            kernel's reads of pinned RAM, `probes.stage_rate`); None: bus_gbps.
        cpu_gbps: the CPU kernel's rate; None: measured on the RAM cache's rows on `threads()` threads.
        tune: the auto share tunes itself by token time (the decode graphs time the tokens; without them
            it keeps the rates' choice).
    """

    def __init__(
        self,
        gpu: ExpertBank,
        workdir,
        share: float,
        threads: Callable[[], int],
        bus_gbps: float | None = None,
        cpu_gbps: float | None = None,
        tune: bool = True,
        share_gbps: float | None = None,
    ):
        super().__init__(gpu)
        self.layout, self.threads = workdir.layout, threads
        self.k = k = workdir.text_config["num_experts_per_tok"]
        self.ws2 = workdir.expert_scales()[0].float().contiguous()  # [L, E, 3] on the host
        host = gpu.host_blocks
        usable = host is not None and cpu_moe.library() is not None and k <= cpu_moe.NMAX
        self.cpu_gbps = cpu_gbps
        if not usable:
            self.n_cpu = 0
            log.warning("--cpu-moe-share needs the pinned RAM cache and the CPU kernel (a C compiler): off")
        else:
            if self.cpu_gbps is None:  # the bench's bound takes it in either case
                self.cpu_gbps = cpu_moe.layer_rate(host, self.layout, k, threads())
            # a hot set in VRAM serves hot_quota / E of a layer's K under uniform routing
            hot = k * gpu.residency.hot_quota / gpu.num_experts
            self.n_cpu = (
                min(k, round(share * k))
                if share >= 0
                else cpu_experts(
                    k,
                    self.cpu_gbps,
                    share_gbps or bus_gbps or 0,
                    self.layout.payload_bytes,
                    alone_gbps=bus_gbps,
                    in_vram=hot,
                )
            )
            if self.n_cpu:  # the pool's threads stay up over a layer's dense GPU work between two requests
                cpu_moe.set_spin(SPLIT_SPIN_S)
            bus = f"bus {bus_gbps:.1f} GB/s" if bus_gbps else "bus not measured"
            bus += f", the GPU's share {share_gbps:.1f} GB/s" if share_gbps else ""
            log.info("CPU share of RAM-resident decode: %d of %d experts a layer (CPU kernel %.1f GB/s on %d "
                     "threads, %s)", self.n_cpu, k, self.cpu_gbps, threads(), bus)  # fmt: skip
        pin = host is not None and host.is_pinned()
        h, dev = workdir.layout.hidden_size, gpu.cache.device
        # the routed experts [1, K] and weights in the order split_send gives them (the GPU's first)
        self._ids = torch.zeros(1, k, dtype=torch.int64, device=dev)
        self._w = torch.zeros(1, k, device=dev)
        self._pos = torch.arange(k, device=dev)
        # the CPU's ids and weights, x, packed on the GPU
        self._dev = torch.empty(2 * k + h, device=dev)
        self._host = torch.empty(2 * cpu_moe.NMAX + h, pin_memory=pin)  # ... posted here (the request)
        self._out = torch.empty(h, pin_memory=pin)  # the server's answer, the CPU's [H] sum
        self._box = mailbox.new_box(pin)
        self._words = self._box.numpy()  # the host reads FAIL and ERR here without a device call
        self._seq = torch.zeros(1, dtype=torch.int32, device=dev)  # the last request's number
        self._loc = torch.zeros(gpu.num_experts, dtype=torch.int32, device=dev)  # the GPU's share's places
        self._server: cpu_moe.SplitServer | None = None  # started at the first split layer
        self._ev: tuple = ()  # the split layer's CUDA events, set by split_send
        self.cpu_blocks = 0  # routed blocks posted to the CPU
        self.gpu_timing = False  # record CUDA events per split layer for `split_times` (the bench)
        self._timed: list[tuple[int, tuple]] = []  # (layer, events) not read yet
        self._gpu_times = SplitTimes()  # the GPU's times read so far
        # the auto share tunes itself by the first decode tokens' time
        self.tuner = ShareTuner(k, self.n_cpu) if share < 0 and usable and tune else None

    # the GPU bank's state (cache, scales, ...) for the bench; the interface is WrappedBank's
    def __getattr__(self, name):
        if name == "bank":  # not set yet (during __init__): no recursion
            raise AttributeError(name)
        return getattr(self.bank, name)

    @property
    def splitting(self) -> bool:
        """Decode runs split: a CPU share is set and every block has a fixed RAM row."""
        return self.n_cpu > 0 and self.bank.resident == "ram"

    @property
    def decode_mode(self) -> str:
        return "split" if self.splitting else self.bank.decode_mode

    @property
    def stage_guesses(self) -> int:
        """The guesses a layer the decode program stages: none while it splits (the bus then carries the
        GPU's share beside the CPU's work; staged, it carried guesses the split did not need), the GPU
        bank's otherwise (n = 0, prompts, decode before the RAM rows are fixed)."""
        return 0 if self.splitting else self.bank.stage_guesses

    @property
    def graphed(self) -> bool:
        """The send and the take are captured; timed tokens run them eagerly to record CUDA events."""
        return not self.gpu_timing

    @property
    def decode_key(self) -> tuple:
        if not self.splitting:
            return self.bank.decode_key
        return (*self.bank.decode_key, self.n_cpu, self.graphed)

    def warm_up(self, dtype: torch.dtype) -> None:
        """The GPU bank's warm-up, then the decode kernel for the GPU side's K - n experts with FP32 input (K
        is a compile-time constant of its down kernel) for each n the share may take: every n the auto share
        may move to (a compile is ~0.9 s on a cold Triton cache: a move in decode once stalled a token that
        long), or the share set by hand. Decode never compiles then, and a capture cannot."""
        from expertstream.kernels import nvfp4_moe

        self.bank.warm_up(dtype)
        shares = (
            range(1, self.k) if self.tuner is not None else [self.n_cpu] if 0 < self.n_cpu < self.k else []
        )
        dev, h = self.bank.cache.device, self.layout.hidden_size
        e2s = torch.zeros(self.bank.num_experts, dtype=torch.int32, device=dev)
        if shares and self.copies:  # its copy kernel (every entry of e2s a slot: nothing is copied)
            ids = torch.zeros(1, dtype=torch.int64, device=dev)
            stage_blocks(ids, e2s, self.bank.host_blocks, self.bank.cache.slots, 0, e2s.clone())
        for n in shares:
            g = self.k - n
            ids, w = torch.zeros(g, dtype=torch.int64, device=dev), torch.ones(g, device=dev)
            nvfp4_moe.nvfp4_moe_decode(torch.zeros(1, h, device=dev), ids, e2s, self.bank.scales[0], w,
                                       self.layout, self.bank.cache.slots, self.bank.host_blocks,
                                       swiglu_limit=self.bank.swiglu_limit)  # fmt: skip

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, **kw):
        if x.shape[0] != 1 or not self.splitting:  # prompts and batches (`segments`): the GPU bank's
            return self.bank(layer, x, expert_ids, weights, **kw)
        return self._split(layer, x, expert_ids, weights)

    def _split(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        """A split layer eagerly: the stages the decode graphs run ("split" decode mode), in order."""
        self.split_send(layer, x, expert_ids, weights)
        part = self.split_gpu(layer, x)
        self.split_launched(layer)
        return self.split_take(layer, part)

    # A split layer as stages (experts/bank.py, "split"): all device work, captured by the decode graphs
    # (split_send and split_take run eagerly in timed tokens); split_launched is their host hook.

    def split_send(self, layer: int, x, expert_ids, weights) -> None:
        """The routed experts ordered so that those the GPU reads from VRAM (its hot set, guesses staged for
        the layer) come first, the rest after them in top-k order: the CPU takes the last n, blocks that
        would otherwise cross the bus. Its experts, their weights and x [1, H] are packed as FP32 into a
        fixed device buffer and posted to the split server (`mailbox.post`, a new request number)."""
        g, k = self.k - self.n_cpu, self.k
        if self._server is None:
            self._serve()
        if self.bank.decode_reads_vram:  # else every block crosses the bus: top-k order as it is
            order = (self._pos + k * self.bank.decode_in_vram(layer, expert_ids[0]).logical_not()).argsort()
            expert_ids, weights = expert_ids.index_select(1, order), weights.index_select(1, order)
        self._ids.copy_(expert_ids)
        self._w.copy_(weights)
        m = 2 * self.n_cpu + self.layout.hidden_size
        torch.cat([self._ids[0, g:].float(), self._w[0, g:], x[0].float()], out=self._dev[:m])
        self._seq.add_(1)
        mailbox.post(self._dev[:m], self._host, self._seq, self._box, layer, self.n_cpu)
        if self.gpu_timing:  # timed tokens send eagerly: the GPU's share is timed from the send's end, so
            # that the eager launches of the order and the packing do not count as its time
            self._ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            self._ev[0].record()

    @property
    def copies(self) -> bool:
        """The GPU's share is copied into VRAM rows of its own before its kernel reads it (the GPU bank has
        K copy rows) by a kernel; else the kernel reads it in place."""
        return self.bank.copy_rows >= self.k

    def split_gpu(self, layer: int, x) -> torch.Tensor:
        """Graphable: the GPU bank's decode kernel on the first K - n experts of split_send's order, x in
        FP32 -> [1, H]."""
        g = self.k - self.n_cpu
        if not g:
            return torch.zeros(1, self.layout.hidden_size, device=x.device)
        if not self.copies:
            return self.bank.decode_compute(layer, x.float(), self._ids[:, :g], self._w[:, :g])
        bank = self.bank  # a kernel copies them and points self._loc there
        loc, rows = bank.residency.loc[layer], bank.cache.slots
        stage_blocks(self._ids[0, :g], loc, bank.host_blocks, rows, bank.copy_first, self._loc)
        return self.bank.decode_compute(layer, x.float(), self._ids[:, :g], self._w[:, :g], loc=self._loc)

    def split_launched(self, layer: int) -> None:
        """Host work once a split layer is queued: the server armed, the GPU's reads counted, the GPU bank
        told; a request the server refused or never answered raises here."""
        w = self._words
        if w[mailbox.ERR] or w[mailbox.FAIL]:
            what = f"refused a request (code {w[mailbox.ERR]})" if w[mailbox.ERR] else "answered too late"
            raise RuntimeError(
                f"the CPU share's split server {what} by layer {layer}: the output is not valid"
            )
        self._server.arm(self.threads())
        self.cpu_blocks += self.n_cpu
        g = self.k - self.n_cpu
        if g:
            self.bank.decode_fixed_reads(g)
            self.bank.decode_launched()

    def split_take(self, layer: int, part: torch.Tensor) -> torch.Tensor:
        """Graphable: wait on the GPU for the server's answer, then part + the CPU's sum, FP32 [1, H] (the
        caller casts)."""
        ev = self._ev if self.gpu_timing else None
        if ev:  # the GPU idles from ev[1] to ev[2] (it waits for the CPU's sum)
            ev[1].record()
        out = mailbox.take(part, self._out, self._seq, self._box)
        if ev:
            ev[2].record()
            self._timed.append((layer, ev))
        return out

    def _serve(self) -> None:
        """Start the split server on the RAM cache's address table (the rows are fixed for good once every
        block has one: the table is made at the first split layer)."""
        rows = torch.stack([torch.from_numpy(self.bank.ram_rows(i)) for i in range(self.ws2.shape[0])])
        host = self.bank.host_blocks
        addr = (rows.long() * host.stride(0) + host.data_ptr()).contiguous()  # [L, E]
        self._server = cpu_moe.SplitServer(addr, self.ws2, self._host, self._out, self._box, self.layout,
                                           self.threads(), SPLIT_SPIN_S, self.bank.swiglu_limit)  # fmt: skip

    @property
    def tuning(self) -> bool:
        """The auto share is still in its first descent (`ShareTuner`); it is watched after it."""
        return self.tuner is not None and not self.tuner.settled

    def decode_token_seconds(self, seconds: float) -> None:
        """A replayed decode token's GPU time: the auto share moves n as `ShareTuner` says (the decode graphs
        capture each program once, `decode_key`); its first choice is logged, and later moves off or on."""
        if self.tuner is None or self.gpu_timing or self.bank.resident != "ram":  # tokens that could split
            return
        was, settled = self.n_cpu, self.tuner.settled
        n = self.tuner.add(seconds)
        first = self.tuner.settled and not settled
        if first or (settled and (n == 0) != (was == 0) and n in self.tuner.times):  # a move, not a probe
            ms = ", ".join(f"{c}: {t * 1e3:.2f}" for c, t in sorted(self.tuner.times.items()))
            what = "tuned" if first else "off" if not n else "on"
            log.info("CPU share %s by token time (ms a token by experts a layer on the CPU, %s): %d of %d on "
                     "the CPU%s", what, ms, n, self.k, " (off)" if first and not n else "")  # fmt: skip
        if n != self.n_cpu:
            self.n_cpu = n
            if n:
                cpu_moe.set_spin(SPLIT_SPIN_S)

    def split_times(self) -> SplitTimes:
        """The split layers' times so far: the server's calls, and with `gpu_timing` the GPU's, which waits
        for the GPU to read the events recorded since the last call (stats only, never on the decode path)."""
        t = self._gpu_times
        if self._timed:
            self._timed[-1][1][2].synchronize()
            prev = None
            for layer, ev in self._timed:
                t.timed += 1
                t.gpu_share += ev[0].elapsed_time(ev[1]) / 1e3
                t.gpu_idle += ev[1].elapsed_time(ev[2]) / 1e3
                if prev is not None and layer == prev[0] + 1:  # the dense GPU work between the two
                    t.gpu_dense += prev[1][2].elapsed_time(ev[0]) / 1e3
                    t.dense_gaps += 1
                prev = (layer, ev)
            self._timed = []
        calls, kernel, _ = self._server.stats() if self._server is not None else (0, 0.0, [])
        return dataclasses.replace(t, calls=calls, kernel=kernel)

    def kernel_log(self, last: int) -> list[float]:
        """The server's last `last` kernel calls, seconds each (up to 4096)."""
        return self._server.stats(last)[2] if self._server is not None else []

    def close(self) -> None:
        """Stop the server once the device is done with its requests, then close the GPU bank."""
        if self._server is not None:
            if self._box.is_pinned():
                torch.cuda.synchronize(self.bank.cache.device)
            self._server.close()
            self._server = None
        self.bank.close()

    @property
    def cpu_bytes(self) -> int:
        """Expert block bytes the CPU read (its share of decode)."""
        return self.cpu_blocks * self.layout.payload_bytes
