"""The expert store: O_DIRECT reader pool and RAM LRU cache of repacked expert blocks (docs/workdir.md)."""

from expertstream.store.reader import StoreError, alloc_aligned
from expertstream.store.store import ExpertHandle, ExpertStore, StoreStats

__all__ = ["ExpertHandle", "ExpertStore", "StoreError", "StoreStats", "alloc_aligned"]
