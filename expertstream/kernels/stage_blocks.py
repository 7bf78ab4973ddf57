"""Copy expert blocks from pinned host RAM into VRAM rows with a kernel: the next layer's guesses, decided
on the device (`stage_blocks`), and a prompt pass's blocks (`copy_rows`).

Decode with every block in the RAM cache reads each routed block over the bus inside the expert kernel,
while the bus idles through the rest of the layer. A side stream can use that idle time: once layer L's
kernel is queued, copy the best G guesses for layer L+1 (its router on layer L's MoE input) into G VRAM
rows, and point a working copy of layer L+1's location row at them. The guesses exist only on the device,
so the copy is a kernel (a graph cannot hold a copy whose source address is data). Where a block is read
from never changes a result: the rows hold the same bytes.

A prompt pass copies its blocks from known RAM rows into its slots: one `copy_rows` launch instead of a
copy call per block (10-35 us of host time each on the H200's host, and a prompt's passes are bound by the
host), at the kernel's ~49 GB/s on the H200 (33 in one H100 host's profile) instead of the copy engine's 55.

Shapes: G guesses, E experts, B = block bytes; host [C, B] uint8 pinned RAM-cache rows; slots [S, B] uint8.
loc: [E] int32 per expert, a slot (>= 0) or -1 - its RAM row (as the decode kernel reads it).
"""

from __future__ import annotations

import torch

from expertstream.kernels.codec import cdiv, jit, require_triton, tl

CHUNK = 16384  # bytes per step of a program (128 B per thread at 4 warps)
# Programs of the copy, each looping over its share of the (guess, chunk) steps. Few on purpose: the copy
# runs beside the next layer's attention, and one program per chunk (676 for 4 real blocks) would hold
# warp slots on every SM for the whole copy while it waits on the bus; 32 programs of
# 16 KB each keep ~0.5 MB of reads in flight, several times what 55 GB/s over ~2 us of latency needs.
PROGRAMS = 32


def stage_blocks_ref(ids, loc, host, slots, first: int, out_loc, copied=None) -> None:
    """Plain-torch twin of `stage_blocks` (same arguments)."""
    out_loc.copy_(loc)
    for g, e in enumerate(ids.tolist()):
        c = int(loc[e])
        if c < 0:  # in RAM: copy; an expert already in a slot stays where it is
            slots[first + g].copy_(host[-1 - c])
            out_loc[e] = first + g
            if copied is not None:
                copied += 1


def _check_rows(host: torch.Tensor, slots: torch.Tensor) -> None:
    assert host.dtype == slots.dtype == torch.uint8, f"host {host.dtype} / slots {slots.dtype}"
    assert host.shape[1] == slots.shape[1], f"host rows {host.shape[1]} B, slot rows {slots.shape[1]} B"
    assert slots.shape[1] % 16 == 0, "block rows must be 16-byte multiples (vector copies)"


def stage_blocks(
    ids: torch.Tensor,
    loc: torch.Tensor,
    host: torch.Tensor,
    slots: torch.Tensor,
    first: int,
    out_loc: torch.Tensor,
    copied: torch.Tensor | None = None,
) -> None:
    """out_loc = loc, then each guessed expert ids[g] that sits in RAM is copied to slots[first + g] and
    out_loc points there.

    Args:
        ids: [G] int64 distinct guessed experts, on the device.
        loc: [E] int32 the layer's location row.
        host: [C, B] uint8 pinned RAM-cache rows (device-readable).
        slots: [S, B] uint8 VRAM rows; rows first .. first + G - 1 are overwritten.
        first: the first staging row.
        out_loc: [E] int32, the working row the next kernel reads (written in place).
        copied: a [1] int64 count on the device that the blocks copied are added to, or None. Counted in
            the copy itself, on whatever stream runs it (no launch of its own).
    """
    require_triton(ids, loc, slots, out_loc)
    assert copied is None or (copied.dtype == torch.int64 and copied.numel() == 1), "copied: one int64"
    g, b = ids.numel(), slots.shape[1]
    assert ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64), f"ids {ids.dtype} {tuple(ids.shape)}"
    assert (
        loc.dtype == torch.int32
        and loc.dim() == 1
        and out_loc.shape == loc.shape
        and out_loc.dtype == loc.dtype
    )
    _check_rows(host, slots)
    assert 0 <= first and first + g <= slots.shape[0], f"rows {first}..{first + g} outside {slots.shape[0]}"
    out_loc.copy_(loc)
    if g:
        steps = g * cdiv(b, CHUNK)
        count = out_loc if copied is None else copied  # never written when COUNT is off
        _stage_kernel[(min(PROGRAMS, steps),)](
            ids, loc, host, slots, out_loc, count, first, b, steps, CHUNK=CHUNK, COUNT=copied is not None,
            num_warps=4,
        )  # fmt: skip


