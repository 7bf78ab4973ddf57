"""The must-break controls (`check --control`, `ppl --control`): a bank that wraps any store-backed bank and
breaks it on purpose, so that a checker that passes the engine is shown to fail a broken one.

  "swap-nibbles": the wrapped bank is built on a view of the store whose blocks have the two E2M1 codes of
                  every packed weight byte exchanged (copies: the view offers no RAM rows to read in place).
  "no-experts":   the routed sum is zero; the wrapped bank is built but never called.
The banks themselves know nothing of controls: `controlled(control, store, make_bank)` is where an engine
applies one, the same way for the CPU and the CUDA bank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from expertstream.experts.bank import ExpertBank, WrappedBank
from expertstream.formats.expert_block import PROJ

CONTROLS = ("none", "swap-nibbles", "no-experts")


def swap_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Exchange the two E2M1 codes of every byte."""
    return (packed >> 4) | (packed << 4)


class _SwappedHandle:
    """A store handle whose block comes back as a copy with every weight byte's nibbles exchanged."""

    row = None  # no RAM row: a kernel must read the swapped copy, never the stored block in place

    def __init__(self, handle, parts):
        self.handle, self.parts = handle, parts

    @property
    def key(self):
        return self.handle.key

    @property
    def ready(self) -> bool:
        return self.handle.ready

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        block = self.handle.wait(timeout).clone()
        for p in self.parts:
            block[p.offset : p.offset + p.nbytes] = swap_nibbles(block[p.offset : p.offset + p.nbytes])
        return block

    def release(self) -> None:
        self.handle.release()


class SwappedNibblesStore:
    """An `ExpertStore` seen through the swap-nibbles control: its handles give swapped copies, and it has no
    slot memory (`slots` None), so no bank reads or fixes a stored RAM row. Everything else is the store's."""

    slots = None

    def __init__(self, store):
        self.store = store
        self._parts = [store.workdir.layout.part(f"{p}.weight") for p in PROJ]

    def _wrap(self, handles: list) -> list:
        return [h if h is None else _SwappedHandle(h, self._parts) for h in handles]

    def request(self, keys: Iterable, cache: bool = True) -> list:
        return self._wrap(self.store.request(keys, cache=cache))

    def peek(self, keys: Iterable) -> list:
        return self._wrap(self.store.peek(keys))

    def __getattr__(self, name: str):  # prefetch, keep_spare, cached_blocks, stats, ... as the store's
        return getattr(self.store, name)


class ControlledBank(WrappedBank):
    """A bank wrapped by a control (subclasses override what the control changes)."""

    control = "none"


class SwappedNibbles(ControlledBank):
    """The wrapped bank as it is, built on a `SwappedNibblesStore`: every block it reads is broken."""

    control = "swap-nibbles"


class NoExperts(ControlledBank):
    """A zero routed sum. Decode is "fixed" (nothing to fetch, nothing read back); the wrapped bank is never
    called but still set up and closed, as an engine with the control holds it."""

    control = "no-experts"

    def __call__(self, layer, x, expert_ids, weights, **kw) -> torch.Tensor:
        return torch.zeros_like(x)

    @property
    def spec(self):
        return None  # no guesses: nothing is fetched

    @property
    def resident(self) -> str | None:
        return None

    @property
    def decode_mode(self) -> str:
        return "fixed"

    def decode_compute(self, layer, x, expert_ids, weights) -> torch.Tensor:
        return torch.zeros_like(x)

    def decode_join(self) -> None:
        return None

    def decode_fixed_reads(self, n: int) -> None:
        return None


def controlled(control: str, store, make_bank: Callable[[object], ExpertBank]) -> ExpertBank:
    """The bank `make_bank(store)` builds, under `control` (one of CONTROLS): itself for "none", else wrapped,
    built on the store the control gives it."""
    if control not in CONTROLS:
        raise ValueError(f"expert control {control!r} is not one of {CONTROLS}")
    if control == "swap-nibbles":
        return SwappedNibbles(make_bank(SwappedNibblesStore(store)))
    bank = make_bank(store)
    return NoExperts(bank) if control == "no-experts" else bank
