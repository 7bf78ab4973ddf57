import pytest
import torch

from expertstream.runtime.vram_cache import VramExpertCache

BLOCK = 64


class FakeHandle:
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
    for s, e in zip(slots.tolist(), (3, 5)):
        assert torch.all(cache.slots[s] == 16 + e)
        assert torch.equal(cache.ws2[s], torch.arange(3, dtype=torch.float32) + (1 * 8 + e) * 3)
    reads = len([x for x in log if x[0] == "read"])
    again = cache.fetch(1, [5, 3])
    assert again.tolist() == slots.tolist()[::-1]
    assert len([x for x in log if x[0] == "read"]) == reads  # no host traffic on hits
    assert cache.stats.hits == 2 and cache.stats.requests == 4
    assert all(("release", k) in log for k in ((1, 3), (1, 5)))  # host buffers are handed back


def test_lru_evicts_oldest_but_never_the_previous_layer():
    cache, _ = make(4)
    a = cache.fetch(0, [0, 1])  # layer 0
    b = cache.fetch(1, [0, 1])  # layer 1: must not evict layer 0's slots (still protected)
    assert set(a.tolist()).isdisjoint(b.tolist())
    c = cache.fetch(2, [0, 1])  # evicts layer 0 (oldest, no longer protected), never layer 1
    assert set(c.tolist()) == set(a.tolist())
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
