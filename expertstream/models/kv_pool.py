"""The shared KV pool: the attention KV and indexer keys of every sequence in one preallocated tensor per
attention layer and kind, each sequence in a contiguous range of it that grows with its context.

Rows per attention layer: k, v [tokens, kv_heads, head_dim]; idx_k [tokens, indexer_head_dim]; blk_k
[tokens / compress_ratio, indexer_head_dim]. A range is whole KV_BLOCK-token blocks and holds kv_bucket(n)
tokens for n in context (powers of two from 256, then the whole context): the KV window a one-token step
attends over, so a sequence reads the same window however full the pool is. A range that cannot grow in
place moves (a copy of its filled rows; the others move to the front when the free blocks are scattered);
when the free blocks are too few, another sequence's filled rows go to host RAM (swapped out) and come back
when it runs again. Everything runs on the thread that runs the engine.
"""

from __future__ import annotations

import weakref

import torch

from expertstream.memory_plan import KV_BLOCK
from expertstream.models.base import ModelArgs
from expertstream.models.qwen4_exp import kv_bucket

KINDS = ("k", "v", "idx_k", "blk_k")


class KVPool:
    """One pool of `tokens` KV rows (rounded up to whole blocks) for sequences of up to max_model_len tokens.

    States (models/state.py) hold views of their range in their k, v, idx_k and blk_k dicts; `fit` makes a
    state's range hold n tokens before a forward call writes them.
    """

    def __init__(self, args: ModelArgs, tokens: int, max_model_len: int, dtype, device):
        self.c = args.indexer_compress_ratio or 1
        if KV_BLOCK % self.c:
            raise ValueError(f"indexer_compress_ratio {self.c} does not divide the KV block {KV_BLOCK}")
        if tokens < max_model_len:
            raise ValueError(f"a KV pool of {tokens} tokens cannot hold one {max_model_len}-token context")
        self.max_model_len = max_model_len
        self.blocks = -(-tokens // KV_BLOCK)
        rows = self.blocks * KV_BLOCK
        layers = [i for i, t in enumerate(args.layer_types) if t != "linear_attention"]
        kv = (args.num_key_value_heads, args.head_dim)

        # uninitialised: a range is zeroed past its filled rows when it is placed (host pages stay
        # uncommitted until a sequence takes them)
        def empty(n, *shape):
            return {i: torch.empty(n, *shape, dtype=dtype, device=device) for i in layers}

        self.rows = {
            "k": empty(rows, *kv),
            "v": empty(rows, *kv),
            "idx_k": empty(rows, args.indexer_head_dim),
            "blk_k": empty(rows // self.c, args.indexer_head_dim),
        }
        # state -> (first block, blocks), least recently fitted first; a state that dies frees its range
        self._held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._swapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # state -> host rows
        self.moves = self.swaps = 0  # ranges moved, and swapped out (stats)

    def attach(self, st) -> None:
        """Give a new state empty views (no range yet)."""
        self._view(st, 0, 0)

    def fit(self, st, n: int, may_evict=None) -> bool:
        """Make st's range hold n tokens (kv_bucket(n) rows), moving it, or swapping other states' rows to
        host RAM, as needed; st's own swapped rows come back. `may_evict(other)` says which states may be
        swapped out (default: any other, least recently fitted first). False when even that leaves too few
        blocks."""
        need = -(-kv_bucket(max(n, 1), self.max_model_len) // KV_BLOCK)
        held = self._held.pop(st, None)
        if held is not None:
            self._held[st] = held  # most recently fitted last
            if held[1] >= need:
                return True
            if held[0] + need <= self._next_taken(held[0] + held[1]):
                self._place(st, held[0], held[0], held[1], need)  # grows in place
                return True
        while True:
            spot = self._first_fit(need, st)
            if spot is None and self._free() + self._held.get(st, (0, 0))[1] >= need:
                if st in self._held:  # its rows wait in host RAM while the others move to the front
                    self.swap_out(st)
                self._compact()
                spot = self._first_fit(need, st)
            if spot is not None:
                start, have = self._held.get(st, (0, 0))
                self._place(st, start, spot, have, need)
                return True
            victim = next(
                (o for o in self._held if o is not st and (may_evict is None or may_evict(o))), None
            )
            if victim is None:
                return False
            self.swap_out(victim)

    def release(self, st) -> None:
        """Free st's range and any swapped rows (the state's KV is discarded)."""
        self._held.pop(st, None)
        self._swapped.pop(st, None)
        self._view(st, 0, 0)

    def swap_out(self, st) -> None:
        """Copy st's filled rows to host RAM and free its range; its next `fit` brings them back."""
        del self._held[st]
        self._swapped[st] = {
            kind: {
                i: t[: self._filled(kind, st.pos)].to("cpu", copy=True) for i, t in getattr(st, kind).items()
            }
            for kind in KINDS
        }
        self.swaps += 1
        self._view(st, 0, 0)

    def _filled(self, kind: str, pos: int) -> int:
        return -(-pos // self.c) if kind == "blk_k" else pos

    def _free(self) -> int:
        return self.blocks - sum(n for _, n in self._held.values())

    def _next_taken(self, end: int) -> int:
        """The first block at or after `end` that a range holds (or the pool's end)."""
        return min((s for s, _ in self._held.values() if s >= end), default=self.blocks)

    def _first_fit(self, need: int, st) -> int | None:
        """The first block of a free run of `need` blocks, st's own range counted as free."""
        at = 0
        for s, n in sorted(v for o, v in self._held.items() if o is not st):
            if s - at >= need:
                return at
            at = max(at, s + n)
        return at if self.blocks - at >= need else None

    def _compact(self) -> None:
        """Move the ranges to the front, in order, so that the free blocks are one run at the end."""
        at = 0
        for o in sorted(self._held, key=lambda o: self._held[o][0]):
            s, n = self._held[o]
            if s != at:
                self._place(o, s, at, n, n)
            at += n

    def _place(self, st, old: int, new: int, have: int, need: int) -> None:
        """Put st's range at block `new` with `need` blocks: its filled rows (from its old range or host
        RAM) are copied there and the rest of the range zeroed."""
        swapped = self._swapped.pop(st, None)
        for kind in KINDS:
            per = self.c if kind == "blk_k" else 1
            filled = self._filled(kind, st.pos) if swapped or have else 0
            a, b = new * KV_BLOCK // per, (new + need) * KV_BLOCK // per
            for i, t in self.rows[kind].items():
                if swapped:
                    t[a : a + filled] = swapped[kind][i]
                elif old != new and filled:  # ranges may overlap: copy through a temporary
                    t[a : a + filled] = t[old * KV_BLOCK // per :][:filled].clone()
                t[a + filled : b].zero_()
        self._held[st] = (new, need)  # a held state keeps its place in the order
        self.moves += bool(have and old != new)
        self._view(st, new, min(need * KV_BLOCK, self.max_model_len))

    def _view(self, st, start: int, tokens: int) -> None:
        """Point st's KV dicts at `tokens` rows from block `start` (k and v exactly that many, so that a
        one-token step's window is kv_bucket(pos + 1, rows), the same as a whole-context state's)."""
        a = start * KV_BLOCK
        for kind in KINDS:
            per = self.c if kind == "blk_k" else 1
            n = tokens if kind in ("k", "v") else -(-tokens // self.c) * self.c // per
            getattr(st, kind).update({i: t[a // per : a // per + n] for i, t in self.rows[kind].items()})
