"""The expert bank on CUDA: RAM/disk tiers (ExpertStore) -> VRAM slots (VramExpertCache) -> Triton kernels.

Decode: one decode launch pair computes the weighted SwiGLU sum straight from the raw blocks wherever they
are: VRAM slots, or the pinned RAM cache read over the bus (no copy, no slot, no per-block host work). A
location table [L, E] tells the kernel where each expert is. While some blocks may be on disk, each layer
reads its ids back once: misses are read into RAM (the guess for layer L+1, made on the same sync, starts
their disk reads early). Once every block has a fixed place (all in RAM, or all in VRAM) the table is complete
and decode runs without reading anything back (docs/runtime.md). With every block in RAM, `stage_guesses`
G copies layer L+1's G best guesses into VRAM rows on a side stream while the rest of layer L and L+1's
attention run (the bus idles then); L+1's kernel reads those from VRAM through a working location row. Where
the VRAM cache is larger than the prompt passes need (`bank_slots`), half of it holds a hot set instead: each
layer's most-routed blocks, read from VRAM by decode, refreshed after each prompt's layer.
Prefill: the call's (token, k) pairs are sorted by expert into tiles once; its distinct experts run in passes
of consecutive experts that fit the slots, each launched over its own tiles, and every pass's rows are added
per token into the FP32 sum [T, H].
"""

from __future__ import annotations

import time

import numpy as np
import torch

from expertstream.experts.bank import BankCounters, ExpertBank
from expertstream.experts.host_mirror import HostMirror
from expertstream.experts.pass_tables import PassTables
from expertstream.experts.speculation import Speculator
from expertstream.experts.vram_cache import VramExpertCache
from expertstream.formats.expert_block import PROJ
from expertstream.kernels import nvfp4_moe
from expertstream.kernels.codec import tuned_config
from expertstream.kernels.decode_counts import decode_counts
from expertstream.kernels.stage_blocks import stage_blocks
from expertstream.log import get_logger
from expertstream.memory_plan import bank_slots
from expertstream.store.policy import most_routed

log = get_logger(__name__)


class _SwappedNibbles:
    """Handle wrapper for the must-break control: each weight byte with its two nibbles exchanged."""

    row = None  # never read in place: the kernel must see the swapped copy

    def __init__(self, handle, parts):
        self.handle, self.parts = handle, parts

    @property
    def ready(self) -> bool:
        return self.handle.ready

    def wait(self) -> torch.Tensor:
        block = self.handle.wait().clone()
        for p in self.parts:
            w = block[p.offset : p.offset + p.nbytes]
            block[p.offset : p.offset + p.nbytes] = (w >> 4) | (w << 4)
        return block

    def release(self) -> None:
        self.handle.release()


