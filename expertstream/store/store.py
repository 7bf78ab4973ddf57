"""`ExpertStore`: expert blocks from experts.bin through a reader pool into a RAM cache (LFU with aging).

request() does not wait for reads: cached blocks are hits, a block already being read is joined, the rest
are queued to the readers at once (it waits only while a full cache's sole candidates are still landing).
A handle pins its block until release(). With cache=False (prefill) misses go to
transient buffers, so a long prompt cannot evict the decode working set. A GPU runtime adds pinned memory
(pass an `alloc` that registers it) and VRAM slots on top without the model knowing.
Speculation uses two more calls: peek() (blocks already in RAM, no read) and prefetch() (low-priority reads
on one thread that starts a read only while no demand read is queued or in flight).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from expertstream.store.cache import BlockCache, Entry, Key
from expertstream.store.reader import PAGE, BlockReader, StoreError, alloc_aligned
from expertstream.workdir.checksum import ALGORITHM, checksum
from expertstream.workdir.workdir import Workdir


@dataclass(slots=True)
class StoreStats:
    requests: int = 0  # keys asked for
    hits: int = 0  # served from RAM or joined to a read already in flight
    misses: int = 0  # block reads issued
    bytes_read: int = 0
    read_seconds: float = 0.0  # summed over reader threads
    queue_depth: int = 0  # reads queued or in flight now
    max_queue_depth: int = 0
    evictions: int = 0
    cached_blocks: int = 0
    direct: bool = False  # reads bypass the page cache (O_DIRECT)
    prefetches: int = 0  # blocks read by the low-priority prefetch reader (also in bytes_read)
    prefetch_hits: int = 0  # prefetched blocks later served to a request or a peek
    prefetch_dropped: int = 0  # queued prefetches never read (superseded, already cached, no free slot)
    evict_wait_seconds: float = 0.0  # request() waiting for a landing read to free a full cache's slot
    preloads: int = 0  # blocks read by preload() (also in bytes_read; not guesses: not in prefetches)
    checksum_seconds: float = 0.0  # CRC32C of blocks as they land, summed over reader threads (wall)
    checksum_cpu_seconds: float = 0.0  # ... the readers' CPU time in it (wall also waits for the GIL back)
    blocks_checked: int = 0


class ExpertHandle:
    """One requested block: wait() gives its bytes, valid until release()."""

    __slots__ = ("_store", "_entry", "_released")

    def __init__(self, store: ExpertStore, entry: Entry):
        self._store, self._entry, self._released = store, entry, False

    @property
    def key(self) -> Key:
        return self._entry.key

    @property
    def row(self) -> int | None:
        """The block's row in the RAM cache's slot memory (`ExpertStore.slots`), None for a transient read."""
        return self._entry.slot

    @property
    def ready(self) -> bool:
        """The block has landed (or its read failed): wait() returns at once."""
        return self._entry.done.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until read; returns torch.uint8 [block_bytes]. Raises StoreError if the read failed."""
        if self._released:
            raise StoreError(f"handle of expert block {self.key} used after release()")
        if not self._entry.done.wait(timeout):
            l, e = self.key
            raise TimeoutError(f"expert block (layer {l}, expert {e}) not read within {timeout} s")
        if self._entry.error is not None:
            raise StoreError(str(self._entry.error)) from self._entry.error
        return self._entry.buf

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store._release(self._entry)


