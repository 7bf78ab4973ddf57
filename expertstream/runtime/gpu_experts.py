"""The expert bank on CUDA: RAM/disk tiers (ExpertStore) -> VRAM slots (VramExpertCache) -> Triton kernels.

Decode: the layer's <= K distinct experts are fetched (VRAM hit, or RAM/disk -> one H2D copy each on the copy
stream) and one decode launch pair computes the weighted SwiGLU sum straight from the raw blocks.
Prefill: the layer's distinct experts are processed in groups that fit the slots; each group's (token, k)
pairs run through the grouped tensor-core kernel and are summed into [T, H].
"""

from __future__ import annotations

import mmap
import weakref

import torch

from expertstream.formats.expert_block import PROJ
from expertstream.kernels import nvfp4_moe
from expertstream.log import get_logger
from expertstream.runtime.vram_cache import VramExpertCache

log = get_logger(__name__)


def pinned_alloc(nbytes: int) -> torch.Tensor:
    """Page-aligned host memory registered with CUDA, so O_DIRECT reads land where DMA copies start.

    The registration is dropped before the mapping is freed: a later mapping at the same address must not
    inherit a stale registration (cudaErrorHostMemoryAlreadyRegistered).
    """
    mm = mmap.mmap(-1, max(nbytes, 1))  # anonymous mappings are page-aligned; the tensor keeps `mm` alive
    buf = torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
    if nbytes and torch.cuda.is_available():
        cudart, ptr = torch.cuda.cudart(), buf.data_ptr()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of %d B failed (%s): copies will be staged", nbytes, err)
        else:
            weakref.finalize(mm, cudart.cudaHostUnregister, ptr)
    return buf


class _SwappedNibbles:
    """Handle wrapper for the must-break control: each weight byte with its two nibbles exchanged."""

    def __init__(self, handle, parts):
        self.handle, self.parts = handle, parts

    def wait(self) -> torch.Tensor:
        block = self.handle.wait().clone()
        for p in self.parts:
            w = block[p.offset : p.offset + p.nbytes]
            block[p.offset : p.offset + p.nbytes] = (w >> 4) | (w << 4)
        return block

    def release(self) -> None:
        self.handle.release()


class GpuExperts:
    """Bank with the `(layer, x, expert_ids, weights) -> routed sum` contract, on CUDA.

    Args:
        workdir: the `Workdir`.
        store: the `ExpertStore` (host tiers).
        n_slots: VRAM slots (two layers' worth at least; the rest is the VRAM expert cache).
        device: a CUDA device (or CPU with TRITON_INTERPRET=1, for tests).
        control: "none", "swap-nibbles" or "no-experts" (must-break controls).
    """

    def __init__(self, workdir, store, n_slots: int, device, control: str = "none"):
        self.layout = workdir.layout
        self.store, self.control = store, control
        self.num_experts = workdir.num_experts
        parts = [self.layout.part(f"{p}.weight") for p in PROJ]

        def fetch_host(keys):
            # decode misses are cached in RAM; prompt misses bypass it (set per call below)
            handles = store.request(keys, cache=self._cache_reads)
            return [_SwappedNibbles(h, parts) for h in handles] if control == "swap-nibbles" else handles

        self._cache_reads = True
        self.cache = VramExpertCache(
            fetch_host, self.layout.block_bytes, n_slots, workdir.expert_scales()[0], device
        )
        self.expert_to_slot = torch.zeros(self.num_experts, dtype=torch.int32, device=self.cache.device)

    @property
    def stall_seconds(self) -> float:
        return self.cache.stats.wait_seconds

    def __call__(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.control == "no-experts":
            return torch.zeros_like(x)
        # x [T, H], expert_ids [T, K], weights [T, K] fp32
        experts = torch.unique(expert_ids).tolist()  # the layer's one host sync
        self._cache_reads = x.shape[0] == 1
        if x.shape[0] == 1:
            slot_ids = self.cache.fetch(layer, experts)
            self.expert_to_slot[torch.tensor(experts, device=slot_ids.device)] = slot_ids
            y = nvfp4_moe.nvfp4_moe_decode(
                x,
                self.cache.slots,
                self.expert_to_slot[expert_ids[0]],
                self.cache.ws2,
                weights[0].float(),
                self.layout,
            )
            self.cache.mark_used()
            return y
        return self._prefill(layer, x, expert_ids, weights, experts)

    def _prefill(self, layer, x, expert_ids, weights, experts) -> torch.Tensor:
        # groups of half the slots: the previous group's slots stay protected while its kernel runs
        group = max(1, self.cache.n_slots // 2)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for i in range(0, len(experts), group):
            chunk = torch.tensor(experts[i : i + group], device=x.device)
            slot_ids = self.cache.fetch(layer, chunk.tolist())
            self.expert_to_slot[chunk] = slot_ids
            if len(experts) <= group:  # every routed expert is resident: one grouped launch
                y = nvfp4_moe.nvfp4_moe_prefill(
                    x,
                    self.cache.slots,
                    expert_ids,
                    self.expert_to_slot,
                    self.cache.ws2,
                    weights.float(),
                    self.layout,
                )
                self.cache.mark_used()
                return y
            tok, kk = torch.isin(expert_ids, chunk).nonzero(as_tuple=True)  # pairs routed into this group
            y = nvfp4_moe.nvfp4_moe_prefill(
                x[tok],
                self.cache.slots,
                expert_ids[tok, kk][:, None],
                self.expert_to_slot,
                self.cache.ws2,
                weights[tok, kk][:, None].float(),
                self.layout,
            )
            self.cache.mark_used()
            out.index_add_(0, tok, y.float())
        return out.to(x.dtype)

    def close(self) -> None:
        self.cache.close()