class GpuExperts(ExpertBank):
    """The expert bank (experts/bank.py) on CUDA: decode runs "staged", "fixed" once every block has a fixed
    place.

    Args:
        workdir: the `Workdir`.
        store: the `ExpertStore` (host tiers).
        n_slots: VRAM slots (two layers' worth at least; the rest is the VRAM expert cache).
        device: a CUDA device (or CPU with TRITON_INTERPRET=1, for tests).
        control: "none", "swap-nibbles" or "no-experts" (must-break controls).
        speculate: guess the next layer's experts during decode once `set_router_weights` gave the routers.
        speculation_width: guesses per layer as a multiple of K.
        stage_guesses: with every block in RAM, copy this many of the next layer's guesses to VRAM early
            (2 x this many of the slots become staging rows); 0: off.
    """

    def __init__(
        self,
        workdir,
        store,
        n_slots: int,
        device,
        control: str = "none",
        speculate: bool = True,
        speculation_width: float = 1.0,
        stage_guesses: int = 0,
    ):
        self.layout = workdir.layout
        self.store, self.control = store, control
        self.num_experts = workdir.num_experts
        self._parts = [self.layout.part(f"{p}.weight") for p in PROJ]

        def fetch_host(keys):
            # decode misses are cached in RAM; prompt misses bypass it (set per call below)
            return self._wrap(store.request(keys, cache=self._cache_reads))

        self._cache_reads = True
        scales = workdir.expert_scales()[0]  # [L, E, 3] weight_scale_2 (gate, up, down), read once
        self.k = k = workdir.text_config["num_experts_per_tok"]
        # staged guesses a layer; experts per prompt pass and hot blocks a layer of a RAM-resident bank
        n_layers = workdir.num_layers
        self.stage_guesses, self._hot_pass, self._hot_quota = bank_slots(
            stage_guesses, k, n_slots, speculation_width if speculate else 0, self.num_experts, n_layers
        )
        if stage_guesses > 0 and not self.stage_guesses:
            log.warning("stage_guesses %d needs speculation and %d slots; staging off", stage_guesses,
                        2 * (k + stage_guesses))  # fmt: skip
        dev = torch.device(device)
        rows = store.slots
        pinned = rows is not None and (dev.type != "cuda" or rows.is_pinned())
        self.host_blocks = rows if pinned else None  # [C, B] the decode kernel may read in place
        staging = 2 * self.stage_guesses
        self.cache = VramExpertCache(
            fetch_host, self.layout.block_bytes, n_slots - staging, scales, dev, extra_rows=staging,
            host_rows=self.host_blocks,
        )  # fmt: skip
        # prefill: expert -> slot of the pass in flight, set on the host and uploaded without blocking
        self.expert_to_slot = torch.zeros(self.num_experts, dtype=torch.int32, device=dev)
        self._slot_map = HostMirror(self.expert_to_slot)
        self._slot_map_np = self._slot_map.host.numpy()  # its host copy as numpy: cheap small writes
        # decode: where each expert's block is, [L, E] int32: a slot (>= 0) or -1 - its RAM cache row
        self.loc = torch.zeros(workdir.num_layers, self.num_experts, dtype=torch.int32, device=dev)
        self._loc = HostMirror(self.loc)
        self._loc_np = self._loc.host.numpy()
        self.scales = scales.to(dev, torch.float32).contiguous()  # the decode kernel reads scales[layer]
        self._scales_np = scales.to("cpu", torch.float32).numpy()  # [L, E, 3], for the prompt pass tables
        self._pass_tables: PassTables | None = None  # made at the first prompt of a RAM-resident bank
        # "vram" or "ram" once every block has a fixed place there and `loc` says where: no read-back needed
        self.resident: str | None = None
        self._resident_handles: list = []  # the RAM blocks held for that
        self.resident_reads = 0  # blocks decode found through the full table (no lookup, no request)
        self.resident_ram_reads = 0  # ... of which through RAM rows (less stage_counts' and hot_hits' hits)
        spec = Speculator(self.layout.block_bytes, speculation_width, kernel=dev.type == "cuda")
        self.spec = spec if speculate else None
        self.host_syncs = 0  # device -> host reads the bank waits on (decode: one per layer)
        # decode-thread wall time in one-token calls, and the part of it spent in the ids read-back (waiting
        # for the GPU to finish everything queued before: earlier layers, copies, the router)
        self.decode_seconds = self.sync_seconds = 0.0
        self.spec_seconds = 0.0  # ... of which queueing the next layer's guessed disk reads
        self.prefill_passes = 0  # expert groups run by prefill (one fetch + three launches each)
        # a pass's rows of h and output are at most this many tokens' K pairs (the plan's MoE workspace)
        self.prefill_chunk: int | None = None  # None: a call's tokens
        # prompt passes read one group ahead, and a group's buffers wait for its copies: three groups' worth
        store.keep_spare(3 * max(1, n_slots // 2))
        self._launch_pending = False  # a prepared decode whose kernel has not been marked used yet
        self._guess: tuple[int, list[int]] | None = None  # (next layer, its guesses), issued once launched
        # staging (parity p = layer % 2): the working location rows [2, E], the staged ids [2, G] (a copy the
        # side stream may read while the main stream moves on), and routed experts found staged (stats)
        g = max(1, self.stage_guesses)
        self.loc_work = torch.zeros(2, self.num_experts, dtype=torch.int32, device=dev)
        self._stage_ids = torch.zeros(2, g, dtype=torch.int64, device=dev)
        # [blocks staged, routed blocks found staged], counted on the device: graph replays count too
        self._stage_counts = torch.zeros(2, dtype=torch.int64, device=dev)
        self._stage_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and self.stage_guesses else None
        self._staged: int | None = None  # the layer whose working row holds staged guesses
        self._forked = False  # staging queued on the side stream and not yet joined
        # the hot set of a RAM-resident bank (`bank_slots`): routed (token, expert) pairs seen per layer
        # (prompts, and decode while it reads ids back) choose it. `_hot` [L, E]: an expert's hot slot or -1;
        # `_ram_rows` [L, E]: every block's RAM row
        self._route_counts = np.zeros((n_layers, self.num_experts), dtype=np.int64)
        self._hot = np.full((n_layers, self.num_experts), -1, dtype=np.int32)
        self._ram_rows: np.ndarray | None = None
        self._hot_hits = torch.zeros((), dtype=torch.int64, device=dev)  # routed blocks read from the hot set
        # decode's routing once nothing is read back, counted on the device: [L, E], added to the host's
        # counts when a prompt refreshes a layer's hot set
        self._decode_counts = torch.zeros(n_layers, self.num_experts, dtype=torch.int64, device=dev)
        self._uncounted = False  # the decode call that adopted the RAM rows (its reads were fetches)

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the kernels before the first request: one decode, and one prefill in each tile-size bucket
        (1 + 8, 40 and 100 pairs on one slot). Slot contents do not matter; nothing is cached."""
        dev, h = self.cache.device, self.layout.hidden_size
        e2s = torch.zeros(self.num_experts, dtype=torch.int32, device=dev)
        one = torch.ones(1, dtype=torch.float32, device=dev)
        nvfp4_moe.nvfp4_moe_decode(torch.zeros(1, h, dtype=dtype, device=dev), e2s[:1], e2s, self.scales[0],
                                   one, self.layout, self.cache.slots, self.host_blocks)  # fmt: skip
        for t in (8, 40, 100):
            x = torch.zeros(t, h, dtype=dtype, device=dev)
            ids, w = torch.zeros(t, 1, dtype=torch.int64, device=dev), one.expand(t, 1).contiguous()
            nvfp4_moe.nvfp4_moe_prefill(x, self.cache.slots, ids, e2s, self.cache.ws2, w, self.layout)

    def _wrap(self, handles):
        if self.control == "swap-nibbles":
            return [h if h is None else _SwappedNibbles(h, self._parts) for h in handles]
        return handles

    def set_router_weights(self, routers: dict[int, torch.Tensor]) -> None:
        """Routers {layer: W [E, H]} on the compute device in the activation dtype, for speculation."""
        if self.spec is not None:
            self.spec.set_router_weights(routers)

    @property
    def stall_seconds(self) -> float:
        return self.cache.stats.wait_seconds

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.control == "no-experts":
            return torch.zeros_like(x)
        # x [T, H], expert_ids [T, K], weights [T, K] fp32
        self._cache_reads = x.shape[0] == 1
        if x.shape[0] == 1:
            return self._decode(layer, x, expert_ids, weights)
        self._mark_launched()
        self._guess = None
        # pairs per expert: the call's one host sync
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).tolist()
        self.host_syncs += 1
        experts = [e for e, c in enumerate(counts) if c]
        if self.spec is not None:
            self.spec.score(layer, experts)
        return self._prefill(layer, x, expert_ids, weights, counts, experts)

    def _map_pass(self, experts: list[int], slots: list[int]) -> None:
        """Point `expert_to_slot` at a prefill pass's slots, every other expert at -1 (the pass skips their
        pairs), with one non-blocking upload of the whole map (2 KB for 512 experts, `HostMirror`)."""
        self._slot_map_np.fill(-1)
        self._slot_map_np[experts] = slots
        self._slot_map.push()

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
    # host sync) -> compute (graphable: reads the slots and the expert->slot map through fixed addresses),
    # then decode_launched() once compute is queued: the next layer's guesses start behind it.

    def decode_want(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """int64 [K + G] device tensor: the routed experts of x [1, H], then the next layer's G guesses."""
        guess = self.spec.guess(layer, x, expert_ids.shape[1]) if self.spec is not None else None
        return expert_ids[0] if guess is None else torch.cat((expert_ids[0], guess))

    @property
    def decode_mode(self) -> str:
        """ "fixed" once every block has a fixed place that `loc` holds and no guess is staged (none is once
        every block sits in VRAM): a layer's decode is device work alone (decode_compute), so a graphed token
        needs no eager point per layer; "staged" before."""
        staging = self.stage_guesses and self.resident == "ram"
        fixed = self.resident is not None and self.control == "none" and not staging
        return "fixed" if fixed else "staged"

    def set_prefill_chunk(self, tokens: int | None) -> None:
        self.prefill_chunk = tokens

    def decode_fixed_reads(self, n: int) -> None:
        """Count n blocks read through the fixed table by a token decoded without decode_prepare."""
        self.resident_reads += n
        self.resident_ram_reads += n if self.resident == "ram" else 0

    def decode_prepare(self, layer: int, want: torch.Tensor, k: int) -> None:
        """Read `want` back (the host sync), give the K experts a place the kernel reads (a slot, or their
        RAM row) and upload the layer's row of `loc`; keep the guesses for decode_launched(). Nothing at all
        once every block has a fixed place."""
        if self.control == "no-experts":
            return
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
        self._route_counts[layer, experts] += 1
        if self.spec is not None:
            self.spec.score(layer, experts)
        self._loc_np[layer, experts] = self.cache.fetch(layer, experts, in_place=self.host_blocks is not None)
        self._loc.push(layer)
        if len(ids) > k:
            self._guess = (layer + 1, ids[k:])
        self._launch_pending = True
        self._adopt_resident()
        # adopted just now: this layer's reads were fetched, not counted as resident reads, nor as hot hits
        self._uncounted = self.resident is not None
        self.decode_seconds += time.perf_counter() - t0

    def ram_rows(self, layer: int) -> np.ndarray:
        """[E] each expert's RAM cache row in `layer` (held for good once `resident` is "ram")."""
        return self._ram_rows[layer]

    @property
    def _ram_holds_all(self) -> bool:
        """The RAM cache holds (or is reading) every block of the model."""
        return self.store.cached_blocks >= self.loc.numel()

    def _adopt_resident(self) -> None:
        """Once every block has a place that cannot change, fill `loc` for all of them and stop reading ids
        back: all in VRAM (slots for every block), or all in the RAM cache (held here for good)."""
        n_layers, n_experts = self.loc.shape
        # slots for every block: the VRAM cache never evicts then, so a block's slot never changes
        if self.cache.n_slots >= self.loc.numel() and len(self.cache.lru) == self.loc.numel():
            for (layer, e), slot in self.cache.lru.items():
                self._loc_np[layer, e] = slot
            self.resident = "vram"
        elif (
            self.host_blocks is not None
            and self.control == "none"  # a control's altered blocks exist only as copies
            and self._ram_holds_all
        ):
            keys = [(layer, e) for layer in range(n_layers) for e in range(n_experts)]
            handles = self.store.peek(keys)
            if any(h is None for h in handles):  # some still being read: try again on a later call
                for h in handles:
                    if h is not None:
                        h.release()
                return
            self._resident_handles = handles
            for (layer, e), h in zip(keys, handles):
                self._loc_np[layer, e] = -1 - h.row
            self._ram_rows = -1 - self._loc_np.copy()
            self.resident = "ram"
            if self._hot_quota:  # slots the prompt passes leave: each layer's most-routed blocks
                self._refresh_hot(range(n_layers))
                log.info("decode reads %d blocks a layer from a hot set in VRAM (%d slots)", self._hot_quota,
                         self._hot_quota * n_layers)  # fmt: skip
        else:
            return
        self._loc.push()
        log.info("every expert block has a fixed place in %s: decode reads no routing back", self.resident)
        if self.resident == "ram" and self.stage_guesses:
            log.info("decode copies each next layer's %d best guesses to VRAM while the bus is idle "
                     "(--stage-guesses)", self.stage_guesses)  # fmt: skip

    def _refresh_hot(self, layers) -> None:
        """Make each of `layers`' hot set its `_hot_quota` most-routed experts so far (lower ids first on
        ties): the blocks that enter are copied from their RAM rows into the slots of those that leave, and
        `loc` points at the new places (uploaded by the caller). Only changed blocks cross the bus."""
        q, pairs = self._hot_quota, []
        first = 2 * self._hot_pass  # the prompt passes take the slots below
        for layer in layers:
            hot = self._hot[layer]
            want = most_routed(self._route_counts[layer], q)
            enter = [int(e) for e in want if hot[e] < 0]
            leave = np.setdiff1d(np.nonzero(hot >= 0)[0], want)
            base = first + layer * q
            free = sorted(set(range(base, base + q)) - set(hot[hot >= 0].tolist())) + hot[leave].tolist()
            hot[leave] = -1
            for e, slot in zip(enter, free):
                hot[e] = slot
                pairs.append((int(self._ram_rows[layer, e]), slot))
            self._loc_np[layer] = np.where(hot >= 0, hot, -1 - self._ram_rows[layer])
        if pairs:
            self.cache.fill(pairs)

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

    def decode_compute(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        """The routed sum of x [1, H] from the places `decode_prepare` gave (no host work but launches)."""
        if self.control == "no-experts":
            return torch.zeros_like(x)
        self.decode_join()
        loc = self.loc[layer]
        uncounted, self._uncounted = self._uncounted, False
        hot = self._hot_quota and self.resident == "ram" and not uncounted  # routing and hot reads counted
        staged = self._staged == layer  # the guesses staged for this layer: read them from VRAM
        if hot or staged:  # one launch, no sync; routed blocks in the hot set are not stage hits
            decode_counts(
                expert_ids[0], loc,
                *((self._decode_counts[layer], self._hot_hits) if hot else (None, None)),
                *((self._stage_ids[layer % 2], self._stage_counts[1:]) if staged else (None, None)),
            )  # fmt: skip
        if staged:
            self._staged = None
            loc = self.loc_work[layer % 2]
        # with every block in VRAM for good there is no host pool to pass (the launch shape, and so the sums,
        # are the same either way)
        host = None if self.resident == "vram" else self.host_blocks
        return nvfp4_moe.nvfp4_moe_decode(
            x, expert_ids[0], loc, self.scales[layer], weights[0].float(), self.layout, self.cache.slots, host
        )  # fmt: skip

    def decode_stage(self, layer: int, want: torch.Tensor, k: int) -> None:
        """After layer's kernel is queued (graphable): with every block in RAM, copy layer + 1's best guesses
        (want[k:], on the device) to staging rows on the side stream. `decode_join` (or the next compute)
        joins it back."""
        g, nxt = self.stage_guesses, layer + 1
        if not g or self.resident != "ram" or nxt >= self.loc.shape[0] or want.numel() < k + g:
            return
        p = nxt % 2
        self._stage_ids[p].copy_(want[k : k + g])
        first = self.cache.n_slots + p * g
        side = self._stage_stream  # None on the CPU (interpreter tests): in order on the one stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.loc.device))
            self._forked = True
        with torch.cuda.stream(side):  # the copy counts what it copies; hot guesses stay where they are
            rows = (self.host_blocks, self.cache.slots, first, self.loc_work[p])
            stage_blocks(self._stage_ids[p], self.loc[nxt], *rows, copied=self._stage_counts[:1])
        self._staged = nxt

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
        if self._forked:
            self._forked = False
            torch.cuda.current_stream(self.loc.device).wait_stream(self._stage_stream)

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

    def _read_ahead(self, layer: int, experts: list[int]) -> list:
        """Start the host reads of a later prefill group now; its fetch joins them (the store shares a
        block's read). Blocks already in VRAM need none, nor any block once the RAM cache holds them all
        (a request per block and pass was ~0.18 ms of host work per pass, for nothing). Returns handles to
        release after that fetch."""
        if self._ram_holds_all:
            return []
        keys = [(layer, e) for e in experts if (layer, e) not in self.cache.lru]
        return self.store.request(keys, cache=self._cache_reads)

    def _prefill(self, layer, x, expert_ids, weights, counts, experts) -> torch.Tensor:
        self._route_counts[layer] += counts
        if self._hot_quota and self.resident == "ram":  # decode's routing since the last prompt joins it
            # (read after the call's own sync on its ids, so the read waits for nothing more)
            self._route_counts[layer] += self._decode_counts[layer].cpu().numpy()
            self._decode_counts[layer] = 0
        # every block's RAM row fixed: the passes copy rows, no request or policy step (a VRAM cache that
        # can hold every block is filled by the passes instead, so that decode reads it from VRAM); adopted
        # before the passes are formed, whose size then depends on the hot set
        if not self.resident and self._ram_holds_all and self.cache.n_slots < self.loc.numel():
            self._adopt_resident()
        # the call's (token, k) pairs sorted by expert once; tiles run in expert order, so a group of
        # consecutive experts is one range of tiles, and a pass launches over that range only
        order = nvfp4_moe.order_pairs(expert_ids, self.num_experts, self.layout, distinct=len(experts))
        bm = order.config["block_m"]
        starts = nvfp4_moe.tile_starts(counts, bm)
        groups = self._groups(experts, starts, bm, expert_ids.shape[1])
        self.prefill_passes += len(groups)
        tiles = [(starts[g[0]], starts[g[-1] + 1]) for g in groups]
        rows = max(b - a for a, b in tiles) * bm
        y, work = nvfp4_moe.prefill_buffers(x, self.layout, rows)  # a pass's weighted rows, and h
        total = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [T, H] routed sum
        weights = weights.float().contiguous()
        # passes of a few experts each may launch in a shape of their own (tuned_configs.json `HxIxpass`)
        key = f"{self.layout.hidden_size}x{self.layout.intermediate_size}xpass"
        launch = tuned_config("nvfp4_prefill", x.device, key) if len(groups) > 1 else None
        # reads run one group ahead: group g+1's disk reads proceed while group g is copied and computed
        # (with one group its fetch is the only request)
        pending = [self._read_ahead(layer, groups[0]) if len(groups) > 1 else []]
        slots = self._plan_ram_passes(layer, groups) if self.resident == "ram" else None
        try:
            for g, members in enumerate(groups):
                pending.append(self._read_ahead(layer, groups[g + 1]) if g + 1 < len(groups) else [])
                if slots is not None:  # the layer's tables are up: one copy launch
                    t = self._pass_tables
                    self.cache.load_pairs(t.pairs[g], slots[g], layer, run=t.runs[g])
                    e2s, ws2 = t.maps[g], t.ws2[g]
                else:
                    self._map_pass(members, self.cache.fetch(layer, members))
                    e2s, ws2 = self.expert_to_slot, self.cache.ws2
                for h in pending.pop(0):
                    h.release()
                nvfp4_moe.nvfp4_moe_prefill_rows(
                    x, self.cache.slots, e2s, ws2, weights, self.layout, order, tiles[g], y, work,
                    launch=launch,
                )  # fmt: skip
                nvfp4_moe.combine_rows(y, order, e2s, tiles[g], total, accumulate=g > 0)
                self.cache.mark_used()
        finally:
            for h in (h for hs in pending for h in hs):
                h.release()
        if slots is not None and self._hot_quota:  # the layer's hot set follows the routing seen so far
            self._refresh_hot([layer])
            self._loc.push(layer)
        return total  # FP32, cast by the caller (experts/cpu_bank.py)

    def _plan_ram_passes(self, layer: int, groups: list[list[int]]) -> list[list[int]]:
        """Every block's RAM row fixed (`resident` "ram"): the passes take the two halves of the slots in turn
        and copy their rows straight from `loc`. Writes and uploads the layer's pass tables at once
        (experts/pass_tables.py); returns each pass's slots."""
        half, cache = self._pass_size, self.cache
        firsts = [(g % 2) * half if 2 * half <= cache.n_slots else 0 for g in range(len(groups))]
        slots = [list(range(f, f + len(m))) for f, m in zip(firsts, groups)]
        if self._pass_tables is None:
            self._pass_tables = PassTables(self.num_experts, cache.slots.shape[0], half, cache.device)
        self._pass_tables.plan(
            groups, slots, self._ram_rows[layer], self._scales_np[layer], cache.on_copy_stream()
        )
        return slots

    @property
    def _pass_size(self) -> int:
        # experts per prompt pass: half the slots (the previous pass's stay protected while its kernels run),
        # or, beside a hot set, half of the slots it leaves (`bank_slots`)
        return self._hot_pass if self.resident == "ram" else max(1, self.cache.n_slots // 2)

    def _groups(self, experts: list[int], starts: list[int], bm: int, k: int) -> list[list[int]]:
        """Consecutive experts in passes of at most half the slots (the previous pass's slots stay protected
        while its kernels run) and at most `prefill_chunk` tokens' K rows (one expert may exceed it)."""
        size = self._pass_size
        max_rows = self.prefill_chunk * k if self.prefill_chunk else None
        groups: list[list[int]] = []
        for e in experts:
            g = groups[-1] if groups else None
            full = g is not None and max_rows is not None and (starts[e + 1] - starts[g[0]]) * bm > max_rows
            if g is None or len(g) == size or full:
                groups.append([e])
            else:
                g.append(e)
        return groups

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
        if not self.stage_guesses:
            return 0, 0
        self.decode_join()  # the last layer's staging (and its count) may still be queued on the side stream
        staged, hits = self._stage_counts.tolist()
        return staged, hits

    def hot_hits(self) -> int:
        """Routed blocks decode read from the hot set so far (a device read when there is one; stats only)."""
        return int(self._hot_hits) if self._hot_quota else 0

    def counters(self) -> BankCounters:
        """The bank's counts; reads the device's staging and hot-set counters (stats only)."""
        (staged, hits), hot = self.stage_counts(), self.hot_hits()
        seconds = (self.decode_seconds, self.sync_seconds, self.spec_seconds)
        ram_reads = self.resident_ram_reads - hits - hot  # RAM reads neither staged nor hot
        # in BankCounters' field order
        return BankCounters(*seconds, self.bytes_in_place, self.resident_reads, ram_reads, staged, hits, hot)

    def close(self) -> None:
        self._mark_launched()
        self.cache.close()
        for h in self._resident_handles:
            h.release()
        self._resident_handles = []
