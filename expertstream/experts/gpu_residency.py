"""Where the CUDA bank's decode finds each expert block (experts/gpu_bank.py): the location table, and the
fixed layout a bank adopts once no block can move.

`loc` [L, E] int32: a VRAM slot (>= 0) or -1 - the block's RAM cache row (the kernel reads it over the bus in
place). While blocks may be on disk, decode writes a layer's routed entries after each fetch. `adopt()` fixes
the table for good once every block has a place that cannot change: "vram" when the VRAM cache has a slot for
every block and holds them all (it never evicts then), "ram" when the pinned RAM cache holds every block (the
blocks are held here until `close`); decode then reads nothing back. A RAM-resident bank with slots beyond
the prompt passes (`bank_slots`) keeps a hot set: each layer's `hot_quota` most-routed blocks, copied from
their RAM rows into slots of their own and read from VRAM, chosen from the routing prompts and decode saw.
"""

from __future__ import annotations

import numpy as np
import torch

from expertstream.experts.host_mirror import HostMirror
from expertstream.log import get_logger
from expertstream.store.policy import most_routed

log = get_logger(__name__)


class Residency:
    """The location table of a CUDA bank and its resident layout.

    Args:
        store: the `ExpertStore` (`cached_blocks`, `peek`).
        cache: the bank's `VramExpertCache`.
        host_blocks: the RAM cache's rows [C, B] that kernels may read in place (pinned), or None: then no
            "ram" layout is adopted.
        n_layers, n_experts: the table's shape.
        hot_pass, hot_quota: experts per prompt pass and hot blocks a layer of a RAM-resident bank
            (`bank_slots`); the hot set takes the slots from 2 * hot_pass on.
        device: where the table lives.
    """

    def __init__(self, store, cache, host_blocks, n_layers, n_experts, hot_pass, hot_quota, device):
        self.store, self.cache, self.host_blocks = store, cache, host_blocks
        self.hot_pass, self.hot_quota = hot_pass, hot_quota
        self.loc = torch.zeros(n_layers, n_experts, dtype=torch.int32, device=device)
        self._loc = HostMirror(self.loc)
        self._loc_np = self._loc.host.numpy()
        self.resident: str | None = None  # "vram" or "ram" once `loc` is fixed
        self._handles: list = []  # the RAM blocks held for a "ram" layout
        # routed (token, expert) pairs seen per layer (prompts, and decode while it reads ids back) choose
        # the hot set. `_hot` [L, E]: an expert's hot slot or -1; `_ram_rows` [L, E]: every block's RAM row
        self._route_counts = np.zeros((n_layers, n_experts), dtype=np.int64)
        self._hot = np.full((n_layers, n_experts), -1, dtype=np.int32)
        self._ram_rows: np.ndarray | None = None
        self._hot_hits = torch.zeros((), dtype=torch.int64, device=device)  # routed blocks read from it
        # decode's routing once nothing is read back, counted on the device: [L, E], added to the host's
        # counts when a prompt refreshes a layer's hot set
        self._decode_counts = torch.zeros(n_layers, n_experts, dtype=torch.int64, device=device)

    @property
    def ram_holds_all(self) -> bool:
        """The RAM cache holds (or is reading) every block of the model."""
        return self.store.cached_blocks >= self.loc.numel()

    def place(self, layer: int, experts: list[int], where: list[int]) -> None:
        """Decode's fetch put `experts` of `layer` at `where` (slots, or -1 - RAM row): write and upload the
        layer's row, and count them as routed."""
        self._route_counts[layer, experts] += 1
        self._loc_np[layer, experts] = where
        self._loc.push(layer)

    def route_prompt(self, layer: int, counts: list[int]) -> None:
        """A prompt routed counts[e] pairs of `layer` to each expert e; with a hot set, decode's routing
        since the last prompt joins them (read after the prompt's own sync on its ids: it waits for nothing
        more)."""
        self._route_counts[layer] += counts
        if self.hot_quota and self.resident == "ram":
            self._route_counts[layer] += self._decode_counts[layer].cpu().numpy()
            self._decode_counts[layer] = 0

    def adopt(self) -> bool:
        """Once every block has a place that cannot change, fill `loc` for all of them: all in VRAM (slots for
        every block), or all in the pinned RAM cache (held here for good). True if adopted now."""
        if self.resident:
            return False
        n_layers, n_experts = self.loc.shape
        # slots for every block: the VRAM cache never evicts then, so a block's slot never changes
        if self.cache.n_slots >= self.loc.numel() and len(self.cache.lru) == self.loc.numel():
            for (layer, e), slot in self.cache.lru.items():
                self._loc_np[layer, e] = slot
            self.resident = "vram"
        elif self.host_blocks is not None and self.ram_holds_all:
            keys = [(layer, e) for layer in range(n_layers) for e in range(n_experts)]
            handles = self.store.peek(keys)
            if any(h is None for h in handles):  # some still being read: try again on a later call
                for h in handles:
                    if h is not None:
                        h.release()
                return False
            self._handles = handles
            for (layer, e), h in zip(keys, handles):
                self._loc_np[layer, e] = -1 - h.row
            self._ram_rows = -1 - self._loc_np.copy()
            self.resident = "ram"
            if self.hot_quota:  # slots the prompt passes leave: each layer's most-routed blocks
                self._refresh_hot(range(n_layers))
                log.info("decode reads %d blocks a layer from a hot set in VRAM (%d slots)", self.hot_quota,
                         self.hot_quota * n_layers)  # fmt: skip
        else:
            return False
        self._loc.push()
        log.info("every expert block has a fixed place in %s: decode reads no routing back", self.resident)
        return True

    def ram_rows(self, layer: int) -> np.ndarray:
        """[E] every block's RAM row of `layer` (a "ram" layout)."""
        return self._ram_rows[layer]

    def hot_counters(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(decode's routing counts of `layer` [E], the hot-hit count []) for the decode kernel's counting
        launch, or None without a hot set."""
        if self.hot_quota and self.resident == "ram":
            return self._decode_counts[layer], self._hot_hits
        return None

    def follow_routing(self, layer: int) -> None:
        """After a prompt's layer on a "ram" layout: the layer's hot set follows the routing seen so far."""
        if self.hot_quota:
            self._refresh_hot([layer])
            self._loc.push(layer)

    def hot_set(self, layer: int) -> list[int]:
        """The experts of `layer` decode reads from the hot set in VRAM (ascending)."""
        return np.nonzero(self._hot[layer] >= 0)[0].tolist()

    def hot_hits(self) -> int:
        """Routed blocks decode read from the hot set so far (a device read when there is one; stats only)."""
        return int(self._hot_hits) if self.hot_quota else 0

    def _refresh_hot(self, layers) -> None:
        """Make each of `layers`' hot set its `hot_quota` most-routed experts so far (lower ids first on
        ties): the blocks that enter are copied from their RAM rows into the slots of those that leave, and
        `loc` points at the new places (uploaded by the caller). Only changed blocks cross the bus."""
        q, pairs = self.hot_quota, []
        first = 2 * self.hot_pass  # the prompt passes take the slots below
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

    def close(self) -> None:
        for h in self._handles:
            h.release()
        self._handles = []
