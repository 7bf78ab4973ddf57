"""RAM LRU of expert blocks over a fixed pool of page-aligned slots (bookkeeping only; the store locks it)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Key = tuple[int, int]  # (layer, expert)


@dataclass(eq=False, slots=True)
class Entry:
    """One block being read or held: `buf` is a cache slot (slot index set) or a transient bypass buffer."""

    key: Key
    buf: torch.Tensor  # [block_bytes] uint8
    slot: int | None
    pins: int = 0  # unreleased handles
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class BlockCache:
    """capacity = budget // block_bytes slots; evicts the least recently used unpinned, finished block."""

    def __init__(self, capacity: int, block_bytes: int, alloc: Callable[[int], torch.Tensor]):
        self.capacity = capacity
        # slots [capacity, block_bytes] uint8, one allocation so a GPU runtime can register it once
        self.slots = alloc(capacity * block_bytes).view(capacity, block_bytes) if capacity else None
        self._free = list(range(capacity - 1, -1, -1))
        self._lru: OrderedDict[Key, Entry] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: Key) -> Entry | None:
        entry = self._lru.get(key)
        if entry is not None:
            self._lru.move_to_end(key)
        return entry

    def insert(self, key: Key) -> Entry | None:
        """A new most-recent entry in a free or evicted slot; None if every slot is pinned or reading."""
        assert key not in self._lru, "insert only what get() missed"
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            return None
        entry = Entry(key, self.slots[slot], slot)
        self._lru[key] = entry
        return entry

    def _evict(self) -> int | None:
        for key, entry in self._lru.items():
            if entry.pins == 0 and entry.done.is_set():
                del self._lru[key]
                self.evictions += 1
                return entry.slot
        return None

    def reading_unpinned(self) -> bool:
        """Whether a slot will become evictable once a read finishes (nobody holds it)."""
        return any(e.pins == 0 and not e.done.is_set() for e in self._lru.values())

    def forget(self, entry: Entry) -> None:
        """Drop a block whose read failed, so the next request reads it again; its slot returns via `free`."""
        if self._lru.get(entry.key) is entry:
            del self._lru[entry.key]

    def free(self, slot: int) -> None:
        self._free.append(slot)
