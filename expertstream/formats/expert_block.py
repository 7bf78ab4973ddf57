"""The repacked expert block: one routed expert = one page-aligned contiguous byte range.

Layout (H = hidden_size, I = moe_intermediate_size), raw row-major copies of the checkpoint tensors:
  gate_proj.weight  u8   [I, H/2]  | up_proj.weight  u8 [I, H/2] | down_proj.weight u8 [H, I/2]
  gate_proj.weight_scale e4m3 [I, H/16] | up_proj.weight_scale [I, H/16] | down_proj.weight_scale [H, I/16]
then zero padding to a multiple of ALIGN bytes.
Real dims: 3 x 819,200 + 3 x 102,400 = 2,764,800 B = 675 pages.
The FP32 `weight_scale_2` scalars live beside the blocks ([L, E, 3] gate, up, down), not inside them.
MXFP4 experts (DeepSeek-V4-Flash: w1, w3, w2 as gate, up, down) keep the same order with UE8M0 scales
[rows, cols/32] and no second-level scalars: 3 x 4,194,304 + 3 x 262,144 = 13,369,344 B = 3,264 pages.
One block = one O_DIRECT read = one host->device copy; kernels read codes and scales straight from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertstream.formats import mxfp4, nvfp4

ALIGN = 4096
PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Part:
    name: str  # HF sub-name, e.g. "gate_proj.weight_scale"
    offset: int  # bytes from block start
    shape: tuple[int, int]
    dtype: str  # "uint8" (packed E2M1), "float8_e4m3fn" (NVFP4 scales) or "float8_e8m0fnu" (MXFP4 scales)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    hidden_size: int
    intermediate_size: int
    parts: tuple[Part, ...]
    block_bytes: int
    fmt: str = "nvfp4"  # or "mxfp4"

    @classmethod
    def for_format(
        cls, fmt: str, hidden_size: int, intermediate_size: int, align: int = ALIGN
    ) -> ExpertLayout:
        """The block of one expert in `fmt` ("nvfp4" as `for_dims`, or "mxfp4")."""
        if fmt == "nvfp4":
            return cls.for_dims(hidden_size, intermediate_size, align)
        if fmt != "mxfp4":
            raise ValueError(f"unknown expert format {fmt!r}; known: nvfp4, mxfp4")
        h, i, g = hidden_size, intermediate_size, mxfp4.GROUP
        if h % g or i % g:
            raise ValueError(f"MXFP4 expert dims must be multiples of {g}: hidden {h}, intermediate {i}")
        specs = [(f"{p}.weight", s, "uint8") for p, s in zip(PROJ, ((i, h // 2), (i, h // 2), (h, i // 2)))]
        specs += [
            (f"{p}.weight_scale", s, "float8_e8m0fnu")
            for p, s in zip(PROJ, ((i, h // g), (i, h // g), (h, i // g)))
        ]
        parts, off = [], 0
        for name, shape, dtype in specs:
            parts.append(Part(name, off, shape, dtype))
            off += shape[0] * shape[1]
        return cls(h, i, tuple(parts), -(-off // align) * align, "mxfp4")

    @classmethod
    def for_dims(cls, hidden_size: int, intermediate_size: int, align: int = ALIGN) -> ExpertLayout:
        h, i = hidden_size, intermediate_size
        if h % nvfp4.GROUP or i % nvfp4.GROUP:
            raise ValueError(f"expert dims must be multiples of {nvfp4.GROUP}: hidden {h}, intermediate {i}")
        specs = [
            ("gate_proj.weight", (i, h // 2), "uint8"),
            ("up_proj.weight", (i, h // 2), "uint8"),
            ("down_proj.weight", (h, i // 2), "uint8"),
            ("gate_proj.weight_scale", (i, h // 16), "float8_e4m3fn"),
            ("up_proj.weight_scale", (i, h // 16), "float8_e4m3fn"),
            ("down_proj.weight_scale", (h, i // 16), "float8_e4m3fn"),
        ]
        parts, off = [], 0
        for name, shape, dtype in specs:
            parts.append(Part(name, off, shape, dtype))
            off += shape[0] * shape[1]
        block = -(-off // align) * align
        return cls(h, i, tuple(parts), block)

    @property
    def group(self) -> int:
        """Elements per block scale: 16 (NVFP4, E4M3 scales) or 32 (MXFP4, UE8M0 scales)."""
        return mxfp4.GROUP if self.fmt == "mxfp4" else nvfp4.GROUP

    @property
    def payload_bytes(self) -> int:
        last = self.parts[-1]
        return last.offset + last.nbytes

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_json(self) -> dict:
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "block_bytes": self.block_bytes,
            "format": self.fmt,
            "parts": [
                {"name": p.name, "offset": p.offset, "shape": list(p.shape), "dtype": p.dtype}
                for p in self.parts
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> ExpertLayout:
        parts = tuple(Part(p["name"], int(p["offset"]), tuple(p["shape"]), p["dtype"]) for p in d["parts"])
        fmt = d.get("format", "nvfp4")
        layout = cls(int(d["hidden_size"]), int(d["intermediate_size"]), parts, int(d["block_bytes"]), fmt)
        if layout != cls.for_format(fmt, layout.hidden_size, layout.intermediate_size, ALIGN):
            raise ValueError("expert block layout in the manifest differs from the layout this engine reads")
        return layout

    def views(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-copy views of one block ([block_bytes] uint8) as its six raw uint8 tensors."""
        if block.dtype != torch.uint8 or block.numel() < self.payload_bytes:
            raise ValueError(
                f"expected a uint8 block of {self.block_bytes} bytes, got {block.dtype} {block.numel()}"
            )
        return {p.name: block[p.offset : p.offset + p.nbytes].view(p.shape) for p in self.parts}

    def pack(self, tensors: dict[str, torch.Tensor]) -> bytes:
        """Build one block from the checkpoint's six tensors (codes u8 or i8, scales in their fp8 dtype)."""
        out = bytearray(self.block_bytes)
        for p in self.parts:
            t = tensors[p.name]
            if tuple(t.shape) != p.shape:
                raise ValueError(f"{p.name}: shape {tuple(t.shape)} != expected {p.shape}")
            raw = t.contiguous().view(torch.uint8).numpy().tobytes()
            out[p.offset : p.offset + p.nbytes] = raw
        return bytes(out)

    def dequantize(
        self, block: torch.Tensor, weight_scale_2: torch.Tensor | None, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode a block (NVFP4 with its [3] FP32 global scales, MXFP4 with None) -> gate, up, down."""
        v = self.views(block)
        if self.fmt == "mxfp4":
            return tuple(mxfp4.dequantize(v[f"{p}.weight"], v[f"{p}.weight_scale"], dtype) for p in PROJ)
        return tuple(
            nvfp4.dequantize(v[f"{proj}.weight"], v[f"{proj}.weight_scale"], weight_scale_2[j], dtype)
            for j, proj in enumerate(PROJ)
        )
