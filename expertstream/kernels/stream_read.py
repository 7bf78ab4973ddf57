"""Read bytes and do nothing else: the floor under a memory-bound kernel's time, in the same harness.

`bench kernels` times the decode expert kernel and the FP8 GEMV against this: the same rows of the same
buffers read in 4 KiB pieces by a kernel that only xors each piece into one word (so that no load is
dropped). Whatever a kernel takes beyond it is its own work, not the memory's: the launch, the ramp and the
tail of a few-microsecond grid are in both.

Shapes: rows [R, B] uint8 (B a multiple of 4), ids [n] the rows read, nbytes read from each row's start.
"""

from __future__ import annotations

import torch

from expertstream.kernels.codec import cdiv, jit, require_triton, tl

PIECE = 4096  # bytes a program reads (on the H200 4 KiB pieces read as fast as any shape)


def stream_read_ref(rows: torch.Tensor, ids: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Plain-torch twin of `stream_read` (same arguments)."""
    pieces = cdiv(nbytes, PIECE)
    words = torch.zeros(ids.numel(), pieces * PIECE // 4, dtype=torch.int32, device=rows.device)
    for i, r in enumerate(ids.tolist()):
        words[i, : nbytes // 4] = rows[r, :nbytes].view(torch.int32)
    out = words.view(ids.numel(), pieces, PIECE // 4)
    acc = out[:, :, 0].clone()
    for j in range(1, PIECE // 4):
        acc ^= out[:, :, j]
    return acc


def stream_read(rows: torch.Tensor, ids: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The xor of each PIECE-byte piece of the first nbytes of rows[ids[i]], as 32-bit words.

    Args:
        rows: [R, B] uint8, contiguous, B a multiple of 4 (VRAM blocks, or any buffer viewed as one row).
        ids: [n] int32 / int64 rows to read, on the device.
        nbytes: bytes read from each row's start, a multiple of 4, at most B.

    Returns:
        [n, cdiv(nbytes, PIECE)] int32 (the tail piece's missing words count as 0).
    """
    require_triton(rows, ids)
    assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.is_contiguous(), f"rows {rows.dtype}"
    assert rows.shape[1] % 4 == 0 and nbytes % 4 == 0 and 0 < nbytes <= rows.shape[1], f"{nbytes} bytes"
    assert ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64), f"ids {ids.dtype} {tuple(ids.shape)}"
    out = torch.empty(ids.numel(), cdiv(nbytes, PIECE), dtype=torch.int32, device=rows.device)
    if ids.numel():
        grid = (ids.numel(), out.shape[1])
        _read_kernel[grid](rows, ids, out, rows.shape[1] // 4, nbytes // 4, W=PIECE // 4)
    return out


@jit
def _xor(a, b):
    return a ^ b


@jit
def _read_kernel(rows_ptr, ids_ptr, out_ptr, row_words, n_words, W: tl.constexpr):
    # program (i, piece): xor of words piece W .. piece W + W - 1 (those below n_words) of row ids[i]
    i, piece = tl.program_id(0), tl.program_id(1)
    row = rows_ptr.to(tl.pointer_type(tl.int32)) + tl.load(ids_ptr + i).to(tl.int64) * row_words
    w = piece * W + tl.arange(0, W)
    v = tl.load(row + w, mask=w < n_words, other=0)
    tl.store(out_ptr + i * tl.num_programs(1) + piece, tl.reduce(v, 0, _xor))
