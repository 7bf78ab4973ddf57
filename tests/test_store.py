"""The expert store: bytes equal to the snapshot under concurrent readers, eviction by bytes, stats, O_DIRECT
where the filesystem allows it, bypass reads, and errors that name the block."""

import errno
import logging
import mmap
import os
import random
import shutil
import threading

import pytest
import torch

from expertstream.formats.snapshot import Snapshot
from expertstream.store import ExpertStore, StoreError
from expertstream.workdir.inventory import PREFIX
from expertstream.workdir.workdir import Workdir, WorkdirError


@pytest.fixture(scope="module")
def expected(tiny_snapshot, tiny_workdir):
    """(layer, expert) -> the block built independently from the snapshot's six tensors."""
    snap, wd = Snapshot(tiny_snapshot), Workdir(tiny_workdir)
    return {
        (l, e): wd.layout.pack(
            {p.name: snap.read(f"{PREFIX}layers.{l}.mlp.experts.{e}.{p.name}") for p in wd.layout.parts}
        )
        for l in range(wd.num_layers)
        for e in range(wd.num_experts)
    }


@pytest.fixture
def workdir_copy(tiny_workdir, tmp_path):
    return Workdir(shutil.copytree(tiny_workdir, tmp_path / "wd"))


def _get(store, keys, cache=True):
    hs = store.request(keys, cache=cache)
    out = [bytes(h.wait().numpy()) for h in hs]
    for h in hs:
        h.release()
    return out


def _o_direct_works(directory) -> bool:
    probe = directory / "odirect-probe"
    probe.write_bytes(b"\x01" * 2 * mmap.PAGESIZE)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        return os.preadv(fd, [memoryview(mmap.mmap(-1, mmap.PAGESIZE))], 0) == mmap.PAGESIZE
    except OSError:
        return False
    finally:
        os.close(fd)


def test_concurrent_readers_get_snapshot_bytes(tiny_workdir, expected):
    wd = Workdir(tiny_workdir)
    keys = list(expected)
    threads, rounds, per_request = 8, 25, 6
    # room for every pinned block but well below all 64 blocks, so eviction runs under contention
    capacity = threads * per_request + 2
    errors = []
    with ExpertStore(wd, capacity * wd.layout.block_bytes, io_threads=4) as store:

        def worker(seed):
            rng = random.Random(seed)
            try:
                for _ in range(rounds):
                    ks = [rng.choice(keys[:24]) for _ in range(per_request)]  # overlapping sets, duplicates
                    hs = store.request(ks)
                    for k, h in zip(ks, hs):
                        assert h.key == k
                        assert bytes(h.wait().numpy()) == expected[k], k
                    for h in hs:
                        h.release()
            except BaseException as e:  # surfaced below: assertion errors in threads are otherwise lost
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors[0]
        assert _get(store, keys[24:]) == [expected[k] for k in keys[24:]]  # forces evictions
        s = store.stats
    total = threads * rounds * per_request + len(keys) - 24
    assert s.requests == total and s.hits + s.misses == total
    assert s.bytes_read == s.misses * wd.layout.block_bytes
    assert s.queue_depth == 0 and 1 <= s.max_queue_depth <= s.misses
    assert s.evictions > 0 and s.cached_blocks == capacity
    assert s.read_seconds > 0


