"""A Triton kernel and its plain-torch twin behind one call, as the model uses them: the kernel on CUDA
tensors (or under the interpreter) once enabled, else the twin. A kernel failure (a compile error on an
untested chip) logs once and leaves the twin for the rest of the process."""

from __future__ import annotations

from expertstream.kernels.codec import HAVE_TRITON, interpreting
from expertstream.log import get_logger

log = get_logger(__name__)


class Fused:
    def __init__(self, kernel, twin, what: str):
        self._kernel, self.twin, self.what = kernel, twin, what
        self.kernel = None  # the kernel while enabled

    def enable(self, on: bool) -> None:
        self.kernel = self._kernel if on and HAVE_TRITON else None

    def __call__(self, x, *args, **kwargs):
        if self.kernel is not None and (x.is_cuda or interpreting()):
            try:
                return self.kernel(x, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compile or launch failure; the twin is exact
                log.warning("%s kernel failed (%s); using the torch form", self.what, e)
                self.kernel = None
        return self.twin(x, *args, **kwargs)
