"""The CPU expert kernel (cpu_moe.c) and its plain-torch twin: a few tokens' routed SwiGLU sum over NVFP4 or
MXFP4 experts (with DeepSeek-V4's clamp where a limit is given), codes and block scales read in place from
expert blocks ([block_bytes] uint8, RAM cache rows).

The C source is compiled once per machine at first use with the machine's C compiler (`cc -O3
-march=native`, under ~1 s) into ~/.cache/expertstream/kernels/ and loaded through ctypes, which releases
the GIL while it runs; one call at a time holds its thread pool (a mutex on the C side), the split server's
included. Without a compiler the twin runs instead (one warning).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from expertstream.formats.expert_block import PROJ, ExpertLayout
from expertstream.kernels.nvfp4_moe import swiglu_ref
from expertstream.log import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).with_name("cpu_moe.c")
TMAX = 8  # most tokens one kernel call takes (cpu_moe.c's TMAX); more go to the twin
# -ffp-contract=off: the T = 1, 2, 4 copies and the generic loop fuse no multiply-add differently (the dot
# products' FMA is explicit, the same in each), so a token's sums do not depend on how many tokens share the
# call (batched decode equals decode alone)
FLAGS = ("-O3", "-ffp-contract=off", "-march=native", "-shared", "-fPIC", "-pthread", "-std=gnu11")
_PARTS = tuple(f"{p}.weight" for p in PROJ) + tuple(f"{p}.weight_scale" for p in PROJ)

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()  # the build


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "expertstream" / "kernels"


def _cpu_signature() -> str:
    # -march=native code runs only on CPUs with the same features: they are part of the file name
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler (cc) found: CPU experts use the slower torch form; install gcc")
        return None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                src,
                cc.encode(),
                " ".join(FLAGS).encode(),
                _cpu_signature().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]
    so = cache_dir() / f"cpu_moe-{key}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        cmd = [cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode and "-march=native" in cmd:  # a compiler without -march=native (e.g. Apple clang)
            cmd.remove("-march=native")
            r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            os.unlink(tmp)
            log.warning("compiling the CPU expert kernel failed (%s): using the torch form", r.stderr.strip())
            return None
        os.replace(tmp, so)  # atomic: another process may be building the same file
    lib = ctypes.CDLL(str(so))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.fp4_moe_cpu.argtypes = [p, p, p, p, p, p, i, i, i, i, p, f, i]
    lib.fp4_moe_cpu.restype = i
    lib.read_sweep.argtypes = [p, ctypes.c_long, i]
    lib.read_sweep.restype = ctypes.c_float
    lib.pool_spin.argtypes = [ctypes.c_long]
    lib.pool_spin.restype = ctypes.c_long
    lib.pool_stall.argtypes = [ctypes.c_long, ctypes.c_int]
    lib.pool_stall.restype = ctypes.c_long
    lib.serve_start.argtypes = [p, p, p, p, p, p, i, i, i, i, p, f, i, ctypes.c_long]
    lib.serve_start.restype = i
    lib.serve_arm.argtypes = [i]
    lib.serve_arm.restype = None
    lib.serve_stop.argtypes = []
    lib.serve_stop.restype = i
    lib.serve_stats.argtypes = [p, p, i]
    lib.serve_stats.restype = ctypes.c_long
    lib.box_put.argtypes = [p, ctypes.c_int32]
    lib.box_put.restype = None
    lib.box_get.argtypes = [p]
    lib.box_get.restype = ctypes.c_int32
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None when it cannot be built."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = _build()
    return _lib


@functools.lru_cache(maxsize=8)
def layout_words(layout: ExpertLayout) -> torch.Tensor:
    """[7] int64: byte offsets in a block of the gate, up, down codes and the gate, up, down scales, then 1
    for MXFP4 blocks (a UE8M0 scale per 32 weights, no global scale) or 0 for NVFP4 (an E4M3 scale per 16)."""
    if layout.fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"the CPU expert kernel reads NVFP4 and MXFP4 blocks, not {layout.fmt!r}")
    offsets = [layout.part(n).offset for n in _PARTS]
    return torch.tensor([*offsets, int(layout.fmt == "mxfp4")], dtype=torch.long)


def _limit(swiglu_limit: float | None) -> float:
    return math.inf if swiglu_limit is None else float(swiglu_limit)


def set_spin(seconds: float) -> float:
    """How long the kernel's idle pool threads spin before they sleep (0.5 ms at load): a call that comes
    within it finds them running, a later one wakes them (tens of microseconds). Longer suits calls spaced
    by GPU work on a box whose cores are otherwise idle; returns the previous setting, in seconds."""
    lib = library()
    return lib.pool_spin(int(seconds * 1e9)) / 1e9 if lib is not None else 0.0


def moe(
    blocks: list[torch.Tensor],
    ws2: torch.Tensor,
    wt: torch.Tensor,
    x: torch.Tensor,
    layout: ExpertLayout,
    threads: int = 1,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The routed sum of n experts over T <= TMAX tokens with the C kernel.

    Args:
        blocks: n expert blocks, each [block_bytes] uint8 on the CPU (read in place, not copied).
        ws2: [n, 3] FP32 global scales (gate, up, down) of those experts (not read for MXFP4, which has none).
        wt: [n, T] FP32 routing weight of expert j for token t, 0 where t does not route to j.
        x: [T, H] FP32.
        threads: threads the call may use (the caller's included).
        swiglu_limit: clamp gate x above and up x on both sides first (DeepSeek-V4), None: no clamp.

    Returns:
        [T, H] FP32.
    """
    lib = library()
    n, (t, h) = len(blocks), x.shape
    if lib is None or not 1 <= t <= TMAX or h != layout.hidden_size:
        raise ValueError(f"the CPU expert kernel takes 1..{TMAX} tokens of width {layout.hidden_size}")
    for b in blocks:
        if b.dtype != torch.uint8 or b.device.type != "cpu" or b.numel() < layout.payload_bytes:
            raise ValueError("expert blocks must be uint8 CPU tensors of the layout's size")
    ptrs = torch.tensor([b.data_ptr() for b in blocks], dtype=torch.long)
    ws2, wt, x = (a.float().contiguous() for a in (ws2, wt, x))
    out = torch.empty(t, h)
    moe_into(ptrs, ws2, wt, x, out, torch.empty(scratch_floats(layout, n, t)), layout, threads, swiglu_limit)
    return out


