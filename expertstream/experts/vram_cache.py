"""The VRAM tier: expert blocks in GPU slots, an LFU order over them, host->device copies on their own stream.

slots [n_slots, block_bytes] uint8 on the device hold raw repacked blocks (kernels read codes and scales
straight from them); `ws2` [n_slots, 3] float32 holds each slot's global scales. A call protects the slots it
returns until the next call, so layer L+1's fetch never evicts what layer L's kernel is still reading.
A one-token fetch may instead leave a block in the pinned RAM cache for the kernel to read over the bus
(`fetch(..., in_place=True)`): no copy, no slot, the block stays pinned until that kernel ran.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from expertstream.experts.host_mirror import HostMirror
from expertstream.kernels.stage_blocks import copy_rows, copy_rows_ref
from expertstream.store.policy import Key, LfuPolicy


@dataclass(slots=True)
class VramStats:
    requests: int = 0
    hits: int = 0
    copies: int = 0
    bytes_copied: int = 0
    wait_seconds: float = 0.0  # time spent waiting for host blocks (disk or RAM tier)
    in_place: int = 0  # misses left in the RAM cache for the kernel to read over the bus (no copy)

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
        extra_rows: slot rows past n_slots that are not the cache's (the bank stages decode guesses there).
        host_rows: [C, block_bytes] the RAM cache's rows (pinned on CUDA): a batch whose blocks are all
            landed rows of it goes up as one `copy_rows` launch (its torch twin off CUDA) instead of a copy
            call per block; `load_pairs` needs them.
    """

    def __init__(
        self,
        fetch_host: Callable[[Sequence[tuple[int, int]]], list],
        block_bytes: int,
        n_slots: int,
        scales: torch.Tensor,
        device: torch.device | str,
        extra_rows: int = 0,
        host_rows: torch.Tensor | None = None,
    ):
        if n_slots <= 0:
            raise ValueError(f"VRAM expert cache needs at least one slot, got {n_slots}")
        self.device = torch.device(device)
        self.fetch_host = fetch_host
        self.block_bytes = block_bytes
        # rows n_slots.. are not the cache's: the bank stages decode guesses there (kernels read one tensor)
        self.slots = torch.empty(n_slots + extra_rows, block_bytes, dtype=torch.uint8, device=self.device)
        self._n_slots = n_slots
        self._slot_rows = self.slots.unbind(0)  # one view per slot, made once (indexing costs ~1.5 us a call)
        self.ws2 = torch.zeros(n_slots + extra_rows, 3, dtype=torch.float32, device=self.device)
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
        self.copy_stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        # (a copy batch's or a kernel's event, the host handles it needs until then)
        self.in_flight: list[tuple[torch.cuda.Event, list]] = []
        self.slot_events: dict[int, torch.cuda.Event] = {}
        self.read_in_place: list = []  # handles of RAM blocks the next launched kernel reads over the bus
        self.host_rows = host_rows
        if host_rows is not None:  # (RAM row, slot) of a `copy_rows` batch's blocks, [S, 2] int32
            pairs = torch.zeros(n_slots + extra_rows, 2, dtype=torch.int32, device=self.device)
            self._pairs = HostMirror(pairs)
            self._pairs_np = self._pairs.host.numpy()
            self._copy_rows = copy_rows if cuda else copy_rows_ref

    @property
    def n_slots(self) -> int:
        return self._n_slots

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

    def fetch(self, layer: int, experts: Sequence[int], in_place: bool = False) -> list[int]:
        """Make the blocks of `experts` (distinct ids) of `layer` readable by a kernel; return their places.

        Args:
            in_place: a block missing from VRAM that sits in the host RAM cache is not copied unless a slot
                is free; its place is -1 - its RAM cache row (the kernel reads it over the bus). It stays
                pinned until the kernel that reads it ran (`mark_used`). Blocks outside the RAM cache
                (transient reads) are copied either way.

        Returns:
            slot ids (>= 0) or -1 - RAM rows, on the host; the current stream waits for the copies (the host
            does not: uploading the ids with a blocking copy would make it wait for every queued kernel).
        """
        keys = [(layer, int(e)) for e in experts]
        if len(set(keys)) != len(keys):
            raise ValueError(f"fetch expects distinct experts, got {list(experts)}")
        if len(keys) > self.n_slots:
            raise ValueError(f"{len(keys)} experts requested but only {self.n_slots} VRAM slots exist")
        keep = set(self.protected)
        out: list[int | None] = []
        for key in keys:
            self.stats.requests += 1
            slot = self.lru.get(key)
            if slot is not None:
                self.policy.access(key)
                self.stats.hits += 1
                keep.add(slot)
            out.append(slot)
        missing = [(i, key) for i, key in enumerate(keys) if out[i] is None]
        if missing:
            self._reap()
            handles = self.fetch_host([key for _, key in missing])
            if in_place:
                try:
                    missing = self._read_in_place(missing, handles, out)
                except BaseException:  # a failed read: the blocks not yet pointed at go back
                    for h in handles:
                        if h is not None:
                            h.release()
                    raise
                handles = [h for h in handles if h is not None]
            # the previous call's slots stay protected so two consecutive layers never evict each other
            for i, _ in missing:
                out[i] = self._take_slot(keep)
                keep.add(out[i])
            self._copy_in(missing, handles, out)
        self.protected, self.last_layer = {s for s in out if s >= 0}, layer
        return out

    def _read_in_place(self, missing, handles, out) -> list:
        """Point the RAM-cache blocks of `missing` at their rows (no slot free: they stay in RAM); returns
        the (index, key) pairs still to copy. Their handles move to `self.read_in_place`; entries of
        `handles` whose block stays in RAM are set to None."""
        copy, free = [], len(self.free)
        for j, ((i, key), h) in enumerate(zip(missing, handles)):
            if free or h.row is None:  # a free slot costs no eviction: the block is copied and cached
                free -= h.row is not None
                copy.append((i, key))
                continue
            t0 = time.perf_counter()
            h.wait()  # a disk read still landing
            self.stats.wait_seconds += time.perf_counter() - t0
            out[i] = -1 - h.row
            self.read_in_place.append(h)
            self.stats.in_place += 1
            handles[j] = None
        return copy

    def _copy_in(self, missing: list[tuple[int, tuple[int, int]]], handles: list, out: list) -> None:
        done = self._copy_blocks([(out[i], key, h) for (i, key), h in zip(missing, handles)])
        for i, key in missing:
            self.lru[key] = out[i]
            self.policy.access(key)
        self._join(done)

    def _copy_blocks(self, blocks: list[tuple[int, tuple[int, int], object]]) -> torch.cuda.Event | None:
        """Queue the copies of host blocks [(slot, key, handle)] on the copy stream and set their slots'
        global scales; the handles are released once the copies ran. Returns the event recorded after the
        copies (None off CUDA or when nothing was queued). A batch whose blocks are all landed rows of the
        RAM cache goes up as one `copy_rows` launch; otherwise each block goes up as it lands."""
        done = None
        queued = []  # handles whose copy is on the stream (or done)
        stream = self.copy_stream
        try:
            with self.on_copy_stream():
                if self.host_rows is not None and all(h.ready and h.row is not None for _, _, h in blocks):
                    self._gather(blocks, queued)
                else:
                    self._copy_as_landed(blocks, queued)
        finally:  # also after a failed read: copies already queued keep their buffers until they ran
            if stream is None:
                for h in queued:
                    h.release()
            elif queued:
                done = self._copies_done()
                self.in_flight.append((done, queued))
            for _, _, h in blocks[len(queued) :]:  # the failed block and those after it
                h.release()
        self._set_scales([slot for slot, _, _ in blocks], [key for _, key, _ in blocks])
        return done

    def on_copy_stream(self):
        """Context: copies and copy kernels (and their uploads) queue on the copy stream on CUDA; elsewhere
        they run in place."""
        stream = self.copy_stream
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _copies_done(self) -> torch.cuda.Event | None:
        # an event after everything queued on the copy stream so far (None off CUDA: copies ran in place)
        if self.copy_stream is None:
            return None
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done

    def _join(self, done: torch.cuda.Event | None) -> None:
        # the compute stream waits for the copies' own event (wait_stream would record another: ~10 us)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def _count(self, n: int) -> None:
        self.stats.copies += n
        self.stats.bytes_copied += n * self.block_bytes

    def _landed(self, h) -> torch.Tensor:
        # h's block once read (counted as a copy)
        t0 = time.perf_counter()
        block = h.wait()  # blocks on the RAM/disk tiers
        self.stats.wait_seconds += time.perf_counter() - t0
        self._count(1)
        return block

    def _after_last_use(self, slot: int, waited: set[int]) -> None:
        # the copy stream waits for the last kernel that read `slot` (slot_events share one event per kernel
        # launch: each is waited for once per batch)
        last_use = self.slot_events.pop(slot, None)
        if last_use is not None and id(last_use) not in waited:
            self.copy_stream.wait_event(last_use)
            waited.add(id(last_use))

    def _gather(self, blocks: list, queued: list) -> None:
        # every block a landed RAM-cache row: its (row, slot) pairs uploaded, then one kernel copies them all
        # (a copy call per block costs the H200's host 10-35 us, and a prompt's passes are host-bound)
        for _, _, h in blocks:
            self._landed(h)
            queued.append(h)
        self._copy_pairs([(h.row, slot) for slot, _, h in blocks])

    def _copy_pairs(self, pairs: list[tuple[int, int]]) -> None:
        # (RAM row, slot) pairs: one upload of the pairs, then `_rows_to_slots` (on the copy stream on CUDA)
        if pairs:
            self._pairs_np[: len(pairs)] = pairs
        self._pairs.push()
        self._rows_to_slots(self._pairs.device_tensor, [slot for _, slot in pairs])

    def _rows_to_slots(self, pairs: torch.Tensor, slots: Sequence[int], run: tuple[int, int] | None = None):
        # after the last kernel reading each slot, one `copy_rows` of device pairs [>= n, 2] (RAM row, slot),
        # or, for a run (first row, first slot) of consecutive rows into consecutive slots, one copy call: the
        # copy engine moves pinned RAM at the bus's rate, a kernel's reads at ~0.9 of it, on the SMs
        waited: set[int] = set()
        for slot in slots:
            self._after_last_use(slot, waited)
        if run is None:
            self._copy_rows(pairs, len(slots), self.host_rows, self.slots)
        else:
            self._copy_run(run[1], self.host_rows[run[0]], len(slots))

    def _copy_as_landed(self, blocks: list, queued: list) -> None:
        # one copy call per run of blocks that follow each other both in host memory and in the slots; a
        # block still being read ends the run first, so every landed block goes up before the host waits
        waited: set[int] = set()
        run: list = []  # [first slot, its source block, blocks] not yet copied
        for slot, _, h in blocks:
            if run and not h.ready:
                self._copy_run(*run)
                run = []
            block = self._landed(h)
            self._after_last_use(slot, waited)
            if run and _follows(run, slot, block, self.block_bytes):
                run[2] += 1
            else:
                if run:
                    self._copy_run(*run)
                run = [slot, block, 1]
            queued.append(h)
        if run:
            self._copy_run(*run)

    def _copy_run(self, slot: int, block: torch.Tensor, n: int) -> None:
        # n blocks from `block` on in host memory -> slots slot .. slot + n - 1 ([n, block_bytes] each side)
        dst = self._slot_rows[slot] if n == 1 else self.slots[slot : slot + n].view(-1)
        src = block if n == 1 else block.as_strided((n * self.block_bytes,), (1,))
        dst.copy_(src, non_blocking=self.copy_stream is not None)

    def load_pairs(
        self, pairs: torch.Tensor, slots: Sequence[int], layer: int, run: tuple[int, int] | None = None
    ) -> None:
        """Copy RAM-cache rows into `slots` with one `copy_rows` of the device pairs [>= n, 2] (RAM row,
        slot; uploaded inside `on_copy_stream`, n = len(slots)), or, given `run` (first RAM row, first slot:
        the pairs are consecutive rows into consecutive slots), with one copy call; outside the cache's
        bookkeeping: what the cache held is forgotten first, since its slots get overwritten. A bank whose
        every block has a fixed RAM row runs its prompt passes through this (experts/pass_tables.py): no store
        request, handle, policy step or upload per pass. The slots are protected until the next call, as after
        `fetch`; the current stream waits for the copy. The caller gives the kernels the slots' scales (`ws2`
        is not set)."""
        assert self.host_rows is not None, "load_pairs needs the RAM cache's rows (host_rows)"
        if self.lru:
            self._forget()
        with self.on_copy_stream():
            self._rows_to_slots(pairs, slots, run)
        self._count(len(slots))
        self._join(self._copies_done())
        self.protected, self.last_layer = set(slots), layer

    def fill(self, pairs: list[tuple[int, int]]) -> None:
        """Copy RAM-cache rows into slots the cache does not manage, [(RAM row, slot)] (a RAM-resident bank's
        hot set), after everything queued on the current stream so far: kernels that read those slots through
        an older location table. The current stream waits for the copies."""
        assert self.host_rows is not None, "fill needs the RAM cache's rows (host_rows)"
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with self.on_copy_stream():
            self._copy_pairs(pairs)
        self._count(len(pairs))
        self._join(self._copies_done())

    def _forget(self) -> None:
        # every cached block dropped (its slot free again; a kernel still reading it is waited for through
        # slot_events before a copy overwrites it)
        self.lru.clear()
        self.policy = LfuPolicy()
        self.free = list(range(self._n_slots - 1, -1, -1))

    def _set_scales(self, slots: list[int], keys: list[tuple[int, int]]) -> None:
        if slots:
            self._ws2_rows[slots] = self._scale_rows[[layer * self._num_experts + e for layer, e in keys]]
            self._ws2.push()

    def mark_used(self) -> None:
        """Call after launching the kernel that reads the last fetch's blocks: copies into its slots wait for
        it, and the RAM blocks it reads in place are handed back once it ran."""
        if self.copy_stream is None:
            for h in self.read_in_place:  # no GPU: the kernel already ran
                h.release()
            self.read_in_place = []
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        for s in self.protected:
            self.slot_events[s] = ev
        if self.read_in_place:
            self.in_flight.append((ev, self.read_in_place))
            self.read_in_place = []

    def _reap(self) -> None:
        # entries are in queue order: stop at the first still running (a prompt queues a layer's passes
        # ahead, so querying every entry each call would grow with the queue); a finished entry behind it
        # (on the other stream) is handed back on a later call
        done = 0
        for ev, handles in self.in_flight:
            if not ev.query():
                break
            for h in handles:
                h.release()
            done += 1
        del self.in_flight[:done]

    def close(self) -> None:
        """Finish in-flight copies, hand host buffers back and free the slots (the budget's largest part)."""
        self.mark_used()  # hands back in-place blocks not yet launched on (they join in_flight)
        for ev, handles in self.in_flight:
            ev.synchronize()
            for h in handles:
                h.release()
        self.in_flight = []
        self.slots = self.slots.new_empty(0, self.block_bytes)  # a use after close fails on indexing
        self._slot_rows = ()


def _follows(run: list, slot: int, block: torch.Tensor, block_bytes: int) -> bool:
    """`block` goes to the slot after the run's last and starts where its last block ends, both views of one
    tensor (the RAM cache's rows)."""
    first, src, n = run
    base = block._base  # a view's root tensor (None for a standalone buffer)
    return (
        slot == first + n
        and base is not None
        and base is src._base
        and block.data_ptr() == src.data_ptr() + n * block_bytes
    )
