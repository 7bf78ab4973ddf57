import contextlib

import numpy as np
import pytest
import torch

from expertstream.experts.pass_tables import PassTables
from expertstream.experts.vram_cache import VramExpertCache

BLOCK = 64


class FakeHandle:
    row = None  # not a RAM cache row (a transient read)
    ready = True

    def __init__(self, key, log):
        self.key, self.log = key, log

    def wait(self):
        layer, expert = self.key
        return torch.full((BLOCK,), layer * 16 + expert, dtype=torch.uint8)

    def release(self):
        self.log.append(("release", self.key))


def make(n_slots):
    log = []

    def fetch_host(keys):
        log.extend(("read", k) for k in keys)
        return [FakeHandle(k, log) for k in keys]

    scales = torch.arange(4 * 8 * 3, dtype=torch.float32).view(4, 8, 3)
    return VramExpertCache(fetch_host, BLOCK, n_slots, scales, "cpu"), log


def test_blocks_and_scales_land_in_their_slots_and_hits_are_free():
    cache, log = make(8)
    slots = cache.fetch(1, [3, 5])
    for s, e in zip(slots, (3, 5)):
        assert torch.all(cache.slots[s] == 16 + e)
        assert torch.equal(cache.ws2[s], torch.arange(3, dtype=torch.float32) + (1 * 8 + e) * 3)
    reads = len([x for x in log if x[0] == "read"])
    again = cache.fetch(1, [5, 3])
    assert again == slots[::-1]
    assert len([x for x in log if x[0] == "read"]) == reads  # no host traffic on hits
    assert cache.stats.hits == 2 and cache.stats.requests == 4
    assert all(("release", k) in log for k in ((1, 3), (1, 5)))  # host buffers are handed back


def test_blocks_that_follow_each_other_in_ram_and_in_the_slots_go_up_as_one_copy():
    cache, log = make(8)
    ram = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, BLOCK)  # RAM rows: row r holds byte r
    late = {(0, 3)}  # still being read when the copies are queued

    def fetch_host(keys):
        out = []
        for layer, e in keys:
            h = FakeHandle((layer, e), log)
            h.row = 6 if e == 2 else e  # expert 2 sits apart from its neighbours
            h.wait = lambda r=h.row: ram[r]
            h.ready = (layer, e) not in late
            out.append(h)
        return out

    cache.fetch_host = fetch_host
    runs = []
    copy_run = cache._copy_run
    cache._copy_run = lambda slot, block, n: (runs.append((slot, n)), copy_run(slot, block, n))
    slots = cache.fetch(0, [0, 1, 2, 3, 4, 5])
    assert slots == [0, 1, 2, 3, 4, 5]  # free slots in order
    # rows 0-1 follow on; row 6 breaks the run; expert 3 was not ready (its run starts anew); rows 3-5 follow
    assert runs == [(0, 2), (2, 1), (3, 3)]
    for s, e in zip(slots, (0, 1, 2, 3, 4, 5)):
        assert torch.all(cache.slots[s] == (6 if e == 2 else e))
    assert cache.stats.copies == 6


@pytest.mark.gpu  # copy_rows batches run on CUDA only
def test_a_batch_of_landed_ram_rows_goes_up_as_one_kernel(monkeypatch):
    from expertstream.experts import vram_cache as module

    ram = torch.randint(0, 256, (8, BLOCK), dtype=torch.uint8).pin_memory()  # RAM row e holds expert e
    log, late = [], set()

    def fetch_host(keys):
        out = []
        for layer, e in keys:
            h = FakeHandle((layer, e), log)
            h.row, h.wait, h.ready = e, (lambda r=e: ram[r]), (layer, e) not in late
            out.append(h)
        return out

    launches = []
    real = module.copy_rows
    monkeypatch.setattr(module, "copy_rows", lambda pairs, n, *a: (launches.append(n), real(pairs, n, *a)))
    cache = VramExpertCache(fetch_host, BLOCK, 6, torch.zeros(4, 8, 3), "cuda", host_rows=ram)
    first = cache.fetch(0, [3, 1, 6])  # every block a landed RAM row: one launch
    late.add((1, 2))
    second = cache.fetch(1, [2, 5])  # one still being read: copied as they land, no launch
    torch.cuda.synchronize()
    assert launches == [3] and cache.stats.copies == 5
    for s, e in zip(first + second, (3, 1, 6, 2, 5)):
        assert torch.equal(cache.slots[s].cpu(), ram[e])


def test_load_pairs_copies_fixed_ram_rows_outside_the_cache_bookkeeping():
    ram = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, BLOCK)  # RAM row r holds byte r
    cache = VramExpertCache(make(6)[0].fetch_host, BLOCK, 6, torch.zeros(4, 8, 3), "cpu", host_rows=ram)
    cache.fetch(0, [1, 2])
    assert len(cache.lru) == 2
    pairs = torch.tensor([[6, 0], [2, 5], [7, 3]], dtype=torch.int32)  # the third pair is past n: not read
    cache.load_pairs(pairs, [0, 5], layer=1)
    assert not cache.lru and len(cache.free) == 6  # what the cache held is forgotten: its slots get reused
    assert cache.protected == {0, 5} and cache.last_layer == 1 and cache.stats.copies == 4
    assert torch.all(cache.slots[0] == 6) and torch.all(cache.slots[5] == 2)
    assert not torch.all(cache.slots[3] == 7)