MIN_BYTES = 256 << 10  # fewest bytes of blocks worth a thread of their own (`useful_threads`)


def useful_threads(layout: ExpertLayout, n: int, threads: int) -> int:
    """Threads worth waking for n experts' blocks: one per MIN_BYTES at most. A sleeping worker takes tens of
    microseconds to wake (more in a VM), longer than a small model's whole layer on one thread."""
    return max(1, min(threads, n * layout.payload_bytes // MIN_BYTES + 1))


def scratch_floats(layout: ExpertLayout, n: int, t: int) -> int:
    """FP32 scratch `moe_into` needs for n experts and t tokens."""
    return n * t * layout.intermediate_size + t * layout.hidden_size


def moe_into(
    ptrs: torch.Tensor,
    ws2: torch.Tensor,
    wt: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    scratch: torch.Tensor,
    layout: ExpertLayout,
    threads: int = 1,
    swiglu_limit: float | None = None,
) -> None:
    """`moe` on prepared buffers, for callers that keep them from call to call (the CPU share of decode):
    ptrs [n] int64 addresses of the n blocks (checked by the caller), ws2 [n, 3], wt [n, T], x [T, H] and
    out [T, H] contiguous FP32 on the CPU, scratch of `scratch_floats(layout, n, T)` FP32 or more."""
    (n,), (t, h) = ptrs.shape, x.shape
    i = layout.intermediate_size
    assert ptrs.dtype == torch.long and ws2.shape == (n, 3) and wt.shape == (n, t) and out.shape == (t, h)
    assert all(a.dtype == torch.float32 and a.is_contiguous() for a in (ws2, wt, x, out, scratch))
    assert scratch.numel() >= scratch_floats(layout, n, t)
    lib = library()
    assert lib is not None, "the CPU expert kernel could not be built"
    rc = lib.fp4_moe_cpu(
        ptrs.data_ptr(), ws2.data_ptr(), wt.data_ptr(), x.data_ptr(), out.data_ptr(),
        scratch.data_ptr(), n, t, h, i, layout_words(layout).data_ptr(), _limit(swiglu_limit),
        max(1, threads),
    )  # fmt: skip
    if rc:
        raise ValueError(f"the CPU expert kernel refused its shapes (T {t}, H {h}, I {i})")


NMAX = 64  # most experts a split server's request takes (cpu_moe.c's NMAX)


class SplitServer:
    """The C split server (cpu_moe.c's `serve`): a thread that answers the CPU share of split decode layers
    the GPU posts into a mailbox (kernels/mailbox.py) from a table of L layers, gathering each request's
    blocks and scales itself; one per process.

    Args:
        addr: [L, E] int64 each block's address (rows of `layout.block_bytes`, checked by the caller).
        ws2: [L, E, 3] FP32 the layers' global scales.
        packed: FP32 [2 NMAX + H] or longer: a request's n expert ids (as floats), n weights and x [H].
        out: FP32 [H]: the answer, NaN where the kernel refused the request (box[ERR] says why).
        box: the mailbox (`mailbox.new_box`); packed, out and box pinned where the GPU posts.
        threads: the kernel's threads, the server's own included, until `arm` gives others.
        idle_s: how long the server spins for the next request before it sleeps until armed.
        swiglu_limit: as `moe`'s.
    """

    def __init__(
        self,
        addr,
        ws2,
        packed,
        out,
        box,
        layout: ExpertLayout,
        threads: int,
        idle_s: float,
        swiglu_limit: float | None = None,
    ):
        (nl, e), h = addr.shape, layout.hidden_size
        assert addr.dtype == torch.long and addr.is_contiguous() and ws2.shape == (nl, e, 3)
        assert packed.numel() >= 2 * NMAX + h and out.numel() == h and box.dtype == torch.int32
        assert all(a.dtype == torch.float32 and a.is_contiguous() for a in (ws2, packed, out))
        lib = library()
        assert lib is not None, "the CPU expert kernel could not be built"
        scratch = torch.empty(scratch_floats(layout, NMAX, 1))
        # the C side holds their addresses
        self._keep = (addr, ws2, packed, out, box, scratch, layout_words(layout))
        rc = lib.serve_start(
            addr.data_ptr(), ws2.data_ptr(), packed.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            box.data_ptr(), nl, e, h, layout.intermediate_size, self._keep[6].data_ptr(),
            _limit(swiglu_limit), max(1, threads), int(idle_s * 1e9),
        )  # fmt: skip
        if rc:
            why = "a split server already runs in this process" if rc == 1 else "no thread for the server"
            raise RuntimeError(why)
        self._stop = weakref.finalize(self, lib.serve_stop)

    def arm(self, threads: int) -> None:
        """A token's requests follow: wake the server if it sleeps; `threads` from its next request."""
        library().serve_arm(max(1, threads))

    def stats(self, last: int = 0) -> tuple[int, float, list[float]]:
        """(requests answered, their kernel seconds summed, the last min(last, 4096) requests' seconds)."""
        total, log = ctypes.c_long(), (ctypes.c_long * max(1, last))()
        calls = library().serve_stats(ctypes.addressof(total), ctypes.addressof(log), last)
        return calls, total.value / 1e9, [v / 1e9 for v in log[: min(last, calls, 4096)]]

    def close(self) -> None:
        """Stop and join the server thread (nothing more may be posted)."""
        self._stop()


def moe_twin(
    blocks: list[torch.Tensor],
    ws2: torch.Tensor,
    wt: torch.Tensor,
    x: torch.Tensor,
    layout: ExpertLayout,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Plain-torch twin of `moe` (same arguments but threads): decode each block, then SwiGLU in FP32."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for j, block in enumerate(blocks):
        gate, up, down = layout.dequantize(block, ws2[j].float(), torch.float32)
        y = F.linear(swiglu_ref(F.linear(xf, gate), F.linear(xf, up), swiglu_limit), down)  # [T, H]
        out += wt[j, :, None].float() * y
    return out


def read_rate(nbytes: int = 1 << 30, threads: int = 1, repeats: int = 3) -> float:
    """Best GB/s of `repeats` read sweeps over `nbytes` of RAM on `threads` threads (the kernel's pool): the
    memory rate the expert kernel is measured against."""
    buf = torch.ones(nbytes // 4)
    read_seconds(buf, threads)  # warm: pages faulted in, pool up
    return buf.numel() * 4 / min(read_seconds(buf, threads) for _ in range(repeats)) / 1e9


def read_seconds(buf: torch.Tensor, threads: int = 1) -> float:
    """Seconds of one read sweep over `buf` (FP32, contiguous) on `threads` threads of the kernel's pool."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU expert kernel could not be built")
    assert buf.dtype == torch.float32 and buf.is_contiguous()
    t0 = time.perf_counter()
    lib.read_sweep(buf.data_ptr(), buf.numel(), max(1, threads))
    return time.perf_counter() - t0


def layer_rate(
    rows: torch.Tensor, layout: ExpertLayout, k: int, threads: int = 1, rounds: int = 4, warm: float = 0.03
) -> float:
    """GB/s of the kernel on one layer's k experts for one token: the best of `rounds` calls after `warm`
    seconds of calls (the pool built, the cores' clocks up: cold, 4 calls measured 0.4-0.7x the rate decode
    then ran at), each call on the next k rows of `rows` [C, block_bytes] uint8, wrapping around (their
    contents do not change the time; C past the last-level cache makes it the rate from RAM)."""
    c = rows.shape[0]
    x, wt, ws2 = torch.randn(1, layout.hidden_size), torch.ones(k, 1), torch.ones(k, 3)
    best, timed, g, t_end = float("inf"), 0, 0, time.perf_counter() + warm
    while timed < rounds:
        blocks = [rows[(g * k + j) % c] for j in range(k)]
        g += 1
        t0 = time.perf_counter()
        moe(blocks, ws2, wt, x, layout, threads)
        if t0 >= t_end:
            best, timed = min(best, time.perf_counter() - t0), timed + 1
    return k * layout.payload_bytes / best / 1e9
