"""The CUDA driver's copy entry point for a C thread: the split server (kernels/cpu_moe.c) queues the GPU's
share of a request on the copy engine itself, so no Python call sits between the request and its copies.

Loaded from libcuda through ctypes once torch has made the device's primary context; the stream is the
driver's own and non-blocking (a blocking one would wait for the legacy default stream, where a kernel may
be spinning for these very copies).
"""

from __future__ import annotations

import ctypes
import functools

import torch

CU_STREAM_NON_BLOCKING = 1


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"the CUDA driver refused {what} (CUresult {rc})")


class CopyStream:
    """A non-blocking driver stream on `device` and what a C thread needs to queue copies on it:
    `entry_points()` = (cuMemcpyHtoDAsync_v2, the stream, cuCtxSetCurrent, the primary context), as
    addresses."""

    def __init__(self, device: torch.device):
        lib = _libcuda()
        assert lib is not None, "no CUDA driver (libcuda.so.1)"
        torch.cuda.init()
        dev, ctx, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuDeviceGet(ctypes.byref(dev), torch.device(device).index or 0), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self._lib, self._dev, self.ctx = lib, dev, ctx
        _check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            _check(lib.cuStreamCreate(ctypes.byref(stream), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        self.stream = stream

    def entry_points(self) -> tuple[int, int, int, int]:
        addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        lib = self._lib
        return addr(lib.cuMemcpyHtoDAsync_v2), self.stream.value, addr(lib.cuCtxSetCurrent), self.ctx.value

    def close(self) -> None:
        """Destroy the stream (its copies done) and release the context; the server must be stopped first."""
        if self.stream is not None:
            self._lib.cuStreamSynchronize(self.stream)
            self._lib.cuStreamDestroy_v2(self.stream)
            self._lib.cuDevicePrimaryCtxRelease_v2(self._dev)
            self.stream = None
