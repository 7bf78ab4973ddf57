"""The VRAM tier: expert blocks in GPU slots, an LFU order over them, host->device copies on their own stream.

slots [n_slots, block_bytes] uint8 on the device hold raw repacked blocks (kernels read codes and scales
straight from them); `ws2` [n_slots, 3] float32 holds each slot's global scales. A call protects the slots it
returns until the next call, so layer L+1's fetch never evicts what layer L's kernel is still reading.
prefetch() copies guessed next-layer blocks into spare slots without making the compute stream wait.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from expertstream.runtime.host_mirror import HostMirror
from expertstream.store.policy import Key, LfuPolicy


@dataclass(slots=True)
class VramStats:
    requests: int = 0
    hits: int = 0
    copies: int = 0
    bytes_copied: int = 0
    wait_seconds: float = 0.0  # time spent waiting for host blocks (disk or RAM tier)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


class VramExpertCache:
    """Expert blocks in device memory, evicted least frequently used first (`LfuPolicy`, docs/runtime.md).

    Args:
        fetch_host: (keys) -> list of handles with `.wait() -> uint8 [block_bytes]` and `.release()`:
            the host tiers (ExpertStore.request).
        block_bytes: bytes per block.
        n_slots: slots to allocate (>= 2 x experts per layer, so two layers never evict each other).
        scales: [L, E, 3] float32 global scales (kept on the host; a slot's row goes up with its block).
        device: where the slots live (a CPU device works too, for tests).
    """

    def __init__(
        self,
        fetch_host: Callable[[Sequence[tuple[int, int]]], list],
        block_bytes: int,
        n_slots: int,
        scales: torch.Tensor,
        device: torch.device | str,
    ):
        if n_slots <= 0:
            raise ValueError(f"VRAM expert cache needs at least one slot, got {n_slots}")
        self.device = torch.device(device)
        self.fetch_host = fetch_host
        self.block_bytes = block_bytes
        self.slots = torch.empty(n_slots, block_bytes, dtype=torch.uint8, device=self.device)
        self._slot_rows = self.slots.unbind(0)  # one view per slot, made once (indexing costs ~1.5 us a call)
        self.ws2 = torch.zeros(n_slots, 3, dtype=torch.float32, device=self.device)
        self._ws2 = HostMirror(self.ws2)  # each copy batch sets its slots' rows on the host, then one upload
        # numpy views of the host copies: row gathers of a few blocks cost ~1 us there, ~10 in torch
        self._ws2_rows = self._ws2.host.numpy()  # [S, 3]
        self._scale_rows = scales.to("cpu", torch.float32).reshape(-1, 3).numpy()  # [L * E, 3]
        self._num_experts = scales.shape[1]
        self.lru: dict[Key, int] = {}  # resident key -> slot (the bank reads it); eviction order: self.policy
        self.policy = LfuPolicy()
        self.free = list(range(n_slots - 1, -1, -1))
        self.protected: set[int] = set()
        self.last_layer: int | None = None  # layer of the protected slots
        self.stats = VramStats()
        cuda = self.device.type == "cuda"
        # demand copies and speculative ones on separate streams: a demand block must not queue behind guesses
        # (one FIFO stream made every layer wait for the last layer's early copies, right or wrong)
        self.copy_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.spec_stream = torch.cuda.Stream(self.device) if cuda else None
        self.in_flight: list[tuple[torch.cuda.Event, list]] = []  # a batch's last copy, its handles
        self.slot_events: dict[int, torch.cuda.Event] = {}
        self.early_copies: dict[int, torch.cuda.Event] = {}  # slot -> its prefetch copy, not yet awaited

    @property
    def n_slots(self) -> int:
        return self.slots.shape[0]

    def _take_slot(self, keep: set[int]) -> int:
        if self.free:
            return self.free.pop()
        for key in self.policy.victims():
            if self.lru[key] not in keep:
                self.policy.remove(key)
                return self.lru.pop(key)
        raise RuntimeError(
            f"all {self.n_slots} VRAM expert slots are in use by the current request; "
            "the memory plan must give at least two layers' worth of slots"
        )

    def fetch(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Make the blocks of `experts` (distinct ids) of `layer` resident; return their slot ids.

        Returns:
            slot ids, on the host; the current stream waits for the copies (the host does not: uploading the
            ids with a blocking copy would make it wait for every queued copy and kernel).
        """
        keys = [(layer, int(e)) for e in experts]
        if len(set(keys)) != len(keys):
            raise ValueError(f"fetch expects distinct experts, got {list(experts)}")
        if len(keys) > self.n_slots:
            raise ValueError(f"{len(keys)} experts requested but only {self.n_slots} VRAM slots exist")
        keep = set(self.protected)
        out, missing = [], []
        for key in keys:
            self.stats.requests += 1
            slot = self.lru.get(key)
            if slot is not None:
                self.policy.access(key)
                self.stats.hits += 1
                keep.add(slot)
                early = self.early_copies.pop(slot, None)
                if early is not None:  # a prefetched block: the kernel must not read it before it lands
                    torch.cuda.current_stream(self.device).wait_event(early)
            out.append(slot)
        # the previous call's slots stay protected so two consecutive layers never evict each other
        for i, key in enumerate(keys):
            if out[i] is None:
                out[i] = self._take_slot(keep)
                keep.add(out[i])
                missing.append((i, key))
        if missing:
            self._copy_in(missing, out)
        self.protected, self.last_layer = set(out), layer
        return out

    def _copy_in(self, missing: list[tuple[int, tuple[int, int]]], out: list[int]) -> None:
        self._reap()
        handles = self.fetch_host([key for _, key in missing])
        self._copy_blocks([(out[i], key, h) for (i, key), h in zip(missing, handles)])
        for i, key in missing:
            self.lru[key] = out[i]
            self.policy.access(key)
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def _copy_blocks(self, blocks: list[tuple[int, tuple[int, int], object]], speculative: bool = False):
        """Queue the copies of host blocks [(slot, key, handle)] (on the speculative stream for guesses) and
        set their slots' global scales. Returns one event per block for guesses (a demand hit on one waits
        for that block only), else None: demand copies are awaited as a whole."""
        events, queued = [], []  # queued: handles whose copy is on the stream (released once it ran)
        stream = self.spec_stream if speculative else self.copy_stream
        waited: set[int] = set()  # slot_events share one event per kernel launch: wait for each once
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for slot, _, h in blocks:
                    t0 = time.perf_counter()
                    block = h.wait()  # blocks on the RAM/disk tiers; each block goes up the moment it lands
                    self.stats.wait_seconds += time.perf_counter() - t0
                    self.stats.copies += 1
                    self.stats.bytes_copied += self.block_bytes
                    if stream is None:
                        self._slot_rows[slot].copy_(block)
                        queued.append(h)
                        continue
                    earlier = self.early_copies.pop(slot, None)  # an unused guess still landing here
                    if earlier is not None and not speculative:
                        stream.wait_event(earlier)  # the other stream's write must finish before this one
                    last_use = self.slot_events.pop(slot, None)
                    if (
                        last_use is not None and id(last_use) not in waited
                    ):  # never overwrite what a kernel reads
                        stream.wait_event(last_use)
                        waited.add(id(last_use))
                    self._slot_rows[slot].copy_(block, non_blocking=True)
                    queued.append(h)
                    if speculative:
                        events.append(torch.cuda.Event())
                        events[-1].record(stream)
        finally:  # also after a failed read: copies already queued keep their buffers until they ran
            if stream is None:
                for h in queued:
                    h.release()
            elif queued:
                done = events[-1] if events else torch.cuda.Event()
                if not events:
                    done.record(stream)
                self.in_flight.append((done, queued))
            for _, _, h in blocks[len(queued) :]:  # the failed block and those after it
                h.release()
        self._set_scales([slot for slot, _, _ in blocks], [key for _, key, _ in blocks])
        return events if speculative else None

    def _set_scales(self, slots: list[int], keys: list[tuple[int, int]]) -> None:
        if slots:
            self._ws2_rows[slots] = self._scale_rows[[layer * self._num_experts + e for layer, e in keys]]
            self._ws2.push()

    def prefetch(self, blocks: list[tuple[tuple[int, int], object]]) -> list[tuple[int, int]]:
        """Copy guessed blocks already in host RAM ((key, handle) pairs) into spare slots ahead of demand.

        Never evicts the last fetch's slots, nor any block of the last fetch's layer or of a guessed key's
        layer (the current and next layers' demand); copies enter uncounted at the cold end, so a wrong
        guess is the next block evicted. The compute stream does not wait for them: a later fetch that hits
        one does. Returns the keys copied; the other handles are released.
        """
        self._reap()
        skip = {key[0] for key, _ in blocks} | {self.last_layer}
        chosen, copied = [], []
        for key, h in blocks:
            slot = None if key in self.lru else self._spare_slot(skip)
            if slot is None:
                h.release()
                continue
            chosen.append((slot, key, h))
            self.lru[key] = slot
            self.policy.add_cold(key)
            copied.append(key)
        events = self._copy_blocks(chosen, speculative=True)
        for (slot, _, _), ev in zip(chosen, events or ()):
            self.early_copies[slot] = ev
        return copied

    def _spare_slot(self, skip_layers: set[int | None]) -> int | None:
        if self.free:
            return self.free.pop()
        for key in self.policy.victims():
            if self.lru[key] not in self.protected and key[0] not in skip_layers:
                self.policy.remove(key)
                return self.lru.pop(key)
        return None

    def mark_used(self) -> None:
        """Call after launching the kernel that reads the last fetch's slots: copies into them wait for it."""
        if self.copy_stream is None:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        for s in self.protected:
            self.slot_events[s] = ev

    def _reap(self) -> None:
        pending = []
        for ev, handles in self.in_flight:
            if ev.query():
                for h in handles:
                    h.release()
            else:
                pending.append((ev, handles))
        self.in_flight = pending

    def close(self) -> None:
        """Finish in-flight copies, hand host buffers back and free the slots (the budget's largest part)."""
        for ev, handles in self.in_flight:
            ev.synchronize()
            for h in handles:
                h.release()
        self.in_flight = []
        self.slots = self.slots.new_empty(0, self.block_bytes)  # a use after close fails on indexing
        self._slot_rows = ()
