"""A Triton kernel and its plain-torch twin behind one call, as the model uses them: `kernel=True` at the call
runs the kernel on CUDA tensors (or under the interpreter), anything else the twin. A kernel failure (a
compile error on an untested chip) logs once and leaves the twin for the rest of the process."""

from __future__ import annotations

from expertstream.kernels.codec import HAVE_TRITON, interpreting
from expertstream.log import get_logger

log = get_logger(__name__)


class Fused:
    def __init__(self, kernel, twin, what: str):
        self.kernel, self.twin, self.what = kernel, twin, what
        self.failed = False  # the kernel raised once: the twin from then on

    def __call__(self, x, *args, kernel: bool, **kwargs):
        if kernel and HAVE_TRITON and not self.failed and (x.is_cuda or interpreting()):
            try:
                return self.kernel(x, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compile or launch failure; the twin is exact
                log.warning("%s kernel failed (%s); using the torch form", self.what, e)
                self.failed = True
        return self.twin(x, *args, **kwargs)
