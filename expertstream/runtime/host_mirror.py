"""A small device tensor whose authoritative copy lives on the host (the expert->slot map, the slots' scales).

A pageable host -> device copy waits for the stream to drain, so every such upload in the decode path was a
hidden host sync; push() instead stages the host copy in one of two pinned buffers, used in turn, and copies
it without blocking. A buffer is reused only once its previous upload has run (two pushes ago: long done).
"""

from __future__ import annotations

import torch


class HostMirror:
    """Edit `host` (a CPU tensor shaped like `device_tensor`), then push() it to the device."""

    def __init__(self, device_tensor: torch.Tensor):
        self.device_tensor = device_tensor
        self.host = torch.zeros_like(device_tensor, device="cpu")
        self._cuda = device_tensor.device.type == "cuda"
        # two pinned staging buffers on CUDA (none elsewhere: the copy is synchronous there)
        self._stage = [torch.empty_like(self.host, pin_memory=True) for _ in range(2)] if self._cuda else []
        self._done: list[torch.cuda.Event | None] = [None, None]
        self.pushes = 0

    def push(self, row: int | None = None) -> None:
        """Queue the upload of `host` (or of its `row` along dim 0) on the current stream; the host does not
        wait for the GPU."""
        self.pushes += 1
        sel = slice(None) if row is None else row
        if not self._cuda:
            self.device_tensor[sel].copy_(self.host[sel])
            return
        i = self.pushes % 2
        if self._done[i] is not None:
            self._done[i].synchronize()
        self._stage[i][sel].copy_(self.host[sel])
        self.device_tensor[sel].copy_(self._stage[i][sel], non_blocking=True)
        self._done[i] = torch.cuda.Event()
        self._done[i].record(torch.cuda.current_stream(self.device_tensor.device))
