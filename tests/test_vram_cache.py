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
    for s, e in zip(slots, (3, 5)):
        assert torch.all(cache.slots[s] == 16 + e)
        assert torch.equal(cache.ws2[s], torch.arange(3, dtype=torch.float32) + (1 * 8 + e) * 3)
    reads = len([x for x in log if x[0] == "read"])
    again = cache.fetch(1, [5, 3])
    assert again == slots[::-1]
    assert len([x for x in log if x[0] == "read"]) == reads  # no host traffic on hits
    assert cache.stats.hits == 2 and cache.stats.requests == 4
    assert all(("release", k) in log for k in ((1, 3), (1, 5)))  # host buffers are handed back


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


def guesses(keys, log):
    return [(k, FakeHandle(k, log)) for k in keys]


def test_prefetch_never_evicts_the_current_or_the_next_layers_blocks():
    cache, log = make(6)
    cache.fetch(3, [7])  # an older block of layer 3: the layer being guessed
    cache.fetch(0, [0, 1])  # old blocks of another layer
    current = cache.fetch(2, [2, 3])  # layer 2 runs now (protected)
    copied = cache.prefetch(guesses([(3, 4), (3, 5), (3, 6), (3, 1)], log))
    # one free slot, then layer 0's two blocks; (3, 7) and layer 2 are never candidates, so (3, 1) has no slot
    assert copied == [(3, 4), (3, 5), (3, 6)]
    assert (0, 0) not in cache.lru and (0, 1) not in cache.lru and (3, 7) in cache.lru
    assert [cache.lru[(2, e)] for e in (2, 3)] == current
    assert ("release", (3, 1)) in log  # the guess that found no slot hands its host buffer back
    for key in copied:
        assert torch.all(cache.slots[cache.lru[key]] == key[0] * 16 + key[1])


def test_prefetched_blocks_are_hits_and_wrong_guesses_are_evicted_first():
    cache, log = make(6)
    cache.fetch(3, [7])
    cache.fetch(0, [0, 1])
    cache.fetch(2, [2, 3])
    cache.prefetch(guesses([(3, 4), (3, 5), (3, 6)], log))
    copies = cache.stats.copies
    cache.fetch(3, [4, 0])  # (3, 4) was guessed right; (3, 0) needs a slot
    assert cache.stats.copies == copies + 1 and cache.stats.hits == 1
    # the slot came from the coldest wrong guess, not from the proven (3, 7)
    assert (3, 6) not in cache.lru and (3, 7) in cache.lru and (3, 5) in cache.lru


def test_prefetch_skips_resident_keys_and_keeps_protection():
    cache, log = make(4)
    cache.fetch(1, [0, 1])
    protected = set(cache.protected)
    assert cache.prefetch(guesses([(1, 0), (2, 0)], log)) == [(2, 0)]
    assert cache.protected == protected and cache.last_layer == 1
    assert ("release", (1, 0)) in log


def test_host_mirror_pushes_the_host_copy():
    from expertstream.runtime.host_mirror import HostMirror

    dev = torch.zeros(4, 3)
    m = HostMirror(dev)
    m.host[1] = torch.tensor([1.0, 2.0, 3.0])
    assert dev.abs().sum() == 0  # nothing moves before push()
    m.push()
    assert torch.equal(dev, m.host) and m.pushes == 1
    m.host[1] = 0
    m.push()
    assert dev.abs().sum() == 0


def test_a_failed_read_hands_every_buffer_back():
    cache, log = make(8)

    class Broken(FakeHandle):
        def wait(self):
            raise OSError("read failed")

    cache.fetch_host = lambda keys: [(Broken if k[1] == 4 else FakeHandle)(k, log) for k in keys]
    with pytest.raises(OSError, match="read failed"):
        cache.fetch(0, [2, 4, 6])
    assert sorted(k for what, k in log if what == "release") == [(0, 2), (0, 4), (0, 6)]
