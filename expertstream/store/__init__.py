"""The expert store: O_DIRECT reader pool and a RAM cache of expert blocks (docs/workdir.md)."""

from expertstream.store.reader import StoreError, alloc_aligned
from expertstream.store.store import ExpertHandle, ExpertStore, StoreStats

__all__ = ["ExpertHandle", "ExpertStore", "StoreError", "StoreStats", "alloc_aligned"]
