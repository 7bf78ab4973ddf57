"""PLE: the hashed n-gram row ids (exactly as transformers' Qwen4ExpTextNGramEmbedding) and the row readers.

Row ids: for order g in 2..ngram_size, mix = XOR_{j<g} t_j * mult_j in wrapping int64 (t_0 the token, t_j
the token j back, replaced by EOS when that crosses an EOS or the sequence start); row = mix mod vocab_h +
offset_h for the heads_per_ngram heads of that order. The rows of all heads, concatenated, are the token's
PLE embedding.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from expertstream.formats.fp8 import e4m3_to_float


def _shifted(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """history [N] -> the token `shift` back at each position, EOS where that crosses an EOS or the start."""
    if shift == 0:
        return history
    n = history.shape[0]
    pos = torch.arange(n, device=history.device)
    # index of the last EOS strictly before each position (-1: none)
    eos_at = torch.where(history == eos, pos, torch.full_like(pos, -1))
    last_eos_before = torch.cat((eos_at.new_full((1,), -1), torch.cummax(eos_at, 0).values[:-1]))
    src = pos - shift
    ok = (src > last_eos_before) & (src >= 0)
    return torch.where(ok, history[src.clamp_min(0)], torch.full_like(history, eos))


def ngram_row_ids(
    context: torch.Tensor,
    ids: torch.Tensor,
    eos: int,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    heads_per_ngram: int,
) -> torch.Tensor:
    """PLE table rows of each new token.

    Args:
        context: [ngram_size - 1] int64, the tokens fed before `ids` (EOS at the start of a conversation).
        ids: [T] int64 new tokens.
        eos: the EOS id that resets n-grams.
        multipliers: [ngram_size] int64 (the checkpoint's `layer_multipliers` buffer).
        vocab_sizes, offsets: [(ngram_size - 1) * heads_per_ngram] int64 per-head modulus and row offset.
        heads_per_ngram: heads per n-gram order.

    Returns:
        [T, (ngram_size - 1) * heads_per_ngram] int64 global row ids.
    """
    ngram_size = multipliers.shape[0]
    history = torch.cat((context.long(), ids.long()))
    shifted = [_shifted(history, s, eos) * multipliers[s] for s in range(ngram_size)]
    blocks = []
    for order in range(2, ngram_size + 1):
        mix = shifted[0]
        for j in range(1, order):
            mix = torch.bitwise_xor(mix, shifted[j])
        h = slice((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mix[:, None], vocab_sizes[h][None, :]) + offsets[h][None, :])
    return torch.cat(blocks, dim=-1)[-ids.shape[0] :]


def _wrap64(v: int) -> int:
    """A Python int as the int64 it wraps to (two's complement)."""
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


def ngram_rows_one(
    context: list[int], token: int, eos: int, multipliers: list[int], vocab_sizes: list[int],
    offsets: list[int], heads_per_ngram: int,
) -> list[int]:  # fmt: skip
    """`ngram_row_ids` of one new token in plain Python ints (a decode step: no tensor ops on the host).

    context: the ngram_size - 1 tokens before `token`, oldest first; the rest as `ngram_row_ids`."""
    history = list(context) + [token]
    n = len(history)
    # the token s back, or EOS where that crosses an EOS before the token or the start (as `_shifted`)
    last_eos = max((i for i in range(n - 1) if history[i] == eos), default=-1)
    src = [n - 1 - s for s in range(1, len(multipliers))]
    back = [token] + [history[i] if i > last_eos and i >= 0 else eos for i in src]
    terms = [_wrap64(t * m) for t, m in zip(back, multipliers)]
    rows = []
    for order in range(2, len(multipliers) + 1):
        mix = 0
        for j in range(order):
            mix ^= terms[j]
        for h in range((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram):
            rows.append(mix % vocab_sizes[h] + offsets[h])
    return rows


class DenseTable:
    """An in-memory PLE table [rows, width] (tests, reference). Its raw rows are the values themselves."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def read(self, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """rows [T, heads] int64 (or one token's list) -> raw rows [T, heads * width] (float32 values)."""
        rows = torch.tensor([rows]) if isinstance(rows, list) else rows
        return self.weight[rows.to(self.weight.device)].float().flatten(-2)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw rows (on any device) -> float32 values."""
        return raw.float()

    def read_ahead(self, rows: torch.Tensor | None) -> None:
        """Nothing to read ahead: the table is in memory."""


class PleTable:
    """The FP8 PLE table read in place from the snapshot shards: one `width`-byte `preadv` per distinct row.

    A prompt's rows are known before its layers run: `read_ahead` reads them on `read_threads` threads
    (the drive sees that many reads in flight, and `pread` releases the GIL) while the layers before the PLE
    layer compute; the PLE layer's `read` of them then only gathers. A 2,451-token prompt is 39,000 rows:
    ~0.07 s of serial reads on the H200 box even from the page cache, and one drive latency each from NVMe.

    `ple` is the workdir manifest's ple block (shard paths absolute): dtype, width, scale, rows, shards.
    """

    def __init__(self, ple: dict, read_threads: int = 8):
        self._fds: list[int] = []
        self.read_threads = read_threads
        self._pool: ThreadPoolExecutor | None = None  # started by the first read_ahead
        # the last read_ahead: (its distinct rows, sorted [U] int64; their bytes [U, width]; the reads)
        self._ahead: tuple[np.ndarray, np.ndarray, list[Future]] | None = None
        if ple.get("dtype") != "float8_e4m3fn":
            raise ValueError(
                f"PLE table dtype {ple.get('dtype')!r} is not supported (expected float8_e4m3fn)"
            )
        self.width = int(ple["width"])
        self.scale = float(ple["scale"])
        self.rows = int(ple["rows"])
        self._offsets, self._first = [], []
        first = 0
        for shard in ple["shards"]:
            self._offsets.append(int(shard["offset"]))
            self._first.append(first)
            first += int(shard["rows"])
        if first != self.rows:
            raise ValueError(f"PLE shards hold {first} rows, manifest says {self.rows}")
        for shard in ple["shards"]:
            path = Path(shard["path"])
            try:
                self._fds.append(os.open(path, os.O_RDONLY))
            except OSError as e:
                self.close()
                raise FileNotFoundError(f"PLE shard {path} cannot be opened: {e}") from e
        self.bytes_read = 0
        self._luts: dict[torch.device, torch.Tensor] = {}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # no read may land in a closed file
            self._pool = None
        self._ahead = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):
        self.close()

    def _check(self, rows: np.ndarray) -> None:
        bad = rows[(rows < 0) | (rows >= self.rows)]
        if bad.size:
            raise IndexError(f"PLE row {int(bad[0])} outside the table of {self.rows} rows")

    def _read_now(self, rows: np.ndarray) -> np.ndarray:
        """Rows [n] read on the calling thread -> their bytes [n, width]."""
        self._check(rows)
        out = np.empty((rows.size, self.width), dtype=np.uint8)
        self._read_into(rows, out)
        self.bytes_read += out.nbytes
        return out

    def _read_into(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Rows [n] (checked) -> out [n, width], one pread straight into each row of out (a worker's share,
        or a whole read). Shards and offsets come from numpy up front: the loop holds the GIL little."""
        shard = np.searchsorted(self._first, rows, side="right") - 1
        offs = np.asarray(self._offsets)[shard] + (rows - np.asarray(self._first)[shard]) * self.width
        fds = [self._fds[i] for i in shard.tolist()]
        for j, (fd, off, dst) in enumerate(zip(fds, offs.tolist(), out)):
            n = os.preadv(fd, [dst], off)
            if n != self.width:
                raise OSError(
                    f"short read of PLE row {int(rows[j])} at byte {off} of shard {int(shard[j])}: "
                    f"{n} of {self.width} bytes"
                )

    def read_ahead(self, rows: torch.Tensor | None) -> None:
        """Start reading the distinct rows of rows [T, heads] (a prompt's) on the worker threads; a later
        `read` whose rows are all among them waits for these reads and gathers. Replaces the last one;
        None drops it (the prompt is done: one-token reads stop looking there)."""
        if rows is None:
            self._ahead = None
            return
        uniq = np.unique(rows.numpy().reshape(-1))
        self._check(uniq)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="ple-read")
        out = np.empty((uniq.size, self.width), dtype=np.uint8)
        cuts = [uniq.size * j // self.read_threads for j in range(self.read_threads + 1)]
        futures = [  # contiguous shares of the sorted rows, each written in place into its rows of out
            self._pool.submit(self._read_into, uniq[a:b], out[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a
        ]
        self._ahead = (uniq, out, futures)
        self.bytes_read += out.nbytes

    def _from_ahead(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [T, heads] from the last read_ahead (after its reads landed), or None if any is not there."""
        if self._ahead is None:
            return None
        uniq, out, futures = self._ahead
        flat = rows.numpy().reshape(-1)
        idx = np.searchsorted(uniq, flat)
        if not flat.size or (idx >= uniq.size).any() or (uniq[idx] != flat).any():
            return None
        for f in futures:
            f.result()  # re-raises a failed read
        return torch.from_numpy(out[idx]).view(rows.shape[0], -1)

    def read(self, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """rows [T, heads] int64 (or one token's list of rows) -> FP8 bytes [T, heads * width] uint8 on the
        host; each distinct row read once."""
        if isinstance(rows, list):
            # a prompt's one-token piece reads ahead too; decode (nothing ahead) skips the lookup
            ahead = self._from_ahead(torch.tensor([rows])) if self._ahead is not None else None
            if ahead is not None:
                return ahead
            return torch.from_numpy(self._read_now(np.asarray(rows, dtype=np.int64))).view(1, -1)
        ahead = self._from_ahead(rows.cpu())
        if ahead is not None:
            return ahead
        uniq, inverse = torch.unique(rows.cpu(), return_inverse=True)
        return torch.from_numpy(self._read_now(uniq.numpy()))[inverse].flatten(-2)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """FP8 bytes (on any device) -> float32 values (fp8 * scale) through a 256-entry table on that
        device: one gather, so a decode graph can hold it."""
        lut = self._luts.get(raw.device)
        if lut is None:
            lut = e4m3_to_float(torch.arange(256, dtype=torch.uint8))  # [256] float32, one upload per device
            if raw.device.type == "cuda":
                lut = lut.pin_memory()
            lut = self._luts[raw.device] = lut.to(raw.device, non_blocking=True)
        return lut[raw.long()] * self.scale
