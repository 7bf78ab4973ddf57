"""Capture a function's launches into a CUDA graph without running them (the decode graphs)."""

from __future__ import annotations

import torch


def capture(fn, stream: torch.cuda.Stream, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's return value): fn's launches captured on `stream`, ordered after the work queued on the
    current stream so far, into `pool` (None: a pool of the graph's own). Nothing runs until a replay."""
    dev = stream.device
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        # thread_local: the store's reader threads keep synchronising their copy events meanwhile
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(dev).wait_stream(stream)
    return graph, out
