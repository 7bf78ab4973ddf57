"""Conversation state cache: RAM snapshots of the engine state keyed by the token ids they have consumed.

A follow-up turn whose prompt extends a cached key restores that snapshot and processes only the new tail.
Bounded in bytes, not entries (one snapshot of the real model at 8k context is ~340 MB); least recently
used entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from expertstream.log import get_logger

log = get_logger(__name__)


class PromptCache:
    """LRU of state snapshots (anything with `.nbytes`) keyed by token prefix.

    Args:
        max_bytes: budget for the snapshots together; 0 disables the cache.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"state cache budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self._entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int]) -> tuple[int, Any] | None:
        """Longest cached key that is a strict prefix of `tokens` (at least one token must remain to process).

        Returns:
            (number of reused tokens, snapshot), or None on a miss.
        """
        best: tuple[int, ...] | None = None
        for key in self._entries:
            n = len(key)
            if n < len(tokens) and (best is None or n > len(best)) and tuple(tokens[:n]) == key:
                best = key
        if best is None:
            self.misses += 1
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.reused_tokens += len(best)
        return len(best), self._entries[best]

    def insert(self, tokens: Sequence[int], snapshot: Any) -> bool:
        """Store a snapshot of the state that has consumed exactly `tokens`; evicts LRU entries to fit.

        Returns:
            False when the snapshot alone exceeds the budget (it is not stored).
        """
        key = tuple(tokens)
        if key in self._entries:
            self.nbytes -= self._entries.pop(key).nbytes
        if snapshot.nbytes > self.max_bytes:
            log.debug("state snapshot of %d bytes exceeds the %d-byte cache", snapshot.nbytes, self.max_bytes)
            return False
        while self.nbytes + snapshot.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        self._entries[key] = snapshot
        self.nbytes += snapshot.nbytes
        return True
