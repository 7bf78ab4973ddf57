"""The conversation state cache: longest strict prefix, byte-bounded LRU."""

from dataclasses import dataclass

import pytest

from expertstream.runtime.prompt_cache import PromptCache


@dataclass
class Snap:
    name: str
    nbytes: int


def test_longest_strict_prefix_wins():
    cache = PromptCache(1000)
    cache.insert([1, 2], Snap("a", 10))
    cache.insert([1, 2, 3, 4], Snap("b", 10))
    cache.insert([1, 9], Snap("c", 10))
    assert cache.lookup([1, 2, 3, 4, 5])[0] == 4
    assert cache.lookup([1, 2, 3])[1].name == "a"
    # a key equal to the prompt is no use: the last prompt token must run to give logits
    assert cache.lookup([1, 2, 3, 4])[1].name == "a"
    assert cache.lookup([2, 1, 3]) is None
    assert (cache.hits, cache.misses, cache.reused_tokens) == (3, 1, 8)


def test_byte_budget_evicts_least_recently_used():
    cache = PromptCache(100)
    cache.insert([1], Snap("a", 40))
    cache.insert([2], Snap("b", 40))
    assert cache.lookup([1, 5]) is not None  # touch "a": "b" is now the oldest
    cache.insert([3], Snap("c", 40))
    assert cache.lookup([2, 5]) is None
    assert cache.lookup([1, 5]) is not None and cache.lookup([3, 5]) is not None
    assert (len(cache), cache.nbytes) == (2, 80)


def test_oversized_snapshot_is_refused_and_replacing_a_key_keeps_the_count():
    cache = PromptCache(100)
    assert not cache.insert([1], Snap("huge", 101))
    assert cache.insert([1], Snap("a", 30)) and cache.insert([1], Snap("a2", 50))
    assert (len(cache), cache.nbytes) == (1, 50)
    assert cache.lookup([1, 2])[1].name == "a2"


def test_zero_budget_disables_and_negative_is_an_error():
    cache = PromptCache(0)
    assert not cache.insert([1], Snap("a", 1))
    assert cache.lookup([1, 2]) is None
    with pytest.raises(ValueError):
        PromptCache(-1)