def test_load_pairs_copies_a_run_of_rows_with_one_copy_call(monkeypatch):
    # consecutive RAM rows into consecutive slots: one copy call (the copy engine on CUDA), no copy kernel
    ram = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, BLOCK)
    cache = VramExpertCache(make(6)[0].fetch_host, BLOCK, 6, torch.zeros(4, 8, 3), "cpu", host_rows=ram)
    monkeypatch.setattr(cache, "_copy_rows", lambda *a: pytest.fail("a run must not launch copy_rows"))
    pairs = torch.tensor([[3, 2], [4, 3], [5, 4]], dtype=torch.int32)
    cache.load_pairs(pairs, [2, 3, 4], layer=0, run=(3, 2))
    assert [int(cache.slots[s][0]) for s in (2, 3, 4)] == [3, 4, 5] and cache.stats.copies == 3
    assert torch.equal(cache.slots[2:5], ram[3:6]) and cache.protected == {2, 3, 4}


def test_pass_tables_hold_each_pass_map_pairs_and_scales():
    tables = PassTables(num_experts=6, slot_rows=5, pass_size=2, device=torch.device("cpu"))
    rows = np.array([10, 11, 12, 13, 14, 15])
    scales = np.arange(18, dtype=np.float32).reshape(6, 3)
    tables.plan([[0, 2], [3, 4], [5]], [[0, 1], [2, 3], [0]], rows, scales, contextlib.nullcontext())
    assert tables.maps[0].tolist() == [0, -1, 1, -1, -1, -1] and tables.maps[2].tolist() == [-1] * 5 + [0]
    assert tables.pairs[1].tolist() == [[13, 2], [14, 3]] and tables.pairs[2][0].tolist() == [15, 0]
    assert torch.equal(tables.ws2[1][2:4], torch.from_numpy(scales[3:5]))
    assert torch.equal(tables.ws2[0][1], torch.from_numpy(scales[2]))
    # runs: pass 1 copies rows 13, 14 into slots 2, 3; pass 0's rows (10, 12) are not consecutive
    assert tables.runs == [None, (13, 2), (15, 0)]
    tables.plan([[1]], [[4]], rows, scales, contextlib.nullcontext())  # the next layer: row 0 rewritten
    assert tables.maps[0].tolist() == [-1, 4, -1, -1, -1, -1] and tables.pairs[0][0].tolist() == [11, 4]
    assert tables.runs == [(11, 4)]


def test_evicts_the_coldest_but_never_the_previous_layer():
    cache, _ = make(4)
    a = cache.fetch(0, [0, 1])  # layer 0
    b = cache.fetch(1, [0, 1])  # layer 1: must not evict layer 0's slots (still protected)
    assert set(a).isdisjoint(b)
    c = cache.fetch(2, [0, 1])  # evicts layer 0 (used once like layer 1, but earlier; unprotected now)
    assert set(c) == set(a)
    assert (1, 0) in cache.lru and (0, 0) not in cache.lru


def test_errors_are_clear():
    cache, _ = make(2)
    with pytest.raises(ValueError, match="distinct"):
        cache.fetch(0, [1, 1])
    with pytest.raises(ValueError, match="only 2 VRAM slots"):
        cache.fetch(0, [1, 2, 3])
    cache.fetch(0, [1, 2])
    with pytest.raises(RuntimeError, match="in use"):
        cache.fetch(1, [1])  # both slots protected by the previous call


def test_each_block_is_copied_once_while_it_fits():
    cache, _ = make(16)
    for layer in range(4):
        for _ in range(3):
            cache.fetch(layer, list(range(4)))
    assert len(cache.lru) == 16 and cache.stats.copies == 16
    assert cache.stats.hits == 4 * 2 * 4


def test_in_place_reads_fill_free_slots_then_leave_blocks_in_ram_until_the_kernel_ran():
    cache, log = make(3)
    rows = {}

    def fetch_host(keys):  # RAM-cache handles: each block has a row in the RAM cache
        out = []
        for k in keys:
            h = FakeHandle(k, log)
            h.row = rows.setdefault(k, len(rows))
            out.append(h)
        return out

    cache.fetch_host = fetch_host
    first = cache.fetch(0, [0, 1], in_place=True)  # free slots: copied, cached
    assert all(p >= 0 for p in first) and cache.stats.copies == 2
    places = cache.fetch(1, [2, 3], in_place=True)  # one free slot left: one copy, one read in place
    assert places[0] >= 0 and places[1] == -1 - rows[(1, 3)]
    assert cache.stats.copies == 3 and cache.stats.in_place == 1
    assert ("release", (1, 3)) not in log  # pinned until the kernel that reads it ran
    assert (1, 3) not in cache.lru and cache.protected == {places[0]}
    cache.mark_used()
    assert ("release", (1, 3)) in log
    again = cache.fetch(0, [0, 4], in_place=True)  # VRAM hits stay hits; no slot free, nothing evicted
    assert again[0] == first[0] and again[1] == -1 - rows[(0, 4)] and len(cache.lru) == 3


