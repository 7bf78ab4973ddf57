"""Reading a Hugging Face snapshot without loading it: config, index, safetensors headers, tensors by name.

A safetensors file is: u64 little-endian header length N | N bytes of JSON | data. Each JSON entry gives
dtype, shape and data_offsets [begin, end) relative to the data start (8 + N). We parse headers ourselves so
every tensor's absolute file offset is known (the repack reads experts in file order; PLE rows are pread).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from expertstream.errors import UserError

# safetensors dtype code -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
}
TORCH_TO_CODE = {t: code for code, (t, _) in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors spec caps headers at 100 MB
# coalesce tensors closer than this into one read; a read never exceeds READ_CHUNK
GAP = 1 << 20
READ_CHUNK = 64 << 20


class SnapshotError(UserError, ValueError):
    """A snapshot file is missing, truncated, or not what the engine expects."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    path: Path  # shard file
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `path`
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header; raises SnapshotError for a truncated or malformed file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SnapshotError(f"{path}: {size} bytes, too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise SnapshotError(
                f"{path}: header length {n} does not fit in the file ({size} bytes): truncated?"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SnapshotError(f"{path}: unreadable safetensors header ({e})") from e
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype not in DTYPES:
            raise SnapshotError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * DTYPES[dtype][1]:
            raise SnapshotError(f"{path}: tensor {name} spans {end - begin} bytes, not {dtype} {list(shape)}")
        if 8 + n + end > size:
            raise SnapshotError(
                f"{path} is truncated: tensor {name} ends at byte {8 + n + end} but the file has {size} bytes"
            )
        out[name] = TensorInfo(name, path, dtype, shape, 8 + n + begin, end - begin)
    return out


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Read one tensor (a fresh CPU tensor) with a single pread."""
    return bytes_to_tensor(info, pread_exact(info.path, info.offset, info.nbytes))


def bytes_to_tensor(info: TensorInfo, data: bytes | bytearray | memoryview) -> torch.Tensor:
    dtype = DTYPES[info.dtype][0]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(info.shape)


def pread_exact(path: Path, offset: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
    if len(data) != nbytes:
        raise SnapshotError(
            f"{path}: short read of {len(data)} / {nbytes} bytes at offset {offset}: truncated?"
        )
    return data


def iter_tensor_bytes(infos: Iterable[TensorInfo]) -> Iterator[tuple[TensorInfo, memoryview]]:
    """Yield (info, bytes) file by file in offset order, coalescing neighbouring tensors into big reads.

    Sequential large reads are what both NVMe and HDD sources want; the yielded views are valid until the next
    item is requested.
    """
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in infos:
        by_file.setdefault(info.path, []).append(info)
    for path in sorted(by_file):
        todo = sorted(by_file[path], key=lambda t: t.offset)
        fd = os.open(path, os.O_RDONLY)
        try:
            i = 0
            while i < len(todo):
                # one read covers todo[i:j]
                start, end, j = todo[i].offset, todo[i].offset + todo[i].nbytes, i + 1
                while (
                    j < len(todo)
                    and todo[j].offset - end <= GAP
                    and todo[j].offset + todo[j].nbytes - start <= READ_CHUNK
                ):
                    end = max(end, todo[j].offset + todo[j].nbytes)
                    j += 1
                buf = os.pread(fd, end - start, start)
                if len(buf) != end - start:
                    raise SnapshotError(f"{path}: short read at offset {start}: file truncated while reading")
                view = memoryview(buf)
                for info in todo[i:j]:
                    yield info, view[info.offset - start : info.offset - start + info.nbytes]
                i = j
        finally:
            os.close(fd)


class Snapshot:
    """A HF snapshot directory: `config.json`, `model.safetensors.index.json` (or one `model.safetensors`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise SnapshotError(f"{cfg} not found: not a Hugging Face snapshot")
        self.config_bytes = cfg.read_bytes()
        try:
            self.config: dict = json.loads(self.config_bytes)
        except json.JSONDecodeError as e:
            raise SnapshotError(f"{cfg}: invalid JSON ({e})") from e
        self.text_config: dict = self.config.get("text_config", self.config)
        self.tensors = self._read_tensors()

    @property
    def config_sha256(self) -> str:
        return hashlib.sha256(self.config_bytes).hexdigest()

    def _read_tensors(self) -> dict[str, TensorInfo]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise SnapshotError(f"{index}: not a safetensors index with a weight_map ({e!r})") from e
        elif (self.path / "model.safetensors").is_file():
            weight_map = {name: "model.safetensors" for name in read_header(self.path / "model.safetensors")}
        else:
            raise SnapshotError(
                f"{self.path}: neither model.safetensors.index.json nor model.safetensors found"
            )
        headers: dict[str, dict[str, TensorInfo]] = {}
        for shard in sorted(set(weight_map.values())):
            file = self.path / shard
            if not file.is_file():
                raise SnapshotError(f"{file} is listed in {index.name} but missing")
            headers[shard] = read_header(file)
        tensors = {}
        for name, shard in weight_map.items():
            if name not in headers[shard]:
                raise SnapshotError(f"{self.path / shard}: tensor {name} is in the index but not in the file")
            tensors[name] = headers[shard][name]
        return tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SnapshotError(f"{self.path}: tensor {name} not found in the snapshot") from None

    def read(self, name: str) -> torch.Tensor:
        return read_tensor(self.info(name))


def header_bytes(entries: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """Safetensors header (8-byte length + JSON) for (name, dtype code, shape) entries, in this order."""
    header, pos = {}, 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data start 8-byte aligned, as safetensors itself writes
    return struct.pack("<Q", len(raw)) + raw
