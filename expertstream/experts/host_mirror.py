"""Uploads in the decode path that never wait for the GPU.

A pageable host -> device copy waits for the stream to drain, so every such upload in the decode path was a
hidden host sync. `HostMirror`: a small device tensor whose authoritative copy lives on the host (the
expert->slot map, the location table); push() stages the host copy in the next buffer of a pinned ring
and copies it without blocking. `PackedUpload`: a decode token's host inputs (embedding row, position,
PLE rows) packed into one pinned buffer and sent as one copy into device views that never move.
"""

from __future__ import annotations

import time

import torch

RING_BYTES = 64 << 20  # pinned host bytes one mirror's ring may take


class HostMirror:
    """Edit `host` (a CPU tensor shaped like `device_tensor`), then push() it to the device.

    Each push stages the host copy in the next of `depth` pinned buffers (a ring) and waits only for the
    upload made `depth` pushes ago. With two buffers a host faster than its bus could queue only two prompt
    passes ahead of their copies (`wait_seconds` counts such waits; on the H200 machines a pass's host work
    outlasts its copies, so it stays 0 with either depth)."""

    def __init__(self, device_tensor: torch.Tensor, depth: int = 64):
        self.device_tensor = device_tensor
        self.host = torch.zeros_like(device_tensor, device="cpu")
        self._cuda = device_tensor.device.type == "cuda"
        # at most RING_BYTES of pinned copies: a large mirror (the scales of a huge VRAM cache) gets 2
        nbytes = self.host.numel() * self.host.element_size()
        depth = max(2, min(depth, RING_BYTES // max(1, nbytes)))
        # [depth, *shape] pinned staging on CUDA (none elsewhere: the copy is synchronous there)
        self._stage = torch.empty((depth, *self.host.shape), dtype=self.host.dtype, pin_memory=True) if (
            self._cuda
        ) else None  # fmt: skip
        self._done: list[torch.cuda.Event | None] = [None] * depth
        self.pushes = 0
        self.wait_seconds = 0.0  # host time spent waiting for a ring buffer's earlier upload

    def push(self, row: int | slice | None = None) -> None:
        """Queue the upload of `host` (or of its `row`, or rows, along dim 0) on the current stream; the host
        waits only when the ring is full (the upload `depth` pushes ago has not run yet)."""
        self.pushes += 1
        sel = slice(None) if row is None else row
        if not self._cuda:
            self.device_tensor[sel].copy_(self.host[sel])
            return
        i = self.pushes % len(self._done)
        if self._done[i] is not None and not self._done[i].query():
            t0 = time.perf_counter()
            self._done[i].synchronize()
            self.wait_seconds += time.perf_counter() - t0
        stage = self._stage[i]
        stage[sel].copy_(self.host[sel])
        self.device_tensor[sel].copy_(stage[sel], non_blocking=True)
        self._done[i] = self._done[i] or torch.cuda.Event()
        self._done[i].record(torch.cuda.current_stream(self.device_tensor.device))


ALIGN = 16  # bytes: every packed part starts aligned for any dtype's view (and vector loads)


class PackedUpload:
    """Small host tensors uploaded as one copy into device tensors that are the same objects on every call
    (a CUDA graph reads them through fixed addresses). The first call fixes the parts' names, shapes and
    dtypes; each later call packs the host tensors into one pinned buffer, waits until the buffer's previous
    upload has run (a token ago: long done), and queues one non-blocking copy. Device tensors pass through."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._kinds: dict[str, tuple[torch.Size, torch.dtype]] | None = None  # the parts, as the first call
        self._host = self._dev = None
        self._views: dict[str, torch.Tensor] = {}
        self._bytes: dict = {}  # name -> its flat uint8 numpy view of the pinned buffer
        self._done: torch.cuda.Event | None = None

    def owns(self, t: torch.Tensor) -> bool:
        """t is one of the fixed device tensors this upload writes."""
        return any(t is v for v in self._views.values())

    def __call__(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{name: tensor} -> the same names, host tensors replaced by their fixed device copies."""
        host = {name: t for name, t in parts.items() if t.device.type == "cpu"}
        kinds = {name: (t.shape, t.dtype) for name, t in host.items()}
        if self._kinds is None:
            self._layout(host)
        elif kinds != self._kinds:
            raise ValueError(f"packed upload parts changed: {kinds} after {self._kinds}")
        if self._done is not None:
            self._done.synchronize()
        # numpy copies into the pinned bytes: each torch op on the host costs microseconds of dispatch, and
        # this runs once per token with the GPU idle
        for name, t in host.items():
            t = t if t.is_contiguous() else t.contiguous()
            self._bytes[name][:] = (t if t.dtype == torch.uint8 else t.view(torch.uint8)).numpy().reshape(-1)
        self._dev.copy_(self._host, non_blocking=True)
        if self.device.type == "cuda":
            self._done = self._done or torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.device))
        return {**parts, **self._views}

    def _layout(self, host: dict[str, torch.Tensor]) -> None:
        self._kinds, off, spans = {}, 0, {}
        for name, t in host.items():
            self._kinds[name] = (t.shape, t.dtype)
            spans[name] = slice(off, off + t.numel() * t.element_size())  # the part's bytes in the buffers
            off += -(-(spans[name].stop - off) // ALIGN) * ALIGN
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(max(off, ALIGN), dtype=torch.uint8, pin_memory=cuda)
        self._dev = torch.zeros_like(self._host, device=self.device)
        for name, (shape, dtype) in self._kinds.items():
            self._views[name] = self._dev[spans[name]].view(dtype).view(shape)
            self._bytes[name] = self._host.numpy()[spans[name]]