def test_blocks_outside_the_ram_cache_are_copied_even_in_place():
    cache, log = make(3)
    cache.fetch(0, [0, 1])
    cache.fetch(0, [2])  # no free slot now: only a transient block is copied (evicting)
    transient = cache.fetch(1, [5], in_place=True)  # FakeHandle.row is None: a transient buffer
    assert transient[0] >= 0 and (1, 5) in cache.lru and cache.stats.in_place == 0


def test_host_mirror_pushes_the_host_copy():
    from expertstream.experts.host_mirror import HostMirror

    dev = torch.zeros(4, 3)
    m = HostMirror(dev)
    m.host[1] = torch.tensor([1.0, 2.0, 3.0])
    assert dev.abs().sum() == 0  # nothing moves before push()
    m.push()
    assert torch.equal(dev, m.host) and m.pushes == 1
    m.host[1] = 0
    m.push()
    assert dev.abs().sum() == 0


def test_host_mirror_ring_is_bounded_in_bytes():
    from expertstream.experts.host_mirror import RING_BYTES, HostMirror

    small = HostMirror(torch.zeros(16, 3))
    assert len(small._done) == 64  # 192 B a copy: the whole ring
    big = HostMirror(torch.zeros(RING_BYTES // 4 // 8, dtype=torch.float32))  # an eighth of the bytes
    assert len(big._done) == 8
    huge = HostMirror(torch.zeros(RING_BYTES // 2, dtype=torch.uint8))  # half of them: the floor of two
    assert len(huge._done) == 2


@pytest.mark.gpu  # the ring of pinned buffers exists on CUDA only
def test_host_mirror_queues_a_ring_of_pushes_before_it_waits():
    from expertstream.experts.host_mirror import HostMirror

    dev = torch.zeros(3, device="cuda")
    seen = torch.zeros(5, 3, device="cuda")
    m = HostMirror(dev, depth=4)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: no upload can run while the host pushes
    for v in range(5):
        m.host.fill_(v)
        m.push()
        seen[v].copy_(dev)  # what the stream sees right after this push
        if v == 3:
            assert m.wait_seconds == 0  # four pushes fit in the ring without waiting for the GPU
    assert m.wait_seconds > 0  # the fifth reuses the first buffer: it waited for that upload
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), torch.arange(5.0)[:, None].expand(5, 3))  # every push kept its own values


def test_packed_upload_sends_every_part_into_fixed_tensors():
    from expertstream.experts.host_mirror import ALIGN, PackedUpload

    up = PackedUpload("cpu")
    on_device = torch.ones(2)  # the test's "device" is the CPU: device tensors are the ones not packed
    parts = {
        "row": torch.randn(1, 5).to(torch.bfloat16),
        "positions": torch.tensor([7]),
        "raw": torch.arange(7, dtype=torch.uint8).view(1, 7),
        "vals": torch.randn(1, 3),
        "cols": torch.randn(3, 2).t(),  # not contiguous: packed in its logical order
    }
    first = up(parts)
    again = up({name: t + 1 for name, t in parts.items()})
    for name, t in parts.items():
        assert again[name] is first[name] and again[name].dtype == t.dtype and again[name].shape == t.shape
        assert torch.equal(again[name], t + 1) and again[name].data_ptr() % ALIGN == 0
        assert up.owns(again[name]) and not up.owns(t)
    with pytest.raises(ValueError, match="parts changed"):
        up({**parts, "raw": torch.zeros(1, 8, dtype=torch.uint8)})
    assert PackedUpload("meta")({"d": on_device.to("meta")})["d"].device.type == "meta"


def test_a_failed_read_hands_every_buffer_back():
    cache, log = make(8)

    class Broken(FakeHandle):
        def wait(self):
            raise OSError("read failed")

    cache.fetch_host = lambda keys: [(Broken if k[1] == 4 else FakeHandle)(k, log) for k in keys]
    with pytest.raises(OSError, match="read failed"):
        cache.fetch(0, [2, 4, 6])
    assert sorted(k for what, k in log if what == "release") == [(0, 2), (0, 4), (0, 6)]


def test_a_failed_read_in_place_hands_every_buffer_back():
    cache, log = make(4)
    cache.fetch(1, [0, 1, 2, 3])  # no free slot left: RAM blocks are read in place

    class Broken(FakeHandle):
        def wait(self):
            raise OSError("read failed")

    def fetch_host(keys):
        out = [(Broken if k[1] == 4 else FakeHandle)(k, log) for k in keys]
        for i, h in enumerate(out):
            h.row = i
        return out

    cache.fetch_host = fetch_host
    log.clear()
    with pytest.raises(OSError, match="read failed"):
        cache.fetch(0, [2, 4, 6], in_place=True)
    cache.mark_used()  # the block already pointed at is handed back once its kernel would have run
    assert sorted(k for what, k in log if what == "release") == [(0, 2), (0, 4), (0, 6)]
