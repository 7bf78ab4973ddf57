"""The expert bank on CUDA: RAM/disk tiers (ExpertStore) -> VRAM slots (VramExpertCache) -> Triton kernels.

Decode: one decode launch pair computes the weighted SwiGLU sum straight from the raw blocks wherever they
are: VRAM slots, or the pinned RAM cache read over the bus (no copy, no slot, no per-block host work). A
location table [L, E] tells the kernel where each expert is. While some blocks may be on disk, each layer
reads its ids back once: misses are read into RAM (the guess for layer L+1, made on the same sync, starts
their disk reads early). Once every block has a fixed place (all in RAM, or all in VRAM) the table is complete
and decode runs without reading anything back (docs/runtime.md). The bank composes its parts:
  experts/gpu_residency.py  the location table, the fixed "vram"/"ram" layout, a RAM-resident bank's hot set
  experts/gpu_staging.py    next-layer guesses copied to VRAM staging rows on a side stream
  experts/gpu_prefill.py    prompts: one sweep of passes over the slots for a call's prompts, reads one
                            pass ahead
and keeps here the call itself, the decode stages (experts/bank.py) and the counters.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from expertstream.experts.bank import BankCounters, ExpertBank
from expertstream.experts.gpu_prefill import PrefillPasses
from expertstream.experts.gpu_residency import Residency
from expertstream.experts.gpu_staging import Staging
from expertstream.experts.segments import run_segments
from expertstream.experts.speculation import Speculator
from expertstream.experts.vram_cache import VramExpertCache
from expertstream.kernels import nvfp4_moe
from expertstream.kernels.decode_counts import decode_counts
from expertstream.log import get_logger
from expertstream.memory_plan import bank_slots

log = get_logger(__name__)


class GpuExperts(ExpertBank):
    """The expert bank (experts/bank.py) on CUDA: decode runs "staged", "fixed" once every block has a fixed
    place.

    Args:
        workdir: the `Workdir`.
        store: the `ExpertStore` (host tiers).
        n_slots: VRAM slots (two layers' worth at least; the rest is the VRAM expert cache).
        device: a CUDA device (or CPU with TRITON_INTERPRET=1, for tests).
        speculate: guess the next layer's experts during decode once `set_router_weights` gave the routers.
        speculation_width: guesses per layer as a multiple of K.
        stage_guesses: with every block in RAM, copy this many of the next layer's guesses to VRAM early
            (2 x this many of the slots become staging rows); 0: off.
        swiglu_limit: clamp gate x above and up x on both sides first (DeepSeek-V4), None: no clamp. The
            kernels read the workdir's block format (NVFP4 or MXFP4) from its layout.
        copy_rows: VRAM rows, taken from n_slots, for the CPU share's GPU side (experts/split_bank.py): its
            routed RAM blocks are copied there before its kernel reads them; 0: none.
    """

    def __init__(
        self,
        workdir,
        store,
        n_slots: int,
        device,
        speculate: bool = True,
        speculation_width: float = 1.0,
        stage_guesses: int = 0,
        swiglu_limit: float | None = None,
        copy_rows: int = 0,
    ):
        self.layout, self.store = workdir.layout, store
        self.swiglu_limit = swiglu_limit
        self.num_experts = workdir.num_experts

        def fetch_host(keys):
            # decode misses are cached in RAM; prompt misses bypass it (set where each fetches)
            return store.request(keys, cache=self._cache_reads)

        self._cache_reads = True
        scales = workdir.expert_scales()[0]  # [L, E, 3] weight_scale_2 (gate, up, down), read once
        self.k = k = workdir.text_config["num_experts_per_tok"]
        # staged guesses a layer; experts per prompt pass and hot blocks a layer of a RAM-resident bank
        n_layers = workdir.num_layers
        n_slots -= copy_rows
        guesses, hot_pass, hot_quota = bank_slots(
            stage_guesses, k, n_slots, speculation_width if speculate else 0, self.num_experts, n_layers
        )
        if stage_guesses > 0 and not guesses:
            log.warning("stage_guesses %d needs speculation and %d slots; staging off", stage_guesses,
                        2 * (k + stage_guesses))  # fmt: skip
        dev = torch.device(device)
        rows = store.slots
        pinned = rows is not None and (dev.type != "cuda" or rows.is_pinned())
        self.host_blocks = rows if pinned else None  # [C, B] the decode kernel may read in place
        self.cache = VramExpertCache(
            fetch_host, self.layout.block_bytes, n_slots - 2 * guesses, scales, dev,
            extra_rows=2 * guesses + copy_rows, host_rows=self.host_blocks,
        )  # fmt: skip
        # the copy rows follow the staging rows
        self.copy_rows, self.copy_first = copy_rows, n_slots
        self.residency = Residency(
            store, self.cache, self.host_blocks, n_layers, self.num_experts, hot_pass, hot_quota, dev
        )
        self.staging = Staging(guesses, self.cache, self.host_blocks, self.num_experts, dev)
        self.prefill = PrefillPasses(store, self.cache, self.residency, self.layout, scales, swiglu_limit)
        self.scales = scales.to(dev, torch.float32).contiguous()  # the decode kernel reads scales[layer]
        spec = Speculator(self.layout.block_bytes, speculation_width, kernel=dev.type == "cuda")
        self.spec = spec if speculate else None
        self.host_syncs = 0  # device -> host reads the bank waits on (decode: one per layer)
        # decode-thread wall time in one-token calls, and the part of it spent in the ids read-back (waiting
        # for the GPU to finish everything queued before: earlier layers, copies, the router)
        self.decode_seconds = self.sync_seconds = 0.0
        self.spec_seconds = 0.0  # ... of which queueing the next layer's guessed disk reads
        self.resident_reads = 0  # blocks decode found through the full table (no lookup, no request)
        self.resident_ram_reads = 0  # ... of which through RAM rows (less staged and hot-set hits)
        # prompt passes read one group ahead, and a group's buffers wait for its copies: three groups' worth
        store.keep_spare(3 * max(1, n_slots // 2))
        self._launch_pending = False  # a prepared decode whose kernel has not been marked used yet
        self._guess: tuple[int, list[int]] | None = None  # (next layer, its guesses), issued once launched
        self._uncounted = False  # the decode call that adopted the RAM rows (its reads were fetches)

    @property
    def resident(self) -> str | None:
        """ "vram" or "ram" once every block has a fixed place there (experts/gpu_residency.py)."""
        return self.residency.resident

    @property
    def stage_guesses(self) -> int:
        """Guesses staged to VRAM a layer (0: staging off)."""
        return self.staging.guesses

    @property
    def prefill_passes(self) -> int:
        """Expert groups prompts ran so far (one fetch each; three launches per prompt routed to them)."""
        return self.prefill.passes

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the kernels before the first request: one decode, and one prefill in each tile-size bucket
        (1 + 8, 40 and 100 pairs on one slot). Slot contents do not matter; nothing is cached."""
        dev, h = self.cache.device, self.layout.hidden_size
        e2s = torch.zeros(self.num_experts, dtype=torch.int32, device=dev)
        one = torch.ones(1, dtype=torch.float32, device=dev)
        lim = self.swiglu_limit
        nvfp4_moe.nvfp4_moe_decode(torch.zeros(1, h, dtype=dtype, device=dev), e2s[:1], e2s, self.scales[0],
                                   one, self.layout, self.cache.slots, self.host_blocks,
                                   swiglu_limit=lim)  # fmt: skip
        for t in (8, 40, 100):
            x = torch.zeros(t, h, dtype=dtype, device=dev)
            ids, w = torch.zeros(t, 1, dtype=torch.int64, device=dev), one.expand(t, 1).contiguous()
            nvfp4_moe.nvfp4_moe_prefill(x, self.cache.slots, ids, e2s, self.cache.ws2, w, self.layout,
                                        swiglu_limit=lim)  # fmt: skip

    def set_router_weights(self, routers: dict[int, torch.Tensor]) -> None:
        """Routers {layer: W [E, H]} on the compute device in the activation dtype, for speculation."""
        if self.spec is not None:
            self.spec.set_router_weights(routers)

    def set_prefill_chunk(self, tokens: int | None) -> None:
        self.prefill.chunk = tokens

    @property
    def stall_seconds(self) -> float:
        return self.cache.stats.wait_seconds

    # takes `segments`: several sequences' rows share fetches (experts/segments.py)
    segmented = True

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        segments: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        # x [T, H], expert_ids [T, K], weights [T, K] fp32; segments: row ranges [a, b) of several sequences
        if segments is not None and len(segments) > 1:
            return run_segments(self, layer, x, expert_ids, weights, segments)
        if x.shape[0] == 1:
            return self._decode(layer, x, expert_ids, weights)
        total = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        self.prompts(layer, x, expert_ids, weights, [(0, x.shape[0])], total)
        return total  # FP32, cast by the caller (experts/cpu_bank.py)

    def prompts(self, layer: int, x, expert_ids, weights, segments: list[tuple[int, int]], out) -> None:
        """Several prompts' routed sums in one sweep of the layer's experts (experts/gpu_prefill.py): the
        FP32 sums of rows [a, b) of x [T, H] (each a prompt of its own, `segments`) into out [T, H] FP32,
        each block fetched once for all of them and each prompt's sums those of a call over it alone."""
        self._cache_reads = False
        self._mark_launched()
        self._guess = None
        # pairs per expert of each prompt: the call's one host sync
        counts = torch.stack([torch.bincount(expert_ids[a:b].reshape(-1), minlength=self.num_experts)
                              for a, b in segments]).cpu().numpy()  # fmt: skip
        union, counts = counts.sum(0).tolist(), counts.tolist()
        self.host_syncs += 1
        experts = [e for e, c in enumerate(union) if c]
        if self.spec is not None:
            self.spec.score(layer, experts)
        r = self.residency
        r.route_prompt(layer, union)
        # every block's RAM row fixed: the passes copy rows, no request or policy step (a VRAM cache that
        # can hold every block is filled by the passes instead, so that decode reads it from VRAM); adopted
        # before the passes are formed, whose size then depends on the hot set
        if not r.resident and r.ram_holds_all and self.cache.n_slots < r.loc.numel():
            self._adopt()
        self.prefill.run(layer, x, expert_ids, weights, segments, counts, out)
        if r.resident == "ram":
            r.follow_routing(layer)

    def _adopt(self) -> bool:
        """`Residency.adopt`, and the staging it turns on. True if adopted now."""
        adopted = self.residency.adopt()
        if adopted and self.resident == "ram" and self.stage_guesses:
            log.info("decode copies each next layer's %d best guesses to VRAM while the bus is idle "
                     "(--stage-guesses)", self.stage_guesses)  # fmt: skip
        return adopted

    def _decode(self, layer, x, expert_ids, weights) -> torch.Tensor:
        want = self.decode_want(layer, x, expert_ids)
        self.decode_prepare(layer, want, expert_ids.shape[1])
        t0 = time.perf_counter()
        y = self.decode_compute(layer, x, expert_ids, weights)
        self.decode_stage(layer, want, expert_ids.shape[1])
        self.decode_seconds += time.perf_counter() - t0  # eager launches count as bank host time too
        self.decode_launched()
        return y

    # One-token decode in three stages, so the CUDA-graph decode (runtime/decode_graphs.py) captures the
    # device work and only the host work stays eager: want (graphable) -> prepare (eager, the layer's one
    # host sync) -> compute (graphable: reads the slots and the location table through fixed addresses),
    # then decode_launched() once compute is queued: the next layer's guesses start behind it.

    def decode_want(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """int64 [K + G] device tensor: the routed experts of x [1, H], then the next layer's G guesses."""
        guess = self.spec.guess(layer, x, expert_ids.shape[1]) if self.spec is not None else None
        return expert_ids[0] if guess is None else torch.cat((expert_ids[0], guess))

    @property
    def decode_mode(self) -> str:
        """ "fixed" once every block has a fixed place that the location table holds and no guess is staged
        (none is once every block sits in VRAM): a layer's decode is device work alone (decode_compute), so a
        graphed token needs no eager point per layer; "staged" before."""
        staging = self.stage_guesses and self.resident == "ram"
        return "fixed" if self.resident is not None and not staging else "staged"

    def decode_fixed_reads(self, n: int) -> None:
        """Count n blocks read through the fixed table by a token decoded without decode_prepare."""
        self.resident_reads += n
        self.resident_ram_reads += n if self.resident == "ram" else 0

    def decode_prepare(self, layer: int, want: torch.Tensor, k: int) -> None:
        """Read `want` back (the host sync), give the K experts a place the kernel reads (a slot, or their
        RAM row) and upload the layer's row of the location table; keep the guesses for decode_launched().
        Nothing at all once every block has a fixed place."""
        t0 = time.perf_counter()
        self._mark_launched()  # the previous layer's kernel is queued by now: copies into its slots wait
        self._guess = None  # a guess never issued (no decode_launched call) is too late now
        if self.resident:
            self.decode_fixed_reads(k)
            self.decode_seconds += time.perf_counter() - t0
            return
        ids = want.tolist()
        t1 = time.perf_counter()
        self.sync_seconds += t1 - t0
        self.host_syncs += 1
        experts = sorted(set(ids[:k]))  # top-k ids are distinct; a set keeps the fetch contract anyway
        if self.spec is not None:
            self.spec.score(layer, experts)
        self._cache_reads = True  # here, not in __call__: the decode graphs call this stage alone
        where = self.cache.fetch(layer, experts, in_place=self.host_blocks is not None)
        self.residency.place(layer, experts, where)
        if len(ids) > k:
            self._guess = (layer + 1, ids[k:])
        self._launch_pending = True
        # adopted just now: this layer's reads were fetched, not counted as resident reads, nor as hot hits
        self._uncounted = self._adopt()
        self.decode_seconds += time.perf_counter() - t0

    def ram_rows(self, layer: int) -> np.ndarray:
        """[E] each expert's RAM cache row in `layer` (held for good once `resident` is "ram")."""
        return self.residency.ram_rows(layer)

    def decode_launched(self) -> None:
        """Call once the last prepare's compute is queued (its graph replayed, or launched eagerly): marks its
        blocks used, then queues the next layer's guessed disk reads, which so overlap that compute instead
        of delaying its launch."""
        t0 = time.perf_counter()
        self._mark_launched()
        if self._guess is not None:
            layer, guessed = self._guess
            self._guess = None
            t1 = time.perf_counter()
            self._speculate(layer, guessed)
            self.spec_seconds += time.perf_counter() - t1
        self.decode_seconds += time.perf_counter() - t0

    def decode_compute(self, layer: int, x, expert_ids, weights, loc=None) -> torch.Tensor:
        """The routed sum of x [1, H] from the places `decode_prepare` gave (no host work but launches), or
        from `loc` [E] int32 where given: a location row read in the layer's stead (the CPU share's, whose
        RAM blocks point at the copy rows they were copied into, docs/runtime.md)."""
        self.decode_join()
        given, loc = loc, self.residency.loc[layer]
        uncounted, self._uncounted = self._uncounted, False
        hot = None if uncounted else self.residency.hot_counters(layer)  # routing and hot reads counted
        staged = self.staging.take(layer)  # the guesses staged for this layer: read them from VRAM
        if hot or staged:  # one launch, no sync; routed blocks in the hot set are not stage hits
            stage_hits = staged[:2] if staged else (None, None)
            decode_counts(expert_ids[0], loc, *(hot or (None, None)), *stage_hits)
        if staged:
            loc = staged[2]
        if given is not None:
            loc = given
        # with every block in VRAM for good there is no host pool to pass (the launch shape, and so the sums,
        # are the same either way)
        host = None if self.resident == "vram" else self.host_blocks
        return nvfp4_moe.nvfp4_moe_decode(
            x, expert_ids[0], loc, self.scales[layer], weights[0].float(), self.layout, self.cache.slots,
            host, swiglu_limit=self.swiglu_limit,
        )  # fmt: skip

    @property
    def decode_reads_vram(self) -> bool:
        """With every block in RAM, decode still reads some routed blocks from VRAM: staged guesses, or a
        hot set."""
        return bool(self.stage_guesses or self.residency.hot_quota)

    def decode_in_vram(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """[K] bool (graphable): which of `layer`'s routed experts ids [K] its decode kernel reads from VRAM
        (a slot in the location table, or a guess staged for it), without waiting for the staging copies."""
        vram = self.residency.loc[layer][ids] >= 0
        staged = self.staging.ids(layer)
        return vram if staged is None else vram | (ids[:, None] == staged[None, :]).any(1)

    def decode_stage(self, layer: int, want: torch.Tensor, k: int) -> None:
        """After layer's kernel is queued (graphable): with every block in RAM, copy layer + 1's best guesses
        (want[k:], on the device) to staging rows on the side stream. `decode_join` (or the next compute)
        joins it back."""
        g, nxt, loc = self.stage_guesses, layer + 1, self.residency.loc
        if not g or self.resident != "ram" or nxt >= loc.shape[0] or want.numel() < k + g:
            return
        self.staging.stage(nxt, want[k : k + g], loc[nxt])

    def decode_stage_first(self, x: torch.Tensor) -> None:
        """At a token's start (graphable): stage layer 0's guesses, its router on the token's embedding row
        x [1, H] (the residual stream layer 0 starts from), over layer 0's attention; as `decode_stage`."""
        if self.stage_guesses and self.resident == "ram" and self.spec is not None:
            guess = self.spec.guess(-1, x, self.k)
            if guess is not None:
                self.decode_stage(-1, guess, 0)

    def decode_join(self) -> None:
        """The main stream waits for queued staging (graphable; a no-op when nothing is queued). Called at
        the end of every captured stretch, since a capture must join its side stream before it ends."""
        self.staging.join()

    def _mark_launched(self) -> None:
        # the kernel reading the last fetch's slots has been queued since its prepare: record that point
        if self._launch_pending:
            self._launch_pending = False
            self.cache.mark_used()

    def _speculate(self, layer: int, guessed: list[int]) -> None:
        # runs after this layer's launch and after its demand reads landed (fetch waited for them): guesses
        # already in RAM need nothing (the kernel reads them in place), the rest are read from disk into the
        # RAM cache by the low-priority reader, filling the gap before the next layer's demand
        keys = [(layer, e) for e in guessed if (layer, e) not in self.cache.lru]
        self.spec.issue(layer, guessed, self.store.prefetch(keys))

    def hot_set(self, layer: int) -> list[int]:
        """The experts of `layer` decode reads from a RAM-resident bank's hot set in VRAM."""
        return self.residency.hot_set(layer)

    def locations(self) -> torch.Tensor:
        """A host copy of the location table [L, E] int32: a VRAM slot (>= 0) or -1 - a RAM row."""
        return self.residency.loc.cpu()

    @property
    def bytes_in_place(self) -> int:
        """Block bytes decode moved from the RAM cache over the bus without the copy engine: kernels reading
        blocks in place (less the routed blocks found staged) and the staged guesses' copies. Reads the
        device's staging hit count when staging ran (stats only, never on the decode path)."""
        staged, hits = self.stage_counts()
        blocks = self.cache.stats.in_place + self.resident_ram_reads - hits - self.hot_hits() + staged
        return blocks * self.layout.block_bytes

    def stage_counts(self) -> tuple[int, int]:
        """(guessed blocks staged to VRAM, routed blocks decode found staged) so far: a device read when
        staging is on (stats only, never on the decode path)."""
        return self.staging.counts()

    def hot_hits(self) -> int:
        """Routed blocks decode read from the hot set so far (a device read when there is one; stats only)."""
        return self.residency.hot_hits()

    def counters(self) -> BankCounters:
        """The bank's counts; reads the device's staging and hot-set counters (stats only)."""
        (staged, hits), hot = self.stage_counts(), self.hot_hits()
        seconds = (self.decode_seconds, self.sync_seconds, self.spec_seconds)
        ram_reads = self.resident_ram_reads - hits - hot  # RAM reads neither staged nor hot
        # in BankCounters' field order
        return BankCounters(*seconds, self.bytes_in_place, self.resident_reads, ram_reads, staged, hits, hot,
                            self.cache.stats.bytes_copied)  # fmt: skip

    def close(self) -> None:
        self._mark_launched()
        self.cache.close()
        self.residency.close()
