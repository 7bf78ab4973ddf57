"""RAM cache of expert blocks over a fixed pool of page-aligned slots (bookkeeping only; the store locks it).

Eviction order: `LfuPolicy` (expertstream/store/policy.py; measured against LRU in docs/benchmarks.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from expertstream.store.policy import Key, LfuPolicy


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
    """capacity = budget // block_bytes slots; evicts the least frequently used unpinned, finished block."""

    def __init__(self, capacity: int, block_bytes: int, alloc: Callable[[int], torch.Tensor]):
        self.capacity = capacity
        # slots [capacity, block_bytes] uint8, one allocation so a GPU runtime can register it once
        self.slots = alloc(capacity * block_bytes).view(capacity, block_bytes) if capacity else None
        self._free = list(range(capacity - 1, -1, -1))
        self._entries: dict[Key, Entry] = {}
        self._policy = LfuPolicy()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Entry | None:
        """The entry of `key`, counted as a use (demand requests)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._policy.access(key)
        return entry

    def lookup(self, key: Key) -> Entry | None:
        """The entry of `key` without counting a use (speculative peeks and prefetch checks)."""
        return self._entries.get(key)

    def insert(self, key: Key, counted: bool = True) -> Entry | None:
        """A new entry in a free or evicted slot; None if every slot is pinned or reading.

        A prefetched block (counted=False) enters cold: it ranks below every used block until a demand
        request uses it, so a wrong guess is the next block evicted.
        """
        assert key not in self._entries, "insert only what get() missed"
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            return None
        entry = Entry(key, self.slots[slot], slot)
        self._entries[key] = entry
        if counted:
            self._policy.access(key)
        else:
            self._policy.add_cold(key)
        return entry

    def _evict(self) -> int | None:
        for key in self._policy.victims():
            entry = self._entries[key]
            if entry.pins == 0 and entry.done.is_set():
                self._policy.remove(key)
                del self._entries[key]
                self.evictions += 1
                return entry.slot
        return None

    def reading_unpinned(self) -> bool:
        """Whether a slot will become evictable once a read finishes (nobody holds it)."""
        return any(e.pins == 0 and not e.done.is_set() for e in self._entries.values())

    def forget(self, entry: Entry) -> None:
        """Drop a block whose read failed, so the next request reads it again; its slot returns via `free`."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self._policy.remove(entry.key)

    def free(self, slot: int) -> None:
        self._free.append(slot)
