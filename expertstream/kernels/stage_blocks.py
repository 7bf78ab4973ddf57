"""Copy the next layer's guessed expert blocks from pinned host RAM into VRAM rows, decided on the device.

Decode with every block in the RAM cache reads each routed block over the bus inside the expert kernel,
while the bus idles through the rest of the layer. A side stream can use that idle time: once layer L's
kernel is queued, copy the best G guesses for layer L+1 (its router on layer L's MoE input) into G VRAM
rows, and point a working copy of layer L+1's location row at them. The guesses exist only on the device,
so the copy is a kernel (a graph cannot hold a copy whose source address is data). Where a block is read
from never changes a result: the rows hold the same bytes.

Shapes: G guesses, E experts, B = block bytes; host [C, B] uint8 pinned RAM-cache rows; slots [S, B] uint8.
loc: [E] int32 per expert, a slot (>= 0) or -1 - its RAM row (as the decode kernel reads it).
"""

from __future__ import annotations

import torch

from expertstream.kernels.codec import cdiv, jit, require_triton, tl

CHUNK = 16384  # bytes per step of a program (128 B per thread at 4 warps)
# Programs of the copy, each looping over its share of the (guess, chunk) steps. Few on purpose: the copy
# runs beside the next layer's attention, and one program per chunk (676 for 4 real blocks, the sixth
# session's form) held warp slots on every SM for the whole copy while it waited on the bus; 32 programs of
# 16 KB each keep ~0.5 MB of reads in flight, several times what 55 GB/s over ~2 us of latency needs.
PROGRAMS = 32


def stage_blocks_ref(ids, loc, host, slots, first: int, out_loc) -> None:
    """Plain-torch twin of `stage_blocks` (same arguments)."""
    out_loc.copy_(loc)
    for g, e in enumerate(ids.tolist()):
        c = int(loc[e])
        if c < 0:  # in RAM: copy; an expert already in a slot stays where it is
            slots[first + g].copy_(host[-1 - c])
            out_loc[e] = first + g


def stage_blocks(
    ids: torch.Tensor,
    loc: torch.Tensor,
    host: torch.Tensor,
    slots: torch.Tensor,
    first: int,
    out_loc: torch.Tensor,
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
    """
    require_triton(ids, loc, slots, out_loc)
    g, b = ids.numel(), slots.shape[1]
    assert ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64), f"ids {ids.dtype} {tuple(ids.shape)}"
    assert (
        loc.dtype == torch.int32
        and loc.dim() == 1
        and out_loc.shape == loc.shape
        and out_loc.dtype == loc.dtype
    )
    assert host.dtype == torch.uint8 and slots.dtype == torch.uint8 and host.shape[1] == b, (
        "host / slots rows"
    )
    assert 0 <= first and first + g <= slots.shape[0], f"rows {first}..{first + g} outside {slots.shape[0]}"
    assert b % 16 == 0, "block rows must be 16-byte multiples (vector copies)"
    out_loc.copy_(loc)
    if g:
        steps = g * cdiv(b, CHUNK)
        _stage_kernel[(min(PROGRAMS, steps),)](
            ids, loc, host, slots, out_loc, first, b, steps, CHUNK=CHUNK, num_warps=4
        )


@jit
def _stage_kernel(
    ids_ptr, loc_ptr, host_ptr, slots_ptr, out_loc_ptr, first, block_bytes, steps, CHUNK: tl.constexpr
):
    # program p: steps p, p + P, ... of the (guess g, chunk) steps, each one CHUNK of guess g's block,
    # host row -> slot row first + g
    chunks = tl.cdiv(block_bytes, CHUNK)
    for step in range(tl.program_id(0), steps, tl.num_programs(0)):
        g = step // chunks
        part = step % chunks
        e = tl.load(ids_ptr + g).to(tl.int64)
        c = tl.load(loc_ptr + e).to(tl.int64)
        if c < 0:
            offs = part * CHUNK + tl.arange(0, CHUNK)
            m = offs < block_bytes
            v = tl.load(host_ptr + (-1 - c) * block_bytes + offs, mask=m)
            tl.store(slots_ptr + (first + g) * block_bytes + offs, v, mask=m)
            if part == 0:  # read only once the whole kernel is done (the consumer waits for this stream)
                tl.store(out_loc_ptr + e, (first + g).to(tl.int32))
