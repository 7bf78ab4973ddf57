"""Eviction order of the expert caches (RAM `BlockCache`, `VramExpertCache`) and of `bench routing`'s replay.

A policy only orders resident keys; the cache owns the slots and decides which candidates it may not evict
(pinned, protected, still reading). `bench routing` measured both on the demo model's routing
(docs/benchmarks.md): `LfuPolicy` keeps more hits than `LruPolicy` at every cache size, so the caches use it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

Key = tuple[int, int]  # (layer, expert)


def most_routed(counts: np.ndarray, q: int) -> np.ndarray:
    """The q experts of a layer routed most by `counts` [E] (lower ids first on ties): a RAM-resident bank's
    hot set (experts/gpu_residency.py), and `bench routing`'s replay of it."""
    return np.lexsort((np.arange(counts.size), -counts))[:q]


class LruPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def access(self, key: Key) -> None:
        """A demand use (hit or fresh insert): the key becomes resident and most recent."""
        self._order[key] = None
        self._order.move_to_end(key)

    def add_cold(self, key: Key) -> None:
        """A speculative insert: resident, but the first victim until accessed."""
        self._order[key] = None
        self._order.move_to_end(key, last=False)

    def remove(self, key: Key) -> None:
        del self._order[key]

    def victims(self) -> Iterator[Key]:
        """Resident keys, best victim first; stop iterating before calling remove()."""
        return iter(self._order)


class LfuPolicy:
    """Least frequently used first, with counts that outlive eviction and halve as they age.

    Why remembered counts: a layer's K blocks come back only after a whole token (L x K other blocks), so a
    cache smaller than that evicts every block before its next use, and per-residency counts would never
    rise above 1; counts kept per key (at most L x E ints) let a hot expert win its slot back for good.
    Why aging: all counts halve every 4 x (keys with a count) accesses, so the ranking follows a drifting
    workload.
    Ties go to the least recently used; speculative inserts rank below every count until accessed.
    """

    COLD = -1  # rank of a speculative insert

    def __init__(self) -> None:
        self._counts: dict[Key, int] = {}  # every key seen, resident or not
        self._rank: dict[Key, int] = {}  # resident key -> its bucket
        self._buckets: dict[int, OrderedDict[Key, None]] = {}  # rank -> resident keys, oldest first
        self._accesses = 0  # since the last halving

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: Key) -> bool:
        return key in self._rank

    def _place(self, key: Key, rank: int, last: bool = True) -> None:
        if key in self._rank:
            self.remove(key)
        self._rank[key] = rank
        bucket = self._buckets.setdefault(rank, OrderedDict())
        bucket[key] = None
        bucket.move_to_end(key, last=last)

    def access(self, key: Key) -> None:
        """A demand use (hit or fresh insert): count it; the key becomes resident and most recent."""
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        self._place(key, count)
        self._accesses += 1
        if self._accesses >= 4 * len(self._counts):
            self._age()

    def add_cold(self, key: Key) -> None:
        """A speculative insert: resident, not counted, the first victim until accessed."""
        self._place(key, self.COLD, last=False)

    def remove(self, key: Key) -> None:
        rank = self._rank.pop(key)
        bucket = self._buckets[rank]
        del bucket[key]
        if not bucket:
            del self._buckets[rank]

    def _age(self) -> None:
        self._accesses = 0
        self._counts = {k: c // 2 for k, c in self._counts.items() if c > 1}
        # keep the (rank, recency) order; a resident's rank is its count, halved like it
        order = [(k, r) for r in sorted(self._buckets) for k in self._buckets[r]]
        self._rank, self._buckets = {}, {}
        for k, r in order:
            self._place(k, r if r == self.COLD else self._counts.get(k, 0))

    def victims(self) -> Iterator[Key]:
        """Resident keys, best victim first; stop iterating before calling remove()."""
        for rank in sorted(self._buckets):
            yield from self._buckets[rank]
