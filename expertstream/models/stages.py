"""One token's forward as the model declares it: an ordered list of stages over the step's named values.

The model's one-token `forward` runs the stages in order; the CUDA-graph decode (runtime/decode_graphs.py)
captures each stretch of graphable stages once and replays it, running the others eagerly every token. A
stage is `fn(*values it reads) -> what it writes` (a tuple, or the value itself when it writes one name).
Graphable: device work alone, its shapes and addresses fixed by the program it was declared in (the state,
the KV window, the banks' modes), so a CUDA graph may hold it; it never reads the host token "ids". Every
other stage is host work: host inputs, a routing read-back, a length that follows the position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stage:
    """fn over the values named `reads`, writing those named `writes`.

    after: host work run once the stage's device work is queued (with graphs: once the graph holding it is
        replayed), e.g. the next layer's guessed disk reads.
    join: what a captured stretch holding the stage calls last (side-stream work the stage queued must be
        joined before a capture ends).
    """

    fn: Callable
    reads: tuple[str, ...]
    writes: tuple[str, ...] = ()
    graphable: bool = True
    after: tuple[Callable[[], None], ...] = ()
    join: Callable[[], None] | None = None

    def __call__(self, values: dict) -> dict:
        """Run on `values` (holding every name it reads) -> {name: value} of what it writes."""
        out = self.fn(*(values[name] for name in self.reads))
        if len(self.writes) == 1:
            return {self.writes[0]: out}
        return dict(zip(self.writes, out, strict=True)) if self.writes else {}


def run_stages(stages: list[Stage], values: dict) -> dict:
    """Every stage in order, eagerly, on `values` (updated in place and returned); a stage's `after` right
    after it."""
    for stage in stages:
        values.update(stage(values))
        for fn in stage.after:
            fn()
    return values