def test_eviction_by_bytes_and_stats(tiny_workdir, expected):
    wd = Workdir(tiny_workdir)
    a, b, c, d = (0, 0), (0, 1), (1, 0), (2, 5)
    with ExpertStore(wd, 3 * wd.layout.block_bytes + wd.layout.block_bytes // 2, io_threads=2) as store:
        assert store.capacity == 3
        assert _get(store, [a, b, c]) == [expected[k] for k in (a, b, c)]
        assert _get(store, [a]) == [expected[a]]  # hit: a used twice, b and c once, b longest ago
        assert _get(store, [d]) == [expected[d]]  # evicts b
        s = store.stats
        assert (s.requests, s.hits, s.misses, s.evictions, s.cached_blocks) == (5, 1, 4, 1, 3)
        _get(store, [a, c, d])  # all three still cached
        assert store.stats.misses == 4
        assert _get(store, [b]) == [expected[b]]  # b was the one evicted
        s = store.stats
        assert (s.requests, s.hits, s.misses, s.bytes_read) == (9, 4, 5, 5 * wd.layout.block_bytes)


def test_all_pinned_is_a_clear_error_and_leaks_nothing(tiny_workdir, expected):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 2 * wd.layout.block_bytes, io_threads=2) as store:
        held = store.request([(0, 0), (0, 1)])
        with pytest.raises(StoreError, match="all 2 RAM cache slots are pinned"):
            store.request([(3, 3)])
        for h in held:
            h.release()
        # a request failing half-way must unpin what it had pinned
        with pytest.raises(StoreError, match="pinned"):
            store.request([(1, 1), (1, 2), (1, 3)])
        assert _get(store, [(2, 1), (2, 2)]) == [expected[(2, 1)], expected[(2, 2)]]
        with pytest.raises(ValueError, match=r"expert key \(4, 0\) outside"):
            store.request([(4, 0)])


def test_bypass_reads_keep_the_decode_working_set(tiny_workdir, expected):
    wd = Workdir(tiny_workdir)
    decode, prompt = [(0, 0), (0, 1)], [(1, e) for e in range(10)]
    with ExpertStore(wd, 2 * wd.layout.block_bytes, io_threads=4) as store:
        _get(store, decode)
        # more prompt blocks than the cache holds, all pinned at once: no error, no eviction
        assert _get(store, prompt + [(0, 0)], cache=False) == [expected[k] for k in prompt + [(0, 0)]]
        s = store.stats
        assert (s.misses, s.hits, s.evictions, s.cached_blocks) == (12, 1, 0, 2)
        assert _get(store, decode) == [expected[k] for k in decode]
        assert store.stats.misses == 12  # the decode set survived the prompt
        # transient buffers are recycled: the same bypass keys read correctly again
        assert _get(store, prompt[:3], cache=False) == [expected[k] for k in prompt[:3]]


def test_request_joins_a_read_in_flight(tiny_workdir, expected, monkeypatch):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 4 * wd.layout.block_bytes, io_threads=4) as store:
        gate, calls, real = threading.Event(), [], store._reader.read_into

        def slow_read(buf, offset):
            calls.append(offset)
            gate.wait(10)
            return real(buf, offset)

        monkeypatch.setattr(store._reader, "read_into", slow_read)
        first = store.request([(2, 3), (2, 3)])
        second = store.request([(2, 3)], cache=False)
        assert store.stats.queue_depth == 1
        gate.set()
        assert all(bytes(h.wait().numpy()) == expected[(2, 3)] for h in first + second)
        assert calls == [wd.block_offset(2, 3)]
        s = store.stats
        assert (s.requests, s.misses, s.hits) == (3, 1, 2)
        for h in first + second:
            h.release()
        with pytest.raises(StoreError, match="after release"):
            first[0].wait()


def test_a_full_cache_waits_for_a_landing_read_and_counts_it(tiny_workdir, monkeypatch):
    wd = Workdir(tiny_workdir)
    with ExpertStore(wd, 2 * wd.layout.block_bytes, io_threads=2) as store:
        gate, real = threading.Event(), store._reader.read_into
        monkeypatch.setattr(store._reader, "read_into", lambda buf, off: gate.wait(10) and real(buf, off))
        for h in store.request([(0, 0), (0, 1)]):
            h.release()  # unpinned but still reading: the only eviction candidates
        threading.Timer(0.2, gate.set).start()
        (h,) = store.request([(0, 2)])  # waits until one of them lands
        h.wait()
        h.release()
        assert store.stats.evict_wait_seconds >= 0.1


def test_direct_io_exactly_where_the_filesystem_allows_it(tiny_workdir, tmp_path, expected):
    wd = Workdir(shutil.copytree(tiny_workdir, tmp_path / "wd"))
    works = _o_direct_works(tmp_path)
    with ExpertStore(wd, 4 * wd.layout.block_bytes) as store:
        assert _get(store, [(1, 1), (3, 15)]) == [expected[(1, 1)], expected[(3, 15)]]
        assert store.stats.direct is works
        assert store.slots.data_ptr() % mmap.PAGESIZE == 0


