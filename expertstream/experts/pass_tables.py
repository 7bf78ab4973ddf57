"""A RAM-resident bank's prompt passes of one layer, planned and uploaded at once.

Once every block has a fixed RAM row, a layer's passes are known before the first one runs: pass g takes
its slots (`slots[g]`) and copies its experts' rows there. `PassTables` writes, for every pass of the layer,
the expert -> slot map [E], the (RAM row, slot) pairs of its copy [n, 2] and its slots' global scales
[S, 3], and uploads each table once per layer; pass g then hands row g of them to `copy_rows` and the
kernels, or, where its rows and slots both run consecutively (`runs[g]`), copies them with one copy-engine
call. Uploading them per pass costs 0.18 of a pass's 0.37 ms of host time on a fast host, and on slow
hosts the passes' host time is what bounds a prompt from RAM.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from expertstream.experts.host_mirror import HostMirror


class PassTables:
    """Per-pass tables of one layer on the device, as row views: `maps[g]` [E] int32 (-1 off the pass),
    `pairs[g]` [pass_size, 2] int32 and `ws2[g]` [slot_rows, 3] float32; `runs[g]`: (first RAM row, first
    slot) where pass g's rows and slots are both consecutive, else None.

    Args:
        num_experts: experts per layer (at most that many passes per layer).
        slot_rows: rows of the slot tensor the kernels read (the scale table matches it).
        pass_size: most experts in one pass.
        device: where the kernels run.
    """

    def __init__(self, num_experts: int, slot_rows: int, pass_size: int, device: torch.device):
        def mirror(*shape, dtype=torch.int32):
            # a few layers of uploads in flight at most: each layer pushes once
            return HostMirror(torch.zeros(num_experts, *shape, dtype=dtype, device=device), depth=4)

        self._maps, self._pairs = mirror(num_experts), mirror(pass_size, 2)
        self._ws2 = mirror(slot_rows, 3, dtype=torch.float32)
        # row views made once (indexing a tensor costs ~1.5 us a call, three per pass)
        self.maps, self.pairs, self.ws2 = (
            m.device_tensor.unbind(0) for m in (self._maps, self._pairs, self._ws2)
        )
        self.runs: list[tuple[int, int] | None] = []

    @property
    def mirrors(self) -> tuple[HostMirror, ...]:
        return self._maps, self._pairs, self._ws2

    def plan(
        self,
        groups: list[list[int]],
        slots: list[list[int]],
        rows: np.ndarray,
        scales: np.ndarray,
        copy_stream: contextlib.AbstractContextManager,
    ) -> None:
        """Write and upload the tables of a layer's passes: `groups[g]` its experts, `slots[g]` their slots,
        rows [E] each expert's RAM row and scales [E, 3] its global scales. The maps and scales go up on the
        current stream (the kernels', which read them in order), the pairs inside `copy_stream` (the copies'):
        each upload is ordered after the readers of the previous layer's tables on its own stream."""
        n = len(groups)
        assert n <= len(self.maps), f"{n} passes for {len(self.maps)} table rows"
        maps, pairs, ws2 = (m.host.numpy() for m in (self._maps, self._pairs, self._ws2))
        maps[:n] = -1
        for g, (members, s) in enumerate(zip(groups, slots)):
            maps[g, members] = s
            pairs[g, : len(s), 0] = rows[members]
            pairs[g, : len(s), 1] = s
            ws2[g, s] = scales[members]
        # a pass whose rows and slots both run consecutively is one copy-engine copy (`load_pairs`' run)
        self.runs = [
            (int(rows[m[0]]), s[0]) if np.all(np.diff(rows[m]) == 1) and np.all(np.diff(s) == 1) else None
            for m, s in zip(groups, slots)
        ]
        self._maps.push(slice(0, n))
        self._ws2.push(slice(0, n))
        with copy_stream:
            self._pairs.push(slice(0, n))
