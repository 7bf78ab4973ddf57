"""Expert block reads: O_DIRECT into page-aligned memory; buffered where the filesystem refuses O_DIRECT.

O_DIRECT skips the page cache (the store is the cache) but needs buffer, offset and length aligned to the
device's logical block: blocks are whole pages (ExpertLayout), buffers come from anonymous mmap.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import weakref
from pathlib import Path

import torch

from expertstream.errors import UserError
from expertstream.log import get_logger

log = get_logger(__name__)

PAGE = mmap.PAGESIZE


class StoreError(UserError, RuntimeError):
    """An expert block could not be read; the message names the block (layer, expert) or the file."""


def alloc_aligned(nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 host memory starting on a page boundary (what O_DIRECT and cudaHostRegister need)."""
    mm = mmap.mmap(-1, max(nbytes, 1))  # anonymous mappings are page-aligned; the tensor keeps `mm` alive
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


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


class BlockReader:
    """Positional reads of one file from many threads; O_DIRECT while the filesystem accepts it."""

    def __init__(self, path: Path):
        self.path = path
        self._fds = [os.open(path, os.O_RDONLY)]
        self._buffered = self._fds[0]
        self._direct: int | None = None
        self._lock = threading.Lock()
        self._warned = False
        if hasattr(os, "O_DIRECT"):  # Linux; elsewhere buffered reads only
            try:
                self._direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self._fds.append(self._direct)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._fall_back(e)

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def read_into(self, buf: torch.Tensor, offset: int) -> int:
        """Fill `buf` ([n] uint8, page-aligned) from `offset`; returns bytes read (< n only at EOF)."""
        view = memoryview(buf.numpy())
        fd = self._direct
        if fd is not None:
            try:
                # one call: after a short O_DIRECT read at end of file the next offset would be unaligned
                return os.preadv(fd, [view], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._fall_back(e)
        done = 0
        while done < len(view):
            n = os.preadv(self._buffered, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def _fall_back(self, e: OSError) -> None:
        with self._lock:
            self._direct = None
            if self._warned:  # many reader threads may hit EINVAL at once; warn once
                return
            self._warned = True
        log.warning("%s: O_DIRECT refused (%s); using buffered reads through the page cache", self.path, e)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