@jit
def _copy_chunk(src, dst, part, block_bytes, CHUNK: tl.constexpr):
    # bytes part CHUNK .. part CHUNK + CHUNK - 1 of one block: src row -> dst row (16-byte vector copies)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    m = offs < block_bytes
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@jit
def _stage_kernel(
    ids_ptr, loc_ptr, host_ptr, slots_ptr, out_loc_ptr, count_ptr, first, block_bytes, steps,
    CHUNK: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    # program p: steps p, p + P, ... of the (guess g, chunk) steps, each one CHUNK of guess g's block,
    # host row -> slot row first + g
    chunks = tl.cdiv(block_bytes, CHUNK)
    for step in range(tl.program_id(0), steps, tl.num_programs(0)):
        g = step // chunks
        part = step % chunks
        e = tl.load(ids_ptr + g).to(tl.int64)
        c = tl.load(loc_ptr + e).to(tl.int64)
        if c < 0:
            dst = slots_ptr + (first + g).to(tl.int64) * block_bytes  # past 2 GiB in a large cache
            _copy_chunk(host_ptr + (-1 - c) * block_bytes, dst, part, block_bytes, CHUNK)
            if part == 0:  # read only once the whole kernel is done (the consumer waits for this stream)
                tl.store(out_loc_ptr + e, (first + g).to(tl.int32))
                if COUNT:
                    tl.atomic_add(count_ptr, 1)


def copy_rows_ref(pairs, n: int, host, slots) -> None:
    """Plain-torch twin of `copy_rows` (same arguments)."""
    for row, slot in pairs[:n].tolist():
        slots[slot].copy_(host[row])


def copy_rows(pairs: torch.Tensor, n: int, host: torch.Tensor, slots: torch.Tensor) -> None:
    """slots[pairs[i, 1]] = host[pairs[i, 0]] for i < n.

    Args:
        pairs: [>= n, 2] int32 (RAM row, slot) on the device; rows past n are not read.
        n: blocks to copy.
        host: [C, B] uint8 pinned RAM-cache rows (device-readable).
        slots: [S, B] uint8 VRAM rows.
    """
    require_triton(pairs, slots)
    b = slots.shape[1]
    assert pairs.dtype == torch.int32 and pairs.dim() == 2 and pairs.shape[1] == 2 and pairs.is_contiguous()
    assert 0 <= n <= pairs.shape[0], f"{n} pairs of {pairs.shape[0]}"
    _check_rows(host, slots)
    if n:
        steps = n * cdiv(b, CHUNK)
        _copy_rows_kernel[(min(PROGRAMS, steps),)](pairs, host, slots, b, steps, CHUNK=CHUNK, num_warps=4)


@jit
def _copy_rows_kernel(pairs_ptr, host_ptr, slots_ptr, block_bytes, steps, CHUNK: tl.constexpr):
    # program p: steps p, p + P, ... of the (pair i, chunk) steps, each one CHUNK of pair i's block
    chunks = tl.cdiv(block_bytes, CHUNK)
    for step in range(tl.program_id(0), steps, tl.num_programs(0)):
        i = step // chunks
        src = host_ptr + tl.load(pairs_ptr + 2 * i).to(tl.int64) * block_bytes
        dst = slots_ptr + tl.load(pairs_ptr + 2 * i + 1).to(tl.int64) * block_bytes
        _copy_chunk(src, dst, step % chunks, block_bytes, CHUNK)
