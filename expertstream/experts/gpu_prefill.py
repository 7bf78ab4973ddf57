"""Prompt passes of the CUDA bank (experts/gpu_bank.py): a call's (token, k) pairs are sorted by expert into
tiles once; its distinct experts run in passes of consecutive experts that fit the slots, each launched over
its own range of tiles, and every pass's rows are added per token into the FP32 sum [T, H]. Reads run one
pass ahead (the store shares a block's read with the fetch that follows). A RAM-resident bank's passes copy
fixed RAM rows through tables written once per layer (experts/pass_tables.py) instead of fetching."""

from __future__ import annotations

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
        self.passes = 0  # expert groups run (one fetch + three launches each)
        # a pass's rows of h and output are at most this many tokens' K pairs (the plan's MoE workspace)
        self.chunk: int | None = None  # None: a call's tokens

    def run(self, layer, x, expert_ids, weights, counts: list[int], experts: list[int]) -> torch.Tensor:
        """The FP32 routed sum [T, H] of x [T, H]; counts[e]: pairs routed to expert e, `experts` those with
        any, ascending."""
        # the call's (token, k) pairs sorted by expert once; tiles run in expert order, so a group of
        # consecutive experts is one range of tiles, and a pass launches over that range only
        order = nvfp4_moe.order_pairs(expert_ids, self.num_experts, self.layout, distinct=len(experts))
        bm = order.config["block_m"]
        starts = nvfp4_moe.tile_starts(counts, bm)
        groups = self._groups(experts, starts, bm, expert_ids.shape[1])
        self.passes += len(groups)
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
                nvfp4_moe.nvfp4_moe_prefill_rows(
                    x, self.cache.slots, e2s, ws2, weights, self.layout, order, tiles[g], y, work,
                    launch=launch, swiglu_limit=self.swiglu_limit,
                )  # fmt: skip
                nvfp4_moe.combine_rows(y, order, e2s, tiles[g], total, accumulate=g > 0)
                self.cache.mark_used()
        finally:
            for h in (h for hs in pending for h in hs):
                h.release()
        return total

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

    def _groups(self, experts: list[int], starts: list[int], bm: int, k: int) -> list[list[int]]:
        """Consecutive experts in passes of at most half the slots (the previous pass's slots stay protected
        while its kernels run) and at most `chunk` tokens' K rows (one expert may exceed it)."""
        size = self._pass_size
        max_rows = self.chunk * k if self.chunk else None
        groups: list[list[int]] = []
        for e in experts:
            g = groups[-1] if groups else None
            full = g is not None and max_rows is not None and (starts[e + 1] - starts[g[0]]) * bm > max_rows
            if g is None or len(g) == size or full:
                groups.append([e])
            else:
                g.append(e)
        return groups