def test_buffered_fallback_warns_once(workdir_copy, expected, monkeypatch, caplog):
    """A filesystem that accepts O_DIRECT at open but refuses the read (EINVAL): buffered, one warning."""
    direct_fds, real_open, real_preadv = set(), os.open, os.preadv

    def fake_open(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def fake_preadv(fd, buffers, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    keys = list(expected)[:20]
    with caplog.at_level(logging.WARNING), ExpertStore(workdir_copy, 32 * 4096, io_threads=8) as store:
        assert _get(store, keys) == [expected[k] for k in keys]
        assert store.stats.direct is False
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "O_DIRECT refused" in caplog.records[0].message and len(caplog.records) == 1


def test_open_refusing_o_direct_falls_back(workdir_copy, expected, monkeypatch):
    real_open = os.open

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", fake_open)
    with ExpertStore(workdir_copy, 1 << 20) as store:
        assert store.stats.direct is False
        assert _get(store, [(0, 5)]) == [expected[(0, 5)]]


def test_truncated_after_setup_names_the_block(workdir_copy, expected):
    wd = workdir_copy
    L, E, bb = wd.num_layers, wd.num_experts, wd.layout.block_bytes
    with ExpertStore(wd, 8 * bb) as store:
        os.truncate(wd.experts_path, (L * E - 1) * bb + bb // 2)  # half of the last block is gone
        (h,) = store.request([(L - 1, E - 1)])
        with pytest.raises(
            StoreError, match=rf"short read of expert block \(layer {L - 1}, expert {E - 1}\)"
        ):
            h.wait()
        h.release()
        assert _get(store, [(0, 0)]) == [expected[(0, 0)]]
        # a failed read is not cached: asking again reads (and fails) again instead of serving garbage
        (h,) = store.request([(L - 1, E - 1)], cache=False)
        with pytest.raises(StoreError, match=rf"layer {L - 1}, expert {E - 1}"):
            h.wait()
        h.release()
        assert store.stats.misses == 3


def test_missing_file_is_named(workdir_copy):
    os.unlink(workdir_copy.experts_path)
    with pytest.raises(StoreError, match="experts.bin"):
        ExpertStore(workdir_copy, 1 << 20)
    with pytest.raises(WorkdirError, match="experts.bin is missing"):
        ExpertStore(workdir_copy.path, 1 << 20)


def test_closed_store_refuses_requests(tiny_workdir):
    store = ExpertStore(tiny_workdir, 1 << 20, io_threads=1)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.request([(0, 0)])


@pytest.mark.parametrize("thread_runs", [False, True])
def test_ctrl_c_while_the_prefetcher_starts_still_closes(tiny_workdir, monkeypatch, thread_runs):
    """Ctrl-C can interrupt Thread.start() while it waits for the new thread: close() then neither raises
    (join() refuses a thread not yet marked started) nor closes the reader under a thread that reads."""
    start = threading.Thread.start

    def interrupted_start(thread):
        if thread_runs:
            start(thread)
        raise KeyboardInterrupt

    store = ExpertStore(tiny_workdir, 1 << 20, io_threads=1)
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        store.prefetch([(0, 0)])
    monkeypatch.undo()
    store.close()
    assert store._prefetcher_done.is_set() == thread_runs


def test_peeks_count_no_use_and_prefetched_blocks_enter_cold():
    from expertstream.store.cache import BlockCache

    def fill(cache, *keys, counted=True):
        for k in keys:
            cache.insert(k, counted=counted).done.set()

    cache = BlockCache(2, 8, lambda n: torch.zeros(n, dtype=torch.uint8))
    fill(cache, (0, 0), (0, 1))
    cache.lookup((0, 0))  # a speculative peek: (0, 0) stays the least recently used of equal counts
    fill(cache, (0, 2))
    assert cache.lookup((0, 0)) is None and cache.lookup((0, 1)) is not None
    cache = BlockCache(2, 8, lambda n: torch.zeros(n, dtype=torch.uint8))
    fill(cache, (0, 0))  # used once, the oldest
    fill(cache, (1, 0), counted=False)  # prefetched: enters cold, below the older used block
    fill(cache, (1, 1))
    assert cache.lookup((1, 0)) is None and cache.lookup((0, 0)) is not None
