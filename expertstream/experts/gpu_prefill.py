"""Prompt passes of the CUDA bank (experts/gpu_bank.py): one sweep over the experts of a layer for the
prompts of one call. Each prompt's (token, k) pairs are sorted by expert into tiles of its own once; the
distinct experts of all of them run in passes of consecutive experts that fit the slots, each block fetched
once, and each prompt launches over its own range of tiles in each pass and adds its rows into its FP32 sums
[T, H] in expert order. A prompt's tiles, launch shapes and FP32 additions are those a call over it alone
makes, however its experts fall into passes, so its sums are the same bits. Reads run one pass ahead (the
store shares a block's read with the fetch that follows). A RAM-resident bank's passes copy fixed RAM rows
through tables written once per layer (experts/pass_tables.py) instead of fetching."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertstream.experts.host_mirror import HostMirror
from expertstream.experts.pass_tables import PassTables
from expertstream.kernels import nvfp4_moe
from expertstream.kernels.codec import tuned_config


class PrefillPasses:
    """The prompt side of a CUDA bank.

    Args:
        store: the `ExpertStore` (read-ahead requests).
        cache: the bank's `VramExpertCache`.
        residency: the bank's `Residency` (resident layout, RAM rows, experts per pass beside a hot set).
        layout: the expert block layout.
        scales: [L, E, 3] FP32 weight_scale_2 on the host, for the pass tables.
        swiglu_limit: the kernels' SwiGLU clamp (DeepSeek-V4), None: none.
    """

    def __init__(self, store, cache, residency, layout, scales: torch.Tensor, swiglu_limit=None):
        self.store, self.cache, self.residency, self.layout = store, cache, residency, layout
        self.swiglu_limit = swiglu_limit
        self.num_experts = residency.loc.shape[1]
        self._scales_np = scales.to("cpu", torch.float32).numpy()
        # expert -> slot of the pass in flight, set on the host and uploaded without blocking
        self.expert_to_slot = torch.zeros(self.num_experts, dtype=torch.int32, device=cache.device)
        self._slot_map = HostMirror(self.expert_to_slot)
        self._slot_map_np = self._slot_map.host.numpy()  # its host copy as numpy: cheap small writes
        self._tables: PassTables | None = None  # made at the first prompt of a RAM-resident bank
        self.passes = 0  # expert groups run (one fetch each; three launches per prompt routed to them)
        # a pass's rows of h and output are at most this many tokens' K pairs (the plan's MoE workspace)
        self.chunk: int | None = None  # None: a call's tokens

    def run(self, layer, x, expert_ids, weights, segments, counts, out) -> None:
        """Write the FP32 routed sums of the prompts' rows [a, b) (`segments`) of x [T, H] into out [T, H]
        FP32 in one sweep; counts[i][e]: pairs of prompt i routed to expert e (host ints)."""
        k = expert_ids.shape[1]
        prompts = [self._prompt(x, expert_ids, weights, ab, c, out, k) for ab, c in zip(segments, counts)]
        experts = [e for e in range(self.num_experts) if any(c[e] for c in counts)]
        groups = self._groups(experts, [(p.starts, p.bm) for p in prompts], k)
        self.passes += len(groups)
        ranges = [[(p.starts[g[0]], p.starts[g[-1] + 1]) for g in groups] for p in prompts]
        rows = max((b - a) * p.bm for p, rs in zip(prompts, ranges) for a, b in rs)
        y, work = nvfp4_moe.prefill_buffers(x, self.layout, rows)  # a pass's weighted rows and h, any prompt
        # reads run one group ahead: group g+1's disk reads proceed while group g is copied and computed
        # (with one group its fetch is the only request)
        pending = [self._read_ahead(layer, groups[0]) if len(groups) > 1 else []]
        slots = self._plan_ram_passes(layer, groups) if self.residency.resident == "ram" else None
        try:
            for g, members in enumerate(groups):
                pending.append(self._read_ahead(layer, groups[g + 1]) if g + 1 < len(groups) else [])
                if slots is not None:  # the layer's tables are up: one copy launch
                    t = self._tables
                    self.cache.load_pairs(t.pairs[g], slots[g], layer, run=t.runs[g])
                    e2s, ws2 = t.maps[g], t.ws2[g]
                else:
                    self._map_pass(members, self.cache.fetch(layer, members))
                    e2s, ws2 = self.expert_to_slot, self.cache.ws2
                for h in pending.pop(0):
                    h.release()
                for p, rs in zip(prompts, ranges):
                    if rs[g][0] == rs[g][1]:  # none of this prompt's experts in the pass
                        continue
                    nvfp4_moe.nvfp4_moe_prefill_rows(
                        p.x, self.cache.slots, e2s, ws2, p.weights, self.layout, p.order, rs[g], y, work,
                        launch=p.launch, swiglu_limit=self.swiglu_limit,
                    )  # fmt: skip
                    nvfp4_moe.combine_rows(y, p.order, e2s, rs[g], p.total, accumulate=p.summed)
                    p.summed = True
                self.cache.mark_used()
        finally:
            for h in (h for hs in pending for h in hs):
                h.release()

    def _prompt(self, x, expert_ids, weights, segment, counts, out, k) -> _Prompt:
        """Prompt rows [a, b) as a call over them alone takes them: its pairs sorted with the tile size its
        own pair count picks, and the pass launch shape when alone it would run in several passes."""
        a, b = segment
        experts = [e for e, c in enumerate(counts) if c]
        order = nvfp4_moe.order_pairs(expert_ids[a:b], self.num_experts, self.layout, distinct=len(experts))
        bm = order.config["block_m"]
        starts = nvfp4_moe.tile_starts(counts, bm)
        # passes of a few experts each may launch in a shape of their own (tuned_configs.json `HxIxpass`)
        alone = len(self._groups(experts, [(starts, bm)], k))
        key = f"{self.layout.hidden_size}x{self.layout.intermediate_size}xpass"
        launch = tuned_config("nvfp4_prefill", x.device, key) if alone > 1 else None
        w = weights[a:b].float().contiguous()
        return _Prompt(x[a:b], w, order, starts, bm, launch, out[a:b])

    def _map_pass(self, experts: list[int], slots: list[int]) -> None:
        """Point `expert_to_slot` at a pass's slots, every other expert at -1 (the pass skips their pairs),
        with one non-blocking upload of the whole map (2 KB for 512 experts, `HostMirror`)."""
        self._slot_map_np.fill(-1)
        self._slot_map_np[experts] = slots
        self._slot_map.push()

    def _read_ahead(self, layer: int, experts: list[int]) -> list:
        """Start the host reads of a later group now; its fetch joins them (the store shares a block's read).
        Blocks already in VRAM need none, nor any block once the RAM cache holds them all (a request per
        block and pass was ~0.18 ms of host work per pass, for nothing). Prompt reads bypass the RAM cache.
        Returns handles to release after that fetch."""
        if self.residency.ram_holds_all:
            return []
        keys = [(layer, e) for e in experts if (layer, e) not in self.cache.lru]
        return self.store.request(keys, cache=False)

    def _plan_ram_passes(self, layer: int, groups: list[list[int]]) -> list[list[int]]:
        """Every block's RAM row fixed (`resident` "ram"): the passes take the two halves of the slots in turn
        and copy their rows straight from the RAM rows. Writes and uploads the layer's pass tables at once
        (experts/pass_tables.py); returns each pass's slots."""
        half, cache = self._pass_size, self.cache
        firsts = [(g % 2) * half if 2 * half <= cache.n_slots else 0 for g in range(len(groups))]
        slots = [list(range(f, f + len(m))) for f, m in zip(firsts, groups)]
        if self._tables is None:
            self._tables = PassTables(self.num_experts, cache.slots.shape[0], half, cache.device)
        ram_rows = self.residency.ram_rows(layer)
        self._tables.plan(groups, slots, ram_rows, self._scales_np[layer], cache.on_copy_stream())
        return slots

    @property
    def _pass_size(self) -> int:
        # experts per pass: half the slots (the previous pass's stay protected while its kernels run), or,
        # beside a hot set, half of the slots it leaves (`bank_slots`)
        r = self.residency
        return r.hot_pass if r.resident == "ram" else max(1, self.cache.n_slots // 2)

    def _groups(self, experts: list[int], tiles: list[tuple[list[int], int]], k: int) -> list[list[int]]:
        """Consecutive experts in passes of at most half the slots (the previous pass's slots stay protected
        while its kernels run) and, for each prompt, at most `chunk` tokens' K rows (one expert may exceed
        it); tiles: each prompt's (`tile_starts`, block_m)."""
        size = self._pass_size
        max_rows = self.chunk * k if self.chunk else None
        groups: list[list[int]] = []
        for e in experts:
            g = groups[-1] if groups else None
            full = g is not None and max_rows is not None
            full = full and any((starts[e + 1] - starts[g[0]]) * bm > max_rows for starts, bm in tiles)
            if g is None or len(g) == size or full:
                groups.append([e])
            else:
                g.append(e)
        return groups


@dataclass
class _Prompt:
    """One prompt of a sweep: its rows x [T, H] and router weights [T, K] FP32, its pairs' order and tiles,
    its launch shape for a pass (None: the order's), its FP32 sums [T, H] and whether a pass wrote them."""

    x: torch.Tensor
    weights: torch.Tensor
    order: nvfp4_moe.PairOrder
    starts: list[int]
    bm: int
    launch: dict | None
    total: torch.Tensor
    summed: bool = False
