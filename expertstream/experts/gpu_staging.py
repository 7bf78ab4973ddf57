"""Staged guesses of the CUDA bank (experts/gpu_bank.py): with every block in RAM, layer L+1's G best guesses
are copied into VRAM staging rows on a side stream while the rest of layer L and L+1's attention run (the bus
idles then); L+1's kernel reads them through a working location row. Rows and working rows alternate by
layer parity, so the copies for L+1 never overwrite what L's kernel reads. Everything here is graphable."""

from __future__ import annotations

import torch

from expertstream.kernels.stage_blocks import stage_blocks


class Staging:
    """Staging rows and their side stream.

    Args:
        guesses: G, guesses staged a layer (0: off); the cache's 2 G extra rows after its `n_slots` slots.
        cache: the bank's `VramExpertCache` (`slots`, `n_slots`).
        host_blocks: the RAM cache's rows [C, B] the copies read.
        n_experts: E, the width of a working location row.
        device: the bank's device (no side stream on the CPU: copies run in order on the one stream).
    """

    def __init__(self, guesses: int, cache, host_blocks, n_experts: int, device: torch.device):
        self.guesses, self.cache, self.host_blocks = guesses, cache, host_blocks
        g = max(1, guesses)
        # per parity p = layer % 2: the working location rows [2, E], and the staged ids [2, G] (a copy the
        # side stream may read while the main stream moves on)
        self.loc_work = torch.zeros(2, n_experts, dtype=torch.int32, device=device)
        self._ids = torch.zeros(2, g, dtype=torch.int64, device=device)
        # [blocks staged, routed blocks found staged], counted on the device: graph replays count too
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and guesses else None
        self._staged: int | None = None  # the layer whose working row holds staged guesses
        self._forked = False  # staging queued on the side stream and not yet joined

    def stage(self, layer: int, guesses: torch.Tensor, loc: torch.Tensor) -> None:
        """Queue copies of `layer`'s `guesses` [G] (device ids) on the side stream, after the work queued on
        the current stream; `loc` [E] is the layer's row of the location table (hot guesses stay where they
        are). The copy counts what it copies; `join` (or `take`'s caller) joins it back."""
        p = layer % 2
        self._ids[p].copy_(guesses)
        first = self.cache.n_slots + p * self.guesses
        side = self._stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(loc.device))
            self._forked = True
        with torch.cuda.stream(side):
            rows = (self.host_blocks, self.cache.slots, first, self.loc_work[p])
            stage_blocks(self._ids[p], loc, *rows, copied=self._counts[:1])
        self._staged = layer

    def take(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The guesses staged for `layer`, once: (their ids [G], the stage-hit count [1], the working location
        row [E] the kernel reads instead of `loc`), or None."""
        if self._staged != layer:
            return None
        self._staged = None
        p = layer % 2
        return self._ids[p], self._counts[1:], self.loc_work[p]

    def ids(self, layer: int) -> torch.Tensor | None:
        """The guesses [G] staged for `layer` (device ids, written on the current stream before the copies
        were queued: readable there at once), or None; `take` still finds them."""
        return self._ids[layer % 2] if self._staged == layer else None

    def join(self) -> None:
        """The current stream waits for queued staging (a no-op when nothing is queued)."""
        if self._forked:
            self._forked = False
            torch.cuda.current_stream(self.loc_work.device).wait_stream(self._stream)

    def counts(self) -> tuple[int, int]:
        """(guessed blocks staged, routed blocks found staged) so far: a device read (stats only)."""
        if not self.guesses:
            return 0, 0
        self.join()  # the last layer's staging (and its count) may still be queued on the side stream
        staged, hits = self._counts.tolist()
        return staged, hits