class ExpertStore:
    """Expert blocks of a working directory, read with O_DIRECT and cached in RAM (docs/workdir.md).

    Args:
        workdir: a `Workdir` or its path.
        ram_cache_bytes: RAM budget of the cache; it holds ram_cache_bytes // block_bytes blocks.
        io_threads: reader threads (about the drive's useful queue depth).
        alloc: page-aligned host allocator, nbytes -> uint8 tensor (a GPU runtime passes one that pins).
    """

    def __init__(
        self,
        workdir: Workdir | str | os.PathLike,
        ram_cache_bytes: int,
        io_threads: int = 16,
        alloc: Callable[[int], torch.Tensor] = alloc_aligned,
    ):
        self.workdir = workdir if isinstance(workdir, Workdir) else Workdir(workdir)
        self.block_bytes = self.workdir.layout.block_bytes
        if io_threads <= 0:
            raise ValueError(f"io_threads must be positive, got {io_threads}")
        self._alloc = alloc
        self._cache = BlockCache(max(0, ram_cache_bytes) // self.block_bytes, self.block_bytes, alloc)
        if self._cache.slots is not None and self._cache.slots.data_ptr() % PAGE:
            raise ValueError(f"alloc returned memory not aligned to {PAGE} bytes, which O_DIRECT needs")
        try:
            self._reader = BlockReader(self.workdir.experts_path)
        except OSError as e:
            raise StoreError(f"cannot open expert file {self.workdir.experts_path}: {e}") from e
        self._checksums: list[int] = self.workdir.manifest["experts"]["checksums"]  # [L * E], index l * E + e
        self._transient: dict[Key, Entry] = {}  # bypass reads in flight or pinned
        self._spare: list[torch.Tensor] = []  # recycled transient buffers
        self._max_spare = io_threads
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # notified whenever a read finishes
        self._stats = StoreStats()
        # readers keep the CPUs the process had when the store was made, even when a decode thread pinned
        # to one core (EngineConfig.cpu_affinity) is the thread that spawns them
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._pool = ThreadPoolExecutor(
            io_threads, thread_name_prefix="expertstream-io", initializer=self._restore_affinity
        )
        self._prefetch_queue: deque[Key] = deque()
        self._preload_queue: deque[Key] = deque()  # below the guesses: read only when they are all done
        self._prefetched: set[Key] = set()  # read by the prefetcher, not yet served to anyone
        self._prefetcher: threading.Thread | None = None
        self._prefetcher_done = threading.Event()
        self._closed = False

    @property
    def capacity(self) -> int:
        """Blocks the RAM cache holds."""
        return self._cache.capacity

    @property
    def cached_blocks(self) -> int:
        """Blocks in the RAM cache now, read or still being read (a cheap, unlocked count)."""
        return len(self._cache)

    @property
    def slots(self) -> torch.Tensor | None:
        """The cache's slot memory, uint8 [capacity, block_bytes] (for pinning or registration)."""
        return self._cache.slots

    @property
    def stats(self) -> StoreStats:
        with self._lock:
            c = self._cache
            return dataclasses.replace(
                self._stats, evictions=c.evictions, cached_blocks=len(c), direct=self._reader.direct
            )

    def request(self, keys: Iterable[Key], cache: bool = True) -> list[ExpertHandle]:
        """Handles for (layer, expert) keys, in order; reads start now. Duplicates share one read.

        With cache=False, blocks not already in RAM are read into transient buffers and never cached.
        Raises StoreError when every cache slot is pinned by unreleased handles.
        """
        handles: list[ExpertHandle] = []
        L, E = self.workdir.num_layers, self.workdir.num_experts
        with self._lock:
            try:
                for key in keys:
                    l, e = key
                    if not (0 <= l < L and 0 <= e < E):
                        raise ValueError(f"expert key {key} outside {L} layers x {E} experts")
                    self._stats.requests += 1
                    entry = self._lookup_or_read((l, e), cache)
                    entry.pins += 1
                    handles.append(ExpertHandle(self, entry))
            except BaseException:
                for h in handles:  # leave nothing pinned by a request that failed half-way
                    h._released = True
                    self._unpin(h._entry)
                raise
        return handles

    def _lookup_or_read(self, key: Key, cache: bool) -> Entry:
        while True:
            if self._closed:
                raise StoreError("request() on a closed ExpertStore")
            entry = self._cache.get(key) or self._transient.get(key)
            if entry is not None:
                self._stats.hits += 1
                self._count_prefetch_hit(key)
                return entry
            self._prefetched.discard(key)  # evicted before anyone used it: this read is a demand read
            if cache and self._cache.capacity:
                entry = self._cache.insert(key)
                if entry is None and self._cache.reading_unpinned():
                    # the only candidates are unpinned blocks still being read: evictable once they land
                    t0 = time.perf_counter()
                    self._landed.wait()
                    self._stats.evict_wait_seconds += time.perf_counter() - t0
                    continue
                if entry is None:
                    raise StoreError(
                        f"all {self._cache.capacity} RAM cache slots are pinned by unreleased handles "
                        f"(requesting expert block {key}); release handles or raise ram_cache_bytes"
                    )
            else:
                entry = Entry(key, self._spare.pop() if self._spare else self._alloc(self.block_bytes), None)
                self._transient[key] = entry
            self._stats.misses += 1
            self._stats.queue_depth += 1
            self._stats.max_queue_depth = max(self._stats.max_queue_depth, self._stats.queue_depth)
            self._pool.submit(self._read, entry)
            return entry

    def keep_spare(self, blocks: int) -> None:
        """Keep up to `blocks` transient buffers for reuse (default: one per reader). A GPU bank's prompt
        passes hold about two groups of blocks at once; without enough spares every pass maps and pins
        fresh buffers (cudaHostRegister) and drops as many."""
        with self._lock:
            self._max_spare = max(self._max_spare, blocks)

    def _count_prefetch_hit(self, key: Key) -> None:
        if key in self._prefetched:
            self._prefetched.discard(key)
            self._stats.prefetch_hits += 1

    def peek(self, keys: Iterable[Key]) -> list[ExpertHandle | None]:
        """Handles for blocks already read into RAM, None for the rest; starts no read, counts no request."""
        out: list[ExpertHandle | None] = []
        with self._lock:
            for key in keys:
                entry = self._cache.lookup(key)
                if entry is None or not entry.done.is_set() or entry.error is not None:
                    out.append(None)
                    continue
                self._count_prefetch_hit(key)
                entry.pins += 1
                out.append(ExpertHandle(self, entry))
        return out

    def prefetch(self, keys: Iterable[Key]) -> int:
        """Queue low-priority reads of blocks not in RAM into the cache; returns how many were queued.

        The queue holds only the latest call's keys (older guesses are dropped): one thread reads them in
        order, each only once no demand read is queued or in flight, so demand reads always overtake.
        """
        with self._lock:
            if self._closed or not self._cache.capacity:
                return 0
            self._stats.prefetch_dropped += len(self._prefetch_queue)
            self._prefetch_queue.clear()
            for key in keys:
                if self._cache.lookup(key) is None and key not in self._transient:
                    self._prefetch_queue.append(key)
            if self._prefetch_queue:  # waking the prefetcher for nothing costs a thread switch per layer
                self._start_prefetcher()
            return len(self._prefetch_queue)

    def preload(self, keys: Iterable[Key]) -> int:
        """Queue background reads of blocks not in RAM into the cache, below the guesses: the prefetch thread
        reads them only while no demand read and no guess is queued or in flight, and prefetch() does not
        drop them. Returns how many were queued. For a RAM cache that holds every block: it fills up
        without waiting for every block to be asked for once."""
        with self._lock:
            if self._closed or not self._cache.capacity:
                return 0
            n = len(self._preload_queue)
            self._preload_queue.extend(
                k for k in keys if self._cache.lookup(k) is None and k not in self._transient
            )
            self._start_prefetcher()
            return len(self._preload_queue) - n

    def _start_prefetcher(self) -> None:
        if self._prefetcher is None and (self._prefetch_queue or self._preload_queue):
            self._prefetcher = threading.Thread(
                target=self._prefetch_loop, name="expertstream-prefetch", daemon=True
            )
            self._prefetcher.start()
        self._landed.notify_all()

    def _restore_affinity(self) -> None:
        if self._cpus is not None:
            os.sched_setaffinity(0, self._cpus)

    def _prefetch_loop(self) -> None:
        try:
            self._prefetch_until_closed()
        finally:
            self._prefetcher_done.set()

    def _prefetch_until_closed(self) -> None:
        self._restore_affinity()
        while True:
            with self._lock:
                while not self._closed and (
                    not (self._prefetch_queue or self._preload_queue) or self._stats.queue_depth
                ):
                    self._landed.wait()
                if self._closed:
                    return
                guess = bool(self._prefetch_queue)
                key = (self._prefetch_queue if guess else self._preload_queue).popleft()
                entry = None
                if self._cache.lookup(key) is None and key not in self._transient:
                    entry = self._cache.insert(key, counted=False)  # None: every slot pinned or reading
                if entry is None:
                    self._stats.prefetch_dropped += guess
                    continue
                entry.pins += 1  # held while reading so no request can evict it half-read
                self._stats.queue_depth += 1
                if guess:
                    self._stats.prefetches += 1
                    self._prefetched.add(key)
                else:
                    self._stats.preloads += 1
            self._read(entry)
            with self._lock:
                self._unpin(entry)

    def _read(self, entry: Entry) -> None:
        (l, e), path = entry.key, self.workdir.experts_path
        offset, n, error = self.workdir.block_offset(l, e), 0, None
        t0 = time.perf_counter()
        t1, c1 = t0, time.thread_time()
        try:
            n = self._reader.read_into(entry.buf, offset)
            t1, c1 = time.perf_counter(), time.thread_time()
            if n != self.block_bytes:
                error = StoreError(
                    f"short read of expert block (layer {l}, expert {e}) from {path}: {n} of "
                    f"{self.block_bytes} bytes at offset {offset}; was experts.bin truncated after setup?"
                )
            elif (got := checksum(entry.buf.numpy())) != (
                want := self._checksums[l * self.workdir.num_experts + e]
            ):
                # never computed on: a changed block fails its request, the next read tries the disk again
                error = StoreError(
                    f"expert block (layer {l}, expert {e}) read from {path} does not match its {ALGORITHM} "
                    f"({got:#010x}, setup recorded {want:#010x}): experts.bin changed after setup; "
                    "run `expertstream verify --all` and set up again"
                )
        except Exception as exc:  # surfaces in wait(); the reader thread must not die silently
            error = StoreError(f"reading expert block (layer {l}, expert {e}) from {path} failed: {exc}")
            error.__cause__ = exc
        t2, c2 = time.perf_counter(), time.thread_time()
        with self._lock:
            s = self._stats
            s.queue_depth -= 1
            s.bytes_read += n
            s.read_seconds += t1 - t0
            if n == self.block_bytes:
                s.checksum_seconds += t2 - t1
                s.checksum_cpu_seconds += c2 - c1
                s.blocks_checked += 1
            if error is not None:
                entry.error = error
                self._cache.forget(entry)
                if self._transient.get(entry.key) is entry:
                    del self._transient[entry.key]
            entry.done.set()
            self._recycle(entry)
            self._landed.notify_all()

    def _release(self, entry: Entry) -> None:
        with self._lock:
            self._unpin(entry)

    def _unpin(self, entry: Entry) -> None:
        assert entry.pins > 0, "release() matches one request()"
        entry.pins -= 1
        self._recycle(entry)

    def _recycle(self, entry: Entry) -> None:
        # memory of a finished, unpinned block that is not in the cache goes back to its pool
        if entry.pins or not entry.done.is_set():
            return
        if entry.slot is None:
            if self._transient.get(entry.key) is entry:
                del self._transient[entry.key]
            if len(self._spare) < self._max_spare:
                self._spare.append(entry.buf)
        elif entry.error is not None:
            self._cache.free(entry.slot)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._landed.notify_all()
        # Ctrl-C can land inside Thread.start(), before the thread is marked started (join() would raise).
        # One that has not run yet (no ident) finds the store closed before it reads anything.
        if self._prefetcher is not None and self._prefetcher.ident is not None:
            self._prefetcher_done.wait()
        self._pool.shutdown(wait=True)  # outside the lock: finishing reads take it
        self._reader.close()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
