"""The expert bank's interface: everything the model, the engine and the decode graphs call on a bank.

`bank(layer, x [T, H], expert_ids [T, K] int64, weights [T, K] fp32) -> [T, H]`, in x.dtype or FP32 (a bank
that sums in FP32 may return its sums as they are and callers cast). One-token decode also runs as stages,
so that the decode graphs capture a bank's device work and keep only its host work eager (`decode_mode`):
  "eager":  the whole call is host work (the CPU bank): one eager stage.
  "staged": decode_want (graphable) -> decode_prepare (eager: the layer's one host sync, fetches and the
            location table) -> decode_compute (graphable) -> decode_stage (graphable: the next layer's
            guesses copied to VRAM on a side stream, joined by decode_join).
  "fixed":  decode_compute alone: every block has a fixed place, nothing is read back.
  "split":  a CPU share (experts/split_bank.py): split_send (graphable: the CPU's request posted to the split
            server) -> split_gpu (graphable: the GPU's share; split_launched after it, host work) ->
            split_take (graphable: the server's answer awaited on the GPU and added); timed tokens run the
            send and the take eagerly; with staging, decode_want before and decode_stage after.
decode_launched() runs once a stage's device work is queued (host work that must follow it, e.g. the next
layer's guessed disk reads); decode_token_seconds() gets each replayed token's GPU time. The defaults below
are those of a bank with no VRAM tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from expertstream.experts.speculation import Speculator

DECODE_MODES = ("eager", "staged", "fixed", "split")


@dataclass(slots=True)
class BankCounters:
    """What a bank counts beyond the store's statistics (zero for a bank without a VRAM tier); the names are
    those of the engine's `EngineStats`."""

    bank_decode_seconds: float = 0.0  # decode thread inside one-token calls
    bank_sync_seconds: float = 0.0  # ... of which waiting in the routing-id read-back
    bank_spec_seconds: float = 0.0  # ... of which queueing the next layer's guessed disk reads
    bus_read_bytes: int = 0  # expert bytes decode moved over the bus without the copy engine
    resident_reads: int = 0  # decode blocks found through the full location table
    resident_ram_reads: int = 0  # ... of which read from RAM (not staged, not in the hot set)
    staged_blocks: int = 0  # next-layer guesses copied to VRAM staging rows
    stage_hits: int = 0  # routed blocks decode read from staging rows
    hot_hits: int = 0  # routed blocks decode read from the hot set
    copied_bytes: int = 0  # expert bytes the copy engine moved from host RAM into VRAM slots


class ExpertBank(ABC):
    """The routed experts of every MoE layer (see the module docstring for the contract)."""

    spec: Speculator | None = None  # next-layer guesses, with their statistics
    host_syncs: int = 0  # device -> host reads of the routing the bank waited on
    stall_seconds: float = 0.0  # waiting for expert blocks that had not landed yet
    resident: str | None = None  # "vram" or "ram" once every block has a fixed place there
    segmented: bool = False  # __call__ also takes `segments`: one fetch per block for several sequences' rows

    @abstractmethod
    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor: ...

    def set_router_weights(self, routers: dict[int, torch.Tensor]) -> None:
        """Routers {layer: W [E, H]} on the compute device in the activation dtype, for speculation."""
        return None

    def set_prefill_chunk(self, tokens: int | None) -> None:
        """Run a prompt's expert kernels at most `tokens` tokens at a time (None: a call's tokens)."""
        return None

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the bank's kernels for activations of `dtype` before the first request."""
        return None

    def counters(self) -> BankCounters:
        return BankCounters()

    def close(self) -> None:
        """Give back what the bank holds (VRAM, held RAM blocks)."""
        return None

    @property
    def decode_mode(self) -> str:
        return "eager"

    @property
    def decode_key(self) -> tuple:
        """What a captured decode program depends on in the bank: the decode graphs capture anew when it
        changes (every block placed for good, and where blocks reside; a CPU share's size)."""
        return (self.decode_mode == "fixed", self.resident)

    def decode_want(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} decodes eagerly")

    def decode_prepare(self, layer: int, want: torch.Tensor, k: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} decodes eagerly")

    def decode_compute(self, layer: int, x, expert_ids, weights) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} decodes eagerly")

    def decode_stage(self, layer: int, want: torch.Tensor, k: int) -> None:
        """Queue layer + 1's guesses towards VRAM behind layer's kernel (graphable)."""
        return None

    def decode_stage_first(self, x: torch.Tensor) -> None:
        """At a token's start, as decode_stage for layer 0 from the token's embedding row (graphable)."""
        return None

    def decode_join(self) -> None:
        """The main stream waits for side-stream work decode_stage queued (graphable)."""
        return None

    def decode_launched(self) -> None:
        """The last stage's device work is queued: start host work that must follow it."""
        return None

    def decode_fixed_reads(self, n: int) -> None:
        """Count n blocks a "fixed" token read through its fixed table."""
        return None

    def decode_token_seconds(self, seconds: float) -> None:
        """A replayed decode token's GPU time (the decode graphs' CUDA events around its replays), for a
        bank that tunes its decode program by it (the auto CPU share); others ignore it."""
        return None


class WrappedBank(ExpertBank):
    """A bank around another: every call and attribute of the interface goes to the wrapped bank `bank`
    unless a subclass overrides it (the must-break controls, a CPU share of decode)."""

    def __init__(self, bank: ExpertBank):
        self.bank = bank

    def __call__(self, layer, x, expert_ids, weights, **kw) -> torch.Tensor:
        return self.bank(layer, x, expert_ids, weights, **kw)

    @property
    def segmented(self) -> bool:
        return self.bank.segmented

    @property
    def spec(self):
        return self.bank.spec

    @property
    def host_syncs(self) -> int:
        return self.bank.host_syncs

    @property
    def stall_seconds(self) -> float:
        return self.bank.stall_seconds

    @property
    def resident(self) -> str | None:
        return self.bank.resident

    def set_router_weights(self, routers: dict[int, torch.Tensor]) -> None:
        self.bank.set_router_weights(routers)

    def set_prefill_chunk(self, tokens: int | None) -> None:
        self.bank.set_prefill_chunk(tokens)

    def warm_up(self, dtype: torch.dtype) -> None:
        self.bank.warm_up(dtype)

    def counters(self) -> BankCounters:
        return self.bank.counters()

    def close(self) -> None:
        self.bank.close()

    @property
    def decode_mode(self) -> str:
        return self.bank.decode_mode

    @property
    def decode_key(self) -> tuple:
        return self.bank.decode_key

    def decode_want(self, layer, x, expert_ids):
        return self.bank.decode_want(layer, x, expert_ids)

    def decode_prepare(self, layer, want, k) -> None:
        self.bank.decode_prepare(layer, want, k)

    def decode_compute(self, layer, x, expert_ids, weights):
        return self.bank.decode_compute(layer, x, expert_ids, weights)

    def decode_stage(self, layer, want, k) -> None:
        self.bank.decode_stage(layer, want, k)

    def decode_stage_first(self, x) -> None:
        self.bank.decode_stage_first(x)

    def decode_join(self) -> None:
        self.bank.decode_join()

    def decode_launched(self) -> None:
        self.bank.decode_launched()

    def decode_fixed_reads(self, n: int) -> None:
        self.bank.decode_fixed_reads(n)

    def decode_token_seconds(self, seconds: float) -> None:
        self.bank.decode_token_seconds(seconds)
